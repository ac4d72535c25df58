"""transformers as the oracle: greedy generate() tokens and the raw logits of every step."""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=8)
def hf_model(model_dir: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # the engine runs with ignore_eos; so does the oracle
    model.generation_config.pad_token_id = 0
    return model


def hf_greedy(model_dir, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """(generated ids, log_softmax of the raw logits at each step [max_new_tokens, vocab])."""
    model = hf_model(str(model_dir))
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
            output_logits=True, return_dict_in_generate=True,
        )
    ids = out.sequences[0, len(prompt_ids):].tolist()
    logprobs = torch.log_softmax(torch.stack([l[0] for l in out.logits]).float(), dim=-1)
    return ids, logprobs
