"""The pieces of the Responses API that need no server: the store's bounds, expiry and owners, and the reasoning
splitter fed a stream in any pieces."""

from __future__ import annotations

import pytest

from shoal.engine.server.reasoning import ReasoningSplitter, template_thinks
from shoal.engine.server.gateway_contract import TENANT_HEADER, instance_of, response_id
from shoal.engine.server.response_store import ResponseStore, StoredResponse, owner_of


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def _entry(owner="a"):
    return StoredResponse(owner, {"id": "x"}, [])


def test_store_expiry_bound_and_owner():
    clock = Clock()
    store = ResponseStore(max_entries=3, ttl_s=10, clock=clock)
    for i in range(5):
        store.put(f"r{i}", _entry())
    assert len(store) == 3 and store.get("a", "r0") is None and store.get("a", "r4") is not None
    assert store.get("b", "r4") is None and not store.delete("b", "r4")  # another owner: as if absent
    clock.now += 10
    assert store.get("a", "r4") is None and len(store) == 2  # expired: dropped when read
    store.put("r5", _entry())  # expired ones are dropped when something is added
    assert len(store) == 1 and store.delete("a", "r5") and len(store) == 0
    with pytest.raises(ValueError):
        ResponseStore(max_entries=0)


def test_owner_is_the_presented_key():
    assert owner_of({}) == ""
    bearer = owner_of({"Authorization": "Bearer k1"})
    assert bearer == owner_of({"X-API-Key": "k1"}) != owner_of({"Authorization": "Bearer k2"})
    assert "k1" not in bearer


def test_behind_the_shared_gateway_the_named_tenant_owns_and_ids_name_their_engine():
    engine_key = {"Authorization": "Bearer engine-key"}
    a, b = owner_of({**engine_key, TENANT_HEADER: "ns.a"}), owner_of({**engine_key, TENANT_HEADER: "ns.b"})
    assert a != b and owner_of(engine_key) not in (a, b)
    store = ResponseStore()
    rid = response_id(store.instance)
    assert instance_of(rid) == store.instance != ResponseStore().instance
    assert instance_of("resp_" + "0" * 32) is None and instance_of(rid + "0") is None and instance_of(None) is None


TEXT = "  <think>I should say hi.</think>\n\nHello <b>there</b>"


@pytest.mark.parametrize("size", [1, 2, 3, 7, len(TEXT)])
def test_splitter_pieces_any_size(size):
    s = ReasoningSplitter(opened_by_prompt=False)
    out = []
    for i in range(0, len(TEXT), size):
        out += s.feed(TEXT[i:i + size])
    out += s.finish()
    joined = {k: "".join(p for kind, p in out if kind == k) for k in ("reasoning", "text")}
    assert joined == {"reasoning": "I should say hi.", "text": "Hello <b>there</b>"}
    assert [k for k, _ in out] == sorted(k for k, _ in out)  # all reasoning, then all text


def test_splitter_opened_by_prompt_and_unfinished():
    s = ReasoningSplitter(opened_by_prompt=True)
    assert s.feed("still thinking </thi") == [("reasoning", "still thinking ")]
    assert s.finish() == [("reasoning", "</thi")]  # cut short: what was held back is reasoning too
    s = ReasoningSplitter(opened_by_prompt=False)
    assert s.feed("<thi") == [] and s.feed("s is text") == [("text", "<this is text")]
    assert template_thinks("{{ '</think>' }}") and not template_thinks(None) and not template_thinks("plain")
