"""OpenAI Batches through a real `shoal-gateway --batch-dir` in front of a real `shoal-engine serve`, driven by the
official openai client: files, batches, results, cancel, tenancy, malformed input, and a gateway killed mid-batch."""

from __future__ import annotations

import io
import json
import signal

import openai
import pytest

from .gwkit import Proc, engine_cmd, gateway_cmd, metric, wait_for

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine(fleet_model):
    p = Proc(engine_cmd(fleet_model)).wait_ready()
    yield p
    p.stop()


def start(engine: Proc, batch_dir, *extra: str) -> Proc:
    return Proc(gateway_cmd(engine.url, extra=("--batch-dir", str(batch_dir), *extra))).wait_ready(60)


def client(gateway: Proc, tenant: str | None = None) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0, timeout=60,
                         default_headers={"x-tenant": tenant} if tenant else None)


def chat_line(custom_id: str, model: str = "tiny", max_tokens: int = 4) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": model, "max_tokens": max_tokens, "temperature": 0,
                     "messages": [{"role": "user", "content": f"say something about {custom_id}"}]}}


def upload(c: openai.OpenAI, lines: list) -> str:
    data = "\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines).encode() + b"\n"
    return c.files.create(file=("requests.jsonl", io.BytesIO(data)), purpose="batch").id


def results(c: openai.OpenAI, file_id: str | None) -> list[dict]:
    return [json.loads(line) for line in c.files.content(file_id).text.splitlines()] if file_id else []


def finished(c: openai.OpenAI, batch_id: str, timeout: float = 180.0):
    return wait_for(lambda: (b := c.batches.retrieve(batch_id)).status in ("completed", "cancelled", "failed",
                                                                            "expired") and b,
                    timeout, f"batch {batch_id} to finish")


def test_batch_runs_every_request_and_reports_results(engine, tmp_path):
    gw = start(engine, tmp_path)
    try:
        c = client(gw)
        lines = [chat_line(f"req-{i}") for i in range(6)] + [chat_line("unknown-model", model="nope")]
        input_id = upload(c, lines)
        assert c.files.retrieve(input_id).purpose == "batch"
        batch = c.batches.create(input_file_id=input_id, endpoint="/v1/chat/completions", completion_window="24h",
                                 metadata={"job": "nightly"})
        assert batch.status in ("validating", "in_progress") and batch.request_counts.total == 7
        done = finished(c, batch.id)
        assert done.status == "completed", done
        assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (7, 6, 1)
        assert done.metadata == {"job": "nightly"} and done.completed_at >= done.in_progress_at
        out = results(c, done.output_file_id)
        assert sorted(r["custom_id"] for r in out) == sorted(f"req-{i}" for i in range(6))
        for r in out:
            assert r["response"]["status_code"] == 200 and r["error"] is None
            assert r["response"]["body"]["object"] == "chat.completion"
            assert r["response"]["body"]["usage"]["completion_tokens"] >= 1
        errors = results(c, done.error_file_id)
        assert [(e["custom_id"], e["response"]["status_code"]) for e in errors] == [("unknown-model", 404)]
        assert errors[0]["response"]["body"]["error"]["code"] == "model_not_found"
        assert c.files.retrieve(done.output_file_id).purpose == "batch_output"
        assert [b.id for b in c.batches.list()] == [batch.id]
        assert {f.id for f in c.files.list()} == {input_id, done.output_file_id, done.error_file_id}
        assert [f.id for f in c.files.list(purpose="batch")] == [input_id]
        # an input file may be deleted once the batch has it
        assert c.files.delete(input_id).deleted
        with pytest.raises(openai.NotFoundError):
            c.files.retrieve(input_id)
    finally:
        gw.stop()


def test_gateway_killed_mid_batch_resumes_without_losing_or_repeating(engine, tmp_path):
    total = 24
    before = metric(engine.metrics(), "shoal:request_success_total")
    gw = start(engine, tmp_path, "--batch-max-inflight-per-engine", "2")
    c = client(gw)
    batch = c.batches.create(input_file_id=upload(c, [chat_line(f"r{i}", max_tokens=24) for i in range(total)]),
                             endpoint="/v1/chat/completions", completion_window="24h")
    wait_for(lambda: c.batches.retrieve(batch.id).request_counts.completed >= 4, 120, "4 finished requests")
    gw.stop(signal.SIGKILL)  # no chance to flush or drain: what is on the volume is all there is
    gw = start(engine, tmp_path, "--batch-max-inflight-per-engine", "2")
    try:
        c = client(gw)
        done = finished(c, batch.id)
        assert done.status == "completed", done
        assert (done.request_counts.completed, done.request_counts.failed) == (total, 0)
        ids = [r["custom_id"] for r in results(c, done.output_file_id)]
        assert sorted(ids) == sorted(f"r{i}" for i in range(total)), ids  # every one, exactly once
        assert done.error_file_id is None
        # The engine ran each request once, plus at most those in flight when the gateway died (2 per engine)
        ran = metric(engine.metrics(), "shoal:request_success_total") - before
        assert total <= ran <= total + 2, ran
    finally:
        gw.stop()


def test_cancel_stops_a_batch_and_keeps_what_finished(engine, tmp_path):
    gw = start(engine, tmp_path, "--batch-max-inflight-per-engine", "1")
    try:
        c = client(gw)
        batch = c.batches.create(input_file_id=upload(c, [chat_line(f"c{i}", max_tokens=32) for i in range(40)]),
                                 endpoint="/v1/chat/completions", completion_window="24h")
        wait_for(lambda: c.batches.retrieve(batch.id).request_counts.completed >= 1, 120, "a finished request")
        assert c.batches.cancel(batch.id).status in ("cancelling", "cancelled")
        done = finished(c, batch.id)
        assert done.status == "cancelled" and done.cancelled_at is not None
        out = results(c, done.output_file_id)
        assert 1 <= len(out) == done.request_counts.completed < 40
        with pytest.raises(openai.BadRequestError):  # an output file is no batch input (purpose batch_output)
            c.batches.create(input_file_id=done.output_file_id, endpoint="/v1/chat/completions",
                             completion_window="24h")
    finally:
        gw.stop()


def test_batches_and_files_belong_to_their_tenant(engine, tmp_path):
    gw = start(engine, tmp_path, "--tenant-header", "x-tenant", "--trusted-proxies", "127.0.0.1/32")
    try:
        a, b = client(gw, "team-a"), client(gw, "team-b")
        file_id = upload(a, [chat_line("only")])
        batch = a.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
        for call in (lambda: b.files.retrieve(file_id), lambda: b.files.content(file_id),
                     lambda: b.files.delete(file_id), lambda: b.batches.retrieve(batch.id),
                     lambda: b.batches.cancel(batch.id),
                     lambda: b.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                              completion_window="24h")):
            with pytest.raises(openai.NotFoundError):
                call()
        assert list(b.batches.list()) == [] and list(b.files.list()) == []
        assert finished(a, batch.id).status == "completed"
        assert [x.id for x in a.batches.list()] == [batch.id]
    finally:
        gw.stop()


@pytest.mark.parametrize("line, says", [
    ("{not json", "line 2: not valid JSON"),
    ('["a list"]', "line 2: not a JSON object"),
    ({"method": "POST", "url": "/v1/chat/completions", "body": {"model": "tiny"}}, "line 2: `custom_id`"),
    (chat_line("a"), "line 2: duplicate custom_id 'a'"),
    ({**chat_line("b"), "method": "GET"}, "line 2: `method` must be"),
    ({**chat_line("b"), "url": "/v1/completions"}, "line 2: `url` '/v1/completions' is not the batch's endpoint"),
    ({**chat_line("b"), "body": {"messages": []}}, "line 2: `body.model`"),
    ({**chat_line("b"), "body": {**chat_line("b")["body"], "stream": True}}, "line 2: `body.stream`"),
])
def test_malformed_batch_line_is_refused_at_create(engine, tmp_path_factory, line, says):
    gw = start(engine, tmp_path_factory.mktemp("batches"))
    try:
        c = client(gw)
        file_id = upload(c, [chat_line("a"), line])
        with pytest.raises(openai.BadRequestError) as e:
            c.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
        assert says in e.value.body["message"], e.value.body
        assert e.value.body["param"] == "input_file_id" and e.value.body["code"] == "invalid_batch_line"
        assert list(c.batches.list()) == []  # nothing was created
    finally:
        gw.stop()


def test_bad_batch_parameters_are_refused(engine, tmp_path):
    gw = start(engine, tmp_path)
    try:
        c = client(gw)
        file_id = upload(c, [chat_line("a")])
        for kwargs, param in (({"endpoint": "/v1/responses"}, "endpoint"), ({"completion_window": "1h"},
                                                                           "completion_window"),
                              ({"input_file_id": "file-nothere"}, "file_id")):
            args = {"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h",
                    **kwargs}
            with pytest.raises((openai.BadRequestError, openai.NotFoundError)) as e:
                c.batches.create(**args)
            assert e.value.body["param"] == param, e.value.body
        with pytest.raises(openai.BadRequestError) as e:
            c.files.create(file=("x.jsonl", io.BytesIO(b"{}\n")), purpose="fine-tune")
        assert e.value.body["param"] == "purpose"
    finally:
        gw.stop()
