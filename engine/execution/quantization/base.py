"""The interface of a quantized weight: built from a dense [out, in] weight, multiplies like F.linear."""

from __future__ import annotations

import torch


class QuantizedWeight:
    kernel: str = ""  # which kernel runs the matmul (logged)
    # Whether --quantization also stores the token embedding's rows in this form (a lookup: the weight's error
    # only). The LM head is never quantized here: see quantize_model.
    quantizes_embedding: bool = False

    @classmethod
    def unsupported_reason(cls, device: torch.device) -> str | None:
        """None when the method runs on `device`, otherwise why not."""
        return None

    @classmethod
    def from_dense(cls, weight: torch.Tensor) -> "QuantizedWeight":
        raise NotImplementedError

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError

    def dequantize(self) -> torch.Tensor:
        """The float32 [out, in] weight this quantized form stands for (tests and fallbacks)."""
        raise NotImplementedError

    def tensors(self) -> list[torch.Tensor]:
        raise NotImplementedError

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())
