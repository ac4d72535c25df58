"""int8 W8A8: per-output-channel int8 weights, per-token int8 activations, int32 accumulation."""

from __future__ import annotations

import torch

from shoal.engine.execution.quantization.base import QuantizedWeight


def quantize_rows_int8(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric round-to-nearest per row: (int8 values, float32 scale per row)."""
    t = t.float()
    scale = t.abs().amax(dim=-1, keepdim=True).clamp(min=1e-8) / 127.0
    return torch.round(t / scale).clamp_(-127, 127).to(torch.int8), scale


class Int8Weight(QuantizedWeight):
    kernel = "dynamic W8A8 int8 (torch._int_mm)"

    def __init__(self, weight_t: torch.Tensor, scale: torch.Tensor):
        self.weight_t = weight_t  # int8 [in, out]: the right-hand operand _int_mm wants
        self.scale = scale  # float32 [out]

    @classmethod
    def from_dense(cls, weight: torch.Tensor) -> "Int8Weight":
        q, scale = quantize_rows_int8(weight)
        return cls(q.t().contiguous(), scale.reshape(-1))

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        shape = x.shape
        xq, xs = quantize_rows_int8(x.reshape(-1, shape[-1]))
        if xq.is_cuda and xq.shape[0] <= 16:  # cuBLASLt's int8 GEMM wants more than 16 rows
            xq = torch.nn.functional.pad(xq, (0, 0, 0, 17 - xq.shape[0]))
        y = torch._int_mm(xq, self.weight_t)[: xs.shape[0]].float().mul_(xs).mul_(self.scale)
        if bias is not None:
            y += bias
        return y.to(x.dtype).reshape(*shape[:-1], -1)

    def dequantize(self) -> torch.Tensor:
        return self.weight_t.t().float() * self.scale[:, None]

    def tensors(self) -> list[torch.Tensor]:
        return [self.weight_t, self.scale]
