"""The interface of a quantized weight: a layer's weight format (layers/weight_format.py) built from a dense [out, in]
weight, or read packed from a file, that multiplies like F.linear."""

from __future__ import annotations

import torch

from shoal.engine.execution.layers.weight_format import WeightFormat


class QuantizedWeight(WeightFormat):
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

    def tensors(self) -> list[torch.Tensor]:
        raise NotImplementedError
