"""Draft-model speculative decoding, vLLM's recipe: greedy output equals the non-speculative run (chunked prefill,
preemption, prefix caching), a draft equal to the target accepts everything (K+1 tokens a step), sampling keeps
the target distribution when the proposals come from a draft distribution, and a draft with another vocabulary is
refused at start."""

from __future__ import annotations

import shutil

import pytest
import torch
from draftkit import assert_same_greedy_output, assert_some_accepted_some_rejected, noisy_copy
from scipy.stats import chisquare

from shoal.engine import LLM, SamplingParams
from shoal.engine.config import SpeculativeConfig
from shoal.engine.execution.sampling import Sampler, SamplingRow

PROMPTS = [
    "one two three four five six one two three four five six one two three",
    "the cat sat on the mat, the cat sat on the mat, the cat",
    "def f(x): return x + 1\ndef g(x): return x + 1\ndef h(x): return",
]

REGIMES = {
    "default": dict(block_size=4, max_model_len=128),
    # Two-token prefill chunks, and a pool too small for the batch: sequences are preempted and recomputed.
    "chunked-prefill-preemption": dict(block_size=4, max_model_len=96, num_kv_blocks=24, max_num_batched_tokens=8),
}


@pytest.fixture(scope="module")
def draft_model(llama_model, tmp_path_factory):
    """The target's weights with noise added: both acceptance and rejection happen."""
    return noisy_copy(llama_model, tmp_path_factory.mktemp("draft"), 0.05)


def _spec(draft, k=3):
    return {"model": str(draft), "num_speculative_tokens": k}


def _run(model, prompts, params, spec, rounds=1, **kw):
    with LLM(model=model, dtype="float32", speculative_config=spec, **kw) as llm:
        outs = [llm.generate(prompts, params, use_tqdm=False) for _ in range(rounds)]
        engine = llm.llm_engine
        engine.pool.check_all_free()
        return outs, engine.get_stats(), engine


def test_config_implies_the_method_and_checks_it(draft_model):
    assert SpeculativeConfig(**_spec(draft_model)).method == "draft_model"
    with pytest.raises(ValueError, match="needs a \"method\""):
        SpeculativeConfig(num_speculative_tokens=2)
    with pytest.raises(ValueError, match="takes no \"model\""):
        SpeculativeConfig(method="ngram", model=str(draft_model), num_speculative_tokens=2)
    with pytest.raises(ValueError, match="needs the draft \"model\""):
        SpeculativeConfig(method="draft_model", num_speculative_tokens=2)


@pytest.mark.parametrize("regime", list(REGIMES))
def test_greedy_equals_non_speculative(llama_model, draft_model, regime):
    """Twice the same prompts in one engine: the second round is served from the prefix cache (the draft then
    recomputes its own entries)."""
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=2)
    (base,), _, _ = _run(llama_model, PROMPTS, params, None, **REGIMES[regime])
    spec, stats, engine = _run(llama_model, PROMPTS, params, _spec(draft_model), rounds=2, **REGIMES[regime])
    for round_outputs in spec:
        assert_same_greedy_output(base, round_outputs)
    assert_some_accepted_some_rejected(stats)
    if regime == "chunked-prefill-preemption":
        assert engine.scheduler.num_preemptions > 0, "the pool was meant to be too small for the batch"
    else:
        assert engine.pool.prefix_hits > 0 and all(o.num_cached_tokens > 0 for o in spec[1])


def test_a_draft_equal_to_the_target_accepts_everything(llama_model):
    """Acceptance 1.0, and each decode step yields K + 1 tokens."""
    k, n = 3, 1 + 4 * 4  # the prefill's token, then four steps of K + 1
    with LLM(model=llama_model, dtype="float32", block_size=4, max_model_len=128,
             speculative_config=_spec(llama_model, k)) as llm:
        engine = llm.llm_engine
        engine.add_request("r", PROMPTS[0], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        steps = 0
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
        stats = engine.get_stats()
    assert steps == 1 + 4
    assert stats.spec_decode_num_drafts_total == 4
    assert stats.spec_decode_num_accepted_tokens_total == stats.spec_decode_num_draft_tokens_total == 4 * k


def test_seeded_sampling_with_a_draft_model_is_reproducible_and_frees(llama_model, draft_model):
    params = SamplingParams(temperature=0.8, top_k=20, max_tokens=16, seed=7, ignore_eos=True, n=2)
    kw = dict(block_size=4, max_model_len=128)
    (a,), stats, _ = _run(llama_model, PROMPTS[:2], params, _spec(draft_model), **kw)
    (b,), _, _ = _run(llama_model, PROMPTS[:2], params, _spec(draft_model), **kw)
    ids = [[c.token_ids for c in o.outputs] for o in a]
    assert ids == [[c.token_ids for c in o.outputs] for o in b]
    assert all(len(c.token_ids) == 16 for o in a for c in o.outputs)
    assert stats.spec_decode_num_draft_tokens_total > 0


@pytest.mark.parametrize("truncation", [{}, {"top_k": 4}, {"top_p": 0.8}])
def test_rejection_sampling_with_draft_probabilities_keeps_the_target_distribution(truncation):
    """Proposals drawn from a draft distribution q far from the target p, verified with q: the tokens follow the
    target's (truncated) softmax (chi-square), whatever q proposed, including tokens p excludes."""
    V, N, T = 8, 40000, 0.9
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(V, generator=g) * 1.5
    q = torch.randn(V, generator=g).softmax(-1)  # unrelated to the target
    params = SamplingParams(temperature=T, **truncation)
    probs = (logits / T).softmax(-1)
    order = probs.argsort(descending=True)
    keep = torch.ones(V, dtype=torch.bool)
    if "top_k" in truncation:
        keep[order[truncation["top_k"]:]] = False
    if "top_p" in truncation:
        before = probs[order].cumsum(0) - probs[order]
        keep[order[before >= truncation["top_p"]]] = False
    target = torch.where(keep, probs, 0.0)
    target /= target.sum()
    drafts = torch.multinomial(q, N, replacement=True, generator=g).tolist()
    rows = [SamplingRow(params, [], [], draft=d, draft_probs=q) for d in drafts]
    tokens = torch.tensor(Sampler(V)(logits.expand(N, V).contiguous(), rows).token_ids)
    counts = torch.bincount(tokens, minlength=V).double()
    assert counts[~keep].sum() == 0
    observed, expected = counts[keep], target[keep].double()
    expected *= observed.sum() / expected.sum()
    assert chisquare(observed.numpy(), expected.numpy()).pvalue > 1e-4, (observed, expected)
    # The proposal is kept with probability min(1, p/q) summed over q: E = sum_x min(q(x), p(x)).
    kept = (tokens == torch.tensor(drafts)).double().mean()
    assert kept == pytest.approx(torch.minimum(q, target).sum().item(), abs=0.015)


def test_a_draft_with_another_vocabulary_is_refused(llama_model, model_factory, tmp_path):
    other_size = model_factory("llama", seed=1, num_hidden_layers=1, vocab_size=320)
    with pytest.raises(ValueError, match="320 entries, the target model's 384"):
        LLM(model=llama_model, speculative_config=_spec(other_size))
    # Same size, other tokens: the draft's tokenizer trained to a smaller vocabulary.
    from shoal.engine.tools.tiny_model import make_tokenizer

    other_tokens = tmp_path / "draft"
    shutil.copytree(model_factory("llama", seed=1, num_hidden_layers=1), other_tokens)
    make_tokenizer(other_tokens, vocab_size=300)
    with pytest.raises(ValueError, match="tokenizer differs from the target model's"):
        LLM(model=llama_model, speculative_config=_spec(other_tokens))
