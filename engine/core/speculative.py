"""Speculative decoding's proposals: n-gram prompt lookup (vLLM's "ngram" method), a draft model ("draft_model")
and the target checkpoint's own multi-token-prediction layer ("mtp", execution/mtp.py: proposed like a draft
model's, through the executor).

A decoding sequence whose recent tokens already occurred earlier in its prompt or output (code being edited, a
passage being quoted or summarised) is likely to continue as it did then. The proposer finds the latest earlier
occurrence of the sequence's last n tokens (n from prompt_lookup_max down to prompt_lookup_min) and proposes the
tokens that followed it. The engine schedules them after the sequence's last token, the model scores all of them
in one forward pass, and the sampler keeps the longest prefix the target model agrees with (sampling.py,
`SamplingRow.draft`) plus one token of its own, so every step still yields at least one token.
"""

from __future__ import annotations

import numpy as np

from shoal.engine.config import SpeculativeConfig
from shoal.engine.contracts import DraftRequest


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

    The draft model itself is the executor's (execution/drafter.py says where it runs and why): this side only
    decides which sequences verify how many proposals and hands the executor one DraftRequest each. The draft's
    keys/values live in the sequence's own block ids, so `seq.num_draft_computed` (how many leading positions hold
    valid draft keys/values) is all the bookkeeping; the scheduler resets it on preemption. Proposals the target
    rejected leave stale draft entries past the last accepted token, which min(num_draft_computed,
    num_computed_tokens) excludes. A sequence admitted with a prefix-cache hit recomputes its draft entries from
    position 0 (the cached blocks hold the target's keys/values, and the draft's only where an earlier sequence
    wrote them): a draft forward over the prompt, cheap next to the target's.

    Greedy sequences propose the draft's argmax; sampled ones draw from the draft's softmax at the request's
    temperature (from the request's own generator when it is seeded) and hand that distribution to the sampler,
    whose rejection sampling keeps the target's distribution exactly (sampling.py, SamplingRow.draft_probs).
    """

    fills_after_schedule = True

    def __init__(self, config: SpeculativeConfig, executor):
        self.k = config.num_speculative_tokens
        self.executor = executor

    def propose(self, token_ids: list[int], limit: int) -> list[int]:
        """Before scheduling: room for min(k, limit) proposals, filled by fill() once scheduled."""
        return [PENDING] * min(self.k, limit)

    def fill(self, scheduled) -> None:
        """Replace the placeholders of every scheduled sequence that verifies proposals with the draft's tokens
        (and, for sampled sequences, the distributions they were drawn from); drop the rest."""
        todo = []
        for s in scheduled:
            if s.num_draft:
                todo.append(s)
            elif s.seq.spec_token_ids:
                s.seq.spec_token_ids = []
        if not todo:
            return
        requests = [DraftRequest(s.seq.token_ids, min(s.seq.num_draft_computed, s.seq.num_computed_tokens),
                                 s.seq.block_ids, s.num_draft, s.seq.params, s.seq.generator) for s in todo]
        for s, proposal in zip(todo, self.executor.propose(requests)):
            seq = s.seq
            seq.spec_token_ids, seq.spec_probs = proposal.token_ids, proposal.probs
            seq.num_draft_computed = proposal.num_computed


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


def check_mtp_engine(engine) -> None:
    """Refuse speculative MTP where it cannot run."""
    from shoal.engine.execution.gguf_model import is_gguf
    from shoal.engine.execution.mtp import check_mtp_target

    c = engine.config
    if is_gguf(engine.model_dir):
        raise ValueError("speculative method 'mtp' reads the MTP layer from safetensors; a GGUF file has none")
    check_mtp_target(engine.hf_config, engine.model_dir)
    if c.world_size > 1:
        raise ValueError("speculative method 'mtp' runs in one process only: tensor_parallel_size "
                         f"{c.tensor_parallel_size} x pipeline_parallel_size {c.pipeline_parallel_size} is not "
                         "supported with it (the MTP layer would need the target's sharding and last stage)")
    if c.kv_offloading_size is not None:  # blocks loaded back from a tier would lack the target's hidden states
        raise ValueError("speculative method 'mtp' does not support kv_offloading_size (the offloaded blocks do not "
                         "keep the hidden states the MTP layer reads)")
    if c.kv_transfer_config is not None and c.kv_transfer_config.consumes:  # nor do blocks pulled from a producer
        raise ValueError("speculative method 'mtp' does not support a kv_transfer_config consumer (pulled blocks do "
                         "not carry the hidden states the MTP layer reads)")


def make_proposer(config: SpeculativeConfig, engine):
    """The proposer of an engine's speculative config; a draft model is checked here and loaded by the executor."""
    if config.method == "ngram":
        return NgramProposer(config)
    if config.method == "mtp":
        check_mtp_engine(engine)
        engine.executor.load_mtp(config.num_speculative_tokens, engine.max_num_batched_tokens)
        return DraftModelProposer(config, engine.executor)
    from shoal.engine.core.tokenizer import load_tokenizer
    from shoal.engine.execution.model_loader import load_hf_config, resolve_model_dir

    if engine.kv_window is not None:  # freed leading blocks: the draft could not catch up over them
        raise ValueError("draft-model speculative decoding is not supported for a model whose every layer uses "
                         "sliding-window attention (its slid-out KV blocks are freed); use the ngram method")
    trust = engine.config.trust_remote_code
    model_dir = resolve_model_dir(config.model)
    hf_config = load_hf_config(model_dir, trust)
    tokenizer = load_tokenizer(model_dir, trust_remote_code=trust)
    check_same_vocabulary(config.model, hf_config, tokenizer, engine.hf_config, engine.tokenizer)
    engine.executor.load_drafter(model_dir, hf_config, config.num_speculative_tokens, engine.max_num_batched_tokens)
    return DraftModelProposer(config, engine.executor)
