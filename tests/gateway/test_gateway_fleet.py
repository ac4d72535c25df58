"""A real fleet on localhost: several `shoal-engine serve` replicas behind real `shoal-gateway` processes, driven
through the openai client. Engines are shared by the module; tests that hurt an engine get their own."""

from __future__ import annotations

import random
import signal
import string
import threading

import openai
import pytest
from .gwkit import Proc, engine_cmd, http, metric, wait_for

pytestmark = pytest.mark.slow


class Fleet:
    def __init__(self, model_dir):
        # A, B, C serve every test; D is killed and E drained by the tests that need it.
        self.procs = {name: Proc(engine_cmd(model_dir)) for name in "ABCDE"}
        for p in self.procs.values():
            p.wait_ready()

    def __getitem__(self, name: str) -> Proc:
        return self.procs[name]

    @property
    def shared(self) -> list[str]:
        return [self.procs[n].url for n in "ABC"]

    def stop(self) -> None:
        for p in self.procs.values():
            p.stop()


@pytest.fixture(scope="module")
def fleet(fleet_model):
    f = Fleet(fleet_model)
    yield f
    f.stop()


def client(gateway: Proc) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def engine_sum(fleet: Fleet, names: str, name: str, **labels) -> float:
    return sum(metric(fleet[n].metrics(), name, **labels) for n in names)


def prefix_hit_rate(fleet: Fleet, gateway: Proc, seed: int) -> float:
    """Groups of chats sharing a long system prompt, sent one after another; the engines' own hit rate."""
    rng = random.Random(seed)
    c = client(gateway)
    hits0 = engine_sum(fleet, "ABC", "shoal:prefix_cache_hits_total")
    queries0 = engine_sum(fleet, "ABC", "shoal:prefix_cache_queries_total")
    for _group in range(4):
        system = "".join(rng.choice(string.ascii_lowercase + " ") for _ in range(800))
        for i in range(6):
            c.chat.completions.create(model="tiny", max_tokens=2, messages=[
                {"role": "system", "content": system},
                {"role": "user", "content": f"question {i}: {rng.random():.6f}"}])
    hits = engine_sum(fleet, "ABC", "shoal:prefix_cache_hits_total") - hits0
    queries = engine_sum(fleet, "ABC", "shoal:prefix_cache_queries_total") - queries0
    assert queries > 0
    return hits / queries


def test_prefix_load_gets_more_prefix_cache_hits_than_round_robin(fleet, start_gateway):
    prefix = start_gateway(*fleet.shared, routing="prefix-load")
    round_robin = start_gateway(*fleet.shared, routing="round-robin")
    # Different prompts per run, so the second run does not profit from the first one's cache.
    rr_rate = prefix_hit_rate(fleet, round_robin, seed=1)
    prefix_rate = prefix_hit_rate(fleet, prefix, seed=2)
    # Each group costs one cold prefill with affinity, one per engine with round-robin.
    assert prefix_rate > rr_rate + 0.15, (prefix_rate, rr_rate)
    assert metric(prefix.metrics(), "shoal:gateway_prefix_affinity_hits_total") >= 4 * 5


def test_stream_reaches_the_client_before_the_generation_ends(fleet, start_gateway):
    gw = start_gateway(*fleet.shared)
    aborted0 = engine_sum(fleet, "ABC", "shoal:request_success_total", finished_reason="abort")
    stream = client(gw).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "tell me everything"}], max_tokens=4000, stream=True,
        extra_body={"ignore_eos": True})
    first = next(iter(stream))
    assert first.choices[0].delta.role == "assistant"
    stream.close()
    # The client left after the first chunk: if the gateway had buffered the answer, the engine would have
    # finished all 4000 tokens by then; instead the disconnect reaches the engine, which aborts the request.
    wait_for(lambda: engine_sum(fleet, "ABC", "shoal:request_success_total", finished_reason="abort") > aborted0,
             60, "the engine to abort the abandoned stream")


def test_authorization_reaches_the_engine(fleet, start_gateway):
    gw = start_gateway(*fleet.shared)
    status, body, _ = http("GET", gw.url + "/v1/models", headers={"Authorization": "Bearer anything"})
    assert status == 200 and b"tiny" in body
    status, body, _ = http("POST", gw.url + "/tokenize", {"model": "tiny", "prompt": "hello there"})
    assert status == 200 and b"tokens" in body
    r = client(gw).embeddings.create(model="tiny", input=["hello there", "general kenobi"])
    assert len(r.data) == 2 and r.usage.prompt_tokens > 0


def test_a_stopped_backend_does_not_stall_requests_to_the_others(fleet, start_gateway):
    gw = start_gateway(*fleet.shared, extra=("--poll-timeout", "0.5", "--stall-after", "1"))
    c_url = fleet["C"].url
    fleet["C"].signal(signal.SIGSTOP)
    try:
        wait_for(lambda: metric(gw.metrics(), "shoal:gateway_backend_healthy", backend=c_url) == 0, 30,
                 "the gateway to skip the stopped engine")
        c = client(gw)
        for i in range(6):
            r = c.completions.create(model="tiny", prompt=f"prompt number {i} " * 10, max_tokens=2)
            assert r.choices[0].text is not None
        samples = gw.metrics()
        assert metric(samples, "shoal:gateway_requests_total", backend=c_url) == 0
        assert metric(samples, "shoal:gateway_requests_total", code="200") == 6
    finally:
        fleet["C"].signal(signal.SIGCONT)
    wait_for(lambda: metric(gw.metrics(), "shoal:gateway_backend_healthy", backend=c_url) == 1, 30,
             "the resumed engine to be used again")


def test_a_draining_backend_receives_nothing_new(fleet, start_gateway):
    a, e = fleet["A"], fleet["E"]
    gw = start_gateway(a.url, e.url, routing="round-robin")
    # A long request in flight on E keeps it draining (not gone) while the test runs.
    long_stream = openai.OpenAI(base_url=e.url + "/v1", api_key="unused", max_retries=0).completions.create(
        model="tiny", prompt="keep going", max_tokens=4000, stream=True, extra_body={"ignore_eos": True})
    next(iter(long_stream))
    e.signal(signal.SIGTERM)
    try:
        wait_for(lambda: metric(gw.metrics(), "shoal:gateway_backend_healthy", backend=e.url) == 0, 30,
                 "the gateway to see the engine draining")
        c = client(gw)
        for i in range(8):
            c.chat.completions.create(model="tiny", max_tokens=2, messages=[{"role": "user", "content": f"hi {i}"}])
        samples = gw.metrics()
        assert metric(samples, "shoal:gateway_requests_total", backend=a.url, code="200") == 8
        assert metric(samples, "shoal:gateway_retries_total") == 0
        # The engine's own access log: no chat request ever reached it (not even one it refused).
        assert '"POST /v1/chat/completions"' not in e.logs()
    finally:
        long_stream.close()


def test_killed_backend_no_client_error_then_503_when_all_are_gone(fleet, start_gateway):
    a, d = fleet["A"], fleet["D"]
    # Slow polls: the gateway learns of the death from the refused connection itself, and retries.
    slow_poll = ("--poll-interval", "30")
    gw = start_gateway(a.url, d.url, routing="round-robin", extra=slow_poll)
    only_d = start_gateway(d.url, extra=slow_poll)
    d.signal(signal.SIGKILL)
    d.proc.wait(30)
    c = client(gw)
    for i in range(8):
        r = c.completions.create(model="tiny", prompt=f"{i} distinct prompt {i}" * 5, max_tokens=2)
        assert r.choices
    assert metric(gw.metrics(), "shoal:gateway_requests_total", backend=a.url, code="200") == 8
    assert metric(gw.metrics(), "shoal:gateway_retries_total", reason="refused") >= 1

    # Every engine of this gateway is gone: 503, Retry-After and an OpenAI error body (never 404).
    with pytest.raises(openai.APIStatusError) as err:
        client(only_d).completions.create(model="tiny", prompt="anyone there?", max_tokens=2)
    assert err.value.status_code == 503
    assert int(err.value.response.headers["Retry-After"]) >= 1
    assert err.value.body["code"] == "no_backend"
    assert only_d.get("/readyz")[0] == 503


def test_concurrent_streams_through_the_gateway(fleet, start_gateway):
    gw = start_gateway(*fleet.shared, routing="least-load")
    errors: list[BaseException] = []
    texts: list[str] = []

    def one(i: int) -> None:
        try:
            parts = []
            for chunk in client(gw).completions.create(model="tiny", prompt=f"stream {i} " * 8, max_tokens=16,
                                                       stream=True, extra_body={"ignore_eos": True}):
                parts.append(chunk.choices[0].text if chunk.choices else "")
            texts.append("".join(parts))
        except BaseException as e:  # noqa: BLE001 - surfaced below
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(9)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and len(texts) == 9
    served = [metric(gw.metrics(), "shoal:gateway_requests_total", backend=u) for u in fleet.shared]
    assert sum(served) == 9 and min(served) >= 1, served


def test_sigterm_lets_in_flight_streams_finish_then_exits_0(fleet, start_gateway):
    # A gateway pod replaced in a rollout: the stream it is relaying runs to its end, then the process exits 0;
    # with --shutdown-timeout 0 it does not wait for it.
    for timeout in (60, 0):
        gw = start_gateway(*fleet.shared, extra=("--shutdown-timeout", str(timeout)))
        stream = client(gw).completions.create(model="tiny", prompt="Once upon a time", max_tokens=2000,
                                               stream=True, extra_body={"ignore_eos": True})
        chunks = iter(stream)
        next(chunks)
        gw.signal(signal.SIGTERM)
        finish, cut = [], None
        try:
            finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        except openai.APIConnectionError as e:  # the connection cut mid-stream (no drain budget)
            cut = e
        assert finish == (["length"] if timeout else []), (timeout, finish, cut)
        assert gw.proc.wait(30) == 0
