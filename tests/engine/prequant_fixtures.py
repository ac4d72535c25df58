"""Tiny GPTQ and AWQ checkpoints: a random HF model's linear weights quantized round-to-nearest per group and
packed into the published layouts (AutoGPTQ's and AutoAWQ's GEMM), plus the oracle: the same model with the
dequantized weights written densely, for transformers to run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _rtn(w: torch.Tensor, bits: int, group: int, g_idx: torch.Tensor):
    """w [out, in] -> q [in, out], zeros [groups, out], scales fp16 [groups, out], asymmetric per group."""
    wt = w.t().float()
    groups = int(g_idx.max()) + 1
    maxq = (1 << bits) - 1
    q = torch.empty_like(wt, dtype=torch.int64)
    zeros = torch.empty(groups, wt.shape[1], dtype=torch.int64)
    scales = torch.empty(groups, wt.shape[1], dtype=torch.float16)
    for g in range(groups):
        rows = (g_idx == g).nonzero().flatten()
        lo, hi = wt[rows].amin(0).clamp(max=0), wt[rows].amax(0).clamp(min=0)
        s = ((hi - lo) / maxq).clamp(min=1e-5).half()
        z = torch.round(-lo / s.float()).clamp(0, maxq).long()
        q[rows] = torch.round(wt[rows] / s.float() + z).clamp(0, maxq).long()
        zeros[g], scales[g] = z, s
    return q, zeros, scales


def _pack(vals: torch.Tensor, bits: int, along_rows: bool, order=None) -> torch.Tensor:
    v = vals.numpy().astype(np.uint64)
    per = 32 // bits
    if along_rows:
        v = v.reshape(v.shape[0] // per, per, v.shape[1])
        word = sum(v[:, j, :] << np.uint64(bits * j) for j in range(per))
    else:
        v = v.reshape(v.shape[0], v.shape[1] // per, per)
        order = order or tuple(range(per))
        word = sum(v[:, :, order[j]] << np.uint64(bits * j) for j in range(per))
    return torch.from_numpy(word.astype(np.uint32).view(np.int32))


def write_prequantized(model_dir: Path, out: Path, oracle: Path, method: str, bits: int = 4, group: int = 32,
                       act_order: bool = False, seed: int = 0) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(model_dir / "model.safetensors"))
    packed, dense = {}, {}
    rng = torch.Generator().manual_seed(seed)
    for name, t in tensors.items():
        layer = name[: -len(".weight")]
        if not (name.endswith(".weight") and layer.rsplit(".", 1)[-1] in LINEARS):
            packed[name] = dense[name] = t
            continue
        in_features = t.shape[1]
        g_idx = torch.arange(in_features) // group
        if act_order:  # groups follow a permutation of the input channels (GPTQ's desc_act)
            g_idx = g_idx[torch.argsort(torch.randperm(in_features, generator=rng))]
        q, z, s = _rtn(t, bits, group, g_idx)
        dense[name] = ((q - z[g_idx]).float() * s.float()[g_idx]).t().contiguous()
        if method == "gptq":
            packed[layer + ".qweight"] = _pack(q, bits, along_rows=True)
            packed[layer + ".qzeros"] = _pack(z - 1, bits, along_rows=False)  # AutoGPTQ stores zero - 1
            packed[layer + ".scales"] = s
            packed[layer + ".g_idx"] = g_idx.to(torch.int32)
        else:
            packed[layer + ".qweight"] = _pack(q, 4, along_rows=False, order=AWQ_ORDER)
            packed[layer + ".qzeros"] = _pack(z, 4, along_rows=False, order=AWQ_ORDER)
            packed[layer + ".scales"] = s
    for d, ts in ((out, packed), (oracle, dense)):
        shutil.copytree(model_dir, d, dirs_exist_ok=True)
        save_file({k: v.contiguous() for k, v in ts.items()}, str(d / "model.safetensors"))
    cfg = json.loads((out / "config.json").read_text())
    if method == "gptq":
        cfg["quantization_config"] = {"quant_method": "gptq", "bits": bits, "group_size": group,
                                      "desc_act": act_order, "sym": False, "checkpoint_format": "gptq"}
    else:
        cfg["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": group, "version": "gemm",
                                      "zero_point": True}
    (out / "config.json").write_text(json.dumps(cfg, indent=2))


def write_compressed_tensors_int8(model_dir: Path, out: Path, oracle: Path, strategy: str = "channel") -> None:
    """An llm-compressor-style W8A8 checkpoint: int8 `weight` with float32 `weight_scale` [out, 1] (or [1] per
    tensor) from symmetric round-to-nearest; the oracle holds q * scale densely."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(model_dir / "model.safetensors"))
    packed, dense = {}, {}
    for name, t in tensors.items():
        layer = name[: -len(".weight")]
        if not (name.endswith(".weight") and layer.rsplit(".", 1)[-1] in LINEARS):
            packed[name] = dense[name] = t
            continue
        w = t.float()
        amax = w.abs().amax(dim=1, keepdim=True) if strategy == "channel" else w.abs().amax().view(1, 1)
        scale = amax.clamp(min=1e-8) / 127.0
        q = torch.round(w / scale).clamp(-127, 127).to(torch.int8)
        packed[name] = q
        packed[layer + ".weight_scale"] = scale if strategy == "channel" else scale.view(1)
        dense[name] = q.float() * scale
    for d, ts in ((out, packed), (oracle, dense)):
        shutil.copytree(model_dir, d, dirs_exist_ok=True)
        save_file({k: v.contiguous() for k, v in ts.items()}, str(d / "model.safetensors"))
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "int-quantized", "quantization_status": "compressed",
        "ignore": ["lm_head"],
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": strategy, "dynamic": False},
            "input_activations": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token",
                                  "dynamic": True}}}}
    (out / "config.json").write_text(json.dumps(cfg, indent=2))


def write_mxfp4(model_dir: Path, out: Path) -> None:
    """gpt-oss's published layout: every expert projection as MXFP4 `<name>_blocks`/`<name>_scales` in [experts, out,
    in] orientation (transformers' dense tensors are [experts, in, out]), biases and everything else as they were,
    and quantization_config {"quant_method": "mxfp4", "dequantize": true}. transformers reads it back dequantized
    (the oracle)."""
    from safetensors.torch import load_file, save_file

    from shoal.engine.execution.quantization.mxfp4 import quantize_mxfp4

    shutil.copytree(model_dir, out)
    tensors = load_file(str(model_dir / "model.safetensors"))
    packed = {}
    for name, t in tensors.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            packed[name + "_blocks"], packed[name + "_scales"] = quantize_mxfp4(t.transpose(1, 2).contiguous())
        else:
            packed[name] = t
    (out / "model.safetensors").unlink()
    save_file(packed, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    # dequantize: transformers' own flag for reading the blocks as dense weights. Without it, a transformers that
    # finds the `kernels` package tries to fetch gpt-oss's Triton kernels from the Hub (5.25 does; offline: an error).
    config["quantization_config"] = {"quant_method": "mxfp4", "dequantize": True, "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (out / "config.json").write_text(json.dumps(config, indent=2))
