"""LLMEngine: add_request / abort_request / step — the synchronous core every front end drives.

One step = schedule → build the flat batch → run the model → sample → append tokens, detokenize, check stop
conditions → free the blocks of finished sequences. Not thread-safe: one thread drives it (AsyncEngine does).
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Iterable

import torch

from shoal.engine import startup
from shoal.engine.config import DEFAULT_CPU_KV_CACHE_BYTES, EngineConfig, MultiModalLimits
from shoal.engine.contracts import PoolingParams, RequestOutputKind, SamplingParams
from shoal.engine.core.kv_cache import BlockPool
from shoal.engine.core.lora import LoRARegistry, LoRARequest
from shoal.engine.core.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from shoal.engine.core.pooling import finish as finish_pooling
from shoal.engine.core.pooling import make_pooler
from shoal.engine.core.scheduler import ScheduledSeq, Scheduler, build_step_inputs
from shoal.engine.core.sequence import Request, Sequence, SeqStatus
from shoal.engine.core.state_pool import StateCheckpoints, StatePool
from shoal.engine.core.structured_outputs import CompiledGrammar, GrammarCompiler, StructuredOutputsParams
from shoal.engine.core.tokenizer import IncrementalDetokenizer, get_eos_token_ids, load_tokenizer
from shoal.engine.execution.executor import Executor, make_executor
from shoal.engine.execution.model_loader import load_hf_config, resolve_dtype, resolve_model_dir
from shoal.engine.execution.models import accepts_images, model_class
from shoal.engine.execution.sampling import Sampler, SamplingRow, make_generator

logger = logging.getLogger(__name__)


class SleepError(ValueError):
    """A sleep or wake-up request the engine cannot honour now (HTTP 400; `conflict`: 409, requests in flight)."""

    def __init__(self, message: str, conflict: bool = False):
        super().__init__(message)
        self.conflict = conflict


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_waiting_prefill_tokens: int  # prompt (or recompute) tokens not yet in the KV cache: the autoscaler's signal
    kv_cache_usage: float
    num_kv_blocks: int
    num_free_kv_blocks: int
    num_preemptions_total: int
    prefix_cache_queries_total: int
    prefix_cache_hits_total: int
    prompt_tokens_total: int
    generation_tokens_total: int
    # Speculative decoding (vLLM's spec_decode_* counters): sequence-steps that verified proposals, proposed
    # tokens verified, and those the model accepted.
    spec_decode_num_drafts_total: int = 0
    spec_decode_num_draft_tokens_total: int = 0
    spec_decode_num_accepted_tokens_total: int = 0
    # LoRA (--enable-lora): adapter names with running / waiting sequences (vLLM's lora_requests_info), resident
    # (loaded) adapters, and every registered adapter as (name, path, created)
    lora_running: list[str] = field(default_factory=list)
    lora_waiting: list[str] = field(default_factory=list)
    lora_resident: list[str] = field(default_factory=list)
    lora_registered: list[tuple[str, str, int]] = field(default_factory=list)
    lora_loads_total: int = 0  # adapter loads onto the ranks (registrations and reloads after eviction)
    # KV offloading: prefix-cache hits in tokens per tier ("device": the pool itself, "cpu", "disk"), and each
    # offload tier's {"blocks", "used_bytes", "capacity_bytes", "corrupted"} (rank 0's); empty when it is off
    prefix_cache_tier_hits: dict[str, int] = field(default_factory=dict)
    kv_offload_tiers: dict[str, dict[str, int]] = field(default_factory=dict)


class ContextLengthError(ValueError):
    """The prompt plus the tokens to generate do not fit in max_model_len (the one place this is checked)."""

    def __init__(self, max_model_len: int, prompt_len: int, max_tokens: int, embedding: bool = False):
        self.max_model_len, self.prompt_len, self.max_tokens = max_model_len, prompt_len, max_tokens
        if embedding:
            super().__init__(
                f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                f"{prompt_len} tokens in the input for embedding generation. Please reduce the length of the input.")
            return
        super().__init__(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} for the completion). "
            "Please reduce the length of the prompt or the maximum number of tokens.")


def _model_max_len(hf_config) -> int | None:
    for attr in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(hf_config, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def pick_device(choice: str) -> torch.device:
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if choice == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was requested but no CUDA device is available")
    return torch.device(choice)


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        with startup.timed("config"):  # (transformers' config machinery is imported here, on first use)
            self.model_dir = resolve_model_dir(config.model, config.revision)
            self.hf_config = load_hf_config(self.model_dir, config.trust_remote_code)
        self.device = pick_device(config.device)
        if self.device.type == "cpu":  # the tier decides dtype auto, kernels and their builds: say which
            from shoal.engine.execution.cpu_budget import apply_thread_count
            from shoal.engine.execution.cpu_features import log_cpu_features

            apply_thread_count()  # a quota or affinity mask still bounds the threads outside `shoal-engine`
            log_cpu_features()
        self.dtype = resolve_dtype(config.dtype, self.hf_config, self.device)
        if config.quantization is not None:  # refuse before loading anything
            from shoal.engine.execution.quantization import check_supported

            check_supported(config.quantization, self.device)
        # Each layer's attention window (None: full context). When every layer has one, KV blocks that slid out of
        # the smallest window are freed as sequences advance (see Scheduler).
        self.layer_windows = model_class(self.hf_config).sliding_windows(self.hf_config)
        # An encoder-only model (BertModel) only embeds: whole prompts per step (bidirectional attention cannot be
        # chunked), no KV cache kept between steps, nothing generated.
        self.is_encoder = bool(getattr(model_class(self.hf_config), "is_encoder", False))
        self.generates, self.pools = self._resolve_runner()
        all_local = bool(self.layer_windows) and all(self.layer_windows)
        self.kv_window = min(self.layer_windows) if all_local else None
        self.max_model_len = self._resolve_max_model_len()
        with startup.timed("tokenizer"):
            self.tokenizer = load_tokenizer(config.tokenizer or self.model_dir, config.revision,
                                            config.trust_remote_code)
        self.model_name = config.served_model_name or config.model
        torch.manual_seed(config.seed)

        self.max_num_batched_tokens = config.max_num_batched_tokens or self._default_batched_tokens()
        chunked = config.enable_chunked_prefill and not self.is_encoder
        if not chunked and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"without chunked prefill{' (an encoder-only model runs whole prompts)' if self.is_encoder else ''}, "
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least "
                f"max_model_len ({self.max_model_len}), or long prompts could never be scheduled"
            )
        self.pooler = make_pooler(self.model_dir, self.hf_config, self.is_encoder, config.pooler_config) \
            if self.pools else None
        self.images = None  # a vision-language model's image path (core/images.py)
        if accepts_images(self.hf_config):
            from shoal.engine.core.images import image_inputs

            limits = config.limit_mm_per_prompt or MultiModalLimits()
            self.images = image_inputs(self.model_dir, self.hf_config, limits.image, config.max_image_pixels,
                                       self.tokenizer)
            vision = (getattr(self.hf_config, "vl_config", None) or {}).get("vision_config") or {}
            deepstack = vision.get("deepstack_visual_indexes")
            if config.pipeline_parallel_size > 1 and deepstack:  # later stages' layers would need the tower's output
                raise ValueError(f"{self.model_dir.name}: Qwen3-VL's deepstack features enter the first decoder "
                                 "layers, which only the first pipeline stage's tower feeds: drop "
                                 "--pipeline-parallel-size (tensor parallelism works)")
            # Gemma 3: an image is prefilled in one chunk (under pipeline parallelism, in one micro-batch too)
            if getattr(self.images, "num_image_tokens", None) and \
                    self.max_num_batched_tokens < self.images.num_image_tokens:
                raise ValueError(f"--max-num-batched-tokens ({self.max_num_batched_tokens}) is smaller than one "
                                 f"image's {self.images.num_image_tokens} tokens: a Gemma 3 image attends to "
                                 "itself bidirectionally and is never split across prefill chunks")

        self.eos_token_ids = get_eos_token_ids(self.tokenizer, self.model_dir)
        self.vocab_size = self.hf_config.vocab_size
        # One process: the ModelRunner and Sampler side by side. Tensor/pipeline parallel: a DistributedExecutor
        # that starts the local worker ranks and broadcasts every step's plan to them.
        self.executor: Executor = make_executor(config, self.model_dir, self.hf_config, self.dtype, self.device,
                                                self.max_model_len, Sampler(self.vocab_size, self.eos_token_ids))
        self.spec = config.speculative_config
        self.proposer = None
        # Hybrid models: bytes of one sequence's recurrent state (0 for pure transformers), carved from the KV budget,
        # with prefix caching as many checkpoint slots again (core/state_pool.StateCheckpoints), and with speculative
        # decoding one backup slot per sequence (the state before its proposals: core/scheduler.accept_draft).
        self.state_bytes = self.executor.runner.state_bytes_per_seq()
        self.num_checkpoints = config.max_num_seqs if self.state_bytes and config.enable_prefix_caching else 0
        self.num_backups = config.max_num_seqs if self.state_bytes and self.spec is not None else 0
        self.num_state_slots = config.max_num_seqs + self.num_checkpoints + self.num_backups
        try:
            if self.state_bytes and config.enable_sleep_mode:
                raise ValueError("sleep mode is not supported for hybrid models (recurrent layers) yet: their state "
                                 "slots are not released and restored by sleep/wake_up; drop --enable-sleep-mode")
            if self.spec is not None:
                from shoal.engine.core.speculative import make_proposer

                self.proposer = make_proposer(self.spec, self)
            num_blocks = self._num_kv_blocks()
            capacity = num_blocks * config.block_size
            if capacity < self.max_model_len:
                raise ValueError(
                    f"the KV cache holds {capacity} tokens ({num_blocks} blocks of {config.block_size}), fewer than "
                    f"max_model_len={self.max_model_len}: raise --kv-cache-memory / --gpu-memory-utilization / "
                    f"--num-kv-blocks or lower --max-model-len"
                )
            with startup.timed("kv_cache"):  # a draft model's cache too (the executor's), with the same blocks
                self.executor.allocate_kv_cache(num_blocks, config.block_size, self.num_state_slots)
        except BaseException:
            self.executor.shutdown()  # a failed start must not leave worker ranks behind
            raise
        self.prefix_caching = config.enable_prefix_caching and not self.is_encoder  # an encoder keeps no KV
        self.kv_events = None
        if config.kv_events_config is not None and config.kv_events_config.active:
            if not self.prefix_caching:
                self.executor.shutdown()
                raise ValueError("--kv-events-config reports the prefix cache's blocks: it needs prefix caching "
                                 "(drop --no-enable-prefix-caching; an encoder-only model keeps no KV cache)")
            from shoal.engine.core.kv_events import KVEventPublisher

            try:
                self.kv_events = KVEventPublisher(config.kv_events_config, config.block_size,
                                                  "GPU" if self.device.type == "cuda" else "CPU")
            except BaseException:
                self.executor.shutdown()
                raise
        self.pool = BlockPool(num_blocks, config.block_size, self.prefix_caching, events=self.kv_events is not None)
        self.state_pool = StatePool(config.max_num_seqs) if self.state_bytes else None
        try:
            transfer = config.kv_transfer_config
            wants_tiers = config.kv_offloading_size is not None or (transfer is not None and transfer.consumes)
            self.tiers = self._kv_tiers(num_blocks) if wants_tiers else None
        except BaseException:
            if self.kv_events is not None:
                self.kv_events.close()
            raise
        self.kv_transfer = None  # core/kv_transfer.KVTransfer with --kv-transfer-config (prefill/decode split)
        if config.kv_transfer_config is not None:
            from shoal.engine.core.kv_transfer import KVTransfer

            try:
                self.kv_transfer = KVTransfer(self)
            except BaseException:
                self.executor.shutdown()
                if self.kv_events is not None:
                    self.kv_events.close()
                raise
        checkpoints = StateCheckpoints(config.max_num_seqs, self.num_checkpoints) if self.num_checkpoints else None
        self.sleep_level = 0  # 0 awake, else the level of the last sleep (sleep mode)
        self.scheduler = Scheduler(self.pool, config.max_num_seqs, self.max_num_batched_tokens,
                                   chunked, config.scheduling_policy,
                                   sliding_window=self.kv_window,
                                   max_loras=config.max_loras if config.enable_lora else None,
                                   state_pool=self.state_pool, checkpoints=checkpoints, tiers=self.tiers,
                                   backup_base=config.max_num_seqs + self.num_checkpoints if self.num_backups else None)
        self.lora: LoRARegistry | None = None
        if config.enable_lora:
            self.lora = LoRARegistry(self.executor, self.hf_config, config.max_loras, config.max_lora_rank,
                                     config.max_cpu_loras or config.max_loras, self.model_name)
            try:
                for name, path in config.lora_paths.items():
                    self.lora.register(name, path)
            except BaseException:
                self.executor.shutdown()
                if self.kv_events is not None:
                    self.kv_events.close()
                raise
        # Thread-safe: AsyncEngine compiles on worker threads, off the engine loop.
        self.grammar_compiler = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids)
        self._bitmask_words = -(-max(self.vocab_size, len(self.tokenizer)) // 32)  # one bit per token id
        self.requests: dict[str, Request] = {}
        self._seq_ids = itertools.count()
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.spec_num_drafts = 0
        self.spec_num_draft_tokens = 0
        self.spec_num_accepted_tokens = 0
        if self.pooler is not None:
            p = self.pooler
            logger.info("embeddings: %s pooling, %s (%s)%s; generation %s", p.pooling_type,
                        "normalized" if p.normalize else "not normalized", p.source,
                        ", Matryoshka dimensions" if p.matryoshka else "", "on" if self.generates else "off")
        logger.info(
            "KV cache: %d blocks of %d tokens (%.1f MiB, %s); max concurrency %.1f requests at max_model_len=%d; "
            "attention backend %s; prefix caching %s; max_num_batched_tokens=%d",
            num_blocks, config.block_size, num_blocks * self.executor.bytes_per_block(config.block_size) / 2**20,
            "fp8 e4m3 with per-token scales" if config.kv_cache_dtype == "fp8" else f"{str(self.dtype)[6:]}",
            capacity / self.max_model_len, self.max_model_len, self.executor.backend_name,
            "on" if self.prefix_caching else "off", self.max_num_batched_tokens,
        )
        if self.state_bytes:
            logger.info("recurrent state: %d sequence slots (max_num_seqs) + %d prefix-cache checkpoints + %d "
                        "speculative backups of %.2f MiB each, %.1f MiB in all, carved from the KV-cache budget",
                        config.max_num_seqs, self.num_checkpoints, self.num_backups, self.state_bytes / 2**20,
                        self.num_state_slots * self.state_bytes / 2**20)
        self._log_sliding_window(num_blocks)

    # -- set-up ---------------------------------------------------------------------------------------------
    def _resolve_runner(self) -> tuple[bool, bool]:
        """(generates, pools) from --runner and the model: see EngineConfig.runner."""
        runner, c = self.config.runner, self.config
        if self.is_encoder:
            if runner == "generate":
                raise ValueError(f"{self.hf_config.architectures[0]} is an encoder-only model: it cannot generate "
                                 "(use --runner pooling or auto to serve /v1/embeddings)")
            for name, on in (("--speculative-config", c.speculative_config is not None),
                             ("--enable-lora", c.enable_lora), ("--enable-sleep-mode", c.enable_sleep_mode)):
                if on:
                    raise ValueError(f"{name} is not supported for an encoder-only model")
        if c.world_size > 1 and (self.is_encoder or runner == "pooling"):
            raise ValueError("embeddings (--runner pooling, encoder-only models) are not supported with tensor or "
                             "pipeline parallelism: run the model with -tp 1 -pp 1")
        generates = not self.is_encoder and runner != "pooling"
        pools = runner != "generate" and c.world_size == 1  # auto on a parallel decoder: generation only
        return generates, pools

    def _log_sliding_window(self, num_blocks: int) -> None:
        windowed = [w for w in self.layer_windows if w]
        if not windowed:
            return
        bs = self.config.block_size
        full = -(-self.max_model_len // bs)
        if self.kv_window is None:
            logger.info("sliding-window attention (%s tokens) on %d of %d layers: the %d global layers need every "
                        "block, so no KV blocks are freed as sequences advance (concurrency as above)",
                        "/".join(str(w) for w in sorted(set(windowed))), len(windowed), len(self.layer_windows),
                        len(self.layer_windows) - len(windowed))
            return
        # The last `window` keys of a decoding sequence span at most (window - 1) // bs + 2 blocks.
        held = min(full, (self.kv_window - 1) // bs + 2)
        logger.info("sliding-window attention (%d tokens) on every layer: KV blocks that slide out of the window are "
                    "freed, so a decoding sequence holds at most %d blocks instead of %d at max_model_len=%d; "
                    "max concurrency %.1f requests (%.1f without the window)", self.kv_window, held, full,
                    self.max_model_len, num_blocks / held, num_blocks / full)

    def _kv_tiers(self, num_blocks: int):
        """KV offloading: every rank's tiers, sized in blocks (the same count on every rank), and the engine's side."""
        from shoal.engine.core.kv_tiers import KVTiers
        from shoal.engine.execution.kv_offload import OffloadSpec

        c = self.config
        flag = "--kv-offloading-size" if c.kv_offloading_size is not None else "--kv-transfer-config"
        why = ("an encoder-only model keeps no KV cache" if self.is_encoder else
               "a hybrid model's prefix hits need its recurrent state, which is not offloaded" if self.state_bytes
               else None)
        if why:
            self.executor.shutdown()
            raise ValueError(f"{flag}: {why}")
        per_block = self.executor.bytes_per_block(c.block_size) * c.world_size
        # a consumer of prefill/decode disaggregation without an offload tier lands its pulled blocks in one
        # of kv_buffer_size bytes
        cpu_gib = c.kv_offloading_size if c.kv_offloading_size is not None else \
            c.kv_transfer_config.kv_buffer_size / 2**30
        sizes = {flag: cpu_gib, "--kv-offloading-disk-size": c.kv_offloading_disk_size}
        blocks = {name: int(gib * 2**30 // per_block) if gib else 0 for name, gib in sizes.items()}
        for name, n in blocks.items():
            if sizes[name] and n < 1:
                self.executor.shutdown()
                raise ValueError(f"{name} {sizes[name]:g} GiB holds no KV block ({per_block} bytes each over "
                                 f"{c.world_size} rank(s)): raise it")
        spec = OffloadSpec(blocks[flag], blocks["--kv-offloading-disk-size"],
                           c.kv_offloading_disk_path, report_changes=self.kv_events is not None)
        try:
            self.executor.enable_kv_offload(spec)
        except BaseException:
            self.executor.shutdown()
            raise
        logger.info("KV offloading: a CPU tier of %d blocks (%.1f MiB)%s, behind a pool of %d blocks", spec.cpu_blocks,
                    spec.cpu_blocks * per_block / 2**20, f", a disk tier of {spec.disk_blocks} blocks in "
                    f"{spec.disk_path}" if spec.disk_blocks else "", num_blocks)
        return KVTiers(self.executor, self.pool)

    def _resolve_max_model_len(self) -> int:
        limit = _model_max_len(self.hf_config)
        window = getattr(self.hf_config, "sliding_window", None)
        requested = self.config.max_model_len
        # A family that does not honour the config's window (it reports no windowed layer) is served only within it.
        honours_window = any(self.layer_windows)
        if isinstance(window, int) and window > 0 and not honours_window and (limit is None or window < limit):
            # Full attention over at most `window` tokens equals sliding-window attention.
            if requested is not None and requested > window:
                raise ValueError(f"max_model_len {requested} exceeds the model's sliding window ({window}); "
                                 "sliding-window attention beyond it is not supported")
            limit = window
        if requested is None:
            return limit or 2048
        if limit is not None and requested > limit:
            raise ValueError(f"max_model_len {requested} exceeds the model's maximum context length ({limit})")
        return requested

    def _default_batched_tokens(self) -> int:
        default = 8192 if self.device.type == "cuda" else 2048
        if not self.config.enable_chunked_prefill or self.is_encoder:
            default = max(default, self.max_model_len)
        return default

    def _num_kv_blocks(self) -> int:
        c = self.config
        # A draft model's cache has the same blocks; padding blocks are allocated past the pool, so inside the
        # budget too.
        per_block = self.executor.bytes_per_block(c.block_size) + self.executor.drafter_bytes_per_block(c.block_size)
        padding = self.executor.padding_blocks
        if c.num_kv_blocks is not None:
            return c.num_kv_blocks
        if self.is_encoder:  # blocks only count tokens: a step's prompts (each rounded up), freed after the step
            return -(-self.max_num_batched_tokens // c.block_size) + c.max_num_seqs
        if self.device.type == "cuda" and c.kv_cache_memory is None:
            free, total = torch.cuda.mem_get_info(self.device)
            peak = self.executor.profile_peak_memory(
                min(c.max_num_batched_tokens or self._default_batched_tokens(), self.max_model_len), c.block_size)
            used_by_others = total - free - torch.cuda.memory_allocated(self.device)
            budget = total * c.gpu_memory_utilization - torch.cuda.memory_allocated(self.device) - peak - used_by_others
            if budget <= 0:
                raise ValueError(f"no GPU memory left for the KV cache at gpu_memory_utilization={c.gpu_memory_utilization}")
            budget = self._carve_state(int(budget), per_block, padding, "--gpu-memory-utilization")
            return max(1, int(budget // per_block) - padding)
        budget = self._carve_state(c.kv_cache_memory or DEFAULT_CPU_KV_CACHE_BYTES, per_block, padding,
                                   "--kv-cache-memory")
        return max(1, budget // per_block - padding)

    def _carve_state(self, budget: int, per_block: int, padding: int, flag: str) -> int:
        """A hybrid model's recurrent state for --max-num-seqs sequences comes out of the cache budget first; what
        is left must still hold one max_model_len sequence's KV blocks. Returns the bytes left for KV blocks."""
        if not self.state_bytes:
            return budget
        c = self.config
        kv_floor = (-(-self.max_model_len // c.block_size) + padding) * per_block
        per_seq = self.state_bytes * self.num_state_slots // c.max_num_seqs  # its slot (checkpoint's, backup's)
        fits = max(0, (budget - kv_floor) // per_seq)
        if c.max_num_seqs > fits:
            raise ValueError(
                f"--max-num-seqs {c.max_num_seqs} needs {c.max_num_seqs * per_seq / 2**20:.1f} MiB of recurrent "
                f"state ({per_seq / 2**20:.2f} MiB per sequence{self._state_extras()}); "
                f"the cache budget ({flag}, {budget / 2**20:.1f} MiB) holds the state of at most {fits} sequences next "
                f"to the KV blocks of one max_model_len={self.max_model_len} sequence: lower --max-num-seqs to {fits} "
                f"or raise {flag}")
        return budget - c.max_num_seqs * per_seq

    def _state_extras(self) -> str:
        extras = [name for name, n in (("its prefix-cache checkpoint", self.num_checkpoints),
                                       ("its speculative backup", self.num_backups)) if n]
        return f", with {' and '.join(extras)}" if extras else ""

    # -- requests -------------------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int],
                    params: SamplingParams | PoolingParams | None = None, *,
                    arrival_time: float | None = None, priority: int = 0,
                    lora_request: str | LoRARequest | None = None, images: list | None = None) -> None:
        """lora_request: the name of a registered LoRA adapter (or its LoRARequest) to run the request under.
        images: a vision-language model's images (PIL images, encoded bytes, or core.images.ProcessedImage), one
        per image placeholder token of the prompt, in order.
        PoolingParams make it an embedding request: its prompt is prefilled and pooled, nothing is generated."""
        params = params or SamplingParams()
        pooling = None
        if isinstance(params, PoolingParams):
            if self.pooler is None:
                raise ValueError("this engine does not serve embeddings (--runner generate, or a tensor/pipeline-"
                                 "parallel engine); start it with --runner auto or pooling")
            if lora_request is not None:
                raise ValueError("embeddings under a LoRA adapter are not supported")
            pooling = self.pooler.resolve(params)
        elif not self.generates:
            raise ValueError("this engine serves embeddings only (an encoder-only model, or --runner pooling): "
                             "use /v1/embeddings")
        lora = self._lora(lora_request)
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if isinstance(prompt, str):
            text, token_ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, token_ids = None, list(prompt)
            bad = [t for t in token_ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"prompt token id {bad[0]!r} is out of range: ids must be integers in [0, {self.vocab_size})")
        if not token_ids:
            raise ValueError("the prompt is empty")
        placed = None
        if images and self.images is None:
            raise ValueError(f"the model {self.model_name} takes text only: it cannot be given images")
        if self.images is not None and (images or self.images.token_id in token_ids):
            if pooling is not None:
                raise ValueError("embeddings of prompts with images are not supported")
            token_ids, placed = self.images.place(token_ids, self.images.preprocess(list(images or [])),
                                                  self.config.block_size)
        if pooling is not None:
            if len(token_ids) > self.max_model_len:
                raise ContextLengthError(self.max_model_len, len(token_ids), 0, embedding=True)
            self._add_pooling_request(request_id, text, token_ids, pooling, arrival_time, priority)
            return
        max_tokens = params.max_tokens
        if max_tokens is None:
            max_tokens = self.max_model_len - len(token_ids)
        # An explicit max_tokens=0 scores the prompt (prompt_logprobs) without generating.
        if len(token_ids) + max_tokens > self.max_model_len or (max_tokens < 1 and params.max_tokens != 0):
            raise ContextLengthError(self.max_model_len, len(token_ids), max(max_tokens, 1))
        if max_tokens != params.max_tokens:
            params = params.clone(max_tokens=max_tokens)
        grammar = params.structured_outputs
        if isinstance(grammar, StructuredOutputsParams):  # offline callers; the server compiles ahead, off-loop
            grammar = self.grammar_compiler.compile(grammar)
        if grammar is not None and not isinstance(grammar, CompiledGrammar):
            raise TypeError(f"structured_outputs must be StructuredOutputsParams, got {type(grammar).__name__}")
        request = Request(request_id, text, token_ids, params, RequestMetrics(arrival_time or time.time()), priority)
        if lora is not None:
            self.lora.acquire(lora)  # loads it again if it was evicted; last, so a refused request holds nothing
            request.lora = lora
        if params.prompt_logprobs is not None:
            request.prompt_logprobs = [None]
        # A final-only request (the offline LLM) without stop strings needs no text before it finishes: its
        # detokenizer is built and run once then (_append_token), not once per step on the engine's critical path.
        text_at_finish = params.output_kind is RequestOutputKind.FINAL_ONLY and not params.stop
        for i in range(params.n):
            seq = Sequence(
                seq_id=next(self._seq_ids), request=request, index=i, token_ids=list(token_ids),
                num_prompt_tokens=len(token_ids), images=placed,
                generator=make_generator(params.seed, i, self.device) if params.seed is not None else None,
                detokenizer=None if text_at_finish else IncrementalDetokenizer.from_params(self.tokenizer, token_ids,
                                                                                            params),
            )
            seq.logprobs = [] if params.logprobs is not None else None
            seq.grammar = grammar.matcher() if grammar is not None else None
            request.seqs.append(seq)
            self.scheduler.add(seq)
        self.requests[request_id] = request
        self.prompt_tokens_total += len(token_ids)

    def _add_pooling_request(self, request_id: str, text: str | None, token_ids: list[int], pooling: PoolingParams,
                             arrival_time: float | None, priority: int) -> None:
        # Nothing is generated (max_tokens 0); the request keeps plain parameters so shared paths read one type.
        params = SamplingParams(max_tokens=0, output_kind=RequestOutputKind.FINAL_ONLY)
        request = Request(request_id, text, token_ids, params, RequestMetrics(arrival_time or time.time()), priority,
                          pooling=pooling)
        seq = Sequence(seq_id=next(self._seq_ids), request=request, index=0, token_ids=list(token_ids),
                       num_prompt_tokens=len(token_ids))
        request.seqs.append(seq)
        self.scheduler.add(seq)
        self.requests[request_id] = request
        self.prompt_tokens_total += len(token_ids)

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for rid in request_ids:
            request = self.requests.pop(rid, None)
            if request is None:
                continue
            for seq in request.seqs:
                if not seq.is_finished:
                    self.scheduler.remove(seq)
                    seq.finish_reason = "abort"
            self._release(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # -- sleep mode (--enable-sleep-mode; vLLM's /sleep and /wake_up) -----------------------------------------
    def sleep(self, level: int = 1) -> None:
        """Release the KV cache (and at level 2 the weights) on every rank. Refused (SleepError) with requests in
        flight: their KV blocks would go with the cache; the caller waits for them or aborts them first."""
        if not self.config.enable_sleep_mode:
            raise SleepError("sleep mode is not enabled on this engine (start it with --enable-sleep-mode)")
        if level not in (1, 2):
            raise SleepError(f"level must be 1 (free the KV cache, keep the weights) or 2 (free both), got {level}")
        if self.sleep_level:
            raise SleepError(f"the engine is already asleep (level {self.sleep_level}); POST /wake_up first")
        if self.requests:
            raise SleepError(f"{len(self.requests)} request(s) in flight: sleep is refused until they finish",
                             conflict=True)
        if level == 2 and self.lora is not None:
            raise SleepError("level 2 drops the weights the loaded LoRA adapters are attached to; use level 1")
        if self.kv_transfer is not None:
            self.kv_transfer.release_all()
        self.executor.sleep(level)
        self.sleep_level = level
        self.pool.reset_prefix_cache()  # the blocks' contents are gone with the cache (nothing holds a block)
        self._publish_kv_events()

    def wake_up(self) -> None:
        """Weights back (level 1) or reloaded from the model files (level 2), a fresh KV cache and an empty prefix
        cache (the old blocks' contents are gone)."""
        if not self.config.enable_sleep_mode:
            raise SleepError("sleep mode is not enabled on this engine (start it with --enable-sleep-mode)")
        if not self.sleep_level:
            raise SleepError("the engine is awake; there is nothing to wake up")
        c = self.config
        self.executor.wake_up()
        self.executor.allocate_kv_cache(self.pool.num_blocks, c.block_size)
        self.pool = BlockPool(self.pool.num_blocks, c.block_size, c.enable_prefix_caching,
                              events=self.kv_events is not None)
        self.scheduler.pool = self.pool
        if self.tiers is not None:
            self.tiers.attach(self.pool)
        self.sleep_level = 0

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (vLLM's reset_prefix_cache); False, and nothing changed, while requests hold
        KV blocks."""
        if self.kv_transfer is not None:  # prefills held for pulls: what they hold is to be forgotten too
            self.kv_transfer.release_all()
        done = self.pool.reset_prefix_cache()
        if done and self.tiers is not None:
            self.tiers.clear()  # the offloaded blocks are part of the prefix cache
        self._publish_kv_events()
        return done

    def publish_kv_events(self) -> None:
        """Publish what the prefix cache changed since the last call: the pool's events, then the offload tiers'
        (whose copy thread runs off the step, so an idle engine loop calls this too)."""
        self._publish_kv_events()

    def _publish_kv_events(self) -> None:
        if self.kv_events is None:
            return
        events = self.pool.take_events()
        if self.tiers is not None:
            from shoal.engine.core.kv_events import tier_media

            events += self.tiers.take_events(tier_media(self.kv_events.medium))
        if events:
            names = {lora.id: name for name, lora in self.lora.registered.items()} if self.lora is not None else None
            self.kv_events.publish(events, names)

    def memory_bytes(self) -> dict[str, int]:
        """KV-cache and weight bytes rank 0 holds now (what sleep frees and wake_up restores)."""
        return self.executor.memory_bytes()

    def check_health(self) -> None:
        """Raise once the executor can no longer run steps (a rank of a multi-process engine failed), so an idle
        engine loop notices too."""
        self.executor.check_health()

    # -- one step -------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        if self.kv_transfer is not None:  # prefills no pull came for give their blocks back before scheduling
            self.kv_transfer.expire()
        if self.proposer is not None:
            self._propose()
        sched = self.scheduler.schedule()
        if not sched.scheduled and self.scheduler.waiting and self.kv_transfer is not None and \
                self.kv_transfer.held_blocks:  # blocks held for pulls never keep a request from running
            self.kv_transfer.release_all()
            sched = self.scheduler.schedule()
        if not sched.scheduled:
            self._publish_kv_events()
            return []
        now = time.time()
        for s in sched.scheduled:
            if s.seq.request.metrics.first_scheduled_time is None:
                s.seq.request.metrics.first_scheduled_time = now
        if self.proposer is not None and self.proposer.fills_after_schedule:
            self.proposer.fill(sched.scheduled)
        rows, sampling, scoring = self._sampling_rows(sched.scheduled)
        pooling = self._pooling_ranges(sched.scheduled)
        inputs = build_step_inputs(sched.scheduled, self.config.block_size)
        if self.lora is not None:
            self._lora_inputs(inputs, sched.scheduled)
        if self.tiers is not None:
            self.tiers.flush()  # evicted blocks out to the tiers before this step overwrites them
        if inputs.pool_ranges:
            sampled, pooled = self.executor.execute_pooling(inputs, rows)
        else:
            sampled, pooled = self.executor.execute(inputs, rows), None
        self.scheduler.after_step(sched)
        embedded = self._finish_pooling(pooling, pooled) if pooling else []
        self._publish_kv_events()

        for row, request in scoring:
            self._record_prompt_logprob(request, row, sampled)
        now = time.time()
        touched: dict[str, Request] = {}
        for i, seq, num_draft in sampling:
            appended = self._append_tokens(seq, i, num_draft, sampled)
            seq.request.metrics.num_generation_tokens += appended
            self.generation_tokens_total += appended
            touched[seq.request.request_id] = seq.request
        outputs = []
        for request in touched.values():
            m = request.metrics
            if m.first_token_time is None:
                m.first_token_time = now
            else:
                m.inter_token_latency = now - m.last_token_time
            m.last_token_time = now
            if request.is_finished:
                m.finished_time = now
                self.requests.pop(request.request_id, None)
                self._release(request)
            out = self._request_output(request)
            if out is not None:
                outputs.append(out)
        return outputs + embedded

    # -- embedding requests ---------------------------------------------------------------------------------
    @staticmethod
    def _pooling_ranges(scheduled: list[ScheduledSeq]) -> list[ScheduledSeq]:
        """Set the positions each embedding request pools this step; its scheduled entries (in step order)."""
        out = []
        for s in scheduled:
            seq = s.seq
            if seq.pooling is None:
                continue
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + s.num_new_tokens
            kind = seq.pooling.pooling_type
            if kind == "MEAN":
                s.pooled = range(start, end)
            elif kind == "CLS" and start == 0:
                s.pooled = range(0, 1)
            elif kind == "LAST" and end == seq.num_prompt_tokens:
                s.pooled = range(end - 1, end)
            out.append(s)
        return out

    def _finish_pooling(self, scheduled: list[ScheduledSeq], pooled) -> list[RequestOutput]:
        """Add this step's pooled hidden states to each embedding request; finish those whose prompt is done (their
        blocks go back to the pool at once)."""
        outputs = []
        now = time.time()
        row = 0
        for s in scheduled:
            seq = s.seq
            if s.pooled:
                vector = pooled[row]
                row += 1
                # A chunk from position 0 starts the sum again (a preempted prompt is recomputed from there).
                seq.pooled = vector if s.pooled.start == 0 or seq.pooled is None else seq.pooled + vector
            if seq.num_computed_tokens < seq.num_prompt_tokens:
                continue
            request = seq.request
            seq.finish_reason = "stop"
            self.scheduler.remove(seq)
            embedding = finish_pooling(seq.pooled, seq.num_prompt_tokens, request.pooling)
            seq.pooled = None
            m = request.metrics
            m.first_token_time = m.last_token_time = m.finished_time = now
            self.requests.pop(request.request_id, None)
            outputs.append(RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, [], True, m,
                                         seq.num_cached_tokens, embedding=embedding))
        return outputs

    def _sampling_rows(self, scheduled: list[ScheduledSeq]):
        """One sampler row per logits row, in the runner's order: a sequence's prompt-scoring rows (prompt
        logprobs), then its sampling row. Constrained rows get their grammar's bitmask for this step."""
        rows: list[SamplingRow] = []
        sampling: list[tuple[int, Sequence]] = []
        scoring: list[tuple[int, Request]] = []
        constrained: list[tuple[int, Sequence]] = []
        for s in scheduled:
            seq = s.seq
            upto = seq.prompt_scored_upto
            if upto is not None:
                c = seq.num_computed_tokens
                s.scored = range(max(c, upto), min(c + s.num_new_tokens, seq.num_prompt_tokens - 1))
                for p in s.scored:
                    scoring.append((len(rows), seq.request))
                    rows.append(SamplingRow(seq.params, [], [], target=seq.token_ids[p + 1]))
            if s.samples:
                if seq.grammar is not None:
                    constrained.append((len(rows), seq))
                sampling.append((len(rows), seq, s.num_draft))
                output = seq.output_token_ids
                q = seq.spec_probs  # a draft model's distributions (empty for n-gram proposals)
                rows.append(SamplingRow(seq.params, seq.request.prompt_token_ids, output, seq.generator,
                                        draft=seq.spec_token_ids[0] if s.num_draft else None,
                                        draft_probs=q[0] if s.num_draft and q else None))
                # One row per proposal: the model's next token after it, as if the proposals before it had been
                # generated (penalties and min_tokens see them).
                for j in range(1, s.num_draft + 1):
                    more = j < s.num_draft
                    rows.append(SamplingRow(seq.params, seq.request.prompt_token_ids,
                                            output + seq.spec_token_ids[:j], seq.generator,
                                            draft=seq.spec_token_ids[j] if more else None,
                                            draft_probs=q[j] if more and q else None))
        if constrained:
            bitmask = torch.zeros(len(constrained), self._bitmask_words, dtype=torch.int32)
            for j, (i, seq) in enumerate(constrained):
                seq.grammar.fill_bitmask(bitmask, j)
                rows[i].token_bitmask = bitmask[j]
        return rows, sampling, scoring

    def _record_prompt_logprob(self, request: Request, row: int, sampled) -> None:
        token = sampled.token_ids[row]
        entry = {token: Logprob(sampled.logprobs[row], sampled.ranks[row] if sampled.ranks else None,
                                self.tokenizer.decode([token]))}
        for rank, (tid, lp) in enumerate(sampled.top_logprobs[row] or [], start=1):
            entry.setdefault(tid, Logprob(lp, rank, self.tokenizer.decode([tid])))
        request.prompt_logprobs.append(entry)

    def _propose(self) -> None:
        """Speculative decoding: proposals for this step's decoding sequences, or none at all when the batch is
        large enough that verifying them costs more than they save (disable_by_batch_size)."""
        running = self.scheduler.running
        speculate = len(running) <= self.spec.disable_by_batch_size
        for seq in running:
            seq.spec_token_ids, seq.spec_probs = [], []
            # Decoding sequences only: not the last token of a prompt whose prefill was cut just before it (a
            # hybrid's prefix-cache boundary, a chunk), so proposals never depend on how a prompt was chunked.
            if not speculate or seq.grammar is not None or seq.pooling is not None or \
                    seq.num_tokens - seq.num_computed_tokens != 1 or not seq.num_output_tokens:
                continue
            # Room for the proposals and the model's own token after them, within max_tokens and the context.
            room = min(seq.params.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens) - 1
            seq.spec_token_ids = self.proposer.propose(seq.token_ids, room)

    def _append_tokens(self, seq: Sequence, row: int, num_draft: int, sampled) -> int:
        """Append a sequence's sampled token, or, after a speculative step, its accepted proposals and the
        model's token after them, one at a time, so every stop condition applies exactly as without speculation.
        Returns the number of tokens appended."""
        if not num_draft:
            self._append_token(seq, row, sampled)
            return 1
        draft = seq.spec_token_ids
        accepted = 0
        for j in range(num_draft + 1):
            token = sampled.token_ids[row + j]
            self._append_token(seq, row + j, sampled)
            if j == num_draft or token != draft[j]:
                break
            accepted += 1
            if seq.is_finished:
                break
        self.spec_num_drafts += 1
        self.spec_num_draft_tokens += num_draft
        self.spec_num_accepted_tokens += accepted
        seq.spec_token_ids, seq.spec_probs = [], []
        if not seq.is_finished:
            self.scheduler.accept_draft(seq, accepted, num_draft)
        return j + 1

    def _append_token(self, seq: Sequence, row: int, sampled) -> None:
        token = sampled.token_ids[row]
        params = seq.params
        if params.max_tokens == 0:  # scoring only: the prompt is computed, nothing is generated
            seq.finish_reason = "length"
            self.scheduler.remove(seq)
            return
        seq.token_ids.append(token)
        if seq.logprobs is not None:
            seq.cumulative_logprob += sampled.logprobs[row]
            entry = {token: Logprob(sampled.logprobs[row], sampled.ranks[row] if sampled.ranks else None,
                                    self.tokenizer.decode([token]))}
            for rank, (tid, lp) in enumerate(sampled.top_logprobs[row] or [], start=1):
                entry.setdefault(tid, Logprob(lp, rank, self.tokenizer.decode([tid])))
            seq.logprobs.append(entry)

        reason, stop_reason = None, None
        if token in params.stop_token_ids:
            reason, stop_reason = "stop", token
        elif token in self.eos_token_ids and not params.ignore_eos:
            reason = "stop"
        shows_token = reason is None or params.include_stop_str_in_output  # a stop token's text is not shown
        if shows_token and seq.detokenizer is not None:
            seq.unsent_text += seq.detokenizer.append(token)
            if seq.detokenizer.stop_string is not None:
                reason, stop_reason = "stop", seq.detokenizer.stop_string
        if seq.grammar is not None and reason is None:
            seq.grammar.accept(token)
            if seq.grammar.is_finished:  # complete: nothing may follow (EOS itself already stopped it above)
                reason = "stop"
        if reason is None and (seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len):
            reason = "length"
        if reason is not None:
            if seq.detokenizer is None:  # text deferred to the finish (see add_request): all of it at once
                seq.detokenizer = IncrementalDetokenizer.from_params(
                    self.tokenizer, seq.token_ids[:seq.num_prompt_tokens], params)
                shown = seq.output_token_ids if shows_token else seq.output_token_ids[:-1]
                seq.unsent_text += seq.detokenizer.append(shown)
            if seq.detokenizer.stop_string is None:
                seq.unsent_text += seq.detokenizer.flush()
            seq.finish_reason, seq.stop_reason = reason, stop_reason
            self.scheduler.remove(seq)

    def _request_output(self, request: Request) -> RequestOutput | None:
        """This step's output of a request in its params.output_kind: cumulative, only what is new since the last
        output (DELTA: the one place where "new" is decided), or nothing until it finishes (FINAL_ONLY)."""
        kind = request.params.output_kind
        if kind is RequestOutputKind.FINAL_ONLY and not request.is_finished:
            return None
        outputs = []
        for seq in request.seqs:
            start = seq.num_sent_tokens if kind is RequestOutputKind.DELTA else 0
            if (kind is RequestOutputKind.DELTA and start == seq.num_output_tokens and not seq.unsent_text
                    and (seq.finish_sent or seq.finish_reason is None)):
                continue  # nothing new (a finished sibling, or a sequence still prefilling)
            seq.finish_sent = seq.finish_reason is not None
            outputs.append(CompletionOutput(
                index=seq.index,
                text=seq.unsent_text if kind is RequestOutputKind.DELTA else (
                    seq.detokenizer.text if seq.detokenizer is not None else ""),
                token_ids=seq.token_ids[seq.num_prompt_tokens + start:],
                cumulative_logprob=seq.cumulative_logprob if seq.logprobs is not None else None,
                logprobs=seq.logprobs[start:] if seq.logprobs is not None else None,
                finish_reason=seq.finish_reason, stop_reason=seq.stop_reason,
            ))
            seq.num_sent_tokens = seq.num_output_tokens
            seq.unsent_text = ""
        prompt_logprobs = None
        complete = request.prompt_logprobs is not None and len(request.prompt_logprobs) == len(request.prompt_token_ids)
        if complete and (kind is not RequestOutputKind.DELTA or not request.prompt_logprobs_sent):
            prompt_logprobs = request.prompt_logprobs
            request.prompt_logprobs_sent = True
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, outputs,
                             request.is_finished, request.metrics, request.seqs[0].num_cached_tokens,
                             prompt_logprobs)

    # -- LoRA adapters ----------------------------------------------------------------------------------------
    def _lora(self, lora_request: str | LoRARequest | None) -> LoRARequest | None:
        if lora_request is None:
            return None
        if self.lora is None:
            raise ValueError("LoRA adapters are not enabled (start the engine with --enable-lora)")
        return self.lora.get(lora_request if isinstance(lora_request, str) else lora_request.name)

    def _release(self, request: Request) -> None:
        if request.lora is not None:
            self.lora.release(request.lora)
            request.lora = None

    def _lora_inputs(self, inputs, scheduled: list[ScheduledSeq]) -> None:
        """Each token's adapter slot (-1: the base model) and the adapter each slot must hold."""
        ids = {s.seq.lora_id for s in scheduled} - {None}
        if not ids:
            return
        slot_of = self.lora.assign_slots(ids)
        per_seq = torch.tensor([slot_of.get(s.seq.lora_id, -1) for s in scheduled], dtype=torch.int64)
        counts = torch.tensor([s.num_new_tokens for s in scheduled], dtype=torch.int64)
        inputs.lora_token_slots = torch.repeat_interleave(per_seq, counts)
        inputs.lora_slot_ids = list(self.lora.slot_ids)

    def add_lora(self, name: str, path: str) -> LoRARequest:
        """Register and load an adapter (vLLM's /v1/load_lora_adapter); LoRAError says why it cannot be."""
        if self.lora is None:
            raise ValueError("LoRA adapters are not enabled (start the engine with --enable-lora)")
        return self.lora.register(name, path)

    def remove_lora(self, name: str) -> None:
        """Unregister an adapter; its running requests finish under it first."""
        if self.lora is None:
            raise ValueError("LoRA adapters are not enabled (start the engine with --enable-lora)")
        self.lora.unregister(name)

    def list_loras(self) -> list[LoRARequest]:
        return [] if self.lora is None else list(self.lora.registered.values())

    # -- introspection --------------------------------------------------------------------------------------
    def _waiting_prefill_tokens(self) -> int:
        waiting = sum(seq.num_tokens - seq.num_computed_tokens for seq in self.scheduler.waiting)
        prefilling = sum(seq.num_prompt_tokens - seq.num_computed_tokens for seq in self.scheduler.running
                         if seq.num_computed_tokens < seq.num_prompt_tokens)
        return waiting + prefilling

    def get_stats(self) -> EngineStats:
        lora = {}
        if self.lora is not None:
            running, waiting = self.lora.running_waiting(self.scheduler)
            lora = dict(lora_running=running, lora_waiting=waiting,
                        lora_resident=[v.name for v in self.lora.resident.values()],
                        lora_registered=[(v.name, v.path, v.created) for v in self.lora.registered.values()],
                        lora_loads_total=len(self.lora.load_seconds))
        tiers = {}
        if self.tiers is not None:
            tiers = dict(prefix_cache_tier_hits={"device": self.pool.prefix_hits, **self.tiers.hits},
                         kv_offload_tiers=self.tiers.usage())
        return EngineStats(**lora, **tiers,
            num_running=len({s.request.request_id for s in self.scheduler.running}),
            num_waiting=len({s.request.request_id for s in self.scheduler.waiting}),
            num_waiting_prefill_tokens=self._waiting_prefill_tokens(),
            kv_cache_usage=self.pool.usage(),
            num_kv_blocks=self.pool.num_blocks,
            num_free_kv_blocks=self.pool.num_free,
            num_preemptions_total=self.scheduler.num_preemptions,
            prefix_cache_queries_total=self.pool.prefix_queries,
            prefix_cache_hits_total=self.pool.prefix_hits,
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
            spec_decode_num_drafts_total=self.spec_num_drafts,
            spec_decode_num_draft_tokens_total=self.spec_num_draft_tokens,
            spec_decode_num_accepted_tokens_total=self.spec_num_accepted_tokens,
        )

    def shutdown(self) -> None:
        self.executor.shutdown()
        if self.kv_events is not None:
            self.kv_events.close()
