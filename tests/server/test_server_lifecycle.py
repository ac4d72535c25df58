"""Server lifecycle on short-lived processes: API keys, queue cap (429), a model without a chat template,
SIGTERM drain (in-flight stream completes, readiness fails at once, exit 0), a second SIGTERM and the drain
timeout (prompt exit, streams end with finish_reason "abort"), and `shoal-engine demo`."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import openai
import pytest
from openai import OpenAI

from prockit import wait_for

from .conftest import metric

KEY = "s3cret-key"


@pytest.fixture(scope="module")
def no_template_model(llama_model, tmp_path_factory):
    """The tiny Llama with its chat template removed."""
    d = tmp_path_factory.mktemp("no-template") / "model"
    shutil.copytree(llama_model, d)
    (d / "chat_template.jinja").unlink(missing_ok=True)
    cfg = d / "tokenizer_config.json"
    data = json.loads(cfg.read_text())
    data.pop("chat_template", None)
    cfg.write_text(json.dumps(data))
    return d


@pytest.fixture(scope="module")
def keyed(start_server, no_template_model):
    """API key from $SHOAL_API_KEY; one running sequence at a time and a waiting queue of one."""
    return start_server(no_template_model, "--max-num-seqs", "1", "--max-queue-len", "1", "--num-kv-blocks", "64",
                        "--shutdown-timeout", "60", env={"SHOAL_API_KEY": KEY})


AUTH = {"Authorization": f"Bearer {KEY}"}


def long_stream(client: OpenAI, max_tokens: int = 400, **kw):
    return client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=max_tokens, temperature=0,
                                      stream=True, extra_body={"ignore_eos": True}, **kw)


def test_api_key_protects_everything_but_health_and_metrics(keyed):
    for path in ("/v1/models", "/version"):
        status, raw = keyed.get(path)
        assert status == 401, path
        err = json.loads(raw)["error"]
        assert err["code"] == "invalid_api_key" and set(err) == {"message", "type", "param", "code"}
        assert keyed.get(path, headers={"Authorization": "Bearer wrong"})[0] == 401
        assert keyed.get(path, headers=AUTH)[0] == 200
    for path, body in (("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 1}),
                       ("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [5]})):
        assert keyed.post(path, body)[0] == 401
        assert keyed.post(path, body, headers=AUTH)[0] == 200
    for path in ("/health", "/livez", "/readyz", "/startupz", "/metrics"):
        assert keyed.get(path)[0] == 200, path
    with pytest.raises(openai.AuthenticationError):
        OpenAI(base_url=keyed.base + "/v1", api_key="wrong", max_retries=0).models.list()
    ok = OpenAI(base_url=keyed.base + "/v1", api_key=KEY, max_retries=0)
    assert ok.completions.create(model="tiny", prompt="Hello", max_tokens=2).usage.completion_tokens == 2


def test_chat_without_template_is_400_saying_what_to_pass(keyed):
    client = OpenAI(base_url=keyed.base + "/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert ei.value.status_code == 400 and "--chat-template" in str(ei.value)


def test_queue_full_is_429_with_retry_after(keyed):
    client = OpenAI(base_url=keyed.base + "/v1", api_key=KEY, max_retries=0, timeout=60)
    running = long_stream(client)
    next(iter(running))  # admitted and running
    waiting = long_stream(client)  # the one waiting slot (its response headers arrive once admitted)
    deadline = time.monotonic() + 10
    while metric(keyed.metrics(), "shoal:num_requests_waiting") < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    status, body, headers = keyed.post("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 1},
                                       headers=AUTH)
    assert status == 429 and headers.get("Retry-After") and body["error"]["code"] == "queue_full"
    # overloaded, not unready: the pod stays in its EndpointSlice and answers 429, which a gateway retries elsewhere
    assert keyed.get("/readyz")[0] == 200
    assert keyed.get("/livez")[0] == 200
    with pytest.raises(openai.RateLimitError):
        client.completions.create(model="tiny", prompt="x", max_tokens=1)
    running.close()
    waiting.close()
    deadline = time.monotonic() + 10
    while keyed.get("/readyz")[0] != 200 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert keyed.get("/readyz")[0] == 200
    # Both clients hung up: both requests are aborted and their blocks freed.
    while time.monotonic() < deadline:
        m = keyed.metrics()
        if metric(m, "shoal:num_requests_running") + metric(m, "shoal:kv_cache_usage_perc") == 0:
            break
        time.sleep(0.05)
    assert metric(m, "shoal:num_requests_running") == 0 and metric(m, "shoal:kv_cache_usage_perc") == 0


def test_second_sigterm_exits_promptly(keyed):
    client = OpenAI(base_url=keyed.base + "/v1", api_key=KEY, max_retries=0, timeout=60)
    stream = long_stream(client, max_tokens=450)
    it = iter(stream)
    next(it)
    keyed.proc.send_signal(signal.SIGTERM)
    wait_for(lambda: keyed.get("/readyz")[0] == 503, 10, "readiness to fail once draining")  # SIGTERM handled
    assert keyed.proc.poll() is None  # still draining (shutdown timeout is 60s)
    t0 = time.monotonic()
    keyed.proc.send_signal(signal.SIGTERM)
    reasons = [c.choices[0].finish_reason for c in it if c.choices and c.choices[0].finish_reason]
    assert keyed.proc.wait(20) == 0
    assert time.monotonic() - t0 < 12  # far below the 60s shutdown timeout
    assert reasons in (["abort"], ["length"])


# ------------------------------------------------------------------------------------------ drain
def test_sigterm_drains_in_flight_stream_and_exits_0(start_server, llama_model):
    srv = start_server(llama_model, "--num-kv-blocks", "64", "--shutdown-timeout", "60")
    client = OpenAI(base_url=srv.base + "/v1", api_key="x", max_retries=0, timeout=60)
    reference = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=300, temperature=0,
                                          extra_body={"ignore_eos": True}).choices[0].text
    stream = long_stream(client, max_tokens=300)
    it = iter(stream)
    text = next(it).choices[0].text
    srv.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 5
    status = 200
    while status == 200 and time.monotonic() < deadline:
        status, raw = srv.get("/readyz")
    assert status == 503 and json.loads(raw)["status"] == "draining"
    assert srv.get("/livez")[0] == 200  # draining is not dead
    status, body, headers = srv.post("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 1})
    assert status == 503 and headers.get("Retry-After") and body["error"]["code"] == "draining"
    reasons = []
    for chunk in it:
        for c in chunk.choices:
            text += c.text
            if c.finish_reason:
                reasons.append(c.finish_reason)
    assert reasons == ["length"] and text == reference
    assert srv.proc.wait(20) == 0
    logs = srv.logs()
    assert "drained" in logs and "Once upon a time" not in logs  # access logs carry no prompt text
    assert '"POST /v1/completions" 200' in logs and "/readyz" not in logs and "/metrics" not in logs


def test_shutdown_timeout_aborts_and_exits_0(start_server, llama_model):
    srv = start_server(llama_model, "--num-kv-blocks", "64", "--shutdown-timeout", "0.5")
    client = OpenAI(base_url=srv.base + "/v1", api_key="x", max_retries=0, timeout=60)
    it = iter(long_stream(client, max_tokens=450))
    next(it)
    t0 = time.monotonic()
    srv.proc.send_signal(signal.SIGTERM)
    reasons = [c.choices[0].finish_reason for c in it if c.choices and c.choices[0].finish_reason]
    assert srv.proc.wait(20) == 0 and time.monotonic() - t0 < 12
    assert reasons in (["abort"], ["length"])


_SLOW_LOAD = """
import logging, sys, time
from shoal.engine.config import EngineConfig
from shoal.engine.server.run import ServerOptions, run

def never_loads(config):
    time.sleep(600)  # a model load cannot be interrupted: stands for a big checkpoint on a slow disk

logging.basicConfig(level=logging.INFO)
sys.exit(run(EngineConfig(model=sys.argv[1]), ServerOptions(host="127.0.0.1", port=int(sys.argv[2])),
             engine_factory=never_loads))
"""


def _catches(pid: int, sig: int) -> bool:
    """Whether process `pid` has a handler installed for `sig` (Linux: the SigCgt mask of /proc/PID/status)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            mask = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
    except (OSError, StopIteration):
        return False
    return bool(mask >> (sig - 1) & 1)


def test_sigterm_while_starting_exits_0_at_once(llama_model):
    # A pod deleted while it starts (a scale-down of a replica still loading): exit 0 promptly, no abort, no
    # traceback, whether the signal comes during the imports or while the model loads.
    from prockit import LoggedProcess, free_port

    port = free_port()
    loading = LoggedProcess([sys.executable, "-c", _SLOW_LOAD, str(llama_model), str(port)], port)
    try:
        loading.wait_ready(60, path="/livez")
        assert loading.get("/startupz")[0] == 503
        t0 = time.monotonic()
        loading.proc.send_signal(signal.SIGTERM)
        assert loading.proc.wait(30) == 0, loading.logs()
        assert time.monotonic() - t0 < 10
        assert "while the model was loading" in loading.logs() and "Traceback" not in loading.logs()
    finally:
        loading.stop(timeout=5)
    p = subprocess.Popen([sys.executable, "-m", "shoal.engine.cli", "serve", "--model", str(llama_model),
                          "--host", "127.0.0.1", "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True)
    deadline = time.monotonic() + 60
    while not _catches(p.pid, signal.SIGTERM) and p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)  # the interpreter itself starts first: no program can catch a signal before that
    p.send_signal(signal.SIGTERM)  # most likely still importing: before the server's own handlers exist
    out, _ = p.communicate(timeout=60)
    assert p.returncode == 0, out
    assert "Traceback" not in out and ("before serving" in out or "while the model was loading" in out), out


def test_bad_flags_exit_2_without_traceback(llama_model):
    for args in (["--block-size", "0"], ["--max-num-batched-tokens", "4", "--block-size", "16"],
                 ["--kv-cache-memory", "lots"], ["--attention-backend", "magic"],
                 ["--chat-template", "/no/such/template.jinja"], ["--api-key-file", "/no/such/key"],
                 ["--max-model-len", "lots"], ["--gpu-memory-utilization", "1.5"]):
        p = subprocess.run([sys.executable, "-m", "shoal.engine.cli", "serve", "--model", str(llama_model), *args],
                           capture_output=True, text=True, timeout=60)
        assert p.returncode == 2, (args, p.stderr)
        assert "Traceback" not in p.stderr and "error:" in p.stderr, p.stderr


def test_unloadable_model_exits_1(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["NopeForCausalLM"], "model_type": "nope"}')
    p = subprocess.run([sys.executable, "-m", "shoal.engine.cli", "serve", "--model", str(tmp_path), "--port", "0",
                        "--host", "127.0.0.1"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 1, p.stderr
    assert "Traceback" not in p.stderr


def test_demo_command(tmp_path):
    env = dict(os.environ, SHOAL_CACHE=str(tmp_path), TOKENIZERS_PARALLELISM="false")
    env.pop("SHOAL_API_KEY", None)
    p = subprocess.run([sys.executable, "-m", "shoal.engine.cli", "demo", "--max-tokens", "12"], capture_output=True,
                       text=True, timeout=240, env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    out = p.stdout
    assert "random weights" in out.lower() and "--model /path/to/hf-dir" in out
    assert "is not cached and offline" in out  # conftest sets HF_HUB_OFFLINE: it says why it fell back
    assert "shoal-demo>" in out and "usage: " in out and "12 completion tokens" in out
    assert "shoal:generation_tokens_total" in out and "server stopped (exit code 0)" in out
    assert (tmp_path / "demo-llama" / "config.json").exists()
