"""Runs a step's plan (shoal.engine.contracts.StepInputs) through the model over the paged KV cache and returns
logits (or, on a pipeline stage before the last, hidden states)."""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable

import torch

from shoal.engine.contracts import StepImage, StepInputs
from shoal.engine.distributed.parallel_state import get_parallel_state, set_parallel_state
from shoal.engine.execution.attention import select_backend
from shoal.engine.execution.attention.base import AttentionMetadata, KVCache
from shoal.engine.execution.encoder_cache import EncoderCache
from shoal.engine.execution.graph_capture import DecodeGraphs
from shoal.engine.execution.model_loader import load_model

logger = logging.getLogger(__name__)


def attention_metadata(inputs: StepInputs) -> AttentionMetadata:
    """What the attention backends read of a step's plan."""
    return AttentionMetadata(
        slot_mapping=inputs.slot_mapping,
        query_start_loc=inputs.query_start_loc,
        seq_lens=inputs.seq_lens,
        block_tables=inputs.block_tables,
        max_query_len=max(inputs.query_lens),
        max_seq_len=max(inputs.seq_lens_list),
        query_lens_list=inputs.query_lens,
        seq_lens_list=inputs.seq_lens_list,
        is_decode_only=all(q == 1 for q in inputs.query_lens),
        state_slots=inputs.state_slots,
        image_spans=inputs.image_spans,
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
        state_slots=torch.zeros(1, dtype=torch.int64),  # read by hybrid models only (one state slot)
    )


class ModelRunner:
    """Owns this process's model shard and KV cache."""

    def __init__(self, model_dir, hf_config, dtype: torch.dtype, device: torch.device, attention_backend: str,
                 max_model_len: int, layer_partition: list[int] | None = None, block_size: int = 16,
                 quantization: str | None = None, kv_cache_dtype: str = "auto"):
        self.device = device
        self.dtype = dtype
        self.kv_cache_dtype = kv_cache_dtype
        backend = select_backend(attention_backend, device, uses_alibi=_model_flag(hf_config, "uses_alibi"),
                                 uses_sinks=_model_flag(hf_config, "uses_sinks"),
                                 kv_cache_dtype=kv_cache_dtype, dtype=dtype, block_size=block_size,
                                 **_attention_shape(hf_config))
        self.backend = backend
        self.backend_name = backend.name
        self.max_model_len = max_model_len
        self.hf_config = hf_config
        self._load_args = (model_dir, hf_config, dtype, device, backend, max_model_len, layer_partition, quantization)
        self._parallel_state = get_parallel_state()  # the layers read it as they are built; a reload needs it too
        self.model = load_model(*self._load_args)
        self.kv_caches: list[KVCache] = []
        self.block_size = 0
        self.capture: tuple[str, int] | None = None  # (backend, max_num_seqs) once decode capture is enabled
        self.decode_graphs: DecodeGraphs | None = None
        self.lora = None  # an execution.lora.LoRAManager once enable_lora ran
        self.offloaded = False  # sleep level 1 on a GPU: the weights wait in host memory
        self.encoder_cache = EncoderCache() if getattr(self.model, "accepts_images", False) else None
        # Speculative MTP (execution/mtp.py): keep each row's last hidden state at its KV slot (allocate_kv_cache).
        self.keep_hidden = False

    def enable_lora(self, max_loras: int, max_rank: int) -> None:
        """Give every adaptable linear layer max_loras adapter slots of rank up to max_rank (execution/lora.py)."""
        from shoal.engine.execution.lora import LoRAManager

        self.lora = LoRAManager(self.model, self.hf_config, max_loras, max_rank, self.dtype, self.device)

    def add_lora(self, adapter_id: int, path: str) -> None:
        self.lora.add(adapter_id, path)

    def remove_lora(self, adapter_id: int) -> None:
        self.lora.remove(adapter_id)

    def enable_decode_capture(self, backend: str | None, max_num_seqs: int) -> None:
        """Capture pure decode steps with `backend` (see graph_capture.py); None leaves every step eager. Call
        before allocate_kv_cache, which then adds the padding rows' own KV block."""
        if backend is None:
            return
        if not self.backend.graph_capture_safe and backend != "eager":
            logger.info("decode graph capture is off: the %s attention backend cannot be captured",
                        self.backend_name)
            return
        if getattr(self.model, "is_encoder", False):
            return  # an encoder runs whole prompts only, never a decode step
        if getattr(self.model, "has_state", False):
            logger.info("decode graph capture is off: the model's recurrent layers update per-sequence state")
            return
        if not (self.model.ps.is_first_stage and self.model.ps.is_last_stage):
            logger.info("decode graph capture is off under pipeline parallelism")
            return
        self.capture = (backend, max_num_seqs)

    def bytes_per_block(self, block_size: int) -> int:
        """K and V bytes of one block over this rank's layers; an fp8 cache counts its scales too."""
        m = self.model
        if getattr(m, "is_encoder", False):
            return 0  # an encoder keeps no KV cache: its blocks only count tokens in the scheduler
        per_head = m.kv_cache_class.bytes_per_token_head(m.head_dim, self.dtype, self.kv_cache_dtype)
        layers = getattr(m, "num_kv_layers", m.num_local_layers)  # hybrids: only the attention layers
        return max(1, layers * m.num_kv_heads_local * per_head * block_size)

    def state_bytes_per_seq(self) -> int:
        """Recurrent-state bytes of one sequence over this rank's layers (hybrid models; 0 for the others)."""
        return self.model.state_bytes_per_seq() if getattr(self.model, "has_state", False) else 0

    @property
    def padding_blocks(self) -> int:
        """Blocks allocate_kv_cache adds past the pool (decode capture's padding block), to leave out of budgets."""
        return int(self.capture is not None)

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes the allocated KV cache holds (values and, for fp8, scales)."""
        return sum(c.nbytes for c in self.kv_caches if c is not None)  # None: a layer without a cache

    def allocate_kv_cache(self, num_blocks: int, block_size: int, num_state_slots: int = 1) -> None:
        """The paged KV cache of every attention layer and, for hybrid models, num_state_slots sequences' state in
        every recurrent layer (one cache object per local layer, in layer order)."""
        m = self.model
        # With decode capture, one block past the pool belongs to the padding rows of padded batches.
        blocks = num_blocks + (self.capture is not None)
        self.block_size = block_size
        if getattr(m, "is_encoder", False):  # bidirectional attention within each step's prompts: nothing kept
            self.kv_caches = []
            return

        def make_kv():
            return m.kv_cache_class.allocate(blocks, block_size, m.num_kv_heads_local, m.head_dim, self.dtype,
                                             self.device, self.kv_cache_dtype)

        if getattr(m, "has_state", False):
            self.kv_caches = m.allocate_caches(make_kv, num_state_slots, self.device)
        else:
            self.kv_caches = [make_kv() for _ in range(m.num_local_layers)]
        if self.keep_hidden:  # before the decode graphs: captured steps write it too
            m.hidden_sink = torch.zeros(blocks * block_size, m.config.hidden_size, dtype=self.dtype,
                                        device=self.device)
        self.decode_graphs = None
        if self.capture is not None:
            backend, max_num_seqs = self.capture
            self.decode_graphs = DecodeGraphs(self, backend, max_num_seqs, self.max_model_len, block_size,
                                              pad_block=num_blocks)

    def _copy_state(self, src: torch.Tensor, dst: torch.Tensor, from_slots: bool = True) -> None:
        """Copy recurrent state between slots in every recurrent layer, for the sequences where the checkpoint
        slot (src when restoring, dst when saving) is set (>= 0)."""
        use = (src if from_slots else dst) >= 0
        src, dst = src[use], dst[use]
        for cache in self.kv_caches:
            if hasattr(cache, "copy_slots"):
                cache.copy_slots(src, dst)

    def free_kv_cache(self) -> None:
        self.kv_caches = []
        if self.model is not None:
            self.model.hidden_sink = None

    def memory_bytes(self) -> dict[str, int]:
        """What this shard holds now: KV-cache and weight bytes (0 for what sleep released)."""
        from shoal.engine.execution.quantization import resident_weight_bytes

        weights = 0
        if self.model is not None:  # what sleep level 1 moved to host memory does not count
            weights = resident_weight_bytes(self.model) - sum(
                t.numel() * t.element_size() for t in self.model.parameters() if t.device != self.device)
        return {"kv_cache_bytes": self.kv_cache_bytes, "weight_bytes": weights}

    def sleep(self, level: int) -> None:
        """Sleep mode: release the KV cache (its captured decode graphs with it). Level 1 keeps the weights: on a
        GPU they move to host memory, on the CPU they stay where they are. Level 2 drops them; wake_up reloads
        them from the model files. The caller reallocates the KV cache after wake_up. (Level 1 on a GPU moves the
        parameters and buffers; a packed or quantized form kept outside them stays, and memory_bytes counts it.)"""
        self.free_kv_cache()
        self.decode_graphs = None
        if level == 2:
            self.model = None
        elif self.device.type == "cuda":
            self.model.to("cpu")
            self.offloaded = True
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def wake_up(self) -> None:
        if self.model is None:
            previous = get_parallel_state()
            set_parallel_state(self._parallel_state)
            try:
                self.model = load_model(*self._load_args)
            finally:
                set_parallel_state(previous)
        elif self.offloaded:
            self.model.to(self.device)
            self.offloaded = False

    @torch.inference_mode()
    def execute(self, inputs: StepInputs, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Run one step. On the last pipeline stage returns float32 logits [S, vocab] for inputs.logits_indices;
        on other stages the hidden states to hand to the next stage."""
        if self.decode_graphs is not None and hidden is None and inputs.images is None:
            logits = self.decode_graphs.run(inputs)  # None: not a decode step that fits a bucket
            if logits is not None:
                return logits
        if inputs.input_ids.device != self.device:
            inputs = inputs.to(self.device)
        out = self._forward(inputs, hidden)
        if not self.model.ps.is_last_stage:
            return out
        return self.model.compute_logits(out.index_select(0, inputs.logits_indices))

    @torch.inference_mode()
    def execute_pooling(self, inputs: StepInputs) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Run one step that pools (one process, every layer here): float32 logits for inputs.logits_indices (None
        when no row samples) and, per entry of inputs.pool_ranges, the sum of the final hidden states of its rows
        ([P, hidden] float32, on the CPU). Never a captured graph: those return logits only."""
        if inputs.input_ids.device != self.device:
            inputs = inputs.to(self.device)
        out = self._forward(inputs, None)
        pooled = torch.stack([out[a:b].float().sum(0) for a, b in inputs.pool_ranges]).cpu()
        if not inputs.logits_indices.numel():
            return None, pooled
        return self.model.compute_logits(out.index_select(0, inputs.logits_indices)), pooled

    def _forward(self, inputs: StepInputs, hidden: torch.Tensor | None) -> torch.Tensor:
        if self.lora is not None:
            self.lora.prepare(inputs.lora_slot_ids, inputs.lora_token_slots)
        meta = attention_metadata(inputs)
        if inputs.images is not None and hidden is None:
            hidden = self._embed_images(inputs)
        if inputs.state_restore is not None:  # prefix-cache hits and rejected proposals start from a kept state
            self._copy_state(inputs.state_restore, inputs.state_slots)
        if inputs.state_backup is not None:  # sequences verifying proposals keep the state they start from
            self._copy_state(inputs.state_slots, inputs.state_backup, from_slots=False)
        out = self.model(inputs.input_ids, inputs.positions, self.kv_caches, meta, hidden)
        if inputs.state_save is not None:  # ... and keep the state of prompts ending their last full block
            self._copy_state(inputs.state_slots, inputs.state_save, from_slots=False)
        return out

    def _embed_images(self, inputs: StepInputs) -> torch.Tensor:
        """The step's token embeddings with each image slice's rows replaced by the image's encoder features. The
        step's images not in the encoder-output cache run through the tower together (the model batches them);
        a prompt prefilled in chunks finds its image's features cached for every chunk after the first."""
        m, cache = self.model, self.encoder_cache
        missing: dict[bytes, StepImage] = {}
        for image in inputs.images:
            if cache.get(image.digest) is None:
                missing.setdefault(image.digest, image)
        if missing:
            for digest, features in zip(missing, m.encode_images([self._on_device(i) for i in missing.values()])):
                cache.put(digest, features)
        x = m.embed(inputs.input_ids, inputs.positions)
        width, rows, deep = x.shape[1], [], []
        for image in inputs.images:
            features = cache.get(image.digest)
            if features is None:  # pushed out by this very step's others (more images than the cache holds)
                features = m.encode_images([self._on_device(image)])[0]
            features = features[image.start:image.end]
            x[image.row:image.row + image.end - image.start] = features[:, :width].to(x.dtype)
            if features.shape[1] > width:  # deepstack: later layers' features follow the input embeddings'
                rows.append(torch.arange(image.row, image.row + image.end - image.start))
                deep.append(features[:, width:])
        if deep:  # read (and cleared) by the model's next forward (Qwen3-VL adds them after its first layers)
            m.deepstack = (torch.cat(rows).to(x.device), torch.cat(deep).to(x.dtype))
        return x

    def _on_device(self, image: StepImage) -> StepImage:
        return dataclasses.replace(image, pixel_values=image.pixel_values.to(self.device))


def _attention_shape(hf_config) -> dict:
    from shoal.engine.execution.models import model_class

    cls = model_class(hf_config)
    if hasattr(cls, "attention_shape"):  # MLA: the latent's width, one key head
        return cls.attention_shape(hf_config)
    heads = getattr(hf_config, "num_attention_heads", None) or getattr(hf_config, "n_head")
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    hidden = getattr(hf_config, "hidden_size", None) or getattr(hf_config, "n_embd")
    return {"head_dim": getattr(hf_config, "head_dim", None) or hidden // heads, "num_heads": heads,
            "num_kv_heads": kv_heads}


def _model_flag(hf_config, name: str) -> bool:
    """A model class's attention requirement (uses_alibi, uses_sinks), for choosing the attention backend."""
    from shoal.engine.execution.models import model_class

    return bool(getattr(model_class(hf_config), name, False))


@torch.inference_mode()
def profile_peak_memory(runner: ModelRunner, num_tokens: int, block_size: int,
                        run_step: Callable[[StepInputs], object]) -> int:
    """Bytes of activation memory one step of num_tokens tokens needs (CUDA only): run it with `run_step` (the
    runner alone, or a rank's pipelined step) on a scratch KV cache and read the allocator's peak."""
    device = runner.device
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    runner.allocate_kv_cache(-(-num_tokens // block_size), block_size)
    try:
        run_step(dummy_step_inputs(num_tokens, block_size))
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    finally:
        runner.free_kv_cache()
        torch.cuda.empty_cache()
