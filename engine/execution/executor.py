"""The executor seam: what LLMEngine drives to run a step, whatever the process layout behind it.

LLMEngine plans a step (scheduler -> StepInputs) and hands it to its executor together with one SamplingRow per
sequence that samples this step; it gets the sampled tokens back. It never sees logits, processes or ranks.

  - UniProcExecutor (here): one process owns the ModelRunner (model shard + KV cache) and the Sampler.
  - DistributedExecutor (shoal.engine.distributed.driver): rank 0 of a tensor/pipeline-parallel group; it starts
    the other ranks and broadcasts each step's plan to them.

The sampler's constants (vocabulary size, EOS ids) are fixed when the executor is built, on every rank that
samples; a step carries only the rows. With draft-model speculative decoding the executor also owns the draft
model (execution/drafter.py): LLMEngine asks it for a step's proposals and sees only their token ids (and the
distributions sampled proposals were drawn from, which go back into the step's sampling rows).
"""

from __future__ import annotations

from typing import Protocol

import torch

from shoal.engine.contracts import DraftProposal, DraftRequest, StepInputs
from shoal.engine.execution.drafter import DraftHost
from shoal.engine.execution.graph_capture import decode_capture_backend
from shoal.engine.execution.kv_offload import KVOffloader, OffloadSpec, block_nbytes, export_blocks
from shoal.engine.execution.runner import ModelRunner, profile_peak_memory
from shoal.engine.execution.sampling import Sampler, SamplerOutput, SamplingRow


class Executor(Protocol):
    backend_name: str  # the attention backend every rank runs

    def bytes_per_block(self, block_size: int) -> int:
        """KV-cache bytes one block takes on the rank that holds the most (what sizes the pool)."""

    padding_blocks: int  # blocks allocated past the pool (decode capture's padding rows), counted in budgets

    def profile_peak_memory(self, num_tokens: int, block_size: int) -> int:
        """Activation bytes a step of num_tokens needs (CUDA; the most over all ranks)."""

    def allocate_kv_cache(self, num_blocks: int, block_size: int, num_state_slots: int = 1) -> None:
        """Allocate the paged KV cache (and a hybrid model's recurrent-state slots) on every rank."""

    def execute(self, inputs: StepInputs, rows: list[SamplingRow]) -> SamplerOutput | None:
        """Run one step and sample `rows` (one per entry of inputs.logits_indices); None when rows is empty."""

    def check_health(self) -> None:
        """Raise once this executor can no longer run steps (e.g. a rank of its group failed)."""

    def sleep(self, level: int) -> None:
        """Sleep mode on every rank: free the KV cache; level 1 keeps the weights, level 2 drops them."""

    def wake_up(self) -> None:
        """Undo sleep on every rank (weights back or reloaded); the KV cache is then allocated again."""

    def memory_bytes(self) -> dict[str, int]:
        """KV-cache and weight bytes rank 0's shard holds now."""

    def shutdown(self) -> None:
        """Release the KV cache and stop any process this executor started (idempotent)."""

    # KV offloading (execution/kv_offload.py on every rank; core/kv_tiers.py decides what moves)
    def enable_kv_offload(self, spec: OffloadSpec) -> None:
        """Build every rank's offload tiers (after allocate_kv_cache)."""

    def kv_lookup(self, block_hashes: list[int]) -> list[str]:
        """The tier of each leading block the offload tiers hold."""

    def kv_transfer(self, saves: list[tuple[int, int]], loads: list[tuple[int, int]]) -> int:
        """Copy evicted (hash, block id) pairs out to the tiers, then read (hash, block id) pairs back in, in order;
        returns how many leading loads every rank completed."""

    def kv_clear(self) -> None:
        """Empty every rank's offload tiers."""

    def kv_offload_stats(self) -> dict[str, dict[str, int]]:
        """Rank 0's tiers: blocks held, bytes used, capacity."""

    def kv_take_changes(self) -> list[tuple[str, str, int]]:
        """What rank 0's tiers stored and dropped since the last call, in order (with OffloadSpec.report_changes)."""

    # Prefill/decode disaggregation (core/kv_transfer.py): a prompt's blocks out of one engine and into another
    def kv_rank_nbytes(self) -> list[int]:
        """One block's bytes on each rank, in rank order (a block moves as their concatenation)."""

    def kv_export(self, pairs: list[tuple[int, int]]) -> list[bytes]:
        """Each (block hash, block id or -1 for the tiers) pair's bytes, every rank's shard concatenated in rank
        order, up to the first block some rank cannot give."""

    def kv_import(self, items: list[tuple[int, bytes]]) -> None:
        """Keep blocks exported by an engine of the same layout in every rank's first offload tier."""

    # Draft-model speculative decoding (execution/drafter.py: where the draft model runs, and why there)
    def load_drafter(self, model_dir, hf_config, num_speculative_tokens: int, max_num_batched_tokens: int) -> None:
        """Load the draft model (before allocate_kv_cache, which then gives it a cache of the same blocks;
        padding_blocks counts its padding from then on)."""

    def load_mtp(self, num_speculative_tokens: int, max_num_batched_tokens: int) -> None:
        """Speculative MTP: the target checkpoint's MTP layer as the drafter (execution/mtp.py), loaded like
        load_drafter's draft model; the target then keeps its last hidden states per KV slot."""

    def drafter_bytes_per_block(self, block_size: int) -> int:
        """The draft model's KV-cache bytes per block on its rank, on top of bytes_per_block (0 without one)."""

    def propose(self, requests: list[DraftRequest]) -> list[DraftProposal]:
        """The draft model's proposals for this step's verifying sequences (their KV slots are allocated)."""


class UniProcExecutor(DraftHost):
    """One process: the ModelRunner and the Sampler side by side."""

    def __init__(self, config, model_dir, hf_config, dtype: torch.dtype, device: torch.device, max_model_len: int,
                 sampler: Sampler):
        self.runner = ModelRunner(model_dir, hf_config, dtype, device, config.attention_backend, max_model_len,
                                  block_size=config.block_size, quantization=config.quantization,
                                  kv_cache_dtype=config.kv_cache_dtype)
        if config.enable_lora:
            self.runner.enable_lora(config.max_loras, config.max_lora_rank)
        # Decode graph capture is a one-process feature: the ranks of a parallel group run every step eagerly.
        self.runner.enable_decode_capture(decode_capture_backend(config, device), config.max_num_seqs)
        self.engine_config = config
        self.sampler = sampler
        self.backend_name = self.runner.backend_name
        self.offload: KVOffloader | None = None

    def enable_kv_offload(self, spec: OffloadSpec) -> None:
        self.offload = KVOffloader(self.runner, spec)

    def kv_lookup(self, block_hashes: list[int]) -> list[str]:
        return self.offload.lookup(block_hashes)

    def kv_transfer(self, saves: list[tuple[int, int]], loads: list[tuple[int, int]]) -> int:
        return self.offload.transfer(saves, loads)

    def kv_clear(self) -> None:
        self.offload.clear()

    def kv_offload_stats(self) -> dict[str, dict[str, int]]:
        return self.offload.stats()

    def kv_take_changes(self) -> list[tuple[str, str, int]]:
        return self.offload.take_changes()

    def kv_rank_nbytes(self) -> list[int]:
        return [block_nbytes(self.runner)]

    def kv_export(self, pairs: list[tuple[int, int]]) -> list[bytes]:
        return [row.numpy().tobytes() for row in export_blocks(self.runner, self.offload, pairs)]

    def kv_import(self, items: list[tuple[int, bytes]]) -> None:
        self.offload.put([(h, torch.frombuffer(bytearray(data), dtype=torch.uint8)) for h, data in items])

    def bytes_per_block(self, block_size: int) -> int:
        return self.runner.bytes_per_block(block_size)

    @property
    def padding_blocks(self) -> int:
        return max(self.runner.padding_blocks, self.drafter.padding_blocks if self.drafter else 0)

    def profile_peak_memory(self, num_tokens: int, block_size: int) -> int:
        return profile_peak_memory(self.runner, num_tokens, block_size, self.runner.execute)

    def allocate_kv_cache(self, num_blocks: int, block_size: int, num_state_slots: int = 1) -> None:
        self.runner.allocate_kv_cache(num_blocks, block_size, num_state_slots)
        if self.drafter is not None:
            self.drafter.allocate_kv_cache(num_blocks, block_size)

    def execute(self, inputs: StepInputs, rows: list[SamplingRow]) -> SamplerOutput | None:
        logits = self.runner.execute(inputs)
        return self.sampler(logits, rows) if rows else None

    def execute_pooling(self, inputs: StepInputs, rows: list[SamplingRow]) -> tuple[SamplerOutput | None,
                                                                                    torch.Tensor]:
        """A step with embedding requests in it: the sampled rows as execute() and the pooled hidden-state sums
        (ModelRunner.execute_pooling). Only this executor pools: the parallel ones do not return hidden states."""
        logits, pooled = self.runner.execute_pooling(inputs)
        return (self.sampler(logits, rows) if rows else None), pooled

    def add_lora(self, adapter_id: int, path: str) -> None:
        self.runner.add_lora(adapter_id, path)

    def remove_lora(self, adapter_id: int) -> None:
        self.runner.remove_lora(adapter_id)

    def check_health(self) -> None:
        """One process has no peer that could fail: a failed step raises from execute() itself."""

    def sleep(self, level: int) -> None:
        self.runner.sleep(level)

    def wake_up(self) -> None:
        self.runner.wake_up()

    def memory_bytes(self) -> dict[str, int]:
        return self.runner.memory_bytes()

    def shutdown(self) -> None:
        if self.offload is not None:
            self.offload.close()
            self.offload = None
        self.runner.free_kv_cache()
        if self.drafter is not None:
            self.drafter.free_kv_cache()


def make_executor(config, model_dir, hf_config, dtype: torch.dtype, device: torch.device, max_model_len: int,
                  sampler: Sampler) -> Executor:
    """A UniProcExecutor for world size 1, a DistributedExecutor (which starts the local worker ranks) above."""
    if config.world_size == 1:
        return UniProcExecutor(config, model_dir, hf_config, dtype, device, max_model_len, sampler)
    from shoal.engine.distributed.driver import DistributedExecutor  # imports torch.distributed machinery

    return DistributedExecutor(config, model_dir, hf_config, dtype, device, max_model_len, sampler)
