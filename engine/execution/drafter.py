"""The draft model of draft-model speculative decoding (vLLM's "draft_model" method), on the executor's side.

core/ (speculative.DraftModelProposer) decides which decoding sequences verify how many proposals; it hands the
executor one DraftRequest per sequence and gets back the proposed token ids (and, for sampled requests, the
distributions they were drawn from, which the sampler's rejection sampling reads). It never sees the draft's
runner, logits or KV cache.

Where the draft runs: whole (tensor-parallel size 1, every layer) on rank 0's device, in both executors
(execution/executor.py, distributed/driver.py), like vLLM v0's `speculative_draft_tensor_parallel_size=1`. Why
there and not sharded like the target:
  - a draft is small by design (a few percent of the target): sharding it would add two all-reduces per layer to
    each of its K sequential rounds, and every round would need a message from rank 0 to the peers (the next
    round's tokens are chosen between rounds), which costs more than the shard saves;
  - rank 0 is where the proposals are needed: it builds the step's StepInputs from them before any other rank
    sees the step, so nothing travels for the draft at all, with or without pipeline stages;
  - a seeded request's draws come from its generator, which rank 0 keeps; on rank 0 the draft draws exactly as in
    one process, so the same seed gives the same tokens whatever the parallel layout.
The cost: rank 0 alone holds the draft's weights and KV cache (counted into the KV budget per block, so the pool
shrinks to fit), and the other ranks wait while it proposes (they would wait anyway: the target step needs the
proposals first).

The draft's paged KV cache has the same block size and as many blocks as the target's pool, and a sequence's draft
keys/values live in the same block ids as its target keys/values: allocation, prefix-cache sharing, preemption and
the release of rejected proposals' blocks all follow the target's scheduler, with nothing to keep in sync. A
request's `num_computed` counts the positions whose draft keys/values are valid; a proposal first catches up on
the tokens the target computed since (the whole prompt after the target's prefill, or after a preemption), then
feeds its own proposals. Greedy requests propose the draft's argmax; sampled ones draw from the draft's softmax at
the request's temperature (from the request's own generator when it is seeded).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from shoal.engine.contracts import DraftProposal, DraftRequest, StepInputs
from shoal.engine.execution.graph_capture import decode_capture_backend
from shoal.engine.execution.runner import ModelRunner
from shoal.engine.execution.sampling import choose_proposals

if TYPE_CHECKING:
    from shoal.engine.config import EngineConfig
    from shoal.engine.execution.mtp import MTPDrafter
    from shoal.engine.execution.sampling import Sampler


class DraftHost:
    """The draft-model part of both executors (the Executor protocol's load_drafter, drafter_bytes_per_block and
    propose): the draft runs in the executor's own process, beside `self.runner` (rank 0's, in a parallel group),
    built from `self.engine_config`; allocate_kv_cache and shutdown give it and free its cache."""

    drafter: DraftModel | MTPDrafter | None = None
    # what the executor that mixes this in has (execution/executor.py, distributed/driver.py)
    runner: ModelRunner  # the target's runner: the draft runs on its device, dtype and max_model_len
    engine_config: EngineConfig
    sampler: Sampler  # its vocab_size is the draft's

    def check_health(self) -> None:  # the executor's own: raises when a rank of its parallel group has failed
        raise NotImplementedError

    def load_drafter(self, model_dir, hf_config, num_speculative_tokens: int, max_num_batched_tokens: int) -> None:
        self.drafter = DraftModel(self.runner, self.engine_config, model_dir, hf_config, self.sampler.vocab_size,
                                  num_speculative_tokens, max_num_batched_tokens)

    def load_mtp(self, num_speculative_tokens: int, max_num_batched_tokens: int) -> None:
        """Speculative MTP: the target checkpoint's own MTP layer as the drafter (execution/mtp.py)."""
        from shoal.engine.execution.mtp import MTPDrafter

        self.drafter = MTPDrafter(self.runner, self.engine_config, self.sampler.vocab_size, num_speculative_tokens,
                                  max_num_batched_tokens)

    def drafter_bytes_per_block(self, block_size: int) -> int:
        return self.drafter.bytes_per_block(block_size) if self.drafter is not None else 0

    def propose(self, requests: list[DraftRequest]) -> list[DraftProposal]:
        self.check_health()  # a parallel group's failed rank: stop before the draft works for nothing
        return self.drafter.propose(requests)


class DraftModel:
    """The draft model's runner and its K autoregressive rounds per step."""

    def __init__(self, target: ModelRunner, config, model_dir, hf_config, vocab_size: int, num_speculative_tokens: int,
                 max_num_batched_tokens: int):
        """Beside the target's runner `target` on its device, dtype and max_model_len; `config` the EngineConfig."""
        device = target.device
        self.k = num_speculative_tokens
        self.budget = max_num_batched_tokens
        self.vocab_size = vocab_size  # the target's: the draft's logits past it are padding
        self.block_size = config.block_size
        self.runner = ModelRunner(model_dir, hf_config, target.dtype, device, config.attention_backend,
                                  target.max_model_len, block_size=config.block_size)
        if self.runner.state_bytes_per_seq():  # its state would need slots and roll-backs of its own
            raise ValueError(f"draft model {config.speculative_config.model}: a hybrid model (recurrent layers: "
                             f"{hf_config.architectures[0]}) cannot be the draft model; use a transformer draft "
                             "model, 'ngram', or the target's own 'mtp' layer")
        # Its rounds after the first are pure decode steps: captured like a one-process target's (graph_capture.py).
        self.runner.enable_decode_capture(decode_capture_backend(config, device), config.max_num_seqs)

    def bytes_per_block(self, block_size: int) -> int:
        return self.runner.bytes_per_block(block_size)

    @property
    def padding_blocks(self) -> int:
        return self.runner.padding_blocks

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        self.runner.allocate_kv_cache(num_blocks, block_size)

    def free_kv_cache(self) -> None:
        self.runner.free_kv_cache()

    def propose(self, requests: list[DraftRequest]) -> list[DraftProposal]:
        """Each request's num_draft proposals: round 0 catches up to the sequence's last token (in chunks within
        the token budget) and its logits give the first proposal; rounds 1.. feed the previous proposal and give
        the next."""
        computed = [r.num_computed for r in requests]
        tokens: list[list[int]] = [[] for _ in requests]
        probs: list[list[torch.Tensor | None]] = [[] for _ in requests]
        last_logits: dict[int, torch.Tensor] = {}
        pending = list(enumerate(computed))
        while pending:
            items, budget, rest = [], self.budget, []
            for i, start in pending:
                r = requests[i]
                n = min(len(r.token_ids) - start, max(budget, 1))
                items.append((i, r.token_ids[start:start + n], start))
                budget -= n
                if start + n < len(r.token_ids):
                    rest.append((i, start + n))
            logits = self._forward(requests, items)
            for row, (i, chunk, start) in enumerate(items):
                computed[i] = start + len(chunk)
                if computed[i] == len(requests[i].token_ids):
                    last_logits[i] = logits[row]
            pending = rest
        active = list(range(len(requests)))
        for _ in range(self.k):
            rows = torch.stack([last_logits[i] for i in active])
            for i, token, q in zip(active, *choose_proposals(rows, [requests[i] for i in active])):
                tokens[i].append(token)
                probs[i].append(q)
            active = [i for i in active if len(tokens[i]) < requests[i].num_draft]
            if not active:
                break
            # Feed each proposal at the position after the last one: its keys/values go into the slots the
            # scheduler allocated for this step's proposals.
            items = [(i, [tokens[i][-1]], len(requests[i].token_ids) + len(tokens[i]) - 1) for i in active]
            logits = self._forward(requests, items)
            for row, (i, _, start) in enumerate(items):
                computed[i] = start + 1
                last_logits[i] = logits[row]
        return [DraftProposal(t, q, c) for t, q, c in zip(tokens, probs, computed)]

    def _forward(self, requests: list[DraftRequest], items) -> torch.Tensor:
        """Draft logits [len(items), vocab] after each (request index, tokens, first position) chunk, its
        keys/values written into the request's blocks."""
        bs = self.block_size
        tokens, positions, slots, query_start, seq_lens, tables = [], [], [], [0], [], []
        width = max(len(requests[i].block_ids) for i, _, _ in items)
        for i, chunk, start in items:
            block_ids = requests[i].block_ids
            span = range(start, start + len(chunk))
            tokens.extend(chunk)
            positions.extend(span)
            slots.extend(block_ids[p // bs] * bs + p % bs for p in span)
            query_start.append(len(tokens))
            seq_lens.append(start + len(chunk))
            tables.append(block_ids + [0] * (width - len(block_ids)))
        inputs = StepInputs(
            input_ids=torch.tensor(tokens, dtype=torch.int64), positions=torch.tensor(positions, dtype=torch.int64),
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            query_start_loc=torch.tensor(query_start, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=torch.tensor(tables, dtype=torch.int32),
            logits_indices=torch.tensor(query_start[1:], dtype=torch.int64) - 1,
            query_lens=[len(c) for _, c, _ in items], seq_lens_list=seq_lens)
        return self.runner.execute(inputs)[:, :self.vocab_size]

