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
