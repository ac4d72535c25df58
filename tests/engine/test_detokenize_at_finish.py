"""Final-only requests (the offline LLM) without stop strings are detokenized once, when they finish, instead of
once per step: the text must be exactly what per-step (streamed) detokenization gives, for every way a sequence
ends."""

from __future__ import annotations

import pytest

from shoal.engine import LLM, SamplingParams
from shoal.engine.core import tokenizer as tokenizer_module
from shoal.engine.contracts import RequestOutputKind

PROMPTS = ["Hello world! The quick brown", "東京は日本の首都です 🐟", "def add(a, b):", "numbers 0 1 2 3"]


def _run(llm, params: SamplingParams) -> dict[str, list[str]]:
    """request id -> each completion's full text, streaming DELTA outputs joined or the final-only output."""
    engine = llm.llm_engine
    texts: dict[str, list[str]] = {}
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, params)
        texts[str(i)] = [""] * params.n
    while engine.has_unfinished_requests():
        for out in engine.step():
            for c in out.outputs:
                if params.output_kind is RequestOutputKind.DELTA:
                    texts[out.request_id][c.index] += c.text
                else:
                    texts[out.request_id][c.index] = c.text
    return texts


CASES = {
    "length": dict(temperature=0, max_tokens=12, ignore_eos=True),
    "sampled-n2": dict(temperature=1.0, seed=3, max_tokens=30, n=2),
    "stop-token-shown": dict(temperature=0, max_tokens=30, include_stop_str_in_output=True),
    "stop-token": dict(temperature=0, max_tokens=30),
    "scoring-only": dict(temperature=0, max_tokens=0),
}


@pytest.mark.parametrize("name", list(CASES))
def test_text_at_finish_equals_streamed_text(llama_model, name, monkeypatch):
    case = dict(CASES[name])
    calls = []
    real = tokenizer_module.IncrementalDetokenizer.append

    def counting(self, token_ids):
        calls.append(1)
        return real(self, token_ids)

    with LLM(model=llama_model, dtype="float32", max_model_len=128, block_size=4) as llm:
        if name.startswith("stop-token"):  # end every sequence on a token it really generates (its 4th)
            greedy = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
            case["stop_token_ids"] = sorted({o.outputs[0].token_ids[3] for o in greedy})
            reasons = {c.finish_reason for o in llm.generate(PROMPTS, SamplingParams(**case), use_tqdm=False)
                       for c in o.outputs}
            assert reasons == {"stop"}
        streamed = _run(llm, SamplingParams(**case, output_kind=RequestOutputKind.DELTA))
        monkeypatch.setattr(tokenizer_module.IncrementalDetokenizer, "append", counting)
        final = _run(llm, SamplingParams(**case, output_kind=RequestOutputKind.FINAL_ONLY))
    assert final == streamed
    if case["max_tokens"]:
        assert len(calls) == len(PROMPTS) * case.get("n", 1)  # once per sequence, not once per token


def test_stop_strings_still_detokenize_every_step(llama_model):
    """A stop string can end a sequence mid-step, so such requests keep the per-step path (and its result)."""
    with LLM(model=llama_model, dtype="float32", max_model_len=128, block_size=4) as llm:
        ref = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
        text = ref[0].outputs[0].text
        stop = text[len(text) // 2:len(text) // 2 + 2]
        if not stop.strip():
            pytest.skip("the tiny model's text has no usable stop string here")
        got = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[stop]))
    out = got[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop and out.text == text[:text.index(stop)]
