"""Prefill/decode disaggregation through the real `shoal-gateway` (--prefill-endpoint) in front of a prefill engine
(kv_producer) and a decode engine (kv_consumer), driven by the openai client: the answers are one engine's, the
decode engine computed only the prompt's tail from the KV it pulled, a client's own kv_transfer_params never reach
an engine, and with the prefill engine gone the decode engine prefills itself."""

from __future__ import annotations

import json
import signal

import pytest
from openai import OpenAI

from shoal.engine import LLM, SamplingParams

from .gwkit import Proc, engine_cmd, free_port, gateway_cmd, metric

BLOCK = 4
MAX_NEW = 6
PROMPTS = ["Once upon a time there was a little shoal of fish that swam together in the warm sea, and",
           "Kubernetes runs pods on nodes; an operator reconciles custom resources into pods and services"]


def role(name: str) -> str:
    return json.dumps({"kv_connector": "ShoalConnector", "kv_role": name})


def engine(model, kv_role: str) -> Proc:
    return Proc([*engine_cmd(model), "--block-size", str(BLOCK), "--dtype", "float32", "--max-model-len", "256",
                 "--kv-transfer-config", role(kv_role)])


@pytest.fixture(scope="module")
def fleet(llama_model):
    producer, consumer = engine(llama_model, "kv_producer"), engine(llama_model, "kv_consumer")
    procs = [producer, consumer]
    try:
        for p in procs:
            p.wait_ready()
        gateway = Proc(gateway_cmd(consumer.url, extra=("--prefill-endpoint", producer.url)))
        plain = Proc(gateway_cmd(consumer.url))  # no prefill engines: what a client's kv_transfer_params do there
        procs += [gateway, plain]
        gateway.wait_ready(60)
        plain.wait_ready(60)
        yield producer, consumer, gateway, plain
    finally:
        for p in procs:
            p.stop(signal.SIGTERM, timeout=15)


@pytest.fixture(scope="module")
def want(llama_model):
    with LLM(model=llama_model, block_size=BLOCK, dtype="float32") as llm:
        params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
        return [o.outputs[0].text for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def complete(gateway: Proc, prompt: str, stream: bool = False, extra: dict | None = None) -> str:
    client = OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    kw = dict(model="tiny", prompt=prompt, max_tokens=MAX_NEW, temperature=0,
              extra_body={"ignore_eos": True, **(extra or {})})
    if stream:
        return "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw) if c.choices)
    return client.completions.create(**kw).choices[0].text


def test_prefill_on_the_producer_decode_on_the_consumer_same_answers(fleet, want):
    producer, consumer, gateway, _ = fleet
    assert complete(gateway, PROMPTS[0]) == want[0]
    assert complete(gateway, PROMPTS[1], stream=True) == want[1]
    g, p, c = gateway.metrics(), producer.metrics(), consumer.metrics()
    assert metric(g, "shoal:gateway_remote_prefills_total", outcome="ok") == 2
    pulled = metric(c, "shoal:kv_transfer_blocks_total", direction="pulled")
    assert pulled > 0 and pulled == metric(p, "shoal:kv_transfer_blocks_total", direction="served")
    assert metric(c, "shoal:prefix_cache_tier_hits_total", tier="cpu") == pulled * BLOCK
    # the producer ran each prompt for one token; the consumer generated the answers
    assert metric(p, "shoal:generation_tokens_total") == 2
    assert metric(c, "shoal:generation_tokens_total") == 2 * MAX_NEW


def test_a_clients_own_kv_transfer_params_never_reach_an_engine(fleet, want):
    _, consumer, _, plain = fleet
    before = metric(consumer.metrics(), "shoal:kv_transfer_fallbacks_total")
    bogus = {"kv_transfer_params": {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": free_port()}}
    assert complete(plain, PROMPTS[0] + " and more", extra=bogus)
    c = consumer.metrics()
    assert metric(c, "shoal:kv_transfer_fallbacks_total") == before  # it never tried to pull from there


def test_with_the_prefill_engine_gone_the_decode_engine_prefills(fleet, llama_model):
    producer, _, gateway, _ = fleet
    producer.stop(signal.SIGTERM, timeout=15)
    prompt = "A prompt no engine has seen, so that the decode engine has to compute all of it: one two three"
    with LLM(model=llama_model, block_size=BLOCK, dtype="float32") as llm:
        (local,) = [o.outputs[0].text for o in llm.generate(
            [prompt], SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True), use_tqdm=False)]
    assert complete(gateway, prompt) == local
    assert metric(gateway.metrics(), "shoal:gateway_remote_prefills_total", outcome="refused") >= 1
