"""Random-weight PEFT LoRA adapters for a model directory: what tests and the LoRA benchmark serve."""

from __future__ import annotations

import json
from pathlib import Path

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


def make_lora_adapter(path, model_dir, rank: int = 8, alpha: float = 16, targets=ATTN + MLP, seed: int = 0,
                      use_rslora: bool = False, std: float = 0.05, layers: list[int] | None = None) -> Path:
    """Write adapter_config.json + adapter_model.safetensors (PEFT's names and layouts) adapting `targets` of
    every layer (or `layers`) of the model in model_dir, with random A and B (std `std`)."""
    import torch
    from safetensors.torch import save_file

    from shoal.engine.execution.lora import _base_shapes

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    hf = type("Cfg", (), cfg)
    shapes = _base_shapes(hf)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in (range(cfg["num_hidden_layers"]) if layers is None else layers):
        for name in targets:
            out, inp = shapes[name]
            mod = f"base_model.model.model.layers.{layer}.{'mlp' if name in MLP else 'self_attn'}.{name}"
            tensors[f"{mod}.lora_A.weight"] = torch.randn(rank, inp, generator=gen) * std
            tensors[f"{mod}.lora_B.weight"] = torch.randn(out, rank, generator=gen) * std
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": alpha, "use_rslora": use_rslora, "bias": "none",
        "target_modules": sorted(set(targets)), "base_model_name_or_path": str(model_dir), "lora_dropout": 0.0,
        "task_type": "CAUSAL_LM"}, indent=1))
    return path
