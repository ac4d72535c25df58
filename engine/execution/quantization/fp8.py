"""fp8 (e4m3) W8A8 on CUDA: per-output-channel weight scales, per-token activation scales, torch._scaled_mm."""

from __future__ import annotations

import torch

from shoal.engine.execution.quantization.base import QuantizedWeight

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max


def quantize_rows_fp8(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    t = t.float()
    scale = t.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / FP8_MAX
    return (t / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8), scale


class Fp8Weight(QuantizedWeight):
    kernel = "fp8 e4m3 W8A8 (torch._scaled_mm, row-wise scales)"

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor):
        self.weight, self.scale = weight, scale  # fp8 [out, in], float32 [1, out]

    @classmethod
    def unsupported_reason(cls, device: torch.device) -> str | None:
        if device.type != "cuda":
            return "fp8 weights need a CUDA GPU (compute capability 8.9 or newer); on CPU use int8 or int4"
        if torch.cuda.get_device_capability(device) < (8, 9):
            return "fp8 needs compute capability 8.9 or newer (Ada, Hopper)"
        return None

    @classmethod
    def from_dense(cls, weight: torch.Tensor) -> "Fp8Weight":
        q, scale = quantize_rows_fp8(weight)
        return cls(q, scale.reshape(1, -1))

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        shape = x.shape
        xq, xs = quantize_rows_fp8(x.reshape(-1, shape[-1]))
        y = torch._scaled_mm(xq, self.weight.t(), scale_a=xs, scale_b=self.scale, out_dtype=torch.bfloat16)
        if bias is not None:
            y = y + bias
        return y.to(x.dtype).reshape(*shape[:-1], -1)

    def dequantize(self) -> torch.Tensor:
        return self.weight.float() * self.scale.reshape(-1, 1)

    def tensors(self) -> list[torch.Tensor]:
        return [self.weight, self.scale]
