"""transformers as the oracle: greedy generate() tokens and the raw logits of every step.

On the CPU in float32 by default; the GPU run (e2e/gpu/checks.py) asks for CUDA and half precision too."""

from __future__ import annotations

import functools

import pytest
import torch


@functools.lru_cache(maxsize=8)
def hf_model(model_dir: str, dtype: torch.dtype = torch.float32, device: str = "cpu", gguf_file: str | None = None):
    """The model of `model_dir` (or of the GGUF file `gguf_file` in it, read by transformers' own GGUF loader)."""
    from transformers import AutoModelForCausalLM

    extra = {"gguf_file": gguf_file} if gguf_file else {}
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, **extra).to(device).eval()
    model.generation_config.eos_token_id = None  # the engine runs with ignore_eos; so does the oracle
    model.generation_config.pad_token_id = 0
    return model


def hf_greedy(model_dir, prompt_ids: list[int], max_new_tokens: int, dtype: torch.dtype = torch.float32,
              device: str = "cpu", gguf_file: str | None = None) -> tuple[list[int], torch.Tensor]:
    """(generated ids, log_softmax of the raw logits at each step [max_new_tokens, vocab], on the CPU)."""
    model = hf_model(str(model_dir), dtype, device, gguf_file)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids], device=device), max_new_tokens=max_new_tokens, do_sample=False,
            output_logits=True, return_dict_in_generate=True,
        )
    ids = out.sequences[0, len(prompt_ids):].tolist()
    logprobs = torch.log_softmax(torch.stack([l[0] for l in out.logits]).float(), dim=-1).cpu()
    return ids, logprobs


def assert_greedy_matches(model_dir, tokenizer, prompts: list[str], outputs, max_new_tokens: int,
                          context: tuple = (), abs_tol: float = 2e-4) -> None:
    """Each of `outputs` (the engine's, greedy with logprobs, one per prompt) has transformers' greedy tokens for
    its prompt, and each logprob it reports is transformers' own within `abs_tol`; `context` leads the messages."""
    for prompt, out in zip(prompts, outputs):
        ref_ids, ref_lp = hf_greedy(model_dir, tokenizer.encode(prompt), max_new_tokens)
        assert out.outputs[0].token_ids == ref_ids, (*context, prompt)
        for step, entry in enumerate(out.outputs[0].logprobs):
            for tid, lp in entry.items():
                assert lp.logprob == pytest.approx(float(ref_lp[step, tid]), abs=abs_tol), (*context, prompt, step)
