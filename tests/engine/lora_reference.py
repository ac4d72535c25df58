"""The LoRA oracle without peft: merge W + scale * B @ A into a copy of the checkpoint and run transformers on it
(what PEFT's merge_and_unload computes), with the scale computed here from adapter_config.json."""

from __future__ import annotations

import json
import math
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

_merged: dict = {}


def merged_model(model_dir, adapter_dir, out_root) -> Path:
    key = (str(model_dir), str(adapter_dir))
    if key in _merged:
        return _merged[key]
    out = Path(tempfile.mkdtemp(prefix=f"merged-{Path(adapter_dir).name}-", dir=out_root)) / "model"
    shutil.copytree(model_dir, out)
    cfg = json.loads((Path(adapter_dir) / "adapter_config.json").read_text())
    lora = load_file(str(Path(adapter_dir) / "adapter_model.safetensors"))
    weights = load_file(str(out / "model.safetensors"))
    for key_a, a in lora.items():
        if not key_a.endswith(".lora_A.weight"):
            continue
        b = lora[key_a.replace("lora_A", "lora_B")]
        r = a.shape[0]
        scale = cfg["lora_alpha"] / (math.sqrt(r) if cfg.get("use_rslora") else r)
        target = key_a.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
        weights[target] = (weights[target].double() + scale * (b.double() @ a.double())).to(weights[target].dtype)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    _merged[key] = out
    return out
