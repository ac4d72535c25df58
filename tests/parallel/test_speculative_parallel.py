"""Draft-model speculative decoding under TP=2, PP=2 and TP=2 x PP=2 (gloo, worker processes on this machine): the
draft model runs whole on rank 0 (execution/drafter.py), the target sharded as without speculation. Greedy output
equals the non-speculative run's, proposals are accepted, and seeded sampling draws as in one process."""

from __future__ import annotations

import shutil

import pytest
import torch

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
    """The target's weights with a little noise added: a draft that agrees with the target often but not always,
    so both acceptance and rejection happen (this model's logits are nearly flat: more noise flips most argmaxes,
    and two unrelated random models never agree)."""
    from safetensors.torch import load_file, save_file

    path = tmp_path_factory.mktemp("draft")
    shutil.copytree(llama_kv1, path, dirs_exist_ok=True)
    g = torch.Generator().manual_seed(1)
    for f in path.glob("*.safetensors"):
        tensors = load_file(f)
        save_file({k: v + 0.005 * torch.randn(v.shape, generator=g) if v.dim() == 2 else v
                   for k, v in tensors.items()}, f, metadata={"format": "pt"})
    return path


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
    for want, got in zip(without_speculation, outputs):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids, want.prompt
        for ew, eg in zip(want.outputs[0].logprobs, got.outputs[0].logprobs):
            assert list(eg) == list(ew)
            assert all(eg[t].logprob == pytest.approx(ew[t].logprob, abs=1e-4) for t in ew)
    drafted, accepted = stats.spec_decode_num_draft_tokens_total, stats.spec_decode_num_accepted_tokens_total
    assert 0 < accepted < drafted  # a different model: some proposals kept, some rejected


def test_a_draft_equal_to_the_target_accepts_everything_under_tp(llama_kv1):
    """The target as its own draft (whole on rank 0, against the target's two shards): every proposal is kept and
    each decode step yields K + 1 tokens."""
    k, n = 3, 1 + 4 * 4  # the prefill's token, then four steps of K + 1
    options = dict(OPTIONS, max_num_batched_tokens=128)  # the prompt in one step
    with LLM(model=llama_kv1, tensor_parallel_size=2, speculative_config=_spec(llama_kv1, k), **options) as llm:
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
