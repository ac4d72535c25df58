"""Linear layers split across tensor-parallel ranks.

Column-parallel layers own a contiguous range of output features; row-parallel layers own a range of input
features and sum their partial products with one all-reduce. Weights are stored [out, in] like nn.Linear.
Loading goes through a `read(dim, start, length)` callable so each rank reads only its own slice, whatever the
checkpoint's layout (GPT-2's Conv1D stores [in, out] and passes a transposing reader).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from shoal.engine.distributed.parallel_state import divide, get_parallel_state
from shoal.engine.execution.layers.weight_format import WeightFormat, plain_format

# read(dim, start, length) -> tensor in [out, in] layout, sliced along `dim` (0 = out, 1 = in) of that layout
Reader = Callable[[int, int, int], torch.Tensor]


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class PackedMatmul(nn.Module):
    """A linear layer's weight and the format that multiplies by it (layers/weight_format.py): the dense Parameter
    `weight` as loaded, until use() puts the chosen format in place (model_loader.choose_formats, once the
    checkpoint is read). A layer built without the loader runs on its Parameter (plain_format without a copy)."""

    format: WeightFormat | None = None  # None: not chosen yet (plain_format on the first matmul)
    gguf_segments: list | None = None  # [(first row, GGUF blocks)] from a packed GGUF file, until formats are chosen
    lora = None  # an execution.lora.LoRASlots once --enable-lora wraps this layer: adds the adapters' updates
    _shape: tuple[int, int] | None = None  # [out, in] of the dense weight a format replaced (it may be freed)

    @property
    def weight_shape(self) -> tuple[int, int]:
        """[out, in] of this layer's weight, whatever form holds it."""
        return self._shape or tuple(self.weight.shape)

    def use(self, fmt: WeightFormat, free_dense: bool = True, shape: tuple[int, int] | None = None) -> None:
        """Run on `fmt` from now on. A format that does not run on the Parameter frees it, unless free_dense is False
        (a tied LM head's Parameter is the embedding table, which the lookup still reads). `shape`: the [out, in]
        the format computes, where the Parameter's is not it (a tied head whose table was freed already)."""
        self._shape = shape or self.weight_shape
        self.format = fmt
        if free_dense and not fmt.runs_on_parameter:
            self.weight.data = torch.empty(0, dtype=self.weight.dtype, device=self.weight.device)

    def _put(self, offset: int, value) -> None:
        """Rows [offset, offset + len(value)) of the weight: dense values are copied in; GGUF blocks (from a packed
        GGUF source: not a tensor) are kept as they are until the formats are chosen."""
        if isinstance(value, torch.Tensor):
            self.weight.data[offset:offset + value.shape[0]].copy_(value)
        else:
            self.gguf_segments = (self.gguf_segments or []) + [(offset, value)]

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        fmt = self.format
        if fmt is None:
            fmt = self.format = plain_format(self.weight, prepack=False)
        y = fmt.matmul(x, bias)
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
