"""The Batches store (operator/gateway/batch_store.py) on a temporary directory, and the runner's place below every
interactive request (batch_runner.py), in-process against stand-in engines the tests release one by one."""

from __future__ import annotations

import asyncio
import json
import os
import time

import aiohttp
import pytest
from aiohttp import web

from shoal.operator.gateway.batch_store import BatchError, Store, parse_input, validate_create
from shoal.operator.gateway.proxy import Gateway, GatewayConfig

from shoal.operator.gateway.tenants import EngineKeys, TenantKeys
from shoal.operator.k8s.client import KubeAPI

from .test_admission import Engine, _fake_api, endpoint_slice, isvc, shared, started, until


def line(custom_id: str, url: str = "/v1/completions", **body) -> bytes:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url,
                       "body": {"model": "m", "prompt": custom_id, **body}}).encode()


def add_file(store: Store, owner: str, data: bytes, purpose: str = "batch") -> str:
    tmp = store.upload_path()
    with open(tmp, "wb") as f:
        f.write(data)
    return store.add_file(tmp, owner, "in.jsonl", purpose)["id"]


# ---- the store ----------------------------------------------------------------------------------------------
def test_parse_input_keeps_order_and_skips_blank_lines():
    lines = parse_input(line("a") + b"\n\n" + line("b") + b"\n", "/v1/completions")
    assert [(x.index, x.custom_id, x.body["prompt"]) for x in lines] == [(0, "a", "a"), (1, "b", "b")]
    with pytest.raises(BatchError, match="line 3: duplicate custom_id 'a'"):
        parse_input(line("a") + b"\n\n" + line("a"), "/v1/completions")
    with pytest.raises(BatchError, match="no request"):
        parse_input(b"\n  \n", "/v1/completions")


def test_create_parameters_are_checked_field_by_field():
    ok = {"input_file_id": "file-1", "endpoint": "/v1/embeddings", "completion_window": "24h"}
    assert validate_create(ok) == ("file-1", "/v1/embeddings", "24h", None)
    for bad, param in (({"metadata": {"k": 1}}, "metadata"), ({"metadata": {str(i): "v" for i in range(17)}},
                                                               "metadata"),
                       ({"input_file_id": ""}, "input_file_id"), ({"endpoint": "/v1/moderations"}, "endpoint")):
        with pytest.raises(BatchError) as e:
            validate_create({**ok, **bad})
        assert (e.value.status, e.value.param) == (400, param)


def test_files_and_batches_belong_to_their_owner(tmp_path):
    store = Store(str(tmp_path))
    file_id = add_file(store, "a", line("x") + b"\n")
    assert store.get_file(file_id, "a")["bytes"] == len(line("x")) + 1
    record, lines = store.create_batch("a", None, file_id, "/v1/completions", "24h", {"k": "v"})
    batch_id = record["batch"]["id"]
    assert [x.custom_id for x in lines] == ["x"] and record["batch"]["request_counts"]["total"] == 1
    for call in (lambda: store.get_file(file_id, "b"), lambda: store.delete_file(file_id, "b"),
                 lambda: store.get_batch(batch_id, "b"),
                 lambda: store.create_batch("b", None, file_id, "/v1/completions", "24h", None),
                 lambda: store.get_file("file-../../etc", "a"), lambda: store.get_batch("batch_x/../y", "a")):
        with pytest.raises(BatchError) as e:
            call()
        assert e.value.status == 404
    assert [r["batch"]["id"] for r in store.records("a")] == [batch_id] and list(store.records("b")) == []
    # the batch keeps its own copy of the input: deleting the file does not take its requests away
    store.delete_file(file_id, "a")
    assert [x.custom_id for x in store.input_lines(store.get_batch(batch_id, "a"))] == ["x"]


def test_finished_ids_come_from_the_result_files_and_a_torn_last_line_is_cut(tmp_path):
    store = Store(str(tmp_path))
    record, _ = store.create_batch("a", None, add_file(store, "a", b"\n".join(line(c) for c in "xyz")),
                                   "/v1/completions", "24h", None)
    batch_id = record["batch"]["id"]
    store.append(batch_id, [("output.jsonl", b'{"custom_id":"x"}'), ("errors.jsonl", b'{"custom_id":"y"}')])
    out = os.path.join(store.batch_dir(batch_id), "output.jsonl")
    with open(out, "ab") as f:
        f.write(b'{"custom_id":"z","resp')  # a crash in the middle of a write
    assert store.finished(batch_id) == ({"x"}, {"y"})
    with open(out, "rb") as f:
        assert f.read() == b'{"custom_id":"x"}\n'  # z runs again, and its line is appended whole
    # publishing is idempotent: a crash after it is finished again on resume with the same file
    assert store.publish_result(record, "output.jsonl", "file-1output") == "file-1output"
    assert store.publish_result(record, "output.jsonl", "file-1output") == "file-1output"
    assert store.get_file("file-1output", "a")["purpose"] == "batch_output"
    with open(store.file_content_path("file-1output", "a"), "rb") as f:
        assert f.read() == b'{"custom_id":"x"}\n'
    assert store.publish_result(record, "nothing.jsonl", "file-1nothing") is None


def test_lists_page_with_openai_cursors():
    from shoal.operator.gateway.batch_api import _page

    items = [{"id": f"x{i}"} for i in range(5)]
    assert _page(items, None, 2) == {"object": "list", "data": items[:2], "first_id": "x0", "last_id": "x1",
                                     "has_more": True}
    assert _page(items, "x1", 10)["data"] == items[2:] and not _page(items, "x1", 10)["has_more"]
    assert _page(items, "gone", 10)["data"] == [] and _page([], None, 1)["first_id"] is None


def test_one_process_at_a_time_runs_a_batch(tmp_path):
    store = Store(str(tmp_path))
    record, _ = store.create_batch("a", None, add_file(store, "a", line("x")), "/v1/completions", "24h", None)
    batch_id = record["batch"]["id"]
    other = Store(str(tmp_path))  # another replica on the same volume
    fd = store.lock(batch_id)
    assert fd is not None and other.lock(batch_id) is None
    os.close(fd)
    fd = other.lock(batch_id)
    assert fd is not None
    os.close(fd)


def test_a_batch_dir_that_cannot_be_used_is_a_flag_error(tmp_path):
    from shoal.operator.gateway.cli import build_parser, config_from_args

    (tmp_path / "file").write_text("")
    args = build_parser().parse_args(["--endpoint", "http://127.0.0.1:1", "--batch-dir", str(tmp_path / "file/x")])
    with pytest.raises(ValueError, match="--batch-dir: cannot keep batches in"):
        config_from_args(args)
    args = build_parser().parse_args(["--endpoint", "http://127.0.0.1:1", "--batch-dir", str(tmp_path / "ok")])
    assert config_from_args(args).batch_dir == str(tmp_path / "ok") and (tmp_path / "ok" / "batches").is_dir()


# ---- the runner below interactive requests ------------------------------------------------------------------
async def create_batch(client, *ids: str, models: dict[str, str] | None = None, headers=None) -> str:
    form = aiohttp.FormData()
    form.add_field("purpose", "batch")
    form.add_field("file", b"\n".join(line(i, max_tokens=8, model=(models or {}).get(i, "m")) for i in ids),
                   filename="in.jsonl")
    r = await client.post("/v1/files", data=form, headers=headers)
    assert r.status == 200, await r.text()
    file_id = (await r.json())["id"]
    r = await client.post("/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/completions",
                                               "completion_window": "24h"}, headers=headers)
    assert r.status == 200, await r.text()
    return (await r.json())["id"]


async def test_an_interactive_request_takes_the_next_free_slot_before_the_batch(tmp_path):
    async with Engine("e") as engine:
        gw = Gateway(GatewayConfig(max_inflight=1, max_queued=1, poll_interval=0.05, batch_dir=str(tmp_path),
                                   batch_per_engine=1))
        gw.backends.replace([engine.url])
        client = await started(gw)
        try:
            batch_id = await create_batch(client, "b0", "b1", "b2")
            await until(lambda: len(engine.seen) == 1)  # the batch took the idle engine
            interactive = asyncio.create_task(client.post("/v1/completions", json={"model": "m", "prompt": "i0"}))
            await until(lambda: len(gw.pools.pool.queue) == 1)
            engine.release(0)
            await until(lambda: len(engine.seen) == 2)
            assert engine.seen[1]["body"]["prompt"] == "i0"  # not the batch's next request
            await asyncio.sleep(0.2)  # an absence: the batch must not take a second slot beside it
            assert len(engine.seen) == 2
            engine.release(1)
            assert (await interactive).status == 200
            for i in (2, 3):
                await until(lambda: len(engine.seen) == i + 1)
                engine.release(i)
            assert [s["body"]["prompt"] for s in engine.seen] == ["b0", "i0", "b1", "b2"]

            async def status():
                return await (await client.get(f"/v1/batches/{batch_id}")).json()
            for _ in range(200):
                if (b := await status())["status"] == "completed":
                    break
                await asyncio.sleep(0.02)
            assert b["status"] == "completed" and b["request_counts"] == {"total": 3, "completed": 3, "failed": 0}
            m = gw.metrics
            assert m.batch_requests.labels("completed")._value.get() == 3 and m.batch_running._value.get() == 0
        finally:
            await client.close()
            await gw.stop()


class BusyEngine(Engine):
    """An engine that reports requests waiting in its own queue (others' traffic) until told otherwise."""

    waiting = 3

    async def metrics(self, request):
        return web.Response(text=f'shoal:num_requests_running{{model_name="m"}} 1\n'
                                 f'shoal:num_requests_waiting{{model_name="m"}} {self.waiting}\n')


async def test_without_gateway_slots_the_batch_waits_while_the_engine_queues(tmp_path):
    async with BusyEngine("e", hold=False) as engine:
        gw = Gateway(GatewayConfig(poll_interval=0.05, batch_dir=str(tmp_path)))
        gw.backends.replace([engine.url])
        client = await started(gw)
        try:
            await until(lambda: gw.backends.all()[0].fresh(time.monotonic()))  # its queue is known
            await create_batch(client, "b0", "b1")
            await asyncio.sleep(0.5)  # polled several times: the engine still queues, the batch stays out
            assert engine.seen == []
            engine.waiting = 0
            await until(lambda: len(engine.seen) == 2)
        finally:
            await client.close()
            await gw.stop()


async def batch_status(client, batch_id: str, until_status: str, headers=None) -> dict:
    for _ in range(500):
        b = await (await client.get(f"/v1/batches/{batch_id}", headers=headers)).json()
        if b["status"] == until_status:
            return b
        await asyncio.sleep(0.02)
    raise AssertionError(f"batch {batch_id} never reached {until_status}: {b}")


async def test_a_batch_past_its_window_expires_with_an_error_line_per_request_left(tmp_path):
    store = Store(str(tmp_path))
    record, _ = store.create_batch("default", None, add_file(store, "default", line("x") + b"\n" + line("y")),
                                   "/v1/completions", "24h", None)
    record["batch"]["expires_at"] = record["batch"]["created_at"] - 1  # as if the gateway was down for a day
    store.save(record)
    async with Engine("e", hold=False) as engine:
        gw = Gateway(GatewayConfig(poll_interval=0.05, batch_dir=str(tmp_path)))
        gw.backends.replace([engine.url])
        client = await started(gw)  # resumes the directory's batch
        try:
            b = await batch_status(client, record["batch"]["id"], "expired")
            assert b["request_counts"] == {"total": 2, "completed": 0, "failed": 2} and b["output_file_id"] is None
            errors = [json.loads(x) for x in (await (await client.get(
                f"/v1/files/{b['error_file_id']}/content")).read()).splitlines()]
            assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [("x", "batch_expired"),
                                                                               ("y", "batch_expired")]
            assert engine.seen == []
        finally:
            await client.close()
            await gw.stop()


async def test_results_that_cannot_be_written_fail_the_batch_instead_of_completing_it(tmp_path):
    async with Engine("e", hold=False) as engine:
        gw = Gateway(GatewayConfig(poll_interval=0.05, batch_dir=str(tmp_path)))
        gw.backends.replace([engine.url])
        client = await started(gw)

        def disk_full(batch_id, results):
            raise OSError(28, "No space left on device")
        gw.batches.store.append = disk_full
        try:
            b = await batch_status(client, await create_batch(client, "x", "y"), "failed")
            assert "No space left on device" in b["errors"]["data"][0]["message"]
            assert b["output_file_id"] is None and b["request_counts"]["completed"] == 0
        finally:
            await client.close()
            await gw.stop()


async def test_the_shared_gateway_routes_each_batch_request_by_model_with_the_engines_key(tmp_path):
    (tmp_path / "tenants").mkdir()
    (tmp_path / "tenants" / "team.a").write_text("sk-a\n")
    (tmp_path / "tenants" / "team.b").write_text("sk-b\n")
    (tmp_path / "engines").mkdir()
    (tmp_path / "engines" / "team.chat").write_text("engine-secret\n")
    a, b = {"Authorization": "Bearer sk-a"}, {"Authorization": "Bearer sk-b"}
    async with Engine("chat", served="chat-7b", hold=False) as chat, Engine("code", served="coder", hold=False) \
            as code:
        config = GatewayConfig(tenant_keys=TenantKeys(str(tmp_path / "tenants")), batch_dir=str(tmp_path / "b"),
                               engine_keys=EngineKeys(str(tmp_path / "engines")))
        gw, client = await shared(config, [isvc("chat", "chat-7b", scheduling="priority"), isvc("code", "coder")],
                                  {"chat": chat, "code": code})
        try:
            assert (await client.get("/v1/batches")).status == 401  # no key, no batches
            batch_id = await create_batch(client, "x", "y", "z", headers=a,
                                          models={"x": "chat-7b", "y": "coder", "z": "gpt-5"})
            done = await batch_status(client, batch_id, "completed", headers=a)
            assert done["request_counts"] == {"total": 3, "completed": 2, "failed": 1}
            assert [s["body"]["prompt"] for s in chat.seen] == ["x"] and [s["body"]["prompt"] for s in code.seen] \
                == ["y"]
            assert chat.seen[0]["auth"] == "Bearer engine-secret"  # the engines' key, never the tenant's
            assert chat.seen[0]["body"]["priority"] > 2**50  # below every interactive request at the engine
            errors = (await (await client.get(f"/v1/files/{done['error_file_id']}/content", headers=a)).read())
            assert json.loads(errors)["response"]["body"]["error"]["code"] == "model_not_found"
            assert (await client.get(f"/v1/batches/{batch_id}", headers=b)).status == 404  # another tenant's
            assert (await (await client.get("/v1/batches", headers=b)).json())["data"] == []
        finally:
            await client.close()
            await gw.stop()


# ---- --batch-share, scale from zero -------------------------------------------------------------------------
@pytest.mark.parametrize("share", ["idle", "spare"])
async def test_batch_share_idle_keeps_batch_requests_off_an_engine_with_an_interactive_one(tmp_path, share):
    async with Engine("e") as engine:
        gw = Gateway(GatewayConfig(poll_interval=0.05, batch_dir=str(tmp_path), batch_per_engine=2,
                                   batch_share=share))
        gw.backends.replace([engine.url])
        client = await started(gw)
        try:
            interactive = asyncio.create_task(client.post("/v1/completions", json={"model": "m", "prompt": "i0"}))
            await until(lambda: len(engine.seen) == 1)
            await create_batch(client, "b0", "b1")
            if share == "spare":  # a free slot is enough: both go beside the interactive request
                await until(lambda: len(engine.seen) == 3)
            else:
                await asyncio.sleep(0.3)  # an absence: polled six times, the engine is never idle
                assert len(engine.seen) == 1
            engine.release(0)
            assert (await interactive).status == 200
            await until(lambda: len(engine.seen) == 3)  # idle again: the batch goes
            assert sorted(s["body"]["prompt"] for s in engine.seen[1:]) == ["b0", "b1"]
        finally:
            await client.close()
            await gw.stop()


def test_batch_share_is_a_flag_with_a_checked_value():
    from shoal.operator.gateway.batch_runner import BatchRunner
    from shoal.operator.gateway.cli import build_parser, config_from_args

    assert config_from_args(build_parser().parse_args(["--endpoint", "http://127.0.0.1:1"])).batch_share == "idle"
    args = build_parser().parse_args(["--endpoint", "http://127.0.0.1:1", "--batch-share", "spare"])
    assert config_from_args(args).batch_share == "spare"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--endpoint", "http://127.0.0.1:1", "--batch-share", "greedy"])
    with pytest.raises(ValueError, match="batch share must be one of idle, spare"):
        BatchRunner(None, None, share="greedy")


async def test_a_batch_wakes_a_pool_with_no_engine_and_reports_its_pending_requests(tmp_path):
    from prometheus_client import generate_latest

    from shoal.operator.autoscaler import gateway_view

    gw = Gateway(GatewayConfig(poll_interval=0.05, batch_dir=str(tmp_path)))
    wakes: list[float] = []
    gw.on_hold.append(lambda: wakes.append(time.monotonic()))
    client = await started(gw)

    def pending() -> float:
        return gateway_view(generate_latest(gw.metrics.registry).decode()).batch_pending
    try:
        assert pending() == 0
        batch_id = await create_batch(client, "b0", "b1", "b2")
        await until(lambda: len(wakes) == 1)  # no engine: a wake-up, as a held request gives
        assert pending() == 3 and gw.pools.pool.held == 0  # no client is held: nothing to count as one
        await until(lambda: len(wakes) == 2)
        assert wakes[1] - wakes[0] >= 0.9  # at most once per WAKE_EVERY while it waits
        async with Engine("e", hold=False) as engine:  # the engine the wake-up asked for
            gw.backends.replace([engine.url])
            await batch_status(client, batch_id, "completed")
            assert pending() == 0 and len(engine.seen) == 3
    finally:
        await client.close()
        await gw.stop()


async def test_each_batch_request_is_a_span_with_its_batch_and_custom_id_and_the_engine_gets_its_context(
        tmp_path, monkeypatch):
    from otlpkit import Collector, attributes

    class TracedEngine(Engine):
        traces: list[str | None] = []

        async def complete(self, request):
            self.traces.append(request.headers.get("traceparent"))
            return await super().complete(request)

    collector = Collector()
    for k, v in collector.env("gateway").items():
        monkeypatch.setenv(k, v)
    async with TracedEngine("e", hold=False) as engine:
        url = engine.url
        gw = Gateway(GatewayConfig(poll_interval=0.05, batch_dir=str(tmp_path)))
        gw.backends.replace([url])
        client = await started(gw)
        try:
            batch_id = await create_batch(client, "b0", "b1")
            await batch_status(client, batch_id, "completed")
            await until(lambda: len(collector.named("engine_attempt")) == 2, 20)
        finally:
            await client.close()
            await gw.stop()
            collector.close()
    spans = {attributes(s)["shoal.batch.custom_id"]: s for s in collector.named("shoal.gateway.batch_request")}
    assert set(spans) == {"b0", "b1"}
    a = attributes(spans["b0"])
    assert a["shoal.batch.id"] == batch_id and a["gen_ai.request.model"] == "m"
    assert a["http.response.status_code"] == 200
    attempts = {s.parent_span_id: s for s in collector.named("engine_attempt")}
    assert set(attempts) == {s.span_id for s in spans.values()}
    assert attributes(attempts[spans["b0"].span_id])["server.address"] == url
    # each engine request carries its attempt's context: the engine's spans nest under it
    assert sorted(t.split("-")[2] for t in engine.traces) == sorted(s.span_id.hex() for s in attempts.values())


async def test_the_shared_gateway_wakes_only_the_service_a_batch_needs(tmp_path):
    runner, url, patched = await _fake_api()
    async with Engine("chat", served="chat-7b", hold=False) as chat:
        gw, client = await shared(GatewayConfig(batch_dir=str(tmp_path)), [isvc("chat", "chat-7b", from_zero=True),
                                           isvc("code", "coder", from_zero=True)], {}, api=KubeAPI(url))
        try:
            batch_id = await create_batch(client, "a", "b", models={"a": "chat-7b", "b": "chat-7b"})
            await until(lambda: patched)
            assert patched == ["team/chat-wake"] and gw.pools.resolve("chat-7b").held == 0
            gw.pools.slice_event("ADDED", endpoint_slice("chat-engines", chat.url))  # the replica it asked for
            done = await batch_status(client, batch_id, "completed")
            assert done["request_counts"]["completed"] == 2
        finally:
            await client.close()
            await gw.stop()
            await runner.cleanup()
