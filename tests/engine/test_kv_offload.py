"""KV offload tiers (--kv-offloading-size, --kv-offloading-disk-path/-size) through the offline LLM API: a pool too
small for the workload evicts every prompt's blocks before it comes back; with offloading the prefix is read back
from the CPU or the disk tier instead of recomputed, and greedy tokens are the same whichever tier served it."""

from __future__ import annotations

import pytest
from offloadkit import BLOCK, PARAMS, POOL, gib, prompts, run_twice, tokens

from shoal.engine import LLM
from shoal.engine.config import EngineConfig
from shoal.engine.execution.kv_disk_tier import SUFFIX
from shoal.engine.kv_hash import hash_chain


@pytest.fixture(scope="module")
def reference(llama_model):
    """Greedy tokens with the pool alone (ample: the second round hits the device tier), and a block's bytes."""
    with LLM(model=llama_model, block_size=BLOCK, max_model_len=64) as llm:
        first, second = run_twice(llm, prompts())
        assert all(o.num_cached_tokens > 0 for o in second)
        assert tokens(first) == tokens(second)
        return tokens(first), llm.llm_engine.executor.bytes_per_block(BLOCK)


def test_prefix_from_the_cpu_tier_gives_the_same_tokens(llama_model, reference):
    want, per_block = reference
    with LLM(model=llama_model, **POOL, kv_offloading_size=gib(200, per_block)) as llm:
        engine = llm.llm_engine
        first, second = run_twice(llm, prompts())
        assert tokens(first) == want and tokens(second) == want
        assert engine.pool.prefix_hits == 0, "the pool was meant to have evicted every prompt"
        assert all(o.num_cached_tokens == 36 for o in second)  # 9 full blocks; the last token is always computed
        assert engine.tiers.hits == {"cpu": 4 * 36, "disk": 0}
        engine.pool.check_all_free()
        stats = engine.get_stats()
        assert stats.prefix_cache_tier_hits == {"device": 0, "cpu": 144, "disk": 0}
        assert stats.kv_offload_tiers["cpu"]["blocks"] > 0
        # A prefix-cache reset empties the tiers too: nothing is served from them afterwards.
        assert llm.reset_prefix_cache()
        assert engine.get_stats().kv_offload_tiers["cpu"]["blocks"] == 0
        again = llm.generate([prompts()[1]], PARAMS)[0]
        assert again.num_cached_tokens == 0 and again.outputs[0].token_ids == want[1]


def test_prefix_from_the_disk_tier_gives_the_same_tokens(llama_model, reference, tmp_path):
    want, per_block = reference
    with LLM(model=llama_model, **POOL, kv_offloading_size=gib(2, per_block), kv_offloading_disk_path=str(tmp_path),
             kv_offloading_disk_size=gib(500, per_block)) as llm:
        engine = llm.llm_engine
        first, second = run_twice(llm, prompts())
        assert tokens(first) == want and tokens(second) == want
        assert all(o.num_cached_tokens == 36 for o in second)
        assert engine.tiers.hits["disk"] >= 3 * 36, engine.tiers.hits  # the CPU tier keeps 2 blocks only
        assert list((tmp_path / "rank-0").glob("*" + SUFFIX))
        engine.pool.check_all_free()


def test_damaged_disk_blocks_are_recomputed_not_served(llama_model, reference, tmp_path):
    want, per_block = reference
    with LLM(model=llama_model, **POOL, kv_offloading_size=gib(2, per_block), kv_offloading_disk_path=str(tmp_path),
             kv_offloading_disk_size=gib(500, per_block)) as llm:
        engine = llm.llm_engine
        batch = prompts()
        assert tokens([llm.generate([p], PARAMS)[0] for p in batch]) == want
        engine.executor.offload.wait_idle()  # every copy written: then damage what was written
        # The first block of prompt 0 cut short, of prompt 1 one byte flipped (its length stays right).
        first = [tmp_path / "rank-0" / f"{next(hash_chain(p, BLOCK)):016x}{SUFFIX}" for p in batch[:2]]
        raw = first[0].read_bytes()
        first[0].write_bytes(raw[:len(raw) - 8])
        raw = bytearray(first[1].read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        first[1].write_bytes(raw)
        again = [llm.generate([p], PARAMS)[0] for p in batch[:2]]
        assert [o.num_cached_tokens for o in again] == [0, 0], "a damaged block was served"
        assert engine.tiers.hits["disk"] == 0
        assert engine.get_stats().kv_offload_tiers["disk"]["corrupted"] == 2
        assert not first[0].exists() and tokens(again) == want[:2]
        # Recomputed, the prompts' blocks are stored again, intact, and served from the tiers next time.
        for p in batch[2:]:
            llm.generate([p], PARAMS)
        third = [llm.generate([p], PARAMS)[0] for p in batch[:2]]
        assert tokens(third) == want[:2] and all(o.num_cached_tokens == 36 for o in third)
        engine.pool.check_all_free()


def test_disk_tier_is_discarded_at_start(llama_model, reference, tmp_path):
    _, per_block = reference
    stale = tmp_path / "rank-0" / f"{123:016x}{SUFFIX}"
    stale.parent.mkdir()
    stale.write_bytes(b"from an earlier run")
    keep = tmp_path / "rank-0" / "notes.txt"
    keep.write_text("not ours")
    with LLM(model=llama_model, **POOL, kv_offloading_size=gib(2, per_block), kv_offloading_disk_path=str(tmp_path),
             kv_offloading_disk_size=gib(10, per_block)):
        assert not stale.exists() and keep.exists()


@pytest.mark.parametrize("options, message", [
    (dict(kv_offloading_size=1.0, kv_offloading_backend="lmcache"), "only 'native'"),
    (dict(kv_offloading_size=0.0), "greater than 0"),
    (dict(kv_offloading_size=1.0, kv_offloading_disk_path="/tmp/kv"), "needs kv_offloading_disk_size"),
    (dict(kv_offloading_size=1.0, kv_offloading_disk_size=1.0), "needs kv_offloading_disk_path"),
    (dict(kv_offloading_disk_path="/tmp/kv", kv_offloading_disk_size=1.0), "needs kv_offloading_size"),
    (dict(kv_offloading_size=1.0, enable_prefix_caching=False), "needs prefix caching"),
])
def test_bad_offloading_options_are_refused(options, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(model="/m", **options)


def test_an_offload_tier_too_small_for_one_block_is_refused(llama_model, reference):
    _, per_block = reference
    with pytest.raises(ValueError, match="--kv-offloading-size .* holds no KV block"):
        LLM(model=llama_model, **POOL, kv_offloading_size=gib(1, per_block) / 2)


def test_an_unusable_disk_path_is_refused(llama_model, reference, tmp_path):
    _, per_block = reference
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ValueError, match="--kv-offloading-disk-path: cannot use"):
        LLM(model=llama_model, **POOL, kv_offloading_size=gib(2, per_block), kv_offloading_disk_path=str(blocker),
            kv_offloading_disk_size=gib(10, per_block))


def test_cli_takes_vllm_flag_names_and_refuses_other_backends(capsys):
    from shoal.engine import cli

    with pytest.raises(SystemExit) as ei:
        cli.main(["serve", "--model", "/m", "--kv-offloading-size", "2", "--kv-offloading-backend", "lmcache"])
    assert ei.value.code == 2
    err = capsys.readouterr().err
    assert "only 'native'" in err and "Traceback" not in err
