"""One rank's model shard and the pipelined execution of a step (the same code on every rank, rank 0 included).

Each step's batch is split into up to M micro-batches (contiguous runs of sequences with balanced token counts)
and pushed through the stages GPipe-style: stage s works on micro-batch m while stage s+1 works on m-1. Hidden
states go stage to stage with point-to-point isend/recv (tensor-parallel rank t of stage s talks to rank t of
stage s+1). The last stage's tensor-parallel rank 0 samples: rank 0 sends it the step's sampling rows and gets
back only the sampled tokens and logprobs, never [batch, vocab] logits. The pipeline drains at the end of every
step (rank 0 needs the tokens before it can schedule the next one), so the ideal bubble is (P - 1) / (M + P - 1)
of a step; every rank measures its own (PipelineStats).

M defaults to P, one micro-batch per stage in flight (--pipeline-micro-batches overrides it). On the 2-core CPU
benchmark more micro-batches lowered the ideal bubble but not the time: smaller matmuls and more messages cost
more than the idle time they save (PP=2: M=2 ~390 tok/s, M=4 ~280, M=8 ~175); on GPUs with large batches a
larger M pays off.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from shoal.engine.contracts import StepInputs
from shoal.engine.distributed.comm import Group
from shoal.engine.distributed.parallel_state import using_parallel_state
from shoal.engine.execution.runner import ModelRunner, profile_peak_memory
from shoal.engine.execution.sampling import Sampler


def split_micro_batches(inputs: StepInputs, m: int) -> list[StepInputs]:
    """Up to m micro-batches of whole sequences with about equal token counts, in order (so their logits
    concatenate to the step's logits). Deterministic: every rank computes the same split from the same plan."""
    B = len(inputs.query_lens)
    m = max(1, min(m, B))
    if m == 1:
        return [inputs]
    q = inputs.query_start_loc.tolist()
    total = q[-1]
    cuts = [0]
    for k in range(1, m):
        target = total * k / m
        i = cuts[-1] + 1
        while i < B - (m - k) and q[i] < target:
            i += 1
        cuts.append(i)
    cuts.append(B)
    out = []
    li = inputs.logits_indices
    for a, b in zip(cuts, cuts[1:]):
        t0, t1 = q[a], q[b]
        sel = li[(li >= t0) & (li < t1)] - t0
        out.append(StepInputs(
            input_ids=inputs.input_ids[t0:t1], positions=inputs.positions[..., t0:t1],  # [T], or M-RoPE's [3, T]
            slot_mapping=inputs.slot_mapping[t0:t1], query_start_loc=inputs.query_start_loc[a:b + 1] - t0,
            seq_lens=inputs.seq_lens[a:b], block_tables=inputs.block_tables[a:b], logits_indices=sel,
            query_lens=inputs.query_lens[a:b], seq_lens_list=inputs.seq_lens_list[a:b],
            lora_token_slots=None if inputs.lora_token_slots is None else inputs.lora_token_slots[t0:t1],
            lora_slot_ids=inputs.lora_slot_ids,
            state_slots=None if inputs.state_slots is None else inputs.state_slots[a:b],
            state_restore=None if inputs.state_restore is None else inputs.state_restore[a:b],
            state_save=None if inputs.state_save is None else inputs.state_save[a:b],
            state_backup=None if inputs.state_backup is None else inputs.state_backup[a:b],
            images=_images_within(inputs.images, t0, t1), image_spans=_spans_within(inputs.image_spans, a, b)))
    return out


def _images_within(images, t0: int, t1: int):
    """The image slices whose rows fall in [t0, t1), re-based to the micro-batch (a slice never spans two: it lies
    inside one sequence's chunk, and micro-batches hold whole sequences)."""
    inside = [replace(im, row=im.row - t0) for im in images or () if t0 <= im.row < t1]
    return inside or None


def _spans_within(spans, a: int, b: int):
    """The bidirectional image spans (Gemma 3) of sequences a..b-1, re-based to the micro-batch's sequence index
    (positions stay absolute). A span is whole in its sequence's chunk: the scheduler never cuts inside an image."""
    inside = [(seq - a, start, end) for seq, start, end in spans or () if a <= seq < b]
    return inside or None


@dataclass
class PipelineStats:
    steps: int = 0
    busy_s: float = 0.0  # time spent computing this rank's layers
    wall_s: float = 0.0  # time from receiving the plan to the end of the step

    def as_list(self) -> list[float]:
        return [float(self.steps), self.busy_s, self.wall_s]


def build_runner(group: Group, config, model_dir, hf_config, dtype, device, max_model_len: int) -> ModelRunner:
    """This rank's ModelRunner: the layers read the group's parallel state while they are built."""
    state = dataclasses.replace(group.state, expert_parallel=config.enable_expert_parallel)
    experts = getattr(hf_config, "num_local_experts", None) or getattr(hf_config, "num_experts", None) or 0
    if state.expert_parallel and state.tp_size > 1 and experts and experts % state.tp_size == 0:
        from shoal.engine.distributed import expert_exchange

        # Ranks arrive here at different times (a worker has just started); the measurement's collectives run
        # under the short collective timeout, so everyone meets on the control group first.
        dist.barrier(group=group.control)
        state.expert_exchange = expert_exchange.choose(state, hf_config.hidden_size, hf_config.num_experts_per_tok,
                                                       experts, dtype, device)
    with using_parallel_state(state):
        runner = ModelRunner(model_dir, hf_config, dtype, device, config.attention_backend, max_model_len,
                             config.distributed.layer_partition, block_size=config.block_size,
                             quantization=config.quantization, kv_cache_dtype=config.kv_cache_dtype)
        if config.enable_lora:
            runner.enable_lora(config.max_loras, config.max_lora_rank)
        return runner


class Shard:
    """This rank's ModelRunner, its place in the pipeline, and (on the sampler rank) the Sampler."""

    def __init__(self, group: Group, runner: ModelRunner, hidden_size: int, micro_batches: int,
                 sampler: Sampler | None):
        self.group = group
        self.runner = runner
        self.hidden_size = hidden_size
        self.micro_batches = micro_batches if group.pp_size > 1 else 1
        ps = group.state
        self.first, self.last = ps.is_first_stage, ps.is_last_stage
        self.prev = group.stage_rank(ps.pp_rank - 1, ps.tp_rank) if not self.first else None
        self.next = group.stage_rank(ps.pp_rank + 1, ps.tp_rank) if not self.last else None
        self.sampler_rank = group.stage_rank(group.pp_size - 1, 0)  # last stage, tensor rank 0: samples
        self.sampler = sampler if group.rank == self.sampler_rank else None
        self.stats = PipelineStats()

    @torch.inference_mode()
    def run_step(self, inputs: StepInputs, started: float) -> torch.Tensor | None:
        """Run this shard over the step; the sampler rank gets the step's logits [S, vocab], other ranks None."""
        runner, device = self.runner, self.runner.device
        rank = self.group.rank
        pending, logits = [], []
        busy = 0.0
        for mb in split_micro_batches(inputs, self.micro_batches):
            hidden = None
            if not self.first:
                hidden = torch.empty(mb.input_ids.numel(), self.hidden_size, dtype=runner.dtype, device=device)
                dist.recv(hidden, src=self.prev)
            t0 = time.perf_counter()
            out = runner.execute(mb, hidden)
            busy += time.perf_counter() - t0
            if not self.last:  # keep each sent tensor referenced until its send completes
                out = out.contiguous()
                pending.append((dist.isend(out, dst=self.next), out))
            elif rank == self.sampler_rank:
                logits.append(out)
        for work, _ in pending:
            work.wait()
        self.stats.steps += 1
        self.stats.busy_s += busy
        self.stats.wall_s += time.perf_counter() - started
        if rank != self.sampler_rank:
            return None
        return logits[0] if len(logits) == 1 else torch.cat(logits)

    def sample_for_rank0(self, logits: torch.Tensor, rows: list) -> None:
        """On the sampler rank of a pipeline: sample rank 0's rows and send it the SamplerOutput."""
        dist.send_object_list([self.sampler(logits, rows)], dst=0, group=self.group.control)

    def profile(self, num_tokens: int, block_size: int) -> int:
        """Peak activation bytes of one pipelined step of num_tokens (CUDA; every rank runs it together)."""
        if self.runner.device.type != "cuda":
            return 0
        return profile_peak_memory(self.runner, num_tokens, block_size,
                                   lambda inputs: self.run_step(inputs, time.perf_counter()))
