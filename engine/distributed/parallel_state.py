"""Which slice of the model this process holds: tensor- and pipeline-parallel rank and size.

Layers ask this object for their shard and for the collectives they need. A single-process engine uses the
default (rank 0 of 1, no communication); the distributed launcher installs a state with real process groups.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class ParallelState:
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    tp_group: Any = None  # torch.distributed ProcessGroup of this rank's tensor-parallel peers
    expert_parallel: bool = False  # MoE layers hold whole experts per tp rank (--enable-expert-parallel)
    expert_exchange: Any = None  # with expert_parallel: distributed.expert_exchange.ExpertExchange, chosen at start

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return x
        import torch.distributed as dist

        dist.all_reduce(x, group=self.tp_group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every tensor-parallel rank's x along the last dimension (rank order)."""
        if self.tp_size == 1:
            return x
        import torch.distributed as dist

        parts = [torch.empty_like(x) for _ in range(self.tp_size)]
        dist.all_gather(parts, x.contiguous(), group=self.tp_group)
        return torch.cat(parts, dim=-1)


_state = ParallelState()


def get_parallel_state() -> ParallelState:
    return _state


def set_parallel_state(state: ParallelState) -> None:
    global _state
    _state = state


@contextlib.contextmanager
def using_parallel_state(state: ParallelState) -> Iterator[ParallelState]:
    """`state` for the block (layers read it while they are built: a rank's shard), the previous one after."""
    previous = _state
    set_parallel_state(state)
    try:
        yield state
    finally:
        set_parallel_state(previous)


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) is not divisible by the tensor-parallel size ({denominator})")
    return numerator // denominator


def layer_range(num_layers: int, pp_rank: int, pp_size: int, partition: list[int] | None = None) -> tuple[int, int]:
    """[start, end) of the decoder layers that pipeline stage `pp_rank` runs: an even split unless `partition`
    gives each stage's layer count."""
    if partition is not None:
        if len(partition) != pp_size or sum(partition) != num_layers or min(partition) < 1:
            raise ValueError(f"layer partition {partition} must give {pp_size} positive counts summing to {num_layers}")
        start = sum(partition[:pp_rank])
        return start, start + partition[pp_rank]
    if num_layers < pp_size:
        raise ValueError(f"{num_layers} layers cannot be split over {pp_size} pipeline stages")
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return start, start + base + (1 if pp_rank < extra else 0)
