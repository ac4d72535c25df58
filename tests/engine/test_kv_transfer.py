"""Prefill/decode disaggregation, the engine's side (core/kv_transfer.py): a producer exports a prompt's blocks by
hash, a consumer keeps them in its first offload tier and its prefill starts from them (TP=2 as well); the
consumer really reads them (damaged bytes change its answer); the wire format and the fingerprint refuse what
cannot be used; configurations that cannot work are refused at start."""

from __future__ import annotations

import pytest

from shoal.engine import LLM, SamplingParams
from shoal.engine.config import EngineConfig
from shoal.engine.core.kv_transfer import TransferError, decode_blocks, encode_blocks
from shoal.engine.kv_hash import hash_chain

BLOCK = 4
PROMPT = list(range(5, 42))  # 37 tokens: 9 full blocks before the last token
PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
HASHES = list(hash_chain(PROMPT[:-1], BLOCK))
OPTIONS = dict(block_size=BLOCK, max_model_len=96, num_kv_blocks=64, dtype="float32")


def role(name: str, **kw) -> dict:
    return {"kv_connector": "ShoalConnector", "kv_role": name, **kw}


def generate(llm: LLM):
    return llm.generate([{"prompt_token_ids": PROMPT}], PARAMS, use_tqdm=False)[0]


def exported(model, tp: int = 1):
    with LLM(model, kv_transfer_config=role("kv_producer"), tensor_parallel_size=tp, **OPTIONS) as producer:
        want = generate(producer).outputs[0].token_ids
        kt = producer.llm_engine.kv_transfer
        assert kt.held(HASHES) == len(HASHES)
        return want, kt.export(HASHES), kt.fingerprint


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_imported_blocks_are_the_prefix_and_the_answer_is_the_producers(llama_model, tp):
    want, blobs, fingerprint = exported(llama_model, tp)
    assert len(blobs) == len(HASHES)
    with LLM(llama_model, kv_transfer_config=role("kv_consumer", kv_buffer_size=1e6), tensor_parallel_size=tp,
             **OPTIONS) as consumer:
        kt = consumer.llm_engine.kv_transfer
        assert kt.mismatch(fingerprint) is None and kt.held(HASHES) == 0
        kt.import_blocks(HASHES, decode_blocks(encode_blocks(HASHES, blobs), HASHES, kt.block_nbytes))
        assert kt.held(HASHES) == len(HASHES)
        out = generate(consumer)
        assert out.num_cached_tokens == len(HASHES) * BLOCK
        assert out.outputs[0].token_ids == want
        consumer.llm_engine.pool.check_all_free()


def test_the_consumer_computes_from_the_imported_bytes(llama_model):
    # blocks of the right size but other bytes: were they not read, the answer could not change
    want, blobs, _ = exported(llama_model)
    with LLM(llama_model, kv_transfer_config=role("kv_consumer", kv_buffer_size=1e6), **OPTIONS) as consumer:
        consumer.llm_engine.kv_transfer.import_blocks(HASHES, [bytes(len(b)) for b in blobs])
        assert generate(consumer).outputs[0].token_ids != want


def test_a_producer_gives_only_what_it_still_holds(llama_model):
    with LLM(llama_model, kv_transfer_config=role("kv_producer"), **OPTIONS) as producer:
        generate(producer)
        kt = producer.llm_engine.kv_transfer
        other = list(hash_chain([7] * 12, BLOCK))
        assert kt.export(other) == [] and kt.held(other) == 0
        assert len(kt.export(HASHES[:3] + other)) == 3  # a prefix: up to the first block it lacks
        producer.llm_engine.reset_prefix_cache()
        assert kt.export(HASHES) == []


def test_a_prefills_blocks_are_held_for_the_pull_until_taken_or_expired(llama_model, monkeypatch):
    from shoal.engine.core import kv_transfer

    # a pool of 32 blocks of 4: another prompt of 12 blocks evicts the oldest free blocks, not the held ones
    options = {**OPTIONS, "num_kv_blocks": 32, "max_model_len": 128}
    config = role("kv_producer", kv_connector_extra_config={"hold_seconds": 60})
    with LLM(llama_model, kv_transfer_config=config, **options) as producer:
        engine = producer.llm_engine
        kt, pool = engine.kv_transfer, engine.pool
        generate(producer)
        hold = kt.hold(HASHES)
        assert kt.held_blocks == len(HASHES) and pool.num_free == 32 - len(HASHES)
        for start in (100, 200):  # 24 blocks in all: more than were free beside the held ones
            producer.generate([{"prompt_token_ids": list(range(start, start + 47))}], SamplingParams(max_tokens=1),
                              use_tqdm=False)
        assert kt.held(HASHES) == len(HASHES)  # survived the other prompts' allocations
        assert len(kt.export(HASHES, hold)) == len(HASHES) and kt.held_blocks == 0  # taken: given back
        assert pool.num_free == 32
        kt.hold(HASHES[:2])  # a hold no pull comes for goes back after hold_seconds
        later = kv_transfer.time.monotonic() + 61
        monkeypatch.setattr(kv_transfer.time, "monotonic", lambda: later)
        kt.expire()
        assert kt.held_blocks == 0
        monkeypatch.undo()
        # holds never keep a request from running: a prompt that needs more than the free blocks releases them
        generate(producer)
        assert kt.hold(HASHES) is not None
        big = producer.generate([{"prompt_token_ids": list(range(250, 350))}], SamplingParams(max_tokens=1),
                                use_tqdm=False)[0]
        assert len(big.outputs[0].token_ids) == 1 and kt.held_blocks == 0
        kt.hold(HASHES[:2])
        assert engine.reset_prefix_cache() and kt.held_blocks == 0  # a reset lets go of every hold
        pool.check_all_free()


def test_holds_take_at_most_half_the_pool(llama_model):
    with LLM(llama_model, kv_transfer_config=role("kv_producer"), **{**OPTIONS, "num_kv_blocks": 24,
                                                                     "max_model_len": 64}) as producer:
        kt = producer.llm_engine.kv_transfer
        generate(producer)
        first = kt.hold(HASHES[:6])
        assert kt.hold(HASHES[:9]) is not None and first not in kt._holds  # 15 > 12: the oldest went
        assert kt.held_blocks == 9


def test_fingerprints_name_the_field_that_differs(llama_model):
    _, _, fingerprint = exported(llama_model)
    with LLM(llama_model, kv_transfer_config=role("kv_both", kv_buffer_size=1e6),
             **{**OPTIONS, "dtype": "bfloat16"}) as other:
        assert other.llm_engine.kv_transfer.mismatch(fingerprint).startswith("dtype: this engine has 'bfloat16'")


def test_the_wire_format_refuses_damaged_and_unasked_blocks():
    blobs = [bytes([i]) * 16 for i in range(3)]
    payload = encode_blocks(HASHES[:3], blobs)
    assert decode_blocks(payload, HASHES, 16) == blobs
    with pytest.raises(TransferError, match="damaged or truncated") as e:
        decode_blocks(payload[:-5], HASHES, 16)
    assert e.value.reason == "corrupted"
    flipped = bytearray(payload)
    flipped[-1] ^= 1
    with pytest.raises(TransferError, match="damaged"):
        decode_blocks(bytes(flipped), HASHES, 16)
    with pytest.raises(TransferError, match="not asked for"):
        decode_blocks(payload, HASHES[1:], 16)
    with pytest.raises(TransferError, match="this engine's 32") as e:
        decode_blocks(payload, HASHES, 32)
    assert e.value.reason == "incompatible"
    with pytest.raises(TransferError, match="not a KV transfer payload"):
        decode_blocks(b"\x00\x00\x00\x05hello", HASHES, 16)


@pytest.mark.parametrize("config, message", [
    (role("kv_consumer") | {"kv_connector": "NixlConnector"}, "only 'ShoalConnector'"),
    (role("kv_decoder"), "kv_role"),
    (role("kv_consumer", kv_connector_extra_config={"pull_timeout": 0}), "pull_timeout must be a positive"),
    (role("kv_producer", kv_connector_extra_config={"hold_seconds": "long"}), "hold_seconds must be a positive"),
    (role("kv_consumer", kv_connector_extra_config={"side_channel": 1}), "unknown key"),
])
def test_bad_kv_transfer_configs_are_refused(config, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(model="x", kv_transfer_config=config)


def test_kv_transfer_needs_prefix_caching_and_an_attention_only_model(llama_model, model_factory):
    with pytest.raises(ValueError, match="needs prefix caching"):
        EngineConfig(model="x", kv_transfer_config=role("kv_producer"), enable_prefix_caching=False)
    with pytest.raises(ValueError, match="recurrent state"):
        LLM(model_factory("qwen3_next"), kv_transfer_config=role("kv_producer"), block_size=BLOCK, max_model_len=64)
    with pytest.raises(ValueError, match="--kv-transfer-config: a hybrid"):
        LLM(model_factory("qwen3_next"), kv_transfer_config=role("kv_consumer"), block_size=BLOCK, max_model_len=64)
