"""Draft-model speculative decoding under TP=2, PP=2 and TP=2 x PP=2 (gloo, worker processes on this machine): the
draft model runs whole on rank 0 (execution/drafter.py), the target sharded as without speculation. Greedy output
equals the non-speculative run's, proposals are accepted, and seeded sampling draws as in one process."""

from __future__ import annotations

import pytest
from draftkit import assert_same_greedy_output, assert_some_accepted_some_rejected, noisy_copy

from shoal.engine import LLM, SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [
    "one two three four five six one two three four five six one two three",
    "the cat sat on the mat, the cat sat on the mat, the cat",
    "def f(x): return x + 1\ndef g(x): return x + 1\ndef h(x): return",
]
# Small blocks and a small token budget: chunked prefill mixes with speculative decodes, and the draft catches up
# over the prompt in chunks.
OPTIONS = dict(block_size=4, max_model_len=128, num_kv_blocks=128, max_num_batched_tokens=24)
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def noisy_draft(llama_kv1, tmp_path_factory):
    """The target's weights with a little noise added: both acceptance and rejection happen (this model's logits
    are nearly flat: more noise flips most argmaxes)."""
    return noisy_copy(llama_kv1, tmp_path_factory.mktemp("draft"), 0.005)


@pytest.fixture(scope="module")
def without_speculation(llama_kv1):
    with LLM(model=llama_kv1, **OPTIONS) as llm:
        return llm.generate(PROMPTS, GREEDY, use_tqdm=False)


def _spec(draft, k=3):
    return {"model": str(draft), "num_speculative_tokens": k}


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2), (2, 2)], ids=lambda v: str(v))
def test_greedy_with_a_draft_model_equals_no_speculation(llama_kv1, noisy_draft, without_speculation, tp, pp):
    with LLM(model=llama_kv1, tensor_parallel_size=tp, pipeline_parallel_size=pp,
             speculative_config=_spec(noisy_draft), **OPTIONS) as llm:
        engine = llm.llm_engine
        assert engine.executor.group.world_size == tp * pp
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        engine.pool.check_all_free()
        stats = engine.get_stats()
    assert_same_greedy_output(without_speculation, outputs)
    assert_some_accepted_some_rejected(stats)


def test_a_draft_equal_to_the_target_accepts_everything_under_tp(llama_kv1, without_speculation):
    """The target as its own draft (whole on rank 0, against the target's two tensor-parallel shards): every
    proposal is kept, and the output is the non-speculative one."""
    with LLM(model=llama_kv1, tensor_parallel_size=2, speculative_config=_spec(llama_kv1), **OPTIONS) as llm:
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        stats = llm.llm_engine.get_stats()
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in without_speculation]
    assert stats.spec_decode_num_drafts_total > 0
    assert stats.spec_decode_num_accepted_tokens_total == stats.spec_decode_num_draft_tokens_total
    # Each verifying step yields K + 1 tokens (a step near max_tokens verifies fewer proposals).
    assert stats.spec_decode_num_draft_tokens_total > 2 * stats.spec_decode_num_drafts_total


def test_seeded_sampling_with_a_draft_model_through_a_pipeline_is_reproducible(llama_kv1, noisy_draft):
    """Seeded sampled requests with a draft model: through a two-stage pipeline (the last stage samples, with the
    draft's distributions and rank 0's seeded draws sent along) they get the same tokens as in one process."""
    params = [SamplingParams(temperature=0.8, top_k=20, max_tokens=12, seed=7, ignore_eos=True, n=2),
              SamplingParams(temperature=1.0, max_tokens=12, seed=8, ignore_eos=True)]
    prompts = PROMPTS[:2]
    with LLM(model=llama_kv1, speculative_config=_spec(noisy_draft), **OPTIONS) as llm:
        want = llm.generate(prompts, params, use_tqdm=False)
    with LLM(model=llama_kv1, pipeline_parallel_size=2, speculative_config=_spec(noisy_draft), **OPTIONS) as llm:
        got = llm.generate(prompts, params, use_tqdm=False)
        llm.llm_engine.pool.check_all_free()
        stats = llm.llm_engine.get_stats()
    for w, g in zip(want, got):
        assert [c.token_ids for c in g.outputs] == [c.token_ids for c in w.outputs], w.prompt
    assert all(len(c.token_ids) == 12 for o in got for c in o.outputs)
    assert stats.spec_decode_num_accepted_tokens_total > 0
