"""How one linear layer's weight is stored and multiplied: one object per layer (`PackedMatmul.format`), chosen once
the checkpoint is read (model_loader.choose_formats) and never re-decided on the hot path.

  DenseWeight       the layer's own [out, in] Parameter through F.linear: every device and dtype (the fallback)
  SmallGemmWeight   the same Parameter, multiplied by the small-M C++ kernel for low-batch steps (small_gemm.py)
  AmxBf16Weight     a bf16 copy in AMX's tile pair layout, every batch size on AMX tiles (amx_gemm.py); the
                    Parameter is freed
  OneDNNBf16Weight  a bf16 copy in oneDNN's blocked layout (see can_prepack); the Parameter is freed
  QuantizedWeight   (execution/quantization/) int8, int4 or fp8 built from the dense weight, or a GGUF file's blocks

A LoRA adapter is not a format: its update is added after whichever format ran (PackedMatmul.lora).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shoal.engine.execution.cpu_features import cpu_features
from shoal.engine.execution.layers import amx_gemm, small_gemm


class WeightFormat:
    kernel: str = ""  # what runs the matmul (logged)
    # True when the format multiplies by the layer's own Parameter (which then stays, and memory counts already)
    runs_on_parameter: bool = False

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError

    def matmul_float32(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """matmul's result as float32 (an LM head's logits): the same values, converted."""
        return self.matmul(x, bias).float()

    def dequantize(self) -> torch.Tensor:
        """The float32 [out, in] weight this form stands for (tests and fallbacks)."""
        raise NotImplementedError

    def tensors(self) -> list[torch.Tensor]:
        """What this form holds outside the layer's Parameters."""
        return []

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


class DenseWeight(WeightFormat):
    kernel = "F.linear"
    runs_on_parameter = True

    def __init__(self, weight: torch.nn.Parameter):
        self.weight = weight  # the layer's Parameter itself: loading into it or moving it (sleep) is seen here

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, self.weight, bias)

    def dequantize(self) -> torch.Tensor:
        return self.weight.detach().float()


class SmallGemmWeight(DenseWeight):
    """Steps of up to small_gemm.MAX_ROWS rows through the small-M kernel (it streams the weight once and beats
    oneDNN there), larger ones through F.linear on the same weight."""

    kernel = "small-M C++ kernel (F.linear above its rows)"

    def __init__(self, weight: torch.nn.Parameter, kernel):
        super().__init__(weight)
        self.small_kernel = kernel

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        w = self.weight
        if small_gemm.serves(x, w):
            return self.small_kernel(x, w, bias)
        return F.linear(x, w, bias)


class AmxBf16Weight(WeightFormat):
    kernel = "AMX bf16 tiles (pair layout)"

    def __init__(self, weight: torch.Tensor, ops):
        self.out_features, self.in_features = weight.shape
        self.packed = amx_gemm.pack(weight)
        self.ops = ops

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        if x2.stride(1) != 1:
            x2 = x2.contiguous()
        y = self.ops.linear(x2, self.packed, bias)
        return y.view(*x.shape[:-1], self.out_features)

    def matmul_float32(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        # Written as float32 by the kernel (the bfloat16 values widened): no bfloat16 copy, no conversion pass.
        x2 = x.reshape(-1, self.in_features)
        if x2.stride(1) != 1:
            x2 = x2.contiguous()
        return self.ops.linear(x2, self.packed, bias, True).view(*x.shape[:-1], self.out_features)

    def dequantize(self) -> torch.Tensor:
        return amx_gemm.unpack(self.packed).float()

    def tensors(self) -> list[torch.Tensor]:
        return [self.packed]


class OneDNNBf16Weight(WeightFormat):
    kernel = "oneDNN prepacked bf16 GEMM"

    def __init__(self, weight: torch.Tensor):
        self.in_features = weight.shape[1]
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, 32)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")

    def dequantize(self) -> torch.Tensor:
        eye = torch.eye(self.in_features, dtype=torch.bfloat16)
        return self.matmul(eye).t().float()  # exact: each output is one weight times 1

    def tensors(self) -> list[torch.Tensor]:
        return [self.packed]


def can_prepack(weight: torch.Tensor) -> bool:
    """oneDNN can keep a bf16 CPU weight in its own blocked layout: ~1.7x faster than a plain bf16 F.linear for
    decode-sized batches, bit-identical results (fp32 gains nothing and changes rounding). Only where the CPU tier
    has native bf16 (cpu_features): elsewhere oneDNN refuses the bf16 prepack. Not where the small-M kernel serves
    the weight (layers/small_gemm.py): it needs the plain layout, and beats the prepacked GEMM up to batch 16 and
    matches it to 64 (one copy of the weight, not two)."""
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16 or small_gemm.kernel_for(weight) is not None:
        return False
    return (cpu_features().bf16_native and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def plain_format(weight: torch.nn.Parameter, prepack: bool = True) -> WeightFormat:
    """The fastest unquantized form of a loaded dense weight; prepack=False keeps to the forms that run on the
    Parameter itself (a layer used before or without loading: a copy would not see what is loaded later)."""
    amx = amx_gemm.kernel_for(weight) if prepack else None
    if amx is not None:
        return AmxBf16Weight(weight.data, amx)
    small = small_gemm.kernel_for(weight)
    if small is not None:
        return SmallGemmWeight(weight, small)
    if prepack and weight.numel() and can_prepack(weight):
        return OneDNNBf16Weight(weight.data)
    return DenseWeight(weight)
