"""The skeleton every architecture shares: embeddings on the first pipeline stage, this stage's decoder
layers, final norm and LM head on the last stage."""

from __future__ import annotations

import torch
from torch import nn

from shoal.engine.execution.attention.base import AttentionMetadata, KVCache
from shoal.engine.distributed.parallel_state import get_parallel_state, layer_range
from shoal.engine.execution.weights import WeightError, WeightSource


class CausalLM(nn.Module):
    # Set by each architecture before calling super().__init__-dependent helpers.
    num_layers: int
    num_kv_heads_local: int
    head_dim: int
    uses_alibi: bool = False
    uses_sinks: bool = False  # attention sinks: only backends with supports_sinks can run the model
    kv_cache_class: type[KVCache] = KVCache  # each layer's cache (MLA families: a one-tensor latent cache)

    def __init__(self):
        super().__init__()
        ps = get_parallel_state()
        self.ps = ps

    @classmethod
    def sliding_windows(cls, config) -> list[int | None]:
        """Each layer's attention window in tokens (None: the layer attends to the whole context). The engine
        frees KV blocks that slid out of the window only when every layer has one."""
        return [None] * config.num_hidden_layers

    def stage_layers(self, num_layers: int, partition: list[int] | None = None) -> tuple[int, int]:
        self.num_layers = num_layers
        self.start_layer, self.end_layer = layer_range(num_layers, self.ps.pp_rank, self.ps.pp_size, partition)
        return self.start_layer, self.end_layer

    @property
    def num_local_layers(self) -> int:
        return self.end_layer - self.start_layer

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache], meta: AttentionMetadata,
                hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Run this stage. The first stage embeds input_ids; later stages take the previous stage's hidden
        states. The last stage returns final-normed hidden states, others the raw residual stream."""
        if self.ps.is_first_stage:
            hidden = self.embed(input_ids, positions)
        for i, layer in enumerate(self.layers):
            hidden = layer(hidden, positions, kv_caches[i], meta)
        if self.ps.is_last_stage:
            hidden = self.final_norm(hidden)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def load_weights(self, src: WeightSource) -> None:
        raise NotImplementedError


def reader(src: WeightSource, name: str, full_shape: tuple[int, ...], transpose: bool = False):
    """A Reader (see layers.linear) over one checkpoint tensor, checking its full shape first. A GGUF source
    serving packed weights answers with the stored blocks (a GGUFPacked) where it can; layers keep those packed."""
    stored = tuple(reversed(full_shape)) if transpose else tuple(full_shape)
    load_packed = None if transpose else getattr(src, "load_packed", None)

    def read(dim: int, start: int, length: int) -> torch.Tensor:
        if load_packed is not None:
            packed = load_packed(name, stored, dim=dim, start=start, length=length)
            if packed is not None:
                return packed
        if transpose:
            return src.load(name, stored, dim=1 - dim, start=start, length=length).t()
        return src.load(name, stored, dim=dim, start=start, length=length)

    return read


def tensor_reader(t: torch.Tensor):
    """A Reader over a tensor already in memory (a part of a checkpoint tensor read whole)."""
    return lambda dim, start, length: t.narrow(dim, start, length)


def fused_readers(src: WeightSource, name: str, part_rows: list[int], cols: int | None = None) -> list:
    """Readers over the row blocks of one checkpoint tensor [sum(part_rows), cols] (or a bias [sum(part_rows)]) that
    fuses several projections along its output dimension (Phi-3's qkv_proj, gate_up_proj): reader i sees rows
    [offset_i, offset_i + part_rows[i]) as a whole tensor, so a tensor-parallel rank still reads only its rows (from a
    packed GGUF source, as stored blocks where it can)."""
    full = (sum(part_rows),) if cols is None else (sum(part_rows), cols)
    load_packed = getattr(src, "load_packed", None)  # a packed GGUF source: a row range is its stored blocks
    readers, offset = [], 0
    for rows in part_rows:
        def read(dim: int, start: int, length: int, base: int = offset, rows: int = rows) -> torch.Tensor:
            if dim == 0:
                packed = load_packed and load_packed(name, full, dim=0, start=base + start, length=length)
                return packed if packed is not None else src.load(name, full, dim=0, start=base + start,
                                                                  length=length)
            return src.load(name, full, dim=0, start=base, length=rows)[:, start:start + length]

        readers.append(read)
        offset += rows
    return readers


def find_prefix(src: WeightSource, candidates: list[str], probe: str) -> str:
    """The name prefix this checkpoint uses (e.g. 'model.' vs '', 'transformer.' vs '')."""
    for prefix in candidates:
        if src.has(prefix + probe):
            return prefix
    raise WeightError(f"{src.model_dir}: tensor {candidates[0] + probe!r} is missing from the checkpoint")
