"""KV offload tiers in the real `shoal-engine serve` process (--kv-offloading-size, --kv-offloading-disk-path/-size):
completions through the openai client whose prefixes come back from the disk and the CPU tier give the offline
engine's greedy text, and /metrics counts the hits per tier."""

from __future__ import annotations

from offloadkit import BLOCK, PARAMS, gib, prompts, settled
from openai import OpenAI

from shoal.engine import LLM

from .conftest import metric


def test_served_prefixes_come_back_from_the_tiers_with_the_same_tokens(start_server, llama_model, tmp_path):
    batch = prompts()
    with LLM(model=llama_model, block_size=BLOCK, max_model_len=64) as llm:
        want = [o.outputs[0].text for o in llm.generate(batch, PARAMS, use_tqdm=False)]
        per_block = llm.llm_engine.executor.bytes_per_block(BLOCK)
    server = start_server(llama_model, "--block-size", str(BLOCK), "--max-model-len", "64", "--num-kv-blocks", "20",
                          "--kv-offloading-size", repr(gib(12, per_block)), "--kv-offloading-backend", "native",
                          "--kv-offloading-disk-path", str(tmp_path), "--kv-offloading-disk-size",
                          repr(gib(500, per_block)))
    client = OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=600)

    def complete(prompt: list[int]) -> str:
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=PARAMS.max_tokens, temperature=0,
                                      extra_body={"ignore_eos": True})
        settled(lambda: metric(server.metrics(), "shoal:kv_offload_pending_blocks", tier="cpu"))
        return r.choices[0].text

    for _ in range(2):  # each prompt evicts the one before from the 20-block pool
        assert [complete(p) for p in batch] == want
    m = server.metrics()
    assert metric(m, "shoal:prefix_cache_tier_hits_total", tier="disk") == 4 * 36  # 9 blocks a prompt, 12 in CPU
    assert complete(batch[2]) == want[2]  # evicted by prompt 3 just now: partly in the pool, partly in the CPU tier
    m = server.metrics()
    assert metric(m, "shoal:prefix_cache_tier_hits_total", tier="cpu") > 0
    assert metric(m, "shoal:prefix_cache_tier_hits_total", tier="device") > 0
    assert metric(m, "shoal:kv_offload_blocks", tier="disk") > 0
    assert metric(m, "shoal:kv_offload_capacity_bytes", tier="cpu") == 12 * per_block
    assert metric(m, "shoal:kv_offload_corrupted_blocks_total", tier="disk") == 0
    assert metric(m, "shoal:kv_offload_pending_blocks", tier="disk") == 0
    assert metric(m, "shoal:num_free_kv_blocks") == metric(m, "shoal:num_kv_blocks")  # no block leaked
