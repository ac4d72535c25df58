"""What rank 0 broadcasts to the workers on the control group: a fixed-size Header, then (for a step) its plan.

Every command starts with one Header broadcast (a fixed number of int64s, so a worker can post its receive before
knowing the command). A STEP is followed by the step's StepInputs packed into one int64 tensor whose length the
header gives. Fields are named here and encoded in declaration order; unused fields are 0.
"""

from __future__ import annotations

import enum
from dataclasses import astuple, dataclass, fields
from datetime import timedelta

import torch

from shoal.engine.contracts import StepInputs


class Command(enum.IntEnum):
    STEP = 1  # run the plan that follows; the sampler rank also receives the sampling rows
    ALLOC_KV_CACHE = 2  # num_blocks, block_size
    PROFILE = 3  # num_tokens, block_size: every rank runs a dummy step and the peaks are max-reduced
    STATS = 4  # gather every rank's PipelineStats; reset=1 zeroes them afterwards
    SHUTDOWN = 5  # meet at a barrier (SHUTDOWN_BARRIER_TIMEOUT), leave the loop and exit 0


# After SHUTDOWN every rank confirms at a barrier before rank 0 closes the rendezvous store, so no worker can
# mistake the store going away for rank 0 dying.
SHUTDOWN_BARRIER_TIMEOUT = timedelta(seconds=30)


@dataclass(frozen=True)
class Header:
    command: Command
    num_tokens: int = 0  # STEP: tokens in the plan; PROFILE: tokens of the dummy step
    num_seqs: int = 0  # STEP: sequences in the plan
    max_blocks: int = 0  # STEP: width of the block table
    num_logits: int = 0  # STEP: rows whose logits are sampled
    num_blocks: int = 0  # ALLOC_KV_CACHE
    block_size: int = 0  # ALLOC_KV_CACHE, PROFILE
    reset: int = 0  # STATS

    def encode(self) -> torch.Tensor:
        return torch.tensor([int(v) for v in astuple(self)], dtype=torch.int64)

    @classmethod
    def decode(cls, buffer: torch.Tensor) -> "Header":
        command, *rest = buffer.tolist()
        return cls(Command(command), *rest)

    @staticmethod
    def buffer() -> torch.Tensor:
        """A receive buffer for one encoded header."""
        return torch.empty(len(fields(Header)), dtype=torch.int64)

    @property
    def plan_size(self) -> int:
        """int64s in the packed plan of a STEP (see pack_plan for the order)."""
        T, B = self.num_tokens, self.num_seqs
        return 3 * T + (B + 1) + B + B * self.max_blocks + self.num_logits


def pack_plan(inputs: StepInputs) -> tuple[Header, torch.Tensor]:
    """The STEP header and one int64 tensor: input ids, positions, slots, query starts, sequence lengths, the
    flattened block table and the logits indices, in that order."""
    B, max_blocks = inputs.block_tables.shape
    header = Header(Command.STEP, num_tokens=inputs.input_ids.numel(), num_seqs=B, max_blocks=max_blocks,
                    num_logits=inputs.logits_indices.numel())
    body = torch.cat([inputs.input_ids, inputs.positions, inputs.slot_mapping, inputs.query_start_loc.long(),
                      inputs.seq_lens.long(), inputs.block_tables.long().flatten(), inputs.logits_indices]).cpu()
    return header, body


def unpack_plan(header: Header, body: torch.Tensor) -> StepInputs:
    T, B, max_blocks = header.num_tokens, header.num_seqs, header.max_blocks
    parts = body.split([T, T, T, B + 1, B, B * max_blocks, header.num_logits])
    qsl, seq_lens = parts[3].to(torch.int32), parts[4].to(torch.int32)
    q = qsl.tolist()
    return StepInputs(input_ids=parts[0], positions=parts[1], slot_mapping=parts[2], query_start_loc=qsl,
                      seq_lens=seq_lens, block_tables=parts[5].view(B, max_blocks).to(torch.int32),
                      logits_indices=parts[6], query_lens=[q[i + 1] - q[i] for i in range(B)],
                      seq_lens_list=seq_lens.tolist())
