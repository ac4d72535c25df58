"""Checkpoints and proposers for speculative decoding on hybrid models (tests/engine/test_hybrid_speculative.py)."""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path

import torch

MTP_FIELD = {"qwen3_next": "num_nextn_predict_layers", "qwen3_5": "mtp_num_hidden_layers",
             "qwen3_5_moe": "mtp_num_hidden_layers"}
NUM_LAYERS = 4  # the target's decoder layers; the MTP layer is made as a fifth (full-attention) one


def full_model(model_factory, family: str):
    """The family's tiny model with a fifth, full-attention layer: the one qwen_mtp_checkpoint turns into the MTP
    layer (the reference forward reads it from here)."""
    types = ["linear_attention"] * 3 + ["full_attention"] * 2
    return model_factory(family, num_hidden_layers=NUM_LAYERS + 1, layer_types=types)


def qwen_mtp_checkpoint(model_factory, path: Path, family: str = "qwen3_next", seed: int = 3) -> Path:
    """A tiny Qwen3-Next / Qwen3.5 checkpoint with an MTP layer, as Qwen ships them: the fifth layer of full_model's
    checkpoint moves to `mtp.layers.0.*` (config.json then describes 4 layers and one MTP layer), next to random
    mtp.fc, mtp.pre_fc_norm_embedding, mtp.pre_fc_norm_hidden and mtp.norm (zero-centred, as every norm there)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(full_model(model_factory, family), path, dirs_exist_ok=True)
    config = json.loads((path / "config.json").read_text())
    text = config.get("text_config", config)
    text.update(num_hidden_layers=NUM_LAYERS, layer_types=list(text["layer_types"][:NUM_LAYERS]))
    text[MTP_FIELD[family]] = 1
    (path / "config.json").write_text(json.dumps(config, indent=2))
    tensors = load_file(path / "model.safetensors")
    for name in list(tensors):
        for prefix in ("model.layers.", "model.language_model.layers."):
            if name.startswith(f"{prefix}{NUM_LAYERS}."):
                tensors["mtp.layers.0." + name[len(f"{prefix}{NUM_LAYERS}."):]] = tensors.pop(name)
    g = torch.Generator().manual_seed(seed)
    h = text["hidden_size"]
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        tensors[f"mtp.{name}.weight"] = 0.1 * torch.randn(h, generator=g)
    tensors["mtp.fc.weight"] = 0.15 * torch.randn(h, 2 * h, generator=g)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


class OracleProposer:
    """Proposals that know the answer: the reference greedy continuation of whichever prompt the sequence
    continues, right for its first j tokens and wrong after (j cycling through 0..k), so that every step mixes
    fully accepted, partly accepted and wholly rejected proposals. Stands in for the engine's n-gram proposer
    (the same interface), whose proposals a random-weight model never accepts."""

    fills_after_schedule = False

    def __init__(self, k: int, continuations: list[list[int]], vocab_size: int):
        self.k, self.continuations, self.vocab_size = k, continuations, vocab_size
        self._right = itertools.cycle(range(k + 1))

    def propose(self, token_ids: list[int], limit: int) -> list[int]:
        for full in self.continuations:
            if full[:len(token_ids)] == token_ids:
                want = full[len(token_ids):len(token_ids) + min(self.k, limit)]
                right = next(self._right)
                return want[:right] + [(t + 1) % self.vocab_size for t in want[right:]]
        raise AssertionError(f"a sequence left every reference continuation: {token_ids}")
