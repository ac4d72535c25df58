"""Prefill/decode disaggregation between two real `shoal-engine serve` processes, through the openai client: a
producer prefills (kv_transfer_params {"do_remote_decode": true}), a consumer given the producer's answer pulls the
prompt's KV blocks and decodes; its output equals one engine's, the blocks came from the producer (not computed),
and a producer that is gone or of another layout makes the consumer prefill itself with the same answer."""

from __future__ import annotations

import json

import pytest
from openai import BadRequestError, OpenAI

from prockit import free_port

from .conftest import metric, offline_greedy

BLOCK = 4
MAX_NEW = 8
PROMPTS = ["Once upon a time there was a little shoal of fish that swam together in the warm sea, and",
           "Kubernetes runs pods on nodes; an operator reconciles custom resources into pods, services and"]
PRODUCER = json.dumps({"kv_connector": "ShoalConnector", "kv_role": "kv_producer"})
CONSUMER = json.dumps({"kv_connector": "ShoalConnector", "kv_role": "kv_consumer", "kv_buffer_size": 2e6,
                       "kv_connector_extra_config": {"pull_timeout": 5}})
COMMON = ("--block-size", str(BLOCK), "--max-model-len", "512", "--num-kv-blocks", "256", "--dtype", "float32")


def client(server) -> OpenAI:
    return OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def pair(start_server, llama_model):
    producer = start_server(llama_model, *COMMON, "--kv-transfer-config", PRODUCER)
    consumer = start_server(llama_model, *COMMON, "--kv-transfer-config", CONSUMER)
    return producer, consumer


@pytest.fixture(scope="module")
def want(llama_model):
    return offline_greedy(llama_model, PROMPTS, MAX_NEW, block_size=BLOCK, dtype="float32")


def prefill(producer, prompt: str) -> dict:
    r = client(producer).completions.create(model="tiny", prompt=prompt, max_tokens=1, temperature=0,
                                            extra_body={"kv_transfer_params": {"do_remote_decode": True},
                                                        "ignore_eos": True})
    return r.model_extra["kv_transfer_params"]


def decode(consumer, prompt: str, params: dict, stream: bool = False) -> str:
    kw = dict(model="tiny", prompt=prompt, max_tokens=MAX_NEW, temperature=0,
              extra_body={"kv_transfer_params": params, "ignore_eos": True})
    if stream:
        return "".join(c.choices[0].text for c in client(consumer).completions.create(stream=True, **kw)
                       if c.choices)
    return client(consumer).completions.create(**kw).choices[0].text


def test_the_consumer_decodes_from_the_producers_kv_as_one_engine_would(pair, want, llama_model):
    producer, consumer = pair
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(llama_model)
    expected_blocks = 0
    for prompt, text in zip(PROMPTS, want):
        params = prefill(producer, prompt)
        assert params["do_remote_prefill"] is True and params["remote_port"] == int(producer.base.rsplit(":", 1)[1])
        assert params["remote_host"] == "127.0.0.1" and params["remote_block_size"] == BLOCK
        blocks = (len(tok.encode(prompt)) - 1) // BLOCK
        p = producer.metrics()  # the prefill's blocks are held for the pull: out of the free (evictable) ones
        assert metric(p, "shoal:num_kv_blocks") - metric(p, "shoal:num_free_kv_blocks") == blocks
        assert params["remote_request_id"]
        assert decode(consumer, prompt, params) == text
        p = producer.metrics()  # ... and given back once pulled
        assert metric(p, "shoal:num_free_kv_blocks") == metric(p, "shoal:num_kv_blocks")
        expected_blocks += blocks
    c, p = consumer.metrics(), producer.metrics()
    assert metric(c, "shoal:kv_transfer_blocks_total", direction="pulled") == expected_blocks
    assert metric(c, "shoal:kv_transfer_blocks_total", direction="missed") == 0
    assert metric(p, "shoal:kv_transfer_blocks_total", direction="served") == expected_blocks
    # the pulled blocks were read into the pool as prefix hits: the consumer computed only each prompt's tail
    assert metric(c, "shoal:prefix_cache_tier_hits_total", tier="cpu") == expected_blocks * BLOCK
    assert metric(c, "shoal:kv_transfer_fallbacks_total") == 0
    assert metric(c, "shoal:num_free_kv_blocks") == metric(c, "shoal:num_kv_blocks")  # nothing leaked


def test_a_long_prompts_blocks_arrive_whole(pair, llama_model):
    # ~100 float32 blocks (~300 KB): the answer arrives over many reads, and all of it is used
    producer, consumer = pair
    prompt = " ".join(f"word{i}" for i in range(60))
    (local,) = offline_greedy(llama_model, [prompt], MAX_NEW, block_size=BLOCK, dtype="float32")
    before = metric(consumer.metrics(), "shoal:kv_transfer_blocks_total", direction="pulled")
    assert decode(consumer, prompt, prefill(producer, prompt)) == local
    c = consumer.metrics()
    assert metric(c, "shoal:kv_transfer_blocks_total", direction="pulled") - before > 60
    assert metric(c, "shoal:kv_transfer_fallbacks_total") == 0


def test_a_second_decode_of_the_same_prompt_pulls_nothing_and_streams_the_same(pair, want):
    producer, consumer = pair
    before = metric(consumer.metrics(), "shoal:kv_transfer_blocks_total", direction="pulled")
    params = prefill(producer, PROMPTS[0])
    assert decode(consumer, PROMPTS[0], params, stream=True) == want[0]
    # the consumer's own prefix cache holds the prompt now: it asks the producer for nothing
    assert metric(consumer.metrics(), "shoal:kv_transfer_blocks_total", direction="pulled") == before


def test_a_producer_that_is_gone_makes_the_consumer_prefill_itself(pair, llama_model):
    _, consumer = pair
    prompt = PROMPTS[1] + " again and again, with nobody to prefill it"
    (local,) = offline_greedy(llama_model, [prompt], MAX_NEW, block_size=BLOCK, dtype="float32")
    params = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": free_port()}
    assert decode(consumer, prompt, params) == local
    assert metric(consumer.metrics(), "shoal:kv_transfer_fallbacks_total", reason="unreachable") == 1


def test_a_producer_of_another_layout_is_refused_and_the_answer_is_unchanged(start_server, pair, llama_model):
    _, consumer = pair
    other = start_server(llama_model, "--block-size", "8", "--max-model-len", "128", "--num-kv-blocks", "64",
                         "--dtype", "float32", "--kv-transfer-config", PRODUCER)
    prompt = "A different prompt, so that the consumer's own cache does not hold it: one two three four five"
    params = prefill(other, prompt)
    (local,) = offline_greedy(llama_model, [prompt], MAX_NEW, block_size=BLOCK, dtype="float32")
    assert decode(consumer, prompt, params) == local
    assert metric(consumer.metrics(), "shoal:kv_transfer_fallbacks_total", reason="incompatible") == 1
    assert metric(other.metrics(), "shoal:kv_transfer_blocks_total", direction="served") == 0


@pytest.mark.parametrize("target, body, message", [
    ("producer", {"kv_transfer_params": {"do_remote_prefill": True, "remote_host": "h", "remote_port": 1}},
     "this engine is not a KV consumer"),
    ("consumer", {"kv_transfer_params": {"do_remote_decode": True}}, "this engine is not a KV producer"),
    ("consumer", {"kv_transfer_params": {"do_remote_prefill": True}}, "needs remote_host and remote_port"),
    ("consumer", {"kv_transfer_params": {"do_remote_prefill": True, "remote_host": "h", "remote_port": 0}},
     "kv_transfer_params.remote_port"),
    ("producer", {"kv_transfer_params": {"do_remote_decode": True}, "stream": True}, "stream: false"),
])
def test_kv_transfer_params_an_engine_cannot_honour_are_refused(pair, target, body, message):
    server = pair[0] if target == "producer" else pair[1]
    extra = dict(body)
    stream = extra.pop("stream", False)
    with pytest.raises(BadRequestError, match=message):
        client(server).completions.create(model="tiny", prompt="hello", max_tokens=2, stream=stream,
                                          extra_body=extra)


def test_the_pull_route_checks_its_caller(pair):
    producer, consumer = pair
    status, body, _ = consumer.post("/kv_transfer/pull", {"fingerprint": {}, "block_hashes": []})
    assert status == 400 and "not a KV producer" in body["error"]["message"]
    status, body, _ = producer.post("/kv_transfer/pull", {"fingerprint": {}, "block_hashes": ["x"]})
    assert status == 400 and "block_hashes" in body["error"]["message"]
    status, body, _ = producer.post("/kv_transfer/pull", {"fingerprint": {"block_size": 16}, "block_hashes": [1]})
    assert status == 409 and "KV layouts differ" in body["error"]["message"]
