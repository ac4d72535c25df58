"""Sampling as users meet it through the offline API: seeds, n, stop strings and tokens, min/max tokens."""

from __future__ import annotations

import pytest

from shoal.engine import LLM, SamplingParams

PROMPTS = ["Hello world! The quick brown", "Once upon a time there", "def add(a, b):"]


@pytest.fixture(scope="module")
def llm(llama_model):
    with LLM(model=llama_model, block_size=4, max_model_len=128) as llm:
        yield llm


def texts(outputs):
    return [[c.text for c in o.outputs] for o in outputs]


def test_seeded_requests_reproduce_whatever_the_batch(llm):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate(PROMPTS[:1], seeded)
    crowd = llm.generate(PROMPTS + PROMPTS[:1],
                         [SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)] * 3 + [seeded])
    assert alone[0].outputs[0].token_ids == crowd[3].outputs[0].token_ids
    other_seed = llm.generate(PROMPTS[:1], SamplingParams(temperature=1.0, top_p=0.9, seed=99, max_tokens=16,
                                                         ignore_eos=True))
    assert other_seed[0].outputs[0].token_ids != alone[0].outputs[0].token_ids


def test_n_completions_are_independent_samples(llm):
    out = llm.generate(PROMPTS[:1], SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    assert all(len(c.token_ids) == 12 and c.finish_reason == "length" for c in out.outputs)
    greedy = llm.generate(PROMPTS[:1], SamplingParams(n=3, temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert len({tuple(c.token_ids) for c in greedy.outputs}) == 1


def test_stop_string_spanning_tokens_is_trimmed(llm):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    full = llm.generate(PROMPTS[:1], params)[0].outputs[0]
    tok = llm.get_tokenizer()
    # Pick a stop string that straddles a token boundary in the greedy output.
    pieces = [tok.decode(full.token_ids[:i], skip_special_tokens=True) for i in range(len(full.token_ids) + 1)]

    def straddles(i):
        prev, cur = pieces[i - 1], pieces[i]
        window = cur[len(prev) - 2:len(prev) + 1]
        return cur.startswith(prev) and len(prev) >= 2 and len(window) == 3 and window.isascii() and window.isprintable()

    cut = next(i for i in range(2, len(pieces)) if straddles(i))
    stop = pieces[cut][len(pieces[cut - 1]) - 2:len(pieces[cut - 1]) + 1]
    assert stop and stop in full.text
    out = llm.generate(PROMPTS[:1], params.clone(stop=[stop]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full.text[:full.text.index(stop)]
    kept = llm.generate(PROMPTS[:1], params.clone(stop=[stop], include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == full.text[:full.text.index(stop) + len(stop)]


def test_stop_token_ids_and_eos(llm):
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    full = llm.generate(PROMPTS[:1], params)[0].outputs[0]
    stop_tok = full.token_ids[5]
    out = llm.generate(PROMPTS[:1], params.clone(stop_token_ids=[stop_tok]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok
    assert out.token_ids == full.token_ids[:full.token_ids.index(stop_tok) + 1]


def test_min_and_max_tokens(llm):
    eos = llm.get_tokenizer().eos_token_id
    # EOS is masked until min_tokens, so a request that would stop early runs at least that long.
    out = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=10, min_tokens=10,
                                                  stop_token_ids=[eos]))[0].outputs[0]
    assert len(out.token_ids) == 10 and out.finish_reason == "length"
    short = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=3))[0].outputs[0]
    assert len(short.token_ids) <= 3


def test_logprobs_are_reported_per_token(llm):
    out = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=5, logprobs=3, ignore_eos=True))[0]
    c = out.outputs[0]
    assert len(c.logprobs) == 5
    for tid, entry in zip(c.token_ids, c.logprobs):
        assert tid in entry and len(entry) >= 3
        best = max(entry.values(), key=lambda lp: lp.logprob)
        assert entry[tid].logprob == best.logprob  # greedy takes the most likely token
    assert c.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(c.token_ids, c.logprobs)))


def test_invalid_params_raise_clear_errors():
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)


def test_waiting_prefill_tokens_count_what_is_not_yet_computed(llama_model):
    """The autoscaler's prefill signal: queued prompt tokens, then only the part chunked prefill has not reached."""
    with LLM(model=llama_model, block_size=4, max_model_len=128, max_num_batched_tokens=16,
             enable_chunked_prefill=True, enable_prefix_caching=False) as llm:
        engine = llm.llm_engine
        prompts = [list(range(5, 45)), list(range(50, 60))]  # 40 + 10 prompt tokens
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, SamplingParams(max_tokens=2, ignore_eos=True))
        assert engine.get_stats().num_waiting_prefill_tokens == 50
        engine.step()  # a 16-token chunk of the first prompt
        assert engine.get_stats().num_waiting_prefill_tokens == 34
        while engine.has_unfinished_requests():
            engine.step()
        assert engine.get_stats().num_waiting_prefill_tokens == 0
