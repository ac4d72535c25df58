"""int4 weight-only: group-wise asymmetric round-to-nearest, packed two per byte for torch's int4 matmul."""

from __future__ import annotations

import torch

from shoal.engine.execution.quantization.base import QuantizedWeight

GROUP_SIZES = (128, 64, 32)  # the largest that divides the input width wins (finer groups: more scales)


def group_size_for(in_features: int) -> int:
    for g in GROUP_SIZES:
        if in_features % g == 0:
            return g
    raise ValueError(f"int4 needs an input width divisible by 32; this layer has {in_features}")


def quantize_groups_int4(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(uint values 0..15 [out, in] int32, scale [out, in/group], minimum [out, in/group]) with
    w ≈ q * scale + minimum."""
    out, inp = weight.shape
    w = weight.float().reshape(out, inp // group, group)
    lo, hi = w.amin(-1), w.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=1e-8)
    q = torch.round((w - lo[..., None]) / scale[..., None]).clamp_(0, 15).to(torch.int32)
    return q.reshape(out, inp), scale, lo


class Int4Weight(QuantizedWeight):
    def __init__(self, packed, scales_zeros, group: int, out: int, device_kind: str):
        self.packed, self.scales_zeros, self.group, self.out = packed, scales_zeros, group, out
        self.kernel = f"int4 weight-only, groups of {group} (torch._weight_int4pack_mm{'_for_cpu' if device_kind == 'cpu' else ''})"
        self._cpu = device_kind == "cpu"

    @classmethod
    def unsupported_reason(cls, device: torch.device) -> str | None:
        if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 0):
            return "the int4 CUDA kernel needs compute capability 8.0 or newer"
        return None

    @classmethod
    def from_dense(cls, weight: torch.Tensor) -> "Int4Weight":
        out, inp = weight.shape
        group = group_size_for(inp)
        q, scale, lo = quantize_groups_int4(weight, group)
        # torch's layout stores zero = minimum + 8 * scale, for w = (q - 8) * scale + zero.
        sz = torch.stack([scale.t(), (lo + 8 * scale).t()], dim=-1).contiguous()
        if weight.device.type == "cpu":
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
            return cls(packed, sz.to(weight.dtype), group, out, "cpu")
        # CUDA: the uint8 input layout (two nibbles per byte, high nibble first) with 8 inner k tiles.
        q8 = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8)
        packed = torch.ops.aten._convert_weight_to_int4pack(q8, 8)
        return cls(packed, sz.to(torch.bfloat16), group, out, "cuda")

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).contiguous()
        if self._cpu:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.packed, self.group, self.scales_zeros)
        else:  # the CUDA kernel runs in bf16
            y = torch.ops.aten._weight_int4pack_mm(x2.to(torch.bfloat16), self.packed, self.group,
                                                   self.scales_zeros).to(x.dtype)
        if bias is not None:
            y = y + bias
        return y.reshape(*shape[:-1], self.out)

    def dequantize(self) -> torch.Tensor:
        eye = torch.eye(self.packed_in_features(), dtype=self.scales_zeros.dtype, device=self.packed.device)
        return self.matmul(eye).t().float()

    def packed_in_features(self) -> int:
        return self.scales_zeros.shape[0] * self.group

    def tensors(self) -> list[torch.Tensor]:
        return [self.packed, self.scales_zeros]
