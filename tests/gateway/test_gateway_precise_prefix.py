"""precise-prefix routing end to end: two real `shoal-engine serve` processes publishing KV events, a real
`shoal-gateway` subscribed to them, the openai client in front. A long prompt prefix that one engine holds — put
there behind the gateway's back, as another gateway replica would — brings every request that repeats it to that
engine, including when the approximate index (which never saw it) would have sent it to the other one."""

from __future__ import annotations

import hashlib
import json
import random
import string

import openai
import pytest

from shoal.operator.gateway.prefix import block_hashes, render_prompt

from .gwkit import Proc, engine_cmd, free_port, http, metric, running, wait_for

pytestmark = pytest.mark.slow


class EventEngine(Proc):
    def __init__(self, model_dir):
        self.events_port, self.replay_port = free_port(), free_port()
        config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{self.events_port}",
                  "replay_endpoint": f"tcp://*:{self.replay_port}"}
        super().__init__([*engine_cmd(model_dir), "--kv-events-config", json.dumps(config)])


@pytest.fixture(scope="module")
def engines(fleet_model):
    with running([EventEngine(fleet_model), EventEngine(fleet_model)]) as procs:
        yield procs


def complete(url: str, prompt: str) -> None:
    status, body, _ = http("POST", url + "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 1,
                                                             "temperature": 0})
    assert status == 200, body


def chat_body(prefix: str, i: int) -> dict:
    return {"model": "tiny", "max_tokens": 1, "temperature": 0,
            "messages": [{"role": "system", "content": prefix}, {"role": "user", "content": f"question {i}"}]}


def kv_blocks(gateway: Proc, engine: Proc) -> float:
    return metric(gateway.metrics(), "shoal:gateway_kv_blocks", backend=engine.url)


def cold_choice(urls: list[str], path: str, body: dict) -> str:
    """The engine prefix-load's consistent hashing picks for a prompt no engine is known to hold (routing.py's
    RendezvousScorer on the first character block)."""
    first = block_hashes(render_prompt(path, body), 64, 512)[0]
    return max(urls, key=lambda u: hashlib.blake2b(first + u.encode(), digest_size=8).digest())


@pytest.mark.parametrize("api", ["completions", "chat"])
def test_precise_prefix_sends_a_repeated_prefix_to_the_engine_that_holds_it(api, engines, fleet_model, start_gateway):
    """completions: tokenized in the gateway (--tokenizer); chat: token ids from an engine's /tokenize, which
    renders the chat template as the engine does (no --tokenizer)."""
    a, b = engines
    extra = (("--tokenizer", str(fleet_model)) if api == "completions" else ()) + (
             "--kv-events-endpoint", f"{a.url}={a.events_port},{a.replay_port}",
             "--kv-events-endpoint", f"{b.url}={b.events_port},{b.replay_port}")
    gateway = start_gateway(a.url, b.url, routing="precise-prefix", extra=extra)

    # The gateway hears each engine (a PUB socket drops what precedes the subscription; later batches bring the
    # earlier ones back by replay).
    rng = random.Random(7 if api == "completions" else 8)
    for engine in engines:
        wait_for(lambda: complete(engine.url, "warm up " + "".join(rng.choices(string.ascii_lowercase, k=80)))
                 or kv_blocks(gateway, engine) > 0, 60, f"the gateway to index {engine.url}'s KV events")

    prefix = " ".join("".join(rng.choices(string.ascii_lowercase, k=rng.randint(3, 8))) for _ in range(120))
    path = "/v1/completions" if api == "completions" else "/v1/chat/completions"
    body = {"model": "tiny", "prompt": prefix + " question 0"} if api == "completions" else chat_body(prefix, 0)
    # Seed the engine the approximate router would NOT pick for this prefix, behind the gateway's back.
    holder = a if cold_choice([a.url, b.url], path, body) == b.url else b
    other = b if holder is a else a
    before = kv_blocks(gateway, holder)
    if api == "completions":
        complete(holder.url, prefix + " question 0")
    else:
        status, answer, _ = http("POST", holder.url + path, chat_body(prefix, 0))
        assert status == 200, answer
    wait_for(lambda: kv_blocks(gateway, holder) >= before + 10, 30,
             "the gateway to index the seeded prefix's blocks")

    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    sent_before = {e.url: metric(gateway.metrics(), "shoal:gateway_requests_total", backend=e.url, code="200")
                   for e in engines}
    for i in range(1, 7):
        if api == "completions":
            client.completions.create(model="tiny", prompt=f"{prefix} question {i}", max_tokens=1, temperature=0)
        else:
            client.chat.completions.create(**chat_body(prefix, i))
    m = gateway.metrics()
    sent = {e.url: metric(m, "shoal:gateway_requests_total", backend=e.url, code="200") - sent_before[e.url]
            for e in engines}
    assert sent == {holder.url: 6, other.url: 0}, sent
    assert metric(m, "shoal:gateway_precise_prefix_hits_total") >= 6
    assert metric(m, "shoal:gateway_precise_prefix_matched_blocks_total") >= 6 * 10
