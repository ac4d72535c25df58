"""How expert-parallel MoE layers bring each (token, expert) pair to the rank that holds the expert, and back.

Under --enable-expert-parallel the ranks of a tensor-parallel group hold whole experts (a contiguous range each),
and attention leaves every rank with every token's hidden state. Two exchanges give the same result:

- all-reduce: each rank runs the pairs routed to its own experts, for all tokens, and one all-reduce of [tokens,
  hidden] sums the partial outputs (what vLLM does for expert parallelism inside a tensor-parallel group).
- all-to-all: each rank takes a share of the tokens (a contiguous 1/n), sends each of their pairs only to the rank
  owning the pair's expert (one all_to_all_single of the per-(rank, expert) counts, one of the rows), the owners run
  them and send the outputs back (one more), the origin weighs and sums them per token, and an all-gather gives
  every rank every token again. The counts say which expert each received row is for, so no ids travel.

The all-to-all moves top_k rows per token where the all-reduce moves about two, and it takes four collectives to
the all-reduce's one, so it pays off only where the network makes large all-reduces the bottleneck. Which one runs
is decided by measurement when the engine starts (`choose`): both exchanges timed on the real process group at a
decode-sized and a prefill-sized batch, the slowest rank's time counted, so every rank decides alike; the log says
what was measured and chosen. SHOAL_EP_EXCHANGE=all_reduce|all_to_all overrides it (tests run both).

While a CUDA graph is being captured the all-reduce runs: the all-to-all's split sizes are data-dependent host
values, which a graph cannot hold.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

logger = logging.getLogger(__name__)

MODES = ("auto", "all_reduce", "all_to_all")
MEASURED_TOKENS = (16, 256)  # a decode step's batch and a prefill chunk's, for the start-up measurement


@dataclass
class ExpertExchange:
    """all_to_all_from: the smallest token count at which the all-to-all runs (None: never)."""

    all_to_all_from: int | None = None
    measured: dict[int, tuple[float, float]] = field(default_factory=dict)  # tokens -> (all-reduce s, all-to-all s)

    def use_all_to_all(self, num_tokens: int) -> bool:
        if self.all_to_all_from is None or num_tokens < self.all_to_all_from:
            return False
        return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def _splits(t: torch.Tensor) -> list[int]:
    return [int(n) for n in t.tolist()]


def all_to_all_experts(ps, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, num_local: int,
                       run_experts: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """sum over each token's k pairs of weight * expert(x), every expert on its owner rank, for x [T, H] held by
    every rank of ps's tensor-parallel group; returns [T, H] on every rank.

    run_experts(rows [R, H], global expert ids [R]) -> [R, H]: this rank's experts applied to the rows sent to it
    (unweighted). Rank r owns experts [r * num_local, (r + 1) * num_local)."""
    import torch.distributed as dist

    n, rank, group = ps.tp_size, ps.tp_rank, ps.tp_group
    T, k = topk_ids.shape
    H = x.shape[1]
    lo, hi = T * rank // n, T * (rank + 1) // n  # this rank's tokens
    ids = topk_ids[lo:hi].reshape(-1)
    order = torch.argsort(ids, stable=True)  # by expert, hence by owner rank
    counts = torch.bincount(ids, minlength=n * num_local).view(n, num_local)  # [owner, its expert] pairs sent
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts, group=group)  # [source, my expert] pairs received
    send_splits, recv_splits = _splits(counts.sum(1)), _splits(recv_counts.sum(1))

    rows = x.new_empty(sum(recv_splits), H)
    dist.all_to_all_single(rows, x[lo + order // k].contiguous(), recv_splits, send_splits, group=group)
    mine = torch.arange(rank * num_local, (rank + 1) * num_local, device=x.device).repeat(n)
    out = run_experts(rows, torch.repeat_interleave(mine, recv_counts.flatten()))
    back = x.new_empty(ids.numel(), H)
    dist.all_to_all_single(back, out.contiguous(), send_splits, recv_splits, group=group)

    weights = topk_weights[lo:hi].reshape(-1)[order].float()
    shard = torch.zeros(hi - lo, H, dtype=torch.float32, device=x.device)
    shard.index_add_(0, order // k, back.float() * weights[:, None])
    # Every rank every token again: shards padded to one size for the all-gather.
    size = -(-T // n)
    padded = torch.zeros(size, H, dtype=x.dtype, device=x.device)
    padded[: hi - lo] = shard.to(x.dtype)
    parts = [torch.empty_like(padded) for _ in range(n)]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([p[: T * (r + 1) // n - T * r // n] for r, p in enumerate(parts)])


def _best(fn, repeats: int) -> float:
    fn()  # warm-up (connections, allocations)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def choose(ps, hidden: int, top_k: int, num_experts: int, dtype: torch.dtype, device: torch.device,
           repeats: int = 5) -> ExpertExchange:
    """The exchange for this group: SHOAL_EP_EXCHANGE when set, else the faster of the two as measured here (every
    rank takes part; the slowest rank's times decide, identically everywhere)."""
    mode = os.environ.get("SHOAL_EP_EXCHANGE", "auto")
    if mode not in MODES:
        raise ValueError(f"SHOAL_EP_EXCHANGE={mode!r}: choose one of {', '.join(MODES)}")
    if mode != "auto":
        logger.info("expert parallel: %s token exchange (SHOAL_EP_EXCHANGE)", mode.replace("_", "-"))
        return ExpertExchange(all_to_all_from=0 if mode == "all_to_all" else None)
    import torch.distributed as dist

    num_local = num_experts // ps.tp_size
    gen = torch.Generator().manual_seed(0)  # the same routing on every rank, as real routing is
    times = []
    for tokens in MEASURED_TOKENS:
        x = torch.randn(tokens, hidden, generator=gen).to(device=device, dtype=dtype)
        ids = torch.rand(tokens, num_experts, generator=gen).topk(top_k, dim=-1).indices.to(device)
        weights = torch.full((tokens, top_k), 1.0 / top_k, device=device)

        def reduce(x=x):
            dist.all_reduce(x.clone(), group=ps.tp_group)

        def exchange(x=x, ids=ids, weights=weights):
            all_to_all_experts(ps, x, weights, ids, num_local, lambda rows, _: rows)

        times += [_best(reduce, repeats), _best(exchange, repeats)]
    slowest = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=ps.tp_group)
    measured = {t: (float(slowest[2 * i]), float(slowest[2 * i + 1])) for i, t in enumerate(MEASURED_TOKENS)}
    faster_from = None  # the smallest measured size from which the all-to-all is faster at every larger one
    for t in sorted(measured, reverse=True):
        if measured[t][1] >= measured[t][0]:
            break
        faster_from = t
    choice = ExpertExchange(all_to_all_from=faster_from, measured=measured)
    summary = ", ".join(f"{t} tokens: all-reduce {1e3 * ar:.2f} ms, all-to-all {1e3 * a2a:.2f} ms"
                        for t, (ar, a2a) in measured.items())
    logger.info("expert parallel token exchange: %s (measured on this group, hidden %d, top-%d: %s)",
                "all-reduce at every batch size" if faster_from is None
                else f"all-to-all from {faster_from} tokens, all-reduce below", hidden, top_k, summary)
    return choice
