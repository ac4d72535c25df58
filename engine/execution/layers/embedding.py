"""Vocabulary-parallel token embedding and LM head: each rank owns a contiguous range of the vocabulary."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shoal.engine.distributed.parallel_state import get_parallel_state
from shoal.engine.execution.layers.linear import PackedMatmul, Reader


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden: int, dtype: torch.dtype, materialize: bool = True):
        super().__init__()
        ps = get_parallel_state()
        self.ps = ps
        self.vocab_size = vocab_size
        self.hidden = hidden
        self.vocab_local = -(-vocab_size // ps.tp_size)  # padded so every rank holds the same count
        self.vocab_start = ps.tp_rank * self.vocab_local
        rows = self.vocab_local if materialize else 0  # a pipeline stage that never embeds holds no table
        self.weight = nn.Parameter(torch.zeros(rows, hidden, dtype=dtype), requires_grad=False)
        self.int8_rows: tuple[torch.Tensor, torch.Tensor] | None = None  # (int8 table, float32 scale per row)
        self.gguf_rows = None  # a GGUFPacked table read from a GGUF file: a lookup dequantizes the rows it reads

    def quantize_int8(self) -> None:
        """Keep the table as int8 rows with one scale each (--quantization int8): a lookup then dequantizes only
        the rows it reads. The dense weight is left for the caller to free (a tied LM head reads it first)."""
        from shoal.engine.execution.quantization.int8 import quantize_rows_int8

        q, scale = quantize_rows_int8(self.weight.data)
        self.int8_rows = (q, scale.reshape(-1))

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.gguf_rows is not None:
            return self.gguf_rows.dequantize_rows(ids).to(self.weight.dtype)
        if self.int8_rows is None:
            return F.embedding(ids, self.weight)
        q, scale = self.int8_rows
        return (F.embedding(ids, q).float() * scale[ids].unsqueeze(-1)).to(self.weight.dtype)

    def load(self, read: Reader) -> None:
        n = max(0, min(self.vocab_local, self.vocab_size - self.vocab_start))
        if n and self.weight.shape[0]:
            rows = read(0, self.vocab_start, n)
            if isinstance(rows, torch.Tensor):
                self.weight.data[:n].copy_(rows)
            else:  # GGUF blocks kept packed (quantization/gguf.py frees the dense table)
                self.gguf_rows = rows

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.ps.tp_size == 1:
            return self._lookup(input_ids)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.vocab_local)
        out = self._lookup(local.masked_fill(outside, 0))
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return self.ps.all_reduce(out)


class ParallelLMHead(PackedMatmul):
    """Projects hidden states to float32 logits over the full vocabulary (gathered from every rank)."""

    def __init__(self, embedding: VocabParallelEmbedding, tied: bool, bias: bool = False, materialize: bool = True):
        super().__init__()
        self.embedding = embedding
        self.tied = tied
        rows = embedding.vocab_local if materialize else 0  # only the last pipeline stage projects to logits
        dtype = embedding.weight.dtype
        if tied:
            self.weight = embedding.weight
        else:
            self.weight = nn.Parameter(torch.zeros(rows, embedding.hidden, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(rows, dtype=dtype), requires_grad=False) if bias else None

    def load(self, read: Reader) -> None:
        e = self.embedding
        n = max(0, min(e.vocab_local, e.vocab_size - e.vocab_start))
        if n and self.weight.shape[0]:
            self._put(0, read(0, e.vocab_start, n))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.format is not None and self.lora is None:
            logits = self.format.matmul_float32(hidden, self.bias)  # one pass where the kernel writes float32
        else:
            logits = self.matmul(hidden, self.bias)
        logits = self.embedding.ps.all_gather_last_dim(logits)
        return logits[..., : self.embedding.vocab_size].float()
