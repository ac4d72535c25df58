"""Continuous batching under a per-step token budget.

Every step the scheduler hands out at most `max_num_batched_tokens` tokens: first to running sequences (one token
each for decodes, the next chunk for prompts still being prefilled), then to waiting sequences in policy order.
A long prompt is spread over several steps (chunked prefill) so decodes keep flowing. When the KV pool runs
dry, the newest (or, under the priority policy, the lowest-priority) running sequence is preempted: its blocks
are freed and it is recomputed later from its prompt and the tokens it has generated so far.

Under the priority policy a waiting request also goes before the remaining prefill of running requests of a lower
priority (their decodes still run every step): their next chunks wait until it is admitted. So a request the
gateway sends with a better priority — a more important model, or a tenant with fewer requests at this engine
(operator/gateway/proxy.py) — starts within one step even while long prompts of lower priority are being prefilled.

Sliding window: when every layer of the model attends only to its last W keys, a sequence whose next query is at
position c never reads keys before c - W + 1 again, so after each step the blocks wholly before that point go back
to the pool. Their block-table entries become 0 (a valid block: kernels never read before a query's window, and
SDPA masks it) and they are counted in seq.num_freed_blocks, so a later free never drops a second reference.
Prefix caching stays exact: a block is published (hashed) the step it fills, before it can slide out; a freed
block keeps its hash and content in the pool's free queue, where another request may still find it as part of a
cached prefix until it is evicted (evicting drops its hash), and a 0 entry is never published, since only blocks
at or after len(seq.block_hashes) are published and those are never freed before being considered.

build_step_inputs turns a step's schedule into the StepInputs (shoal.engine.contracts) every executor runs.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

import torch

from shoal.engine.contracts import StepImage, StepInputs
from shoal.engine.core.kv_cache import BlockPool
from shoal.engine.core.sequence import Sequence, SeqStatus
from shoal.engine.core.state_pool import StateCheckpoints, StatePool

logger = logging.getLogger(__name__)


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int
    samples: bool  # this step computes the sequence's last known token, so a new one is sampled
    # Speculative decoding: the first num_draft of seq.spec_token_ids follow its last token in this step (they are
    # part of num_new_tokens); every one of them gets a logits row too.
    num_draft: int = 0
    # Positions of this step whose logits score the next prompt token (prompt logprobs), set by the engine.
    scored: range = range(0)
    # Hybrid prefix caching (core/state_pool.StateCheckpoints): the checkpoint slot this step starts the sequence's
    # recurrent state from, and the one its state is copied into after the step (-1: none).
    restore_from: int = -1
    save_to: int = -1
    # Speculative decoding on a hybrid: the slot the sequence's state is backed up into before this step verifies
    # its proposals (-1: none; Scheduler.accept_draft says why).
    backup_to: int = -1
    # Embedding requests: the positions of this step whose final hidden states are pooled (set by the engine).
    pooled: range = range(0)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, pool: BlockPool, max_num_seqs: int, max_num_batched_tokens: int,
                 enable_chunked_prefill: bool = True, policy: str = "fcfs", sliding_window: int | None = None,
                 max_loras: int | None = None, state_pool: StatePool | None = None,
                 checkpoints: StateCheckpoints | None = None, tiers=None, backup_base: int | None = None):
        self.pool = pool
        self.tiers = tiers  # core/kv_tiers.KVTiers with KV offloading on: prefixes the pool lost come back from it
        # Hybrid models: one recurrent-state slot per running sequence (it has max_num_seqs of them).
        self.state_pool = state_pool
        self.checkpoints = checkpoints  # hybrid prefix caching: recurrent state kept at prompts' last full block
        # Hybrid speculative decoding: sequence slot s backs its state up in slot s + backup_base (accept_draft).
        self.backup_base = backup_base
        self.sliding_window = sliding_window  # every layer's window (the smallest), or None
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
        if seq.held_block_ids:
            self.pool.free(seq.held_block_ids)
        seq.block_ids = []
        seq.block_hashes = []
        if seq.state_slot is not None:  # the state goes with the blocks: recomputed from the tokens if resumed
            self.state_pool.free(seq.state_slot)
            seq.state_slot = None
        seq.num_freed_blocks = 0
        seq.num_computed_tokens = 0
        seq.num_draft_computed = 0  # a draft model's keys/values went with the blocks
        seq.state_rollback = False  # and its backed-up state with its slot

    def _free_slid_out_blocks(self, seq: Sequence) -> None:
        """Give back the leading blocks no future query of `seq` can see (every key before c - W + 1, where c is
        the next query's position)."""
        first_visible = seq.num_computed_tokens - self.sliding_window + 1
        keep_from = min(max(0, first_visible) // self.block_size, len(seq.block_ids))
        if keep_from <= seq.num_freed_blocks:
            return
        self.pool.free(seq.block_ids[seq.num_freed_blocks:keep_from])
        seq.block_ids[seq.num_freed_blocks:keep_from] = [0] * (keep_from - seq.num_freed_blocks)
        seq.num_freed_blocks = keep_from

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self._free_blocks(seq)
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)  # it arrived before everything still waiting
        self.num_preemptions += 1
        out.preempted.append(seq)
        logger.debug("preempted %s (recompute of %d tokens)", seq.request.request_id, seq.num_tokens)

    # -- hybrid prefix caching ------------------------------------------------------------------------------
    def _checkpoint_at(self, seq: Sequence) -> int:
        """The block boundary where a hybrid's state is kept for `seq`: its prompt's last full block before the last
        prompt token (where a repeated prompt resumes). 0: none."""
        if self.checkpoints is None:
            return 0
        return (seq.num_prompt_tokens - 1) // self.block_size * self.block_size

    def _cut_at_checkpoint(self, seq: Sequence, n: int) -> int:
        """A prefill chunk ends at the checkpoint boundary when it would cross it (the state exists only there)."""
        b = self._checkpoint_at(seq)
        return b - seq.num_computed_tokens if seq.num_computed_tokens < b < seq.num_computed_tokens + n else n

    @staticmethod
    def _cut_at_image(seq: Sequence, n: int) -> int:
        """Bidirectional images (Gemma 3) are prefilled whole: a chunk ends before an image it cannot hold all of
        (0: the sequence waits for a step with the budget; vLLM's disable_chunked_mm_input)."""
        return n if seq.images is None else seq.images.cut(seq.num_computed_tokens, n)

    def _save_slot(self, seq: Sequence, n: int) -> int:
        b = self._checkpoint_at(seq)
        if not b or seq.num_computed_tokens + n != b:
            return -1
        # keyed as lookup_prefix hashes the block: with the images it holds (the same tokens, another image, differ)
        images = seq.images.block_key if seq.images is not None else None
        slot = self.checkpoints.put(self.pool.prefix_hash(seq.token_ids, b // self.block_size, seq.lora_id, images))
        return -1 if slot is None else slot

    def _usable_prefix(self, hashes: list[int]) -> int:
        """How many leading cached blocks a hybrid can use: up to the last one whose end state is kept."""
        for n in range(len(hashes), 0, -1):
            if self.checkpoints.get(hashes[n - 1]) is not None:
                return n
        return 0

    def _scheduled(self, seq: Sequence, n: int, samples: bool, draft: int = 0, restore_from: int = -1):
        samples = samples and seq.pooling is None  # an embedding request pools its prompt and samples nothing
        backup_to = -1
        if self.backup_base is not None and seq.state_slot is not None:
            if seq.state_rollback:  # proposals were rejected: start again from the state before them
                restore_from, seq.state_rollback = seq.state_slot + self.backup_base, False
            elif draft:
                backup_to = seq.state_slot + self.backup_base
        return ScheduledSeq(seq, n, samples, draft, restore_from=restore_from, save_to=self._save_slot(seq, n),
                            backup_to=backup_to)

    # -- one step ------------------------------------------------------------------------------------------
    def _blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_ids))

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        if self.policy == "priority":
            self.running.sort(key=self._order_key)
            self.waiting = deque(sorted(self.waiting, key=self._order_key))

        # Priority: the remaining prefill of running sequences ranked below the best waiting one is deferred until
        # after it (at most until the end of this step), so a more important arrival is not stuck behind long
        # prompts already running. Decodes are never deferred.
        head = self._order_key(self.waiting[0]) if self.policy == "priority" and self.waiting else None
        deferred: list[Sequence] = []

        # Running sequences in order: running[:i] are scheduled or deferred, so the preemption victim (the newest,
        # or the lowest priority) is always running[-1], never one already scheduled.
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if head is not None and seq.num_tokens - seq.num_computed_tokens > 1 and self._order_key(seq) > head:
                deferred.append(seq)
                i += 1
                continue
            n = self._cut_at_image(seq, self._cut_at_checkpoint(
                seq, min(seq.num_tokens - seq.num_computed_tokens, budget)))
            if n == 0:  # the rest of an image does not fit this step's budget: its next chunk waits
                i += 1
                continue
            draft = 0
            if seq.spec_token_ids and seq.num_tokens - seq.num_computed_tokens == 1:
                # Proposals ride along only on blocks that are free anyway: never at the price of a preemption
                # (each sequence still to be scheduled may need one new block for its own token).
                draft = min(len(seq.spec_token_ids), budget - 1)
                spare = self.pool.num_free - (len(self.running) - i - 1)
                if self._blocks_needed(seq, seq.num_computed_tokens + 1 + draft) > spare:
                    draft = 0
                n += draft
            need = self._blocks_needed(seq, seq.num_computed_tokens + n)
            while need > self.pool.num_free and self.running[-1] is not seq:
                self._preempt(self.running[-1], out)
            if need > self.pool.num_free:
                self._preempt(seq, out)  # the last unscheduled sequence itself: nothing is left to schedule
                break
            seq.block_ids += self.pool.allocate(need)
            out.scheduled.append(self._scheduled(seq, n, seq.num_computed_tokens + n - draft == seq.num_tokens, draft))
            budget -= n
            i += 1

        # Admit waiting sequences only when nothing had to be preempted: the pool is under pressure otherwise.
        adapters = {s.lora_id for s in self.running if s.lora_id is not None}
        while self.waiting and budget > 0 and not out.preempted and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if deferred and self._order_key(seq) > self._order_key(deferred[0]):
                break  # the deferred prefills rank before the rest of the queue
            if seq.lora_id is not None and seq.lora_id not in adapters and len(adapters) >= self.max_loras:
                break  # every adapter slot is taken by running sequences: wait until one frees up
            if not seq.block_ids:
                # Reuse cached full blocks, but always compute at least the last token (its logits are needed),
                # and every prompt position whose logprobs are still wanted.
                usable = seq.num_tokens - 1 if seq.prompt_scored_upto is None else seq.prompt_scored_upto
                if seq.pooling is not None and seq.pooling.pooling_type != "LAST":
                    usable = 0  # MEAN and CLS pool hidden states a cached prefix would not compute
                images = seq.images.block_key if seq.images is not None else None
                seq.block_ids, seq.block_hashes = self.pool.lookup_prefix(
                    seq.token_ids, usable, seq.lora_id, self._usable_prefix if self.checkpoints else None, images)
                # the offload tiers key blocks by their tokens alone: a prompt with images is never read from them
                if self.tiers is not None and images is None:
                    self.tiers.extend_prefix(seq, usable)
                seq.num_computed_tokens = len(seq.block_ids) * self.block_size
                seq.num_cached_tokens = seq.num_computed_tokens
            n = seq.num_tokens - seq.num_computed_tokens
            if n > budget:
                if not self.enable_chunked_prefill:
                    self._free_blocks(seq)
                    break
                n = budget
            n = self._cut_at_image(seq, self._cut_at_checkpoint(seq, n))
            need = self._blocks_needed(seq, seq.num_computed_tokens + n)
            if n == 0 or need > self.pool.num_free:
                self._free_blocks(seq)  # give back the prefix-cache references; retried next step
                break
            self.waiting.popleft()
            seq.block_ids += self.pool.allocate(need)
            if self.state_pool is not None:
                seq.state_slot = self.state_pool.allocate()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            if seq.lora_id is not None:
                adapters.add(seq.lora_id)
            cached = self.checkpoints is not None and seq.num_cached_tokens > 0 and seq.num_computed_tokens > 0
            restore = self.checkpoints.get(seq.block_hashes[-1]) if cached else None
            out.scheduled.append(self._scheduled(seq, n, seq.num_computed_tokens + n == seq.num_tokens,
                                                 restore_from=-1 if restore is None else restore))
            budget -= n

        # The deferred prefills get what the arrivals left of the budget (no preemption for them: a chunk that
        # finds no free block waits for the next step).
        for seq in deferred:
            if budget <= 0 or out.preempted:
                break
            n = self._cut_at_image(seq, self._cut_at_checkpoint(
                seq, min(seq.num_tokens - seq.num_computed_tokens, budget)))
            if n == 0:
                continue
            need = self._blocks_needed(seq, seq.num_computed_tokens + n)
            if need > self.pool.num_free:
                break
            seq.block_ids += self.pool.allocate(need)
            out.scheduled.append(self._scheduled(seq, n, seq.num_computed_tokens + n == seq.num_tokens))
            budget -= n
        return out

    def after_step(self, out: SchedulerOutput) -> None:
        """Account for the tokens computed this step and publish newly filled blocks to the prefix cache."""
        for s in out.scheduled:
            seq = s.seq
            # Proposed tokens count once accepted (accept_draft): until then their keys/values are not the
            # sequence's, and no block holding them may enter the prefix cache.
            seq.num_computed_tokens += s.num_new_tokens - s.num_draft
            if s.backup_to < 0:  # a hybrid's verified token itself may be taken back too (accept_draft publishes)
                self.pool.cache_full_blocks(seq.token_ids, seq.block_ids, seq.block_hashes, seq.num_computed_tokens,
                                            seq.lora_id, seq.images.block_key if seq.images is not None else None)
            if self.sliding_window is not None:  # after publishing: a block is hashed before it can slide out
                self._free_slid_out_blocks(seq)

    def accept_draft(self, seq: Sequence, num_accepted: int, num_draft: int) -> None:
        """After a speculative step appended num_accepted of its num_draft proposed tokens (and one of the model's
        own): their keys/values are the sequence's now; those of the rejected ones are dropped by releasing every
        block past the computed tokens (the next step rewrites those positions anyway).

        A hybrid's recurrent state cannot drop tokens: the step ran it through every proposal. When one was
        rejected, the state the step started from (backed up before it, ScheduledSeq.backup_to) comes back, and
        the step's first token, the accepted proposals and the model's token are computed again next step, as one
        short prefill chunk; when all were accepted the state is already the sequence's."""
        if self.backup_base is not None and seq.state_slot is not None and num_accepted < num_draft:
            seq.num_computed_tokens -= 1
            seq.state_rollback = True
        else:
            seq.num_computed_tokens += num_accepted
        self.pool.cache_full_blocks(seq.token_ids, seq.block_ids, seq.block_hashes, seq.num_computed_tokens,
                                    seq.lora_id, seq.images.block_key if seq.images is not None else None)
        keep = -(-seq.num_computed_tokens // self.block_size)
        if len(seq.block_ids) > keep:
            self.pool.free(seq.block_ids[keep:])
            del seq.block_ids[keep:]


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
    state_slots: list[int] = []
    restore: list[int] = []
    save: list[int] = []
    backup: list[int] = []
    pool_ranges: list[tuple[int, int]] = []
    images: list[StepImage] = []
    mrope: list[tuple] = []  # M-RoPE prompts' chunks holding image tokens: (first row, first position, length, images)
    spans: list[tuple[int, int, int]] = []  # bidirectional images: (sequence, first position, end)
    for s in scheduled:
        seq, n = s.seq, s.num_new_tokens
        c = seq.num_computed_tokens
        blocks = seq.block_ids
        if n == 1:
            tokens.append(seq.token_ids[c])
            positions.append(c)
            slots.append(blocks[c // block_size] * block_size + c % block_size)
        else:
            tokens.extend(seq.token_ids[c:c + n - s.num_draft])
            if s.num_draft:
                tokens.extend(seq.spec_token_ids[:s.num_draft])
            span = range(c, c + n)
            positions.extend(span)
            slots.extend(blocks[p // block_size] * block_size + p % block_size for p in span)
        if seq.images is not None:
            placed = seq.images
            if placed.positions is not None:  # M-RoPE: positions shifted past the images (and 3-D inside them)
                positions[len(positions) - n:] = placed.rope_row(c, c + n)
            if c < placed.end:  # image tokens in this chunk: their features' rows
                row, before = len(tokens) - n - c, len(images)
                for a, image, first, last in placed.slices(c, c + n - s.num_draft):
                    images.append(StepImage(row + a, first, last, image.digest, image.pixel_values, image.grid_thw))
                if placed.positions is not None and len(images) > before:
                    mrope.append((len(tokens) - n, c, n, placed))
                if placed.bidirectional:
                    spans += [(len(query_lens), a, b) for a, b in placed.spans(c, c + n - s.num_draft)]
        query_lens.append(n)
        seq_lens.append(c + n)
        if seq.state_slot is not None:
            state_slots.append(seq.state_slot)
            restore.append(s.restore_from)
            save.append(s.save_to)
            backup.append(s.backup_to)
        query_start.append(len(tokens))
        tables.append(blocks + [0] * (width - len(blocks)))
        if s.pooled:  # contiguous positions whose hidden states are pooled, as rows of the flat batch
            first = len(tokens) - n + (s.pooled.start - c)
            pool_ranges.append((first, first + len(s.pooled)))
        for p in s.scored:  # prompt positions whose logits score the next prompt token
            logits_indices.append(len(tokens) - n + (p - c))
        if s.samples:
            if s.num_draft:  # the last token and each proposal: the model's next token after every one
                logits_indices.extend(range(len(tokens) - 1 - s.num_draft, len(tokens)))
            else:
                logits_indices.append(len(tokens) - 1)
    position_ids = torch.tensor(positions, dtype=torch.int64)
    if mrope:  # a step with M-RoPE image rows: every row's three position sets (equal outside the images)
        position_ids = position_ids.expand(3, -1).clone()
        for row, c, n, placed in mrope:
            m = min(n, placed.prompt_len - c)
            position_ids[:, row:row + m] = placed.positions[:, c:c + m]
    return StepInputs(
        input_ids=torch.tensor(tokens, dtype=torch.int64),
        positions=position_ids,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=torch.tensor(query_start, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor(tables, dtype=torch.int32),
        logits_indices=torch.tensor(logits_indices, dtype=torch.int64),
        query_lens=query_lens,
        seq_lens_list=seq_lens,
        state_slots=torch.tensor(state_slots, dtype=torch.int64) if state_slots else None,
        state_restore=torch.tensor(restore, dtype=torch.int64) if any(r >= 0 for r in restore) else None,
        state_save=torch.tensor(save, dtype=torch.int64) if any(s >= 0 for s in save) else None,
        state_backup=torch.tensor(backup, dtype=torch.int64) if any(b >= 0 for b in backup) else None,
        pool_ranges=pool_ranges or None,
        images=images or None,
        image_spans=spans or None,
    )
