"""KV offload tiers under tensor parallelism (TP=2 on gloo: one KV head per rank) and pipeline parallelism (PP=2:
layers 2 + 1): every rank saves and loads its own shard of the same blocks, and a block one rank cannot load is
recomputed on every rank."""

from __future__ import annotations

import pytest
from offloadkit import BLOCK, POOL, PARAMS, gib, prompts, run_twice, tokens

from shoal.engine import LLM
from shoal.engine.execution.kv_disk_tier import SUFFIX
from shoal.engine.kv_hash import hash_chain

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("layout", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}], ids=["tp2", "pp2"])
def test_prefixes_from_the_cpu_and_disk_tiers_match_one_process(qwen2_gqa, tmp_path, layout):
    batch = prompts()
    with LLM(model=qwen2_gqa, block_size=BLOCK, max_model_len=64) as llm:
        want = tokens(llm.generate(batch, PARAMS))
        per_block = llm.llm_engine.executor.bytes_per_block(BLOCK)  # both ranks' shards together
    with LLM(model=qwen2_gqa, **layout, **POOL, kv_offloading_size=gib(12, per_block),
             kv_offloading_disk_path=str(tmp_path), kv_offloading_disk_size=gib(500, per_block)) as llm:
        engine = llm.llm_engine
        first, second = run_twice(llm, batch)
        assert tokens(first) == want and tokens(second) == want
        assert all(o.num_cached_tokens == 36 for o in second)
        assert engine.tiers.hits == {"cpu": 0, "disk": 4 * 36}  # 9 blocks a prompt, 12 in the CPU tier
        # Prompt 2 again: its leading blocks are still in the pool, the ones prompt 3 evicted in the CPU tier.
        again = llm.generate([batch[2]], PARAMS)[0]
        assert again.outputs[0].token_ids == want[2] and again.num_cached_tokens == 36
        assert engine.tiers.hits["cpu"] > 0 and engine.pool.prefix_hits > 0
        for rank in (0, 1):
            assert list((tmp_path / f"rank-{rank}").glob("*" + SUFFIX)), rank
        # Rank 1's copy of prompt 0's first block damaged (rank 0's intact): neither rank serves the prefix.
        damaged = tmp_path / "rank-1" / f"{next(hash_chain(batch[0], BLOCK)):016x}{SUFFIX}"
        assert damaged.exists()  # written in round one, kept while it was served from disk in round two
        damaged.write_bytes(damaged.read_bytes()[:100])
        again = llm.generate([batch[0]], PARAMS)[0]
        assert again.num_cached_tokens == 0 and again.outputs[0].token_ids == want[0]
        engine.pool.check_all_free()
