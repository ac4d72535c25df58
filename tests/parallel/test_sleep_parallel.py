"""Sleep mode at tensor-parallel size 2 (gloo): /sleep and /wake_up reach the worker rank through the executor's RPC;
greedy output through the openai client is the same before and after both levels, and rank 0's shard reports its
KV cache and weights freed and restored."""

from __future__ import annotations

import json
import urllib.request

import openai
import pytest

from serving import Served, free_port

pytestmark = pytest.mark.slow


def call(server: Served, method: str, path: str) -> tuple[int, dict]:
    req = urllib.request.Request(f"http://127.0.0.1:{server.port}{path}", method=method)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_sleep_and_wake_at_tensor_parallel_2(llama_kv1, tmp_path):
    server = Served(["--model", str(llama_kv1), "--tensor-parallel-size", "2", "--enable-sleep-mode",
                     "--block-size", "4", "--max-model-len", "128", "--num-kv-blocks", "64",
                     "--served-model-name", "tiny"], tmp_path / "serve.log", free_port())
    try:
        server.wait_status("/readyz", 200, timeout=180)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="none", max_retries=0)

        def greedy() -> str:
            return client.completions.create(model="tiny", prompt="Hello world! The quick brown", max_tokens=12,
                                             temperature=0, extra_body={"ignore_eos": True}).choices[0].text

        before = greedy()
        status, awake = call(server, "GET", "/is_sleeping")
        assert status == 200 and awake["kv_cache_bytes"] > 0 and awake["weight_bytes"] > 0, awake
        for level in (1, 2):
            status, asleep = call(server, "POST", f"/sleep?level={level}")
            assert status == 200 and asleep["kv_cache_bytes"] == 0, asleep
            assert asleep["weight_bytes"] == (awake["weight_bytes"] if level == 1 else 0)
            assert server.get("/readyz") == 503 and server.get("/livez") == 200
            status, woken = call(server, "POST", "/wake_up")
            assert status == 200 and woken == awake, woken
            assert greedy() == before, f"level {level}"
        assert server.proc.poll() is None and "exited with code" not in server.text()
    finally:
        server.stop()
