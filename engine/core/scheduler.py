"""Continuous batching under a per-step token budget.

Every step the scheduler hands out at most `max_num_batched_tokens` tokens: first to running sequences (one token
each for decodes, the next chunk for prompts still being prefilled), then to waiting sequences in policy order.
A long prompt is spread over several steps (chunked prefill) so decodes keep flowing. When the KV pool runs
dry, the newest (or, under the priority policy, the lowest-priority) running sequence is preempted: its blocks
are freed and it is recomputed later from its prompt and the tokens it has generated so far.

build_step_inputs turns a step's schedule into the StepInputs (shoal.engine.contracts) every executor runs.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

import torch

from shoal.engine.contracts import StepInputs
from shoal.engine.core.kv_cache import BlockPool
from shoal.engine.core.sequence import Sequence, SeqStatus

logger = logging.getLogger(__name__)


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int
    samples: bool  # this step computes the sequence's last known token, so a new one is sampled
    # Positions of this step whose logits score the next prompt token (prompt logprobs), set by the engine.
    scored: range = range(0)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, pool: BlockPool, max_num_seqs: int, max_num_batched_tokens: int,
                 enable_chunked_prefill: bool = True, policy: str = "fcfs", max_loras: int | None = None):
        self.pool = pool
        self.block_size = pool.block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.policy = policy
        self.max_loras = max_loras  # distinct LoRA adapters one step may run (None: no adapters)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    # -- queue management ---------------------------------------------------------------------------------
    def _order_key(self, seq: Sequence):
        r = seq.request
        return (r.priority, r.arrival_time, seq.seq_id) if self.policy == "priority" else (r.arrival_time, seq.seq_id)

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out of the queues and free its blocks (finish or abort)."""
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        self._free_blocks(seq)
        seq.status = SeqStatus.FINISHED

    def _free_blocks(self, seq: Sequence) -> None:
        if seq.block_ids:
            self.pool.free(seq.block_ids)
        seq.block_ids = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self._free_blocks(seq)
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)  # it arrived before everything still waiting
        self.num_preemptions += 1
        out.preempted.append(seq)
        logger.debug("preempted %s (recompute of %d tokens)", seq.request.request_id, seq.num_tokens)

    # -- one step ------------------------------------------------------------------------------------------
    def _blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_ids))

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        if self.policy == "priority":
            self.running.sort(key=self._order_key)
            self.waiting = deque(sorted(self.waiting, key=self._order_key))

        # Running sequences in order: running[:i] are scheduled, so the preemption victim (the newest, or the
        # lowest priority) is always running[-1], never one already scheduled.
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            need = self._blocks_needed(seq, seq.num_computed_tokens + n)
            while need > self.pool.num_free and self.running[-1] is not seq:
                self._preempt(self.running[-1], out)
            if need > self.pool.num_free:
                self._preempt(seq, out)  # the last unscheduled sequence itself: nothing is left to schedule
                break
            seq.block_ids += self.pool.allocate(need)
            out.scheduled.append(ScheduledSeq(seq, n, seq.num_computed_tokens + n == seq.num_tokens))
            budget -= n
            i += 1

        # Admit waiting sequences only when nothing had to be preempted: the pool is under pressure otherwise.
        adapters = {s.lora_id for s in self.running if s.lora_id is not None}
        while self.waiting and budget > 0 and not out.preempted and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.lora_id is not None and seq.lora_id not in adapters and len(adapters) >= self.max_loras:
                break  # every adapter slot is taken by running sequences: wait until one frees up
            if not seq.block_ids:
                # Reuse cached full blocks, but always compute at least the last token (its logits are needed),
                # and every prompt position whose logprobs are still wanted.
                usable = seq.num_tokens - 1 if seq.prompt_scored_upto is None else seq.prompt_scored_upto
                seq.block_ids, seq.block_hashes = self.pool.lookup_prefix(seq.token_ids, usable, seq.lora_id)
                seq.num_computed_tokens = len(seq.block_ids) * self.block_size
                seq.num_cached_tokens = seq.num_computed_tokens
            n = seq.num_tokens - seq.num_computed_tokens
            if n > budget:
                if not self.enable_chunked_prefill:
                    self._free_blocks(seq)
                    break
                n = budget
            need = self._blocks_needed(seq, seq.num_computed_tokens + n)
            if need > self.pool.num_free:
                self._free_blocks(seq)  # give back the prefix-cache references; retried next step
                break
            self.waiting.popleft()
            seq.block_ids += self.pool.allocate(need)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            if seq.lora_id is not None:
                adapters.add(seq.lora_id)
            out.scheduled.append(ScheduledSeq(seq, n, seq.num_computed_tokens + n == seq.num_tokens))
            budget -= n
        return out

    def after_step(self, out: SchedulerOutput) -> None:
        """Account for the tokens computed this step and publish newly filled blocks to the prefix cache."""
        for s in out.scheduled:
            seq = s.seq
            seq.num_computed_tokens += s.num_new_tokens
            self.pool.cache_full_blocks(seq.token_ids, seq.block_ids, seq.block_hashes, seq.num_computed_tokens,
                                        seq.lora_id)


def build_step_inputs(scheduled: list[ScheduledSeq], block_size: int) -> StepInputs:
    """The flat batch of a step. Plain Python lists first and one tensor per field at the end: in a decode step
    each sequence adds one token, and a handful of list appends per sequence beats any per-sequence tensor op."""
    tokens: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_lens: list[int] = []
    seq_lens: list[int] = []
    logits_indices: list[int] = []
    query_start = [0]
    width = max(len(s.seq.block_ids) for s in scheduled)
    tables: list[list[int]] = []
    for s in scheduled:
        seq, n = s.seq, s.num_new_tokens
        c = seq.num_computed_tokens
        blocks = seq.block_ids
        if n == 1:
            tokens.append(seq.token_ids[c])
            positions.append(c)
            slots.append(blocks[c // block_size] * block_size + c % block_size)
        else:
            tokens.extend(seq.token_ids[c:c + n])
            span = range(c, c + n)
            positions.extend(span)
            slots.extend(blocks[p // block_size] * block_size + p % block_size for p in span)
        query_lens.append(n)
        seq_lens.append(c + n)
        query_start.append(len(tokens))
        tables.append(blocks + [0] * (width - len(blocks)))
        for p in s.scored:  # prompt positions whose logits score the next prompt token
            logits_indices.append(len(tokens) - n + (p - c))
        if s.samples:
            logits_indices.append(len(tokens) - 1)
    return StepInputs(
        input_ids=torch.tensor(tokens, dtype=torch.int64),
        positions=torch.tensor(positions, dtype=torch.int64),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=torch.tensor(query_start, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor(tables, dtype=torch.int32),
        logits_indices=torch.tensor(logits_indices, dtype=torch.int64),
        query_lens=query_lens,
        seq_lens_list=seq_lens,
    )
