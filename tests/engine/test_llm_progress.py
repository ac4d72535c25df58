"""LLM.generate(use_tqdm=True) shows a progress bar like vLLM's: requests done and token throughput."""

from __future__ import annotations

from shoal.engine import LLM, SamplingParams


def test_generate_shows_a_progress_bar_unless_told_not_to(llama_model, capsys):
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with LLM(model=llama_model, num_kv_blocks=64) as llm:
        capsys.readouterr()
        outputs = llm.generate(["one", "two", "three"], params)
        bar = capsys.readouterr().err
        assert len(outputs) == 3
        assert "Processed prompts" in bar and "3/3" in bar and "100%" in bar
        assert "output " in bar and "tok/s" in bar

        quiet = llm.generate(["one", "two", "three"], params, use_tqdm=False)
        assert capsys.readouterr().err == ""
        assert [o.outputs[0].token_ids for o in quiet] == [o.outputs[0].token_ids for o in outputs]
