"""Sleep mode (--enable-sleep-mode; vLLM's POST /sleep?level=1|2, POST /wake_up, GET /is_sleeping) through the real
`shoal-engine serve` process and the openai client: the same greedy output before and after, the memory freed and
restored as the engine reports it, the health endpoints and the refusals."""

from __future__ import annotations

import json

import openai
import pytest

from prockit import wait_for

PROMPT = "Once upon a time there was a little shoal of fish"
FLAGS = ("--enable-sleep-mode", "--block-size", "4", "--max-model-len", "128", "--kv-cache-memory", "4MiB")


@pytest.fixture(scope="module")
def server(start_server, llama_model):
    # A first start may build the CPU kernels (minutes on a loaded 2-core machine): a longer bound than the default.
    return start_server(llama_model, *FLAGS, wait=False).wait_ready(timeout=300)


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base + "/v1", api_key="none", max_retries=0)


def greedy(server) -> str:
    out = client(server).completions.create(model=server.model, prompt=PROMPT, max_tokens=16, temperature=0,
                                            extra_body={"ignore_eos": True})
    return out.choices[0].text


def is_sleeping(server) -> dict:
    status, body, _ = server.request("GET", "/is_sleeping")
    assert status == 200, body
    return json.loads(body)


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_and_wake_keep_greedy_output_and_free_then_restore_memory(server, level):
    before = greedy(server)
    awake = is_sleeping(server)
    assert awake["is_sleeping"] is False and awake["level"] is None
    assert awake["kv_cache_bytes"] >= 4 * 2**20 * 0.9 and awake["weight_bytes"] > 0

    status, asleep, _ = server.post(f"/sleep?level={level}", None)
    assert status == 200, asleep
    assert asleep == is_sleeping(server)
    assert asleep["is_sleeping"] is True and asleep["level"] == level
    assert asleep["kv_cache_bytes"] == 0  # the KV cache is released at both levels
    # Level 1 keeps the weights (in host memory on a GPU; on this CPU they stay put), level 2 drops them.
    assert asleep["weight_bytes"] == (awake["weight_bytes"] if level == 1 else 0)

    status, body = server.get("/readyz")
    assert status == 503 and json.loads(body)["status"] == "sleeping", body
    assert server.get("/livez")[0] == 200  # asleep is not dead: no restart
    with pytest.raises(openai.APIStatusError) as refused:
        greedy(server)
    assert refused.value.status_code == 503 and refused.value.body["code"] == "sleeping"
    assert "POST /wake_up" in refused.value.message

    status, woken, _ = server.post("/wake_up", None)
    assert status == 200, woken
    assert woken == {**awake, "is_sleeping": False, "level": None}  # the same KV cache and weights again
    wait_for(lambda: server.get("/readyz")[0] == 200, timeout=30, what="/readyz 200 after wake-up")
    assert greedy(server) == before  # after a fresh KV cache (prefix cache emptied) and, at level 2, a reload


def test_bad_sleep_requests_are_refused_clearly(server):
    for query, fragment in (("level=3", "got '3'"), ("level=one", "got 'one'"), ("level=", "got ''")):
        status, body, _ = server.post(f"/sleep?{query}", None)
        assert status == 400 and body["error"]["param"] == "level" and fragment in body["error"]["message"], body
    status, body, _ = server.post("/wake_up", None)
    assert status == 400 and body["error"]["code"] == "not_sleeping", body
    assert server.post("/sleep", None)[0] == 200  # level 1 by default, as vLLM
    status, body, _ = server.post("/sleep?level=2", None)
    assert status == 400 and body["error"]["code"] == "already_sleeping", body
    assert is_sleeping(server)["level"] == 1
    assert server.post("/wake_up", None)[0] == 200
    assert greedy(server)


def test_sleep_is_refused_while_a_request_is_in_flight(server):
    stream = client(server).completions.create(model=server.model, prompt=PROMPT, max_tokens=100, temperature=0,
                                               stream=True, extra_body={"ignore_eos": True})
    chunks = iter(stream)
    next(chunks)
    status, body, _ = server.post("/sleep?level=1", None)
    assert status == 409 and body["error"]["code"] == "requests_in_flight", body
    assert "in flight" in body["error"]["message"]
    rest = "".join(c.choices[0].text for c in chunks)  # the request runs on to the end, untouched
    assert rest and is_sleeping(server)["is_sleeping"] is False
    assert server.get("/readyz")[0] == 200
    wait_for(lambda: server.post("/sleep?level=1", None)[0] == 200, timeout=30,
             what="sleep accepted once the request finished")
    assert server.post("/wake_up", None)[0] == 200


def test_without_the_flag_sleep_endpoints_say_how_to_enable_it(start_server, llama_model):
    plain = start_server(llama_model, "--block-size", "4", "--max-model-len", "128", "--kv-cache-memory", "4MiB",
                         wait=False).wait_ready(timeout=300)
    for method, path in (("POST", "/sleep?level=1"), ("POST", "/wake_up"), ("GET", "/is_sleeping")):
        status, raw, _ = plain.request(method, path)
        body = json.loads(raw)
        assert status == 400 and body["error"]["code"] == "sleep_mode_disabled", (path, body)
        assert "--enable-sleep-mode" in body["error"]["message"]
    assert plain.get("/readyz")[0] == 200
