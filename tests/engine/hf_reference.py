"""transformers as the oracle: greedy generate() tokens and the raw logits of every step.

On the CPU in float32 by default; the GPU run (e2e/gpu/checks.py) asks for CUDA and half precision too."""

from __future__ import annotations

import functools

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
