"""GGUF weights run packed: Q8_0, Q4_0, Q4_1, Q4_K and Q6_K rows kept in llama.cpp's block format.

A `GGUFWeight` is a layer's [out, in] weight as one or more row segments (a fused QKV or gate/up projection is
several GGUF tensors, possibly of different types), each a uint8 tensor [rows, row_bytes] straight from the file,
on the layer's device. `matmul` unpacks blocks in registers as it multiplies: on CPU the C++ kernel
(csrc/cpu_gguf.cpp, built for this process's CPU tier), on CUDA the Triton kernel (gguf_triton.py); the
embedding table dequantizes only the rows a lookup reads.

Tensor parallelism slices these rows before they get here (gguf_model.GGUFWeightSource.load_packed): a row range
is a byte range, and a column range must fall on block boundaries (32 or 256 weights) or the load is refused.
"""

from __future__ import annotations

import functools
import logging
import time

import torch
import torch.nn.functional as F

from shoal.engine.execution.layers.activation import SILU
from shoal.engine.execution.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from shoal.engine.execution.layers.linear import PackedMatmul
from shoal.engine.execution.layers.moe import ExpertsFormat, FusedMoE, load_cpu_kernel
from shoal.engine.execution.quantization.base import QuantizedWeight

logger = logging.getLogger(__name__)

# GGML type name -> (type id, weights per block, bytes per block)
PACKED_TYPES = {"Q4_0": (2, 32, 18), "Q4_1": (3, 32, 20), "Q8_0": (8, 32, 34), "Q4_K": (12, 256, 144),
                "Q6_K": (14, 256, 210)}


@functools.cache
def load_kernels():
    """(torch.ops.shoal_cpu_gguf, its ISA description). Raises NativeBuildError when it cannot be built."""
    from shoal.engine.execution.native_build import kernel_ops

    start = time.perf_counter()
    ops = kernel_ops("gguf")
    isa = ops.kernel_isa()
    logger.info("cpu GGUF kernels ready in %.1fs: %s", time.perf_counter() - start, isa)
    return ops, isa


def packed_unsupported_reason(device: torch.device) -> str | None:
    """None when packed GGUF weights can run on `device`, otherwise why not (the loader then dequantizes)."""
    from shoal.engine.execution.native_build import NativeBuildError

    if device.type == "cuda":
        from shoal.engine.execution.quantization import gguf_triton

        return gguf_triton.available()
    if device.type != "cpu":
        return f"no packed GGUF kernel for {device.type} devices"
    try:
        load_kernels()
    except NativeBuildError as e:
        return str(e)
    return None


class GGUFPacked:
    """Rows of one GGUF tensor as stored: `data` uint8 [rows, row_bytes] of type `qtype` (a PACKED_TYPES name),
    standing for a float [rows, cols] weight. What GGUFWeightSource.load_packed returns to a layer."""

    def __init__(self, data: torch.Tensor, qtype: str, cols: int):
        type_id, block, size = PACKED_TYPES[qtype]
        if data.dtype != torch.uint8 or data.dim() != 2 or cols % block or data.shape[1] != cols // block * size:
            raise ValueError(f"{qtype} rows must be uint8 [rows, {cols // block * size}] for {cols} columns; "
                             f"got {data.dtype} {list(data.shape)}")
        self.data, self.qtype, self.type_id, self.cols = data.contiguous(), qtype, type_id, cols

    @property
    def shape(self) -> tuple[int, int]:
        return self.data.shape[0], self.cols

    def to(self, device: torch.device) -> "GGUFPacked":
        return self if self.data.device == device else GGUFPacked(self.data.to(device), self.qtype, self.cols)

    def dequantize(self) -> torch.Tensor:
        """float32 [rows, cols] on the data's device."""
        if self.data.device.type == "cpu":
            return load_kernels()[0].dequantize(self.data, self.type_id, self.cols)
        from shoal.engine.execution.quantization import gguf_triton

        return gguf_triton.dequantize_rows(self.data, self.type_id, self.cols)

    def dequantize_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """float32 [*ids.shape, cols]: the rows `ids` picks, dequantized (an embedding lookup)."""
        if self.data.device.type == "cpu":
            rows = load_kernels()[0].dequantize_rows(self.data, ids.reshape(-1), self.type_id, self.cols)
        else:
            from shoal.engine.execution.quantization import gguf_triton

            rows = gguf_triton.dequantize_rows(self.data, self.type_id, self.cols, ids)
        return rows.reshape(*ids.shape, self.cols)


class GGUFWeight(QuantizedWeight):
    """A layer's weight as GGUF row segments (concatenated along the output features), padded with zero rows
    to `out` (a vocabulary-parallel LM head whose last rank holds fewer rows)."""

    def __init__(self, segments: list[GGUFPacked], out: int | None = None):
        if not segments or len({s.cols for s in segments}) != 1:
            raise ValueError("a GGUFWeight needs one or more segments of equal width")
        self.segments = segments
        self.in_features = segments[0].cols
        self.rows = sum(s.shape[0] for s in segments)
        self.out = out or self.rows
        self._data = [s.data for s in segments]
        self._types = [s.type_id for s in segments]
        if self._data[0].device.type == "cpu":
            isa = load_kernels()[1].split(" (")[0]
            self._op = load_kernels()[0].matmul.default  # resolved once: a decode step calls it per layer
        else:
            isa, self._op = "triton", self._triton_matmul
        self.kernel = f"gguf packed {'+'.join(sorted({s.qtype for s in segments}))} ({isa})"

    @classmethod
    def unsupported_reason(cls, device: torch.device) -> str | None:
        return packed_unsupported_reason(device)

    @classmethod
    def from_dense(cls, weight: torch.Tensor) -> "GGUFWeight":
        raise NotImplementedError("GGUF weights come packed from a .gguf file; they are not built from dense ones")

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """One kernel call for every segment, the padding rows and the bias; y in x's dtype."""
        if x.dim() == 2:  # the engine's [tokens, features]: no reshapes (a decode step calls this per layer)
            return self._op(x, self._data, self._types, self.in_features, self.out, bias)
        shape = x.shape
        y = self._op(x.reshape(-1, shape[-1]), self._data, self._types, self.in_features, self.out, bias)
        return y.reshape(*shape[:-1], self.out)

    def _triton_matmul(self, x, data, types, K, N, bias):
        from shoal.engine.execution.quantization import gguf_triton

        return gguf_triton.matmul(x, list(zip(data, types)), K, N, bias)

    def dequantize(self) -> torch.Tensor:
        w = torch.cat([s.dequantize() for s in self.segments])
        return F.pad(w, (0, 0, 0, self.out - self.rows)) if self.out > self.rows else w

    def tensors(self) -> list[torch.Tensor]:
        return [s.data for s in self.segments]


class GGUFExperts(ExpertsFormat):
    """A FusedMoE layer's experts as GGUF blocks: one uint8 stack per projection (gate, up, down) across the local
    experts, run by the C++ kernel's packed loop."""

    def __init__(self, stacks: tuple[torch.Tensor, torch.Tensor, torch.Tensor], qtypes: tuple[str, str, str]):
        self.stacks = stacks
        self.type_ids = tuple(PACKED_TYPES[q][0] for q in qtypes)
        self.kernel = f"gguf packed experts {'+'.join(sorted(set(qtypes)))}"

    def run(self, layer, x, topk_weights, topk_ids):
        gate, up, down = self.stacks
        return load_cpu_kernel()[0].fused_experts_gguf(x, gate, up, down, *self.type_ids, topk_weights.float(),
                                                      topk_ids, layer.expert_start)

    def nbytes(self) -> int:
        return sum(t.numel() for t in self.stacks)


def _finish_linear(layer: PackedMatmul) -> None:
    """Run on the packed blocks when they make up the whole weight (the dense weight, never written, is freed); a
    weight only partly packed has its blocks dequantized into place."""
    segments, layer.gguf_segments = sorted(layer.gguf_segments or [], key=lambda s: s[0]), None
    if not segments:
        return
    rows = [0]
    for offset, seg in segments:
        rows.append(offset + seg.shape[0] if offset == rows[-1] else -1)
    if rows[-1] == layer.weight.shape[0]:
        layer.use(GGUFWeight([seg.to(layer.weight.device) for _, seg in segments]))
    else:
        for offset, seg in segments:
            layer.weight.data[offset:offset + seg.shape[0]].copy_(seg.dequantize())


def _finish_head(head: ParallelLMHead) -> None:
    """Packed rows (fewer than vocab_local on a tensor-parallel rank past the vocabulary's end) run padded; a tied
    head runs on the embedding's packed table itself."""
    e = head.embedding
    if head.tied and e.gguf_rows is not None:
        head.use(GGUFWeight([e.gguf_rows], out=e.vocab_local), free_dense=False,  # the table freed it already
                 shape=(e.vocab_local, e.hidden))
    elif head.gguf_segments and sum(s.shape[0] for _, s in head.gguf_segments) < head.weight.shape[0]:
        (_, seg), = head.gguf_segments
        head.gguf_segments = None
        head.use(GGUFWeight([seg.to(head.weight.device)], out=head.weight.shape[0]))
    else:
        _finish_linear(head)


def _finish_table(table: VocabParallelEmbedding) -> None:
    if table.gguf_rows is not None:
        table.gguf_rows = table.gguf_rows.to(table.weight.device)
        table.weight.data = torch.empty(0, dtype=table.weight.dtype, device=table.weight.device)


def _finish_experts(layer: FusedMoE) -> None:
    """Every expert's packed blocks in one stack per projection, when each projection has one type across the
    experts and the packed CPU kernel can run them (the dense stacks, never written, are freed); otherwise (on GPU
    too: no packed Triton expert kernel; biased or non-SiLU experts) the blocks are dequantized into the stacks."""
    parts, layer.gguf_parts = layer.gguf_parts or {}, None
    if not parts:
        return
    n = layer.inter_local
    stackable = (len(parts) == layer.num_local and layer.w13.device.type == "cpu"
                 and layer.b13 is None and layer.activation is SILU
                 and load_cpu_kernel()[0] is not None
                 and all(isinstance(p, GGUFPacked) for trio in parts.values() for p in trio)
                 and all(len({parts[e][k].qtype for e in parts}) == 1 for k in range(3)))
    if not stackable:
        for i, (gate, up, down) in parts.items():
            for dst, src in ((layer.w13.data[i, :n], gate), (layer.w13.data[i, n:], up), (layer.w2.data[i], down)):
                dst.copy_(src.to(dst.device).dequantize() if isinstance(src, GGUFPacked) else src)
        return
    stacks = tuple(torch.stack([parts[e][k].data for e in range(layer.num_local)]) for k in range(3))
    layer.use(GGUFExperts(stacks, tuple(parts[0][k].qtype for k in range(3))))


def finish_gguf_model(model: torch.nn.Module) -> None:
    """After a packed GGUF load: every layer runs on its packed blocks (dense weights freed); logs the kernel and
    the weight memory."""
    modules = list(model.modules())
    for m in modules:  # heads last: a tied head takes over the embedding's packed table
        if isinstance(m, VocabParallelEmbedding):
            _finish_table(m)
        elif isinstance(m, FusedMoE):
            _finish_experts(m)
        elif isinstance(m, PackedMatmul) and not isinstance(m, ParallelLMHead):
            _finish_linear(m)
    for m in modules:
        if isinstance(m, ParallelLMHead):
            _finish_head(m)
    weights = [m.format for m in modules if isinstance(m, PackedMatmul) and isinstance(m.format, GGUFWeight)]
    tables = [m.gguf_rows for m in modules if isinstance(m, VocabParallelEmbedding) and m.gguf_rows is not None]
    experts = [m.format for m in modules if isinstance(m, FusedMoE) and isinstance(m.format, GGUFExperts)]
    packed = {t.data_ptr(): t.numel() for w in weights for t in w.tensors()}
    packed.update({t.data.data_ptr(): t.data.numel() for t in tables})
    packed.update({t.data_ptr(): t.numel() for f in experts for t in f.stacks})
    kernels = sorted({w.kernel for w in weights})
    logger.info("GGUF: %d linear layers%s%s run packed (%s): %.1f MiB of packed weights", len(weights),
                f" and {len(tables)} embedding table(s)" if tables else "",
                f" and the experts of {len(experts)} MoE layer(s)" if experts else "", "; ".join(kernels) or "-",
                sum(packed.values()) / 2**20)
