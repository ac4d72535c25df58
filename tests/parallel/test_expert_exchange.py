"""The expert-parallel all-to-all exchange on two gloo ranks, against the same sum computed in one process: token
counts that do not split evenly (one token: a rank with none), experts that get no rows, and the start-up choice."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from shoal.engine.distributed.parallel_state import ParallelState

EXPERTS, TOP_K, HIDDEN = 6, 2, 8  # 3 experts per rank


def expert_fn(rows: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
    """A stand-in expert whose output depends on both the row and the expert."""
    return rows * (expert_ids[:, None].float() + 1) + expert_ids[:, None].float()


def reference(x, weights, ids):
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            out[t] += weights[t, j] * expert_fn(x[t:t + 1], ids[t, j:j + 1])[0]
    return out


def _rank(rank: int, store_path: str, results) -> None:
    from shoal.engine.distributed.expert_exchange import all_to_all_experts, choose

    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=2)
    try:
        ps = ParallelState(tp_rank=rank, tp_size=2, tp_group=dist.group.WORLD, expert_parallel=True)
        gen = torch.Generator().manual_seed(0)  # the same inputs on both ranks, as attention leaves them
        for tokens in (1, 3, 8):
            x = torch.randn(tokens, HIDDEN, generator=gen)
            ids = torch.rand(tokens, EXPERTS, generator=gen).topk(TOP_K, dim=-1).indices
            ids[:, 0] = 0  # expert 0 always, so rank 0's other experts and rank 1's may get nothing
            weights = torch.rand(tokens, TOP_K, generator=gen)

            def run(rows, expert_ids):
                assert ((expert_ids >= 3 * rank) & (expert_ids < 3 * rank + 3)).all()  # only this rank's experts
                return expert_fn(rows, expert_ids)

            got = all_to_all_experts(ps, x, weights, ids, EXPERTS // 2, run)
            torch.testing.assert_close(got, reference(x, weights, ids), rtol=1e-6, atol=1e-6)
        os.environ["SHOAL_EP_EXCHANGE"] = "auto"
        measured = choose(ps, HIDDEN, TOP_K, EXPERTS, torch.float32, torch.device("cpu"), repeats=1)
        results[rank] = (sorted(measured.measured), measured.all_to_all_from)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_all_to_all_exchange_equals_one_process():
    with tempfile.TemporaryDirectory() as tmp:
        results = mp.Manager().dict()
        mp.spawn(_rank, args=(os.path.join(tmp, "store"), results), nprocs=2, join=True)
    # Both ranks timed both exchanges at both sizes and, taking the slowest rank's times, chose alike.
    assert results[0] == results[1] and results[0][0] == [16, 256]


def test_override_and_bad_value(monkeypatch):
    from shoal.engine.distributed.expert_exchange import choose

    ps = ParallelState(tp_rank=0, tp_size=2, expert_parallel=True)
    monkeypatch.setenv("SHOAL_EP_EXCHANGE", "all_to_all")
    assert choose(ps, HIDDEN, TOP_K, EXPERTS, torch.float32, torch.device("cpu")).use_all_to_all(1)
    monkeypatch.setenv("SHOAL_EP_EXCHANGE", "all_reduce")
    assert not choose(ps, HIDDEN, TOP_K, EXPERTS, torch.float32, torch.device("cpu")).use_all_to_all(10**6)
    monkeypatch.setenv("SHOAL_EP_EXCHANGE", "alltoall")
    with pytest.raises(ValueError, match="SHOAL_EP_EXCHANGE='alltoall': choose one of auto, all_reduce, all_to_all"):
        choose(ps, HIDDEN, TOP_K, EXPERTS, torch.float32, torch.device("cpu"))
