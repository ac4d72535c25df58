"""Shared by the draft-model speculative decoding tests (tests/engine/test_speculative_draft.py,
tests/parallel/test_speculative_parallel.py): a draft made from the target itself."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch


def noisy_copy(model_dir: Path, path: Path, scale: float) -> Path:
    """The model at model_dir copied to path with Gaussian noise of `scale` added to its matrices: a draft that
    agrees with the target often but not always, so both acceptance and rejection happen (two unrelated random
    models never agree)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(model_dir, path, dirs_exist_ok=True)
    g = torch.Generator().manual_seed(1)
    for f in path.glob("*.safetensors"):
        tensors = load_file(f)
        save_file({k: v + scale * torch.randn(v.shape, generator=g) if v.dim() == 2 else v
                   for k, v in tensors.items()}, f, metadata={"format": "pt"})
    return path


def assert_same_greedy_output(want, got) -> None:
    """got (RequestOutputs of a speculative run) has want's tokens and logprobs, prompt by prompt."""
    import pytest

    for a, b in zip(want, got):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids, a.prompt
        for ea, eb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert list(eb) == list(ea)
            assert all(eb[t].logprob == pytest.approx(ea[t].logprob, abs=1e-4) for t in ea)


def assert_some_accepted_some_rejected(stats) -> None:
    drafted, accepted = stats.spec_decode_num_draft_tokens_total, stats.spec_decode_num_accepted_tokens_total
    assert 0 < accepted < drafted  # a different model: some proposals kept, some rejected


def mtp_checkpoint(model_factory, path: Path, seed: int = 3) -> Path:
    """A tiny DeepSeek V3 checkpoint with a multi-token-prediction layer, as DeepSeek ships them: transformers makes a
    4-layer model, whose last layer becomes the MTP layer's decoder layer (`model.layers.3.*`, unread by the 3-layer
    target config.json now describes, with `num_nextn_predict_layers: 1`), plus random enorm, hnorm, eh_proj,
    shared_head.norm, shared_head.head and embed_tokens (its own, unlike the target's). model_factory("deepseek_v3", num_hidden_layers=4) is the same model
    with that layer as a fourth decoder layer (the tests' reference reads it from there)."""
    import json

    from safetensors.torch import load_file, save_file

    full = model_factory("deepseek_v3", num_hidden_layers=4)
    shutil.copytree(full, path, dirs_exist_ok=True)
    config = json.loads((path / "config.json").read_text())
    layer = config["num_hidden_layers"] - 1
    config.update(num_hidden_layers=layer, num_nextn_predict_layers=1)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    tensors = load_file(path / "model.safetensors")
    g = torch.Generator().manual_seed(seed)
    h, v, p = config["hidden_size"], config["vocab_size"], f"model.layers.{layer}."
    for name in ("enorm", "hnorm", "shared_head.norm"):
        tensors[f"{p}{name}.weight"] = 1 + 0.1 * torch.randn(h, generator=g)
    tensors[p + "eh_proj.weight"] = 0.15 * torch.randn(h, 2 * h, generator=g)
    tensors[p + "shared_head.head.weight"] = 0.15 * torch.randn(v, h, generator=g)
    # DeepSeek ships the MTP layer its own copy of the embedding; a different one here, so that using it shows
    tensors[p + "embed_tokens.weight"] = 0.15 * torch.randn(v, h, generator=g)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path
