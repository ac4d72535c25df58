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
    def __init__(self, model_dir, *flags: str):
        self.events_port, self.replay_port = free_port(), free_port()
        config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{self.events_port}",
                  "replay_endpoint": f"tcp://*:{self.replay_port}"}
        super().__init__([*engine_cmd(model_dir), "--kv-events-config", json.dumps(config), *flags])


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


def precise_gateway(engines, start_gateway, tokenizer=None):
    """A precise-prefix gateway over `engines` (tokenizing with `tokenizer`, else through /tokenize) that has heard
    each of them: a PUB socket drops what precedes the subscription; later batches bring the earlier ones back by
    replay."""
    extra = ("--tokenizer", str(tokenizer)) if tokenizer else ()
    for e in engines:
        extra += ("--kv-events-endpoint", f"{e.url}={e.events_port},{e.replay_port}")
    gateway = start_gateway(*(e.url for e in engines), routing="precise-prefix", extra=extra)
    rng = random.Random(len(engines))
    for engine in engines:
        wait_for(lambda: complete(engine.url, "warm up " + "".join(rng.choices(string.ascii_lowercase, k=80)))
                 or kv_blocks(gateway, engine) > 0, 60, f"the gateway to index {engine.url}'s KV events")
    return gateway


def not_the_cold_choice(engines, path: str, body: dict) -> tuple:
    """(the engine to seed a prefix on behind the gateway's back: the one the approximate router would NOT pick
    for it, the other)."""
    a, b = engines
    return (a, b) if cold_choice([a.url, b.url], path, body) == b.url else (b, a)


def words(rng: random.Random, n: int) -> str:
    return " ".join("".join(rng.choices(string.ascii_lowercase, k=rng.randint(3, 8))) for _ in range(n))


def sent_per_engine(gateway: Proc, engines) -> dict[str, float]:
    m = gateway.metrics()
    return {e.url: metric(m, "shoal:gateway_requests_total", backend=e.url, code="200") for e in engines}


@pytest.mark.parametrize("api", ["completions", "chat"])
def test_precise_prefix_sends_a_repeated_prefix_to_the_engine_that_holds_it(api, engines, fleet_model, start_gateway):
    """completions: tokenized in the gateway (--tokenizer); chat: token ids from an engine's /tokenize, which
    renders the chat template as the engine does (no --tokenizer)."""
    gateway = precise_gateway(engines, start_gateway, fleet_model if api == "completions" else None)
    rng = random.Random(7 if api == "completions" else 8)
    prefix = words(rng, 120)
    path = "/v1/completions" if api == "completions" else "/v1/chat/completions"
    body = {"model": "tiny", "prompt": prefix + " question 0"} if api == "completions" else chat_body(prefix, 0)
    holder, other = not_the_cold_choice(engines, path, body)
    before = kv_blocks(gateway, holder)
    if api == "completions":
        complete(holder.url, prefix + " question 0")
    else:
        status, answer, _ = http("POST", holder.url + path, chat_body(prefix, 0))
        assert status == 200, answer
    wait_for(lambda: kv_blocks(gateway, holder) >= before + 10, 30,
             "the gateway to index the seeded prefix's blocks")

    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    sent_before = sent_per_engine(gateway, engines)
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


def test_a_prefix_an_engine_moved_to_its_cpu_tier_still_routes_there(fleet_model, start_gateway):
    """Engines with a KV pool of 40 blocks behind a CPU tier (--kv-offloading-size): a prefix seeded on one behind
    the gateway's back, then pushed out of its pool by other prompts, is announced in the tier (the engine loop
    publishes the copy thread's changes while idle), so the requests repeating it still go to that engine, which
    serves the prefix from its tier — where the approximate router would have sent them to the other one."""
    flags = ("--num-kv-blocks", "40", "--max-model-len", "512", "--kv-offloading-size", "0.01")
    with running([EventEngine(fleet_model, *flags), EventEngine(fleet_model, *flags)]) as tiered:
        gateway = precise_gateway(tiered, start_gateway, fleet_model)
        rng = random.Random(11)
        prefix = words(rng, 40)
        body = {"model": "tiny", "prompt": prefix + " question 0"}
        holder, other = not_the_cold_choice(tiered, "/v1/completions", body)
        before = kv_blocks(gateway, holder)
        complete(holder.url, prefix + " question 0")
        wait_for(lambda: kv_blocks(gateway, holder) >= before + 8, 30, "the gateway to index the seeded prefix")
        for _ in range(3):  # 3 x ~18 blocks through a 40-block pool: the prefix's blocks go to the CPU tier
            complete(holder.url, words(rng, 60))
        stats = holder.metrics()
        assert metric(stats, "shoal:kv_offload_blocks", tier="cpu") >= 8, "the prefix never reached the CPU tier"
        cpu_hits = metric(stats, "shoal:prefix_cache_tier_hits_total", tier="cpu")
        wait_for(lambda: metric(gateway.metrics(), "shoal:gateway_kv_medium_blocks", backend=holder.url,
                                medium="CPU_OFFLOAD") >= 8, 30, "the gateway to hear the blocks the CPU tier took")

        sent_before = sent_per_engine(gateway, tiered)
        for i in range(1, 4):
            status, answer, _ = http("POST", gateway.url + "/v1/completions",
                                     {"model": "tiny", "prompt": f"{prefix} question {i}", "max_tokens": 1,
                                      "temperature": 0})
            assert status == 200, answer
        sent = {url: n - sent_before[url] for url, n in sent_per_engine(gateway, tiered).items()}
        assert sent == {holder.url: 3, other.url: 0}, sent
        assert metric(holder.metrics(), "shoal:prefix_cache_tier_hits_total", tier="cpu") > cpu_hits, \
            "the holder did not serve the prefix from its CPU tier"
