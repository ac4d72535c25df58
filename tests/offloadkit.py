"""Shared by the KV offload tests (tests/engine/test_kv_offload.py, tests/parallel/test_kv_offload_parallel.py,
tests/server/test_kv_offload_server.py): a workload whose prompts evict each other from a small KV pool and come
back, and the tier sizes in GiB."""

from __future__ import annotations

import random
import time

from shoal.engine import LLM, SamplingParams

BLOCK = 4
POOL = dict(block_size=BLOCK, max_model_len=64, num_kv_blocks=20)  # 20 blocks: one 40-token prompt at a time
PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def prompts(n: int = 4, length: int = 40, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 200) for _ in range(length)] for _ in range(n)]


def settled(pending, timeout: float = 60.0) -> None:
    """Wait until `pending()` (rank 0's blocks not yet handed to a tier) is 0. A pending block is served from host
    memory and its hit counts as the CPU tier's, so which tier serves a prefix depends on how far the copy thread
    (niced below the step) has got; the tests that count hits per tier wait for it after each request."""
    deadline = time.monotonic() + timeout
    while pending():
        assert time.monotonic() < deadline, "the KV offload copy thread never caught up"
        time.sleep(0.01)


def generate_settled(llm: LLM, prompt: list[int]):
    """One prompt's output, once the copies of the blocks it evicted have reached their tiers."""
    out = llm.generate([prompt], PARAMS)[0]
    settled(lambda: llm.llm_engine.get_stats().kv_offload_tiers.get("cpu", {}).get("pending", 0))  # 0: tiers off
    return out


def run_twice(llm: LLM, batch: list[list[int]]) -> tuple[list, list]:
    """Each prompt once (each evicts the one before), then each again: (first round, second round) outputs."""
    rounds = [[generate_settled(llm, p) for p in batch] for _ in range(2)]
    return rounds[0], rounds[1]


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def gib(blocks: int, per_block: int) -> float:
    """--kv-offloading-size (GiB) for `blocks` blocks of per_block bytes (over all ranks)."""
    return blocks * per_block / 2**30
