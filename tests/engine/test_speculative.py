"""Speculative decoding (n-gram prompt lookup), vLLM's recipe: greedy output equals the non-speculative run in
every scheduling regime, sampling keeps the target distribution, and no KV block leaks or enters the prefix cache
holding rejected tokens."""

from __future__ import annotations

import argparse

import pytest
import torch
from scipy.stats import chisquare

from shoal.engine import LLM, SamplingParams
from shoal.engine.config import EngineConfig, SpeculativeConfig, parse_speculative_config
from shoal.engine.core.kv_cache import BlockPool
from shoal.engine.core.outputs import RequestMetrics
from shoal.engine.core.scheduler import Scheduler
from shoal.engine.core.sequence import Request, Sequence
from shoal.engine.core.speculative import NgramProposer
from shoal.engine.execution.sampling import Sampler, SamplingRow
from shoal.engine.flags import to_args

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}

# Repetition, so that proposals exist (and some are accepted even by a random-weight model).
PROMPTS = [
    "one two three four five six one two three four five six one two three",
    "the cat sat on the mat, the cat sat on the mat, the cat",
    "A B C A B C A B C A B",
    "def f(x): return x + 1\ndef g(x): return x + 1\ndef h(x): return",
]

REGIMES = {
    "default": dict(block_size=4, max_model_len=128),
    # Two-token prefill chunks, and a pool too small for the batch: sequences are preempted and recomputed.
    "chunked-prefill-preemption": dict(block_size=4, max_model_len=96, num_kv_blocks=26, max_num_batched_tokens=8),
    "no-prefix-cache": dict(block_size=8, max_model_len=128, enable_prefix_caching=False),
}


def _generate(model_dir, prompts, params, spec, **kw):
    with LLM(model=model_dir, dtype="float32", speculative_config=spec, **kw) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
        engine = llm.llm_engine
        engine.pool.check_all_free()
        return outs, engine.get_stats(), engine


def _assert_same(base, spec):
    for a, b in zip(base, spec):
        for x, y in zip(a.outputs, b.outputs):
            assert y.token_ids == x.token_ids, a.prompt
            assert (y.text, y.finish_reason, y.stop_reason) == (x.text, x.finish_reason, x.stop_reason)
            if x.logprobs is not None:
                assert len(y.logprobs) == len(x.logprobs)
                for ex, ey in zip(x.logprobs, y.logprobs):
                    assert list(ey) == list(ex)
                    for t in ex:
                        assert ey[t].logprob == pytest.approx(ex[t].logprob, abs=1e-4)
                        assert ey[t].rank == ex[t].rank


# ------------------------------------------------------------------------------------------ proposals
def test_ngram_proposer_takes_the_latest_longest_match():
    p = NgramProposer(SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_max=3,
                                        prompt_lookup_min=2))
    #        0  1  2  3  4  5  6  7  8  9
    toks = [1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3]
    assert p.propose(toks, 10) == [7, 8, 1]  # the latest occurrence of [1, 2, 3]
    assert p.propose(toks, 2) == [7, 8]  # limited by the room left
    assert p.propose(toks, 0) == []
    assert p.propose([5, 6, 7, 6, 7], 10) == [6, 7]  # [6, 7] is the longest earlier suffix match; tail cut short
    assert p.propose([1, 2, 3, 4], 10) == []  # no bigram repeats (min 2)
    assert p.propose([4, 4], 10) == []  # too short for a bigram with a successor


def test_speculative_config_flag_and_errors():
    cfg = EngineConfig(model="m", speculative_config='{"method": "ngram", "num_speculative_tokens": 3}')
    assert cfg.speculative_config.num_speculative_tokens == 3 and cfg.speculative_config.prompt_lookup_min == 1
    words = to_args(EngineConfig, "speculative_config", cfg.speculative_config)
    assert words[0] == "--speculative-config"
    assert EngineConfig(model="m", speculative_config=parse_speculative_config(words[1])) == cfg
    with pytest.raises(ValueError, match="'eagle' is not supported"):
        EngineConfig(model="m", speculative_config={"method": "eagle", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        SpeculativeConfig(method="ngram", num_speculative_tokens=2, prompt_lookup_min=4, prompt_lookup_max=2)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculativeConfig(method="ngram", num_speculative_tokens=0)
    with pytest.raises(argparse.ArgumentTypeError, match="not valid JSON"):
        parse_speculative_config("{method: ngram}")


# ------------------------------------------------------------------------------------------ KV accounting
def test_rejected_tokens_release_their_blocks_and_never_enter_the_prefix_cache():
    pool = BlockPool(16, 4, enable_prefix_caching=True)
    sched = Scheduler(pool, max_num_seqs=4, max_num_batched_tokens=64)
    params = SamplingParams(max_tokens=32)
    req = Request("r", None, list(range(7)), params, RequestMetrics(0.0))
    seq = Sequence(0, req, 0, list(range(7)), 7)
    sched.add(seq)
    sched.after_step(sched.schedule())  # the prompt: 7 tokens, 2 blocks
    seq.token_ids.append(100)  # the first sampled token; positions 0..6 are computed
    seq.spec_token_ids = [101, 102, 103, 104, 105, 106]
    out = sched.schedule()
    (s,) = out.scheduled
    assert (s.num_new_tokens, s.num_draft, s.samples) == (7, 6, True)
    assert len(seq.block_ids) == 4  # positions 7..13 written: blocks 1, 2 and 3
    sched.after_step(out)
    assert seq.num_computed_tokens == 8  # the last real token only
    draft_blocks = seq.block_ids[2:]
    # One proposal accepted, then a different token: positions 8.. held rejected proposals.
    seq.token_ids += [101, 200]
    sched.accept_draft(seq, 1, 6)
    assert seq.num_computed_tokens == 9 and len(seq.block_ids) == 3
    assert all(pool.blocks[b].ref_count == 0 for b in draft_blocks[1:])
    cached = {pool.blocks[b].block_hash for b in seq.block_ids if pool.blocks[b].block_hash is not None}
    assert len(cached) == 2  # blocks 0 and 1 (tokens 0..7) are full of accepted tokens; block 2 is not full
    assert all(pool.blocks[b].block_hash is None for b in draft_blocks)
    sched.remove(seq)
    pool.check_all_free()


def test_proposals_never_cause_a_preemption():
    pool = BlockPool(3, 4, enable_prefix_caching=False)
    sched = Scheduler(pool, max_num_seqs=4, max_num_batched_tokens=64)
    seqs = []
    for i in range(2):
        req = Request(str(i), None, [1, 2, 3], SamplingParams(max_tokens=8), RequestMetrics(float(i)))
        seq = Sequence(i, req, 0, [1, 2, 3], 3)
        sched.add(seq)
        seqs.append(seq)
    sched.after_step(sched.schedule())
    for seq in seqs:
        seq.token_ids.append(4)
        seq.spec_token_ids = [5, 6, 7]  # would need a second block each; only one is free
    out = sched.schedule()
    # The first may not take the free block (the second might need it for its own token); the last may.
    assert not out.preempted and [s.num_draft for s in out.scheduled] == [0, 3]
    assert pool.num_free == 0


# ------------------------------------------------------------------------------------------ greedy equality
@pytest.mark.parametrize("regime", list(REGIMES))
def test_greedy_equals_non_speculative(llama_model, regime):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    base, _, _ = _generate(llama_model, PROMPTS, params, None, **REGIMES[regime])
    spec, stats, engine = _generate(llama_model, PROMPTS, params, NGRAM, **REGIMES[regime])
    _assert_same(base, spec)
    assert stats.spec_decode_num_draft_tokens_total > 0 and stats.spec_decode_num_accepted_tokens_total > 0
    assert stats.generation_tokens_total == sum(len(o.outputs[0].token_ids) for o in spec)
    if regime == "chunked-prefill-preemption":
        assert engine.scheduler.num_preemptions > 0, "the pool was meant to be too small for the batch"


def test_prefix_caching_and_stop_conditions_match(llama_model):
    """A second round served from the prefix cache (blocks the first round committed while speculating), with
    stop tokens, stop strings and max_tokens cutting outputs inside a step's accepted proposals."""
    kw = dict(block_size=4, max_model_len=128)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    first, _, _ = _generate(llama_model, PROMPTS, params, None, **kw)
    variants = []
    for o in first:
        out = o.outputs[0]
        variants.append(SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[out.token_ids[9]]))
        variants.append(SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[out.text[-12:-6]]))
        variants.append(SamplingParams(temperature=0, max_tokens=11, ignore_eos=True, logprobs=1))
    prompts = [p for p in PROMPTS for _ in range(3)]
    with LLM(model=llama_model, dtype="float32", **kw) as llm:
        llm.generate(PROMPTS, params, use_tqdm=False)
        base = llm.generate(prompts, variants, use_tqdm=False)
    with LLM(model=llama_model, dtype="float32", speculative_config=NGRAM, **kw) as llm:
        first_spec = llm.generate(PROMPTS, params, use_tqdm=False)
        spec = llm.generate(prompts, variants, use_tqdm=False)
        engine = llm.llm_engine
        assert engine.pool.prefix_hits > 0 and all(o.num_cached_tokens > 0 for o in spec)
        assert engine.get_stats().spec_decode_num_accepted_tokens_total > 0
        engine.pool.check_all_free()
    _assert_same(first, first_spec)
    _assert_same(base, spec)


def test_switched_off_above_the_batch_size_threshold(llama_model):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    spec = dict(NGRAM, disable_by_batch_size=2)
    _, stats, _ = _generate(llama_model, PROMPTS, params, spec, block_size=4, max_model_len=128)
    assert stats.spec_decode_num_drafts_total == 0  # four sequences decode together throughout
    _, stats, _ = _generate(llama_model, PROMPTS[:2], params, spec, block_size=4, max_model_len=128)
    assert stats.spec_decode_num_drafts_total > 0


def test_seeded_sampling_with_speculation_runs_and_frees(llama_model):
    params = SamplingParams(temperature=0.8, top_k=20, max_tokens=20, seed=7, ignore_eos=True, logprobs=1, n=2)
    a, stats, _ = _generate(llama_model, PROMPTS[:2], params, NGRAM, block_size=4, max_model_len=128)
    b, _, _ = _generate(llama_model, PROMPTS[:2], params, NGRAM, block_size=4, max_model_len=128)
    assert [o.outputs[i].token_ids for o in a for i in range(2)] == [o.outputs[i].token_ids for o in b
                                                                      for i in range(2)]
    assert all(len(c.token_ids) == 20 for o in a for c in o.outputs)
    assert stats.spec_decode_num_draft_tokens_total > 0


# ------------------------------------------------------------------------------------------ rejection sampling
@pytest.mark.parametrize("truncation", [{}, {"top_k": 5}, {"top_p": 0.8, "min_p": 0.05}])
def test_rejection_sampling_keeps_the_target_distribution(truncation):
    """Many rows with the same logits and the same proposal: the sampled tokens follow the target's (truncated)
    softmax (chi-square), the proposal is kept exactly as often as the target picks it, and a proposal outside the
    truncated support never survives."""
    V, N, T = 8, 40000, 0.9
    torch.manual_seed(0)
    logits = torch.randn(V) * 1.5
    params = SamplingParams(temperature=T, **truncation)
    sampler = Sampler(V)
    probs = (logits / T).softmax(-1)
    order = probs.argsort(descending=True)
    keep = torch.ones(V, dtype=torch.bool)
    if "top_k" in truncation:
        keep[order[truncation["top_k"]:]] = False
    if "top_p" in truncation:
        before = probs[order].cumsum(0) - probs[order]
        keep[order[before >= truncation["top_p"]]] = False
        keep &= probs >= probs.max() * truncation["min_p"]
    target = torch.where(keep, probs, 0.0)
    target /= target.sum()
    for draft in (int(order[1]), int(order[-1])):  # a likely proposal, and one the truncation may remove
        rows = [SamplingRow(params, [], [], draft=draft) for _ in range(N)]
        tokens = torch.tensor(sampler(logits.expand(N, V).contiguous(), rows).token_ids)
        counts = torch.bincount(tokens, minlength=V).double()
        assert counts[~keep].sum() == 0
        observed, expected = counts[keep], target[keep].double()
        expected *= observed.sum() / expected.sum()
        assert chisquare(observed.numpy(), expected.numpy()).pvalue > 1e-4, (draft, observed, expected)
        if not keep[draft]:
            assert counts[draft] == 0
