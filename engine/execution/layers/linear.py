"""Linear layers split across tensor-parallel ranks.

Column-parallel layers own a contiguous range of output features; row-parallel layers own a range of input
features and sum their partial products with one all-reduce. Weights are stored [out, in] like nn.Linear.
Loading goes through a `read(dim, start, length)` callable so each rank reads only its own slice, whatever the
checkpoint's layout (GPT-2's Conv1D stores [in, out] and passes a transposing reader).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from shoal.engine.distributed.parallel_state import divide, get_parallel_state
from shoal.engine.execution.layers import small_gemm

# read(dim, start, length) -> tensor in [out, in] layout, sliced along `dim` (0 = out, 1 = in) of that layout
Reader = Callable[[int, int, int], torch.Tensor]


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


def can_prepack(weight: torch.Tensor) -> bool:
    """oneDNN can keep a bf16 CPU weight in its own blocked layout: ~1.7x faster than a plain bf16 F.linear for
    decode-sized batches, bit-identical results (fp32 gains nothing and changes rounding). Only where the CPU tier
    has native bf16 (cpu_features): elsewhere oneDNN refuses the bf16 prepack. Not where the small-M kernel serves
    the weight (layers/small_gemm.py): it needs the plain layout, and beats the prepacked GEMM up to batch 16 and
    matches it to 64 (one copy of the weight, not two)."""
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16 or small_gemm.kernel_for(weight) is not None:
        return False
    from shoal.engine.execution.cpu_features import cpu_features

    return (cpu_features().bf16_native and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and torch.ops.mkldnn._is_mkldnn_bf16_supported())


class PackedMatmul(nn.Module):
    """A weight that may be prepacked for oneDNN once loaded (see can_prepack), or replaced by a quantized form
    (execution.quantization) that then runs the matmul."""

    packed: torch.Tensor | None = None
    packed_shape: tuple[int, int] | None = None  # [out, in] of the weight a packed/quantized copy replaced
    quantized = None  # a quantization.QuantizedWeight once --quantization applied (or GGUF blocks kept packed)
    gguf_segments: list | None = None  # [(first row, GGUFPacked)] read from a GGUF file, until finish_gguf()
    lora = None  # an execution.lora.LoRASlots once --enable-lora wraps this layer: adds the adapters' updates
    _small_gemm = None  # the small-M kernel for this weight (False: none applies), resolved on first use

    @property
    def weight_shape(self) -> tuple[int, int]:
        """[out, in] of this layer's weight, whether it is held as is or only prepacked."""
        return self.packed_shape or tuple(self.weight.shape)

    def _put(self, offset: int, value) -> None:
        """Rows [offset, offset + len(value)) of the weight: dense values are copied in, GGUF blocks (a GGUFPacked
        from a packed GGUF source) are kept as they are until finish_gguf()."""
        from shoal.engine.execution.quantization.gguf import GGUFPacked

        if isinstance(value, GGUFPacked):
            self.gguf_segments = (self.gguf_segments or []) + [(offset, value)]
        else:
            self.weight.data[offset:offset + value.shape[0]].copy_(value)

    def finish_gguf(self) -> None:
        """After loading: run on the packed blocks when they make up the whole weight (then the dense weight,
        never written, is freed); a weight only partly packed has its blocks dequantized into place."""
        from shoal.engine.execution.quantization.gguf import GGUFWeight

        segments, self.gguf_segments = sorted(self.gguf_segments or [], key=lambda s: s[0]), None
        if not segments:
            return
        rows = [0]
        for offset, seg in segments:
            rows.append(offset + seg.shape[0] if offset == rows[-1] else -1)
        if rows[-1] == self.weight.shape[0]:
            self.quantized = GGUFWeight([seg.to(self.weight.device) for _, seg in segments])
            self.packed_shape = tuple(self.weight.shape)
            self.weight.data = torch.empty(0, dtype=self.weight.dtype, device=self.weight.device)
        else:
            for offset, seg in segments:
                self.weight.data[offset:offset + seg.shape[0]].copy_(seg.dequantize())

    def prepack(self, free_original: bool = True) -> None:
        if self.quantized is None and self.packed is None and self.weight.numel() and can_prepack(self.weight):
            self.packed_shape = tuple(self.weight.shape)
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.data, 32)
            if free_original:
                self.weight.data = torch.empty(0, dtype=self.weight.dtype)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.quantized is not None:
            y = self.quantized.matmul(x, bias)
        elif self.packed is not None:
            y = torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")
        else:
            small = self._small_gemm
            if small is None:  # resolved on the first matmul, once the weight is loaded
                small = self._small_gemm = small_gemm.kernel_for(self.weight) or False
            if (small and x.dim() == 2 and x.shape[0] <= small_gemm.MAX_ROWS and x.dtype == self.weight.dtype
                    and x.stride(1) == 1):
                y = small(x, self.weight, bias)
            else:
                y = F.linear(x, self.weight, bias)
        if self.lora is not None:
            self.lora.add_to(x, y)
        return y


class ColumnParallelLinear(PackedMatmul):
    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype):
        super().__init__()
        ps = get_parallel_state()
        self.tp_rank, self.out_full = ps.tp_rank, out_features
        self.out_local = divide(out_features, ps.tp_size, "output features")
        self.weight = _param(self.out_local, in_features, dtype=dtype)
        self.bias = _param(self.out_local, dtype=dtype) if bias else None

    def load(self, read_weight: Reader, read_bias: Reader | None = None) -> None:
        start = self.tp_rank * self.out_local
        self._put(0, read_weight(0, start, self.out_local))
        if self.bias is not None:
            self.bias.data.copy_(read_bias(0, start, self.out_local))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)


class MergedColumnParallelLinear(PackedMatmul):
    """Several column-parallel projections of the same input fused into one matmul (e.g. gate and up)."""

    def __init__(self, in_features: int, out_features: list[int], bias: bool, dtype: torch.dtype):
        super().__init__()
        ps = get_parallel_state()
        self.tp_rank = ps.tp_rank
        self.locals = [divide(n, ps.tp_size, "output features") for n in out_features]
        self.weight = _param(sum(self.locals), in_features, dtype=dtype)
        self.bias = _param(sum(self.locals), dtype=dtype) if bias else None

    def load(self, readers: list[Reader], bias_readers: list[Reader] | None = None) -> None:
        offset = 0
        for i, (n, read) in enumerate(zip(self.locals, readers)):
            self._put(offset, read(0, self.tp_rank * n, n))
            if self.bias is not None:
                self.bias.data[offset:offset + n].copy_(bias_readers[i](0, self.tp_rank * n, n))
            offset += n

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)


class QKVParallelLinear(PackedMatmul):
    """Query, key and value projections split by attention head.

    Query heads are divided evenly among ranks. Key/value heads are divided when there are at least as many as
    ranks; otherwise each KV head is replicated on the tp_size / num_kv_heads ranks whose query heads use it.
    """

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool,
                 dtype: torch.dtype):
        super().__init__()
        ps = get_parallel_state()
        self.head_dim = head_dim
        self.num_heads = divide(num_heads, ps.tp_size, "number of attention heads")
        if num_kv_heads >= ps.tp_size:
            self.num_kv_heads = divide(num_kv_heads, ps.tp_size, "number of key/value heads")
            self.kv_head_start = ps.tp_rank * self.num_kv_heads
        else:
            divide(ps.tp_size, num_kv_heads, "tensor-parallel size vs key/value heads")
            self.num_kv_heads = 1
            self.kv_head_start = ps.tp_rank * num_kv_heads // ps.tp_size
        self.q_start = ps.tp_rank * self.num_heads * head_dim
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        self.weight = _param(self.q_size + 2 * self.kv_size, hidden, dtype=dtype)
        self.bias = _param(self.q_size + 2 * self.kv_size, dtype=dtype) if bias else None

    def _ranges(self):
        kv_start = self.kv_head_start * self.head_dim
        return [(0, self.q_start, self.q_size), (self.q_size, kv_start, self.kv_size),
                (self.q_size + self.kv_size, kv_start, self.kv_size)]

    def load(self, readers: list[Reader], bias_readers: list[Reader] | None = None) -> None:
        for i, (dst, src, n) in enumerate(self._ranges()):
            self._put(dst, readers[i](0, src, n))
            if self.bias is not None:
                self.bias.data[dst:dst + n].copy_(bias_readers[i](0, src, n))

    def forward(self, x: torch.Tensor):
        qkv = self.matmul(x, self.bias)
        return qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)


class RowParallelLinear(PackedMatmul):
    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype):
        super().__init__()
        ps = get_parallel_state()
        self.ps = ps
        self.in_local = divide(in_features, ps.tp_size, "input features")
        self.weight = _param(out_features, self.in_local, dtype=dtype)
        self.bias = _param(out_features, dtype=dtype) if bias else None

    def load(self, read_weight: Reader, read_bias: Reader | None = None) -> None:
        self._put(0, read_weight(1, self.ps.tp_rank * self.in_local, self.in_local))
        if self.bias is not None:
            self.bias.data.copy_(read_bias(0, 0, self.bias.shape[0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.ps.all_reduce(self.matmul(x))
        return y if self.bias is None else y + self.bias
