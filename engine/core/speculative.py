"""Speculative decoding's proposals: n-gram prompt lookup (vLLM's "ngram" method) and a draft model ("draft_model").

A decoding sequence whose recent tokens already occurred earlier in its prompt or output (code being edited, a
passage being quoted or summarised) is likely to continue as it did then. The proposer finds the latest earlier
occurrence of the sequence's last n tokens (n from prompt_lookup_max down to prompt_lookup_min) and proposes the
tokens that followed it. The engine schedules them after the sequence's last token, the model scores all of them
in one forward pass, and the sampler keeps the longest prefix the target model agrees with (sampling.py,
`SamplingRow.draft`) plus one token of its own, so every step still yields at least one token.
"""

from __future__ import annotations

import numpy as np
import torch

from shoal.engine.config import SpeculativeConfig


class NgramProposer:
    fills_after_schedule = False

    def __init__(self, config: SpeculativeConfig):
        self.k = config.num_speculative_tokens
        self.n_max = config.prompt_lookup_max
        self.n_min = config.prompt_lookup_min

    def propose(self, token_ids: list[int], limit: int) -> list[int]:
        """At most min(k, limit) tokens that followed the latest earlier occurrence of token_ids' longest
        matching suffix; [] when no suffix of prompt_lookup_min..max tokens occurred before."""
        k = min(self.k, limit)
        if k <= 0 or len(token_ids) <= self.n_min:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.n_max, len(tokens) - 1), self.n_min - 1, -1):
            # Windows over tokens[:-1]: a match starting at i is followed by at least one token, tokens[i + n].
            windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
            hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return token_ids[start:start + k]
        return []


# Placeholder proposals: a draft model's tokens are computed after the scheduler has decided how many of them each
# sequence verifies (their KV slots must be allocated first); until then spec_token_ids holds this many -1s.
PENDING = -1


class DraftModelProposer:
    """Proposals from a draft model (vLLM's "draft_model" method): a smaller model with the target's tokenizer
    runs K autoregressive steps per decoding sequence and each of its tokens is verified by the target.

    The draft has its own paged KV cache with the same block size and as many blocks as the target's pool, and a
    sequence's draft keys/values live in the same block ids as its target keys/values: allocation, prefix-cache
    sharing, preemption and the release of rejected proposals' blocks all follow the target's scheduler, with
    nothing to keep in sync. `seq.num_draft_computed` counts the positions whose draft keys/values are valid; a
    draft step first catches up on the tokens the target computed since (the whole prompt after the target's
    prefill, or after a preemption: the scheduler resets it), then feeds its own proposals. Proposals the target
    rejected leave stale draft entries past the last accepted token, which min(num_draft_computed,
    num_computed_tokens) excludes. A sequence admitted with a prefix-cache hit recomputes its draft entries from
    position 0 (the cached blocks hold the target's keys/values, and the draft's only where an earlier sequence
    wrote them): a draft forward over the prompt, cheap next to the target's.

    Greedy sequences propose the draft's argmax; sampled ones draw from the draft's softmax at the request's
    temperature (from the request's own generator when it is seeded) and hand that distribution to the sampler,
    whose rejection sampling keeps the target's distribution exactly (sampling.py, SamplingRow.draft_probs).
    """

    fills_after_schedule = True

    def __init__(self, config: SpeculativeConfig, engine_config, target_hf_config, target_tokenizer, dtype,
                 device, max_model_len: int, max_num_batched_tokens: int):
        from shoal.engine.core.tokenizer import load_tokenizer
        from shoal.engine.execution.graph_capture import decode_capture_backend
        from shoal.engine.execution.model_loader import load_hf_config, resolve_model_dir
        from shoal.engine.execution.runner import ModelRunner

        if engine_config.tensor_parallel_size * engine_config.pipeline_parallel_size > 1:
            raise ValueError("draft-model speculative decoding runs in one process: it is not supported with "
                             "tensor or pipeline parallelism (use the ngram method there)")
        self.k = config.num_speculative_tokens
        self.budget = max_num_batched_tokens
        self.model_dir = resolve_model_dir(config.model)
        hf_config = load_hf_config(self.model_dir, engine_config.trust_remote_code)
        tokenizer = load_tokenizer(self.model_dir, trust_remote_code=engine_config.trust_remote_code)
        check_same_vocabulary(config.model, hf_config, tokenizer, target_hf_config, target_tokenizer)
        self.vocab_size = target_hf_config.vocab_size
        self.runner = ModelRunner(self.model_dir, hf_config, dtype, device, engine_config.attention_backend,
                                  max_model_len, block_size=engine_config.block_size)
        # Its rounds after the first are pure decode steps: captured like the target's (graph_capture.py).
        self.runner.enable_decode_capture(decode_capture_backend(engine_config, device), engine_config.max_num_seqs)
        self.block_size = engine_config.block_size

    def bytes_per_block(self, block_size: int) -> int:
        return self.runner.bytes_per_block(block_size)

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        self.runner.allocate_kv_cache(num_blocks, block_size)

    def propose(self, token_ids: list[int], limit: int) -> list[int]:
        """Before scheduling: room for min(k, limit) proposals, filled by fill() once scheduled."""
        return [PENDING] * min(self.k, limit)

    def fill(self, scheduled) -> None:
        """Replace the placeholders of every scheduled sequence that verifies proposals with the draft's tokens
        (and, for sampled sequences, the distributions they were drawn from); drop the rest."""
        todo = []
        for s in scheduled:
            seq = s.seq
            if s.num_draft:
                todo.append((seq, s.num_draft))
            elif seq.spec_token_ids:
                seq.spec_token_ids = []
        if not todo:
            return
        for seq, _ in todo:
            seq.spec_token_ids, seq.spec_probs = [], []
            seq.num_draft_computed = min(seq.num_draft_computed, seq.num_computed_tokens)
        # Round 0: catch up to each sequence's last token (in chunks within the token budget); its logits give
        # the first proposal. Rounds 1..: feed the previous proposal, get the next.
        pending = [(seq, seq.num_draft_computed) for seq, _ in todo]
        last_logits: dict[int, torch.Tensor] = {}
        while pending:
            items, budget, rest = [], self.budget, []
            for seq, start in pending:
                n = min(seq.num_tokens - start, max(budget, 1))
                items.append((seq, seq.token_ids[start:start + n], start))
                budget -= n
                if start + n < seq.num_tokens:
                    rest.append((seq, start + n))
            logits = self._forward(items)
            for row, (seq, tokens, start) in enumerate(items):
                seq.num_draft_computed = start + len(tokens)
                if seq.num_draft_computed == seq.num_tokens:
                    last_logits[seq.seq_id] = logits[row]
            pending = rest
        active = todo
        for r in range(self.k):
            rows = torch.stack([last_logits[seq.seq_id] for seq, _ in active])
            for (seq, _), token, probs in zip(active, *self._choose(rows, [seq for seq, _ in active])):
                seq.spec_token_ids.append(token)
                seq.spec_probs.append(probs)
            active = [(seq, d) for seq, d in active if len(seq.spec_token_ids) < d]
            if not active:
                break
            # Feed each proposal at the position after the last one: its keys/values go into the slots the
            # scheduler allocated for this step's proposals.
            items = [(seq, [seq.spec_token_ids[-1]], seq.num_tokens + len(seq.spec_token_ids) - 1)
                     for seq, _ in active]
            logits = self._forward(items)
            for row, (seq, _, start) in enumerate(items):
                seq.num_draft_computed = start + 1
                last_logits[seq.seq_id] = logits[row]

    def _forward(self, items) -> torch.Tensor:
        """Draft logits [len(items), vocab] after each (seq, tokens, first position) chunk, its keys/values written
        into the sequence's blocks."""
        from shoal.engine.contracts import StepInputs

        bs = self.block_size
        tokens, positions, slots, query_start, seq_lens, tables = [], [], [], [0], [], []
        width = max(len(seq.block_ids) for seq, _, _ in items)
        for seq, chunk, start in items:
            span = range(start, start + len(chunk))
            tokens.extend(chunk)
            positions.extend(span)
            slots.extend(seq.block_ids[p // bs] * bs + p % bs for p in span)
            query_start.append(len(tokens))
            seq_lens.append(start + len(chunk))
            tables.append(seq.block_ids + [0] * (width - len(seq.block_ids)))
        inputs = StepInputs(
            input_ids=torch.tensor(tokens, dtype=torch.int64), positions=torch.tensor(positions, dtype=torch.int64),
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            query_start_loc=torch.tensor(query_start, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=torch.tensor(tables, dtype=torch.int32),
            logits_indices=torch.tensor(query_start[1:], dtype=torch.int64) - 1,
            query_lens=[len(c) for _, c, _ in items], seq_lens_list=seq_lens)
        return self.runner.execute(inputs)[:, :self.vocab_size]

    @staticmethod
    def _choose(logits: torch.Tensor, seqs) -> tuple[list[int], list[torch.Tensor | None]]:
        """Each sequence's proposal from its draft logits: the argmax for greedy requests, else a draw from the
        softmax at the request's temperature (returned with it, for the target's rejection sampling)."""
        tokens = logits.argmax(dim=-1).tolist()
        probs: list[torch.Tensor | None] = [None] * len(seqs)
        for i, seq in enumerate(seqs):
            params = seq.params
            if params.is_greedy:
                continue
            q = (logits[i] / params.temperature).softmax(dim=-1)
            tokens[i] = int(torch.multinomial(q, 1, generator=seq.generator))
            probs[i] = q
        return tokens, probs


def check_same_vocabulary(draft_name: str, draft_config, draft_tokenizer, target_config, target_tokenizer) -> None:
    """Refuse a draft model whose token ids mean something else than the target's (its proposals would be
    verified as other tokens): the same vocabulary size and the same token -> id map."""
    if draft_config.vocab_size != target_config.vocab_size:
        raise ValueError(f"draft model {draft_name}: its vocabulary has {draft_config.vocab_size} entries, the "
                         f"target model's {target_config.vocab_size}; a draft model must share the target's "
                         "tokenizer")
    draft_vocab, target_vocab = draft_tokenizer.get_vocab(), target_tokenizer.get_vocab()
    if draft_vocab != target_vocab:
        differ = sorted(set(draft_vocab.items()) ^ set(target_vocab.items()), key=str)[:3]
        raise ValueError(f"draft model {draft_name}: its tokenizer differs from the target model's "
                         f"({len(draft_vocab)} vs {len(target_vocab)} tokens; e.g. {differ}); a draft model must "
                         "share the target's tokenizer")


def make_proposer(config: SpeculativeConfig, engine):
    """The proposer of an engine's speculative config."""
    if config.method == "ngram":
        return NgramProposer(config)
    if engine.kv_window is not None:  # freed leading blocks: the draft could not catch up over them
        raise ValueError("draft-model speculative decoding is not supported for a model whose every layer uses "
                         "sliding-window attention (its slid-out KV blocks are freed); use the ngram method")
    return DraftModelProposer(config, engine.config, engine.hf_config, engine.tokenizer, engine.dtype,
                              engine.device, engine.max_model_len, engine.max_num_batched_tokens)
