"""Turns a scheduled step into tensors, runs the model over the paged KV cache and returns logits.

StepInputs is the whole plan of a step in plain tensors (tokens, positions, cache slots, block tables, which
rows need logits): it is what rank 0 sends to the other ranks in a multi-process engine.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from shoal.engine.execution.attention import select_backend
from shoal.engine.execution.attention.base import AttentionMetadata, KVCache
from shoal.engine.execution.graph_capture import DecodeGraphs
from shoal.engine.execution.model_loader import load_model
from shoal.engine.core.scheduler import ScheduledSeq

logger = logging.getLogger(__name__)


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64
    query_start_loc: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, max_blocks] int32
    logits_indices: torch.Tensor  # [S] int64: rows whose next-token logits are needed
    query_lens: list[int]
    seq_lens_list: list[int]

    def to(self, device: torch.device) -> "StepInputs":
        moved = {k: (v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v)
                 for k, v in self.__dict__.items()}
        return StepInputs(**moved)

    def attention_metadata(self) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping,
            query_start_loc=self.query_start_loc,
            seq_lens=self.seq_lens,
            block_tables=self.block_tables,
            max_query_len=max(self.query_lens),
            max_seq_len=max(self.seq_lens_list),
            query_lens_list=self.query_lens,
            seq_lens_list=self.seq_lens_list,
            is_decode_only=all(q == 1 for q in self.query_lens),
        )


def build_step_inputs(scheduled: list[ScheduledSeq], block_size: int) -> StepInputs:
    """The flat batch of a step. Plain Python lists first and one tensor per field at the end: in a decode step
    each sequence adds one token, and a handful of list appends per sequence beats any per-sequence tensor op."""
    tokens: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_lens: list[int] = []
    seq_lens: list[int] = []
    logits_indices: list[int] = []
    query_start = [0]
    width = max(len(s.seq.block_ids) for s in scheduled)
    tables: list[list[int]] = []
    for s in scheduled:
        seq, n = s.seq, s.num_new_tokens
        c = seq.num_computed_tokens
        blocks = seq.block_ids
        if n == 1:
            tokens.append(seq.token_ids[c])
            positions.append(c)
            slots.append(blocks[c // block_size] * block_size + c % block_size)
        else:
            tokens.extend(seq.token_ids[c:c + n])
            span = range(c, c + n)
            positions.extend(span)
            slots.extend(blocks[p // block_size] * block_size + p % block_size for p in span)
        query_lens.append(n)
        seq_lens.append(c + n)
        query_start.append(len(tokens))
        tables.append(blocks + [0] * (width - len(blocks)))
        for p in s.scored:  # prompt positions whose logits score the next prompt token
            logits_indices.append(len(tokens) - n + (p - c))
        if s.samples:
            logits_indices.append(len(tokens) - 1)
    return StepInputs(
        input_ids=torch.tensor(tokens, dtype=torch.int64),
        positions=torch.tensor(positions, dtype=torch.int64),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=torch.tensor(query_start, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor(tables, dtype=torch.int32),
        logits_indices=torch.tensor(logits_indices, dtype=torch.int64),
        query_lens=query_lens,
        seq_lens_list=seq_lens,
    )


def dummy_step_inputs(num_tokens: int, block_size: int) -> StepInputs:
    """One prompt of num_tokens zeros over blocks 0.. of the cache: the step memory profiling runs."""
    blocks = -(-num_tokens // block_size)
    positions = torch.arange(num_tokens)
    return StepInputs(
        input_ids=torch.zeros(num_tokens, dtype=torch.int64), positions=positions, slot_mapping=positions,
        query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32),
        seq_lens=torch.tensor([num_tokens], dtype=torch.int32),
        block_tables=torch.arange(blocks, dtype=torch.int32).unsqueeze(0),
        logits_indices=torch.tensor([num_tokens - 1]), query_lens=[num_tokens], seq_lens_list=[num_tokens],
    )


class ModelRunner:
    """Owns this process's model shard and KV cache."""

    def __init__(self, model_dir, hf_config, dtype: torch.dtype, device: torch.device, attention_backend: str,
                 max_model_len: int, layer_partition: list[int] | None = None, block_size: int = 16,
                 quantization: str | None = None, kv_cache_dtype: str = "auto"):
        self.device = device
        self.dtype = dtype
        self.kv_cache_dtype = kv_cache_dtype
        backend = select_backend(attention_backend, device, uses_alibi=_uses_alibi(hf_config),
                                 kv_cache_dtype=kv_cache_dtype, dtype=dtype, block_size=block_size,
                                 **_attention_shape(hf_config))
        self.backend = backend
        self.backend_name = backend.name
        self.max_model_len = max_model_len
        self.model = load_model(model_dir, hf_config, dtype, device, backend, max_model_len, layer_partition,
                                quantization)
        self.kv_caches: list[KVCache] = []
        self.block_size = 0
        self.capture: tuple[str, int] | None = None  # (backend, max_num_seqs) once decode capture is enabled
        self.decode_graphs: DecodeGraphs | None = None

    def enable_decode_capture(self, backend: str | None, max_num_seqs: int) -> None:
        """Capture pure decode steps with `backend` (see graph_capture.py); None leaves every step eager. Call
        before allocate_kv_cache, which then adds the padding rows' own KV block."""
        if backend is None:
            return
        if not self.backend.graph_capture_safe and backend != "eager":
            logger.info("decode graph capture is off: the %s attention backend cannot be captured",
                        self.backend_name)
            return
        if not (self.model.ps.is_first_stage and self.model.ps.is_last_stage):
            logger.info("decode graph capture is off under pipeline parallelism")
            return
        self.capture = (backend, max_num_seqs)

    def bytes_per_block(self, block_size: int) -> int:
        """K and V bytes of one block over this rank's layers; an fp8 cache counts its scales too."""
        m = self.model
        per_head = KVCache.bytes_per_token_head(m.head_dim, self.dtype, self.kv_cache_dtype)
        return max(1, m.num_local_layers * m.num_kv_heads_local * per_head * block_size)

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes the allocated KV cache holds (values and, for fp8, scales)."""
        return sum(c.nbytes for c in self.kv_caches)

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        m = self.model
        # With decode capture, one block past the pool belongs to the padding rows of padded batches.
        blocks = num_blocks + (self.capture is not None)
        self.block_size = block_size
        self.kv_caches = [
            KVCache.allocate(blocks, block_size, m.num_kv_heads_local, m.head_dim, self.dtype, self.device,
                             self.kv_cache_dtype)
            for _ in range(m.num_local_layers)
        ]
        self.decode_graphs = None
        if self.capture is not None:
            backend, max_num_seqs = self.capture
            self.decode_graphs = DecodeGraphs(self, backend, max_num_seqs, self.max_model_len, block_size,
                                              pad_block=num_blocks)

    def free_kv_cache(self) -> None:
        self.kv_caches = []

    @torch.inference_mode()
    def execute(self, inputs: StepInputs, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Run one step. On the last pipeline stage returns float32 logits [S, vocab] for inputs.logits_indices;
        on other stages the hidden states to hand to the next stage."""
        if self.decode_graphs is not None and hidden is None:
            logits = self.decode_graphs.run(inputs)  # None: not a decode step that fits a bucket
            if logits is not None:
                return logits
        if inputs.input_ids.device != self.device:
            inputs = inputs.to(self.device)
        meta = inputs.attention_metadata()
        out = self.model(inputs.input_ids, inputs.positions, self.kv_caches, meta, hidden)
        if not self.model.ps.is_last_stage:
            return out
        return self.model.compute_logits(out.index_select(0, inputs.logits_indices))


def _attention_shape(hf_config) -> dict:
    heads = getattr(hf_config, "num_attention_heads", None) or getattr(hf_config, "n_head")
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    hidden = getattr(hf_config, "hidden_size", None) or getattr(hf_config, "n_embd")
    return {"head_dim": getattr(hf_config, "head_dim", None) or hidden // heads, "num_heads": heads,
            "num_kv_heads": kv_heads}


def _uses_alibi(hf_config) -> bool:
    from shoal.engine.execution.models import model_class

    return bool(getattr(model_class(hf_config), "uses_alibi", False))
