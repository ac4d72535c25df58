"""Decode graph capture: batch-size buckets, padded static input buffers, capture after warm-up, replay.

A pure decode step (every sequence adds one token and samples) has the same tensor shapes whenever it has the same
number of sequences. Such a step is padded up to the next bucket size (1, 2, 4, 8, then multiples of 8 up to
max_num_seqs), its inputs are copied into that bucket's static buffers, and the bucket's forward — embedding,
every layer, LM head — runs as one captured graph. Padding rows decode token 0 at position 0 into a KV block of
their own (one extra block the runner allocates past the pool), so they never touch a real sequence's cache; their
logits are dropped. Steps with prompt tokens, larger batches, and pipeline stages run eagerly.

One mechanism, pluggable backends (`--enforce-eager` turns capture off):
  - "cuda-graph": torch.cuda.CUDAGraph per bucket, all sharing one memory pool; captured on a bucket's first use
    after two warm-up runs. This removes the per-kernel launch overhead that dominates small decode steps.
  - "cpu-graph" (the CPU default): the bucket's forward recorded once, after two warm-up runs, as the dispatcher
    ops it runs and replayed by TorchScript's interpreter (execution/cpu_graph.py). This removes the Python that
    issues ~25 ops per decoder layer (measured at batch 1 on SmolLM2-135M: 47.0 -> 39.6 ms a step, float32, one
    thread). On CPU only batches up to CPU_GRAPH_MAX_SEQS (64) are captured: above it a step's arithmetic dwarfs
    that Python. The cap was 16 while bf16 batches ran on the vector kernel (its cost grows with every padded row);
    with AMX tiles a padded row is nearly free, and capturing up to 64 measured +7-11% offline on the bench model
    (AMX), +1% capped to AVX-512-BF16 and +6% in float32 capped to AVX2.
  - "eager": the same bucketing and static buffers, run eagerly. It saves nothing (padding costs a little) and
    exists so that the mechanism itself runs and is tested on machines without a GPU.
(A torch.compile backend per bucket was tried on CPU and not kept: Dynamo breaks the graph at every custom kernel.)

A captured CPU graph is saved to $SHOAL_CACHE/cpu-graphs/ and loaded on the next start instead of recorded
(execution/graph_cache.py; SHOAL_GRAPH_CACHE=0 turns that off).

If capturing a bucket fails, a warning is logged and decode steps run eagerly from then on.
"""

from __future__ import annotations

import logging

import torch

from shoal.engine import startup
from shoal.engine.execution.attention.base import AttentionMetadata

logger = logging.getLogger(__name__)

BACKENDS = ("cuda-graph", "cpu-graph", "eager")
CPU_GRAPH_MAX_SEQS = 64


def batch_buckets(max_num_seqs: int) -> list[int]:
    """Bucket sizes: 1, 2, 4, 8, then every multiple of 8 up to max_num_seqs (which is always the last)."""
    sizes = [b for b in (1, 2, 4) if b < max_num_seqs] + list(range(8, max_num_seqs, 8))
    return sorted(set(sizes + [max_num_seqs]))


def decode_capture_backend(config, device: torch.device) -> str | None:
    """The capture backend an engine config asks for on this device (None: every step eager)."""
    if config.enforce_eager or config.decode_capture == "none":
        return None
    if config.decode_capture == "auto":
        return "cuda-graph" if device.type == "cuda" else "cpu-graph"
    return config.decode_capture


class DecodeGraphs:
    """Padded, captured decode steps for one ModelRunner (see the module docstring)."""

    def __init__(self, runner, backend: str, max_num_seqs: int, max_model_len: int, block_size: int,
                 pad_block: int):
        if backend not in BACKENDS:
            raise ValueError(f"unknown decode capture backend {backend!r}; choose from {', '.join(BACKENDS)}")
        self.runner = runner
        self.backend = backend
        if backend == "cpu-graph":
            max_num_seqs = min(max_num_seqs, CPU_GRAPH_MAX_SEQS)
        self.buckets = batch_buckets(max_num_seqs)
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.pad_block = pad_block
        P, dev = self.buckets[-1], runner.device
        width = -(-max_model_len // block_size)
        # Static input buffers, shared by every bucket (bucket b reads their first b rows).
        self.input_ids = torch.zeros(P, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(P, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.zeros(P, dtype=torch.int64, device=dev)
        self.seq_lens = torch.ones(P, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(P + 1, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros(P, width, dtype=torch.int32, device=dev)
        self.graphs: dict[int, tuple[object, torch.Tensor]] = {}  # bucket -> (graph, its static logits)
        if runner.lora is not None:  # LoRA adapters: a static token -> slot map too (execution/lora.py)
            runner.lora.enable_capture(P, dev)
        self.pool = None
        self.failed = False
        self.num_padded_steps = 0  # decode steps that ran through a bucket (captured or eager)
        self.num_loaded = 0  # CPU graphs loaded from the persistent cache rather than recorded (graph_cache.py)
        self._key_parts: dict | None = None  # the cache key's parts every bucket shares ({}: no key can be made)

    # -- which steps ---------------------------------------------------------------------------------------------
    def bucket_for(self, inputs) -> int | None:
        """The bucket of a pure decode step that samples every sequence, or None (the step runs eagerly)."""
        B = len(inputs.query_lens)
        if self.failed or B > self.buckets[-1] or any(q != 1 for q in inputs.query_lens):
            return None
        if inputs.logits_indices.numel() != B or max(inputs.seq_lens_list) > self.max_model_len:
            return None
        return next(b for b in self.buckets if b >= B)

    # -- padding ---------------------------------------------------------------------------------------------------
    def _fill(self, inputs, bucket: int) -> None:
        """Copy a step into the static buffers; rows B..bucket become padding rows."""
        B = len(inputs.query_lens)
        self.input_ids[:B].copy_(inputs.input_ids, non_blocking=True)
        self.positions[:B].copy_(inputs.positions, non_blocking=True)
        self.slot_mapping[:B].copy_(inputs.slot_mapping, non_blocking=True)
        self.seq_lens[:B].copy_(inputs.seq_lens, non_blocking=True)
        w = inputs.block_tables.shape[1]
        self.block_tables[:B, :w].copy_(inputs.block_tables, non_blocking=True)
        if bucket > B:
            self.input_ids[B:bucket].zero_()
            self.positions[B:bucket].zero_()
            self.slot_mapping[B:bucket].fill_(self.pad_block * self.block_size)
            self.seq_lens[B:bucket].fill_(1)
            self.block_tables[B:bucket, 0].fill_(self.pad_block)

    def _meta(self, bucket: int, seq_lens_list: list[int]) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bucket], query_start_loc=self.query_start_loc[:bucket + 1],
            seq_lens=self.seq_lens[:bucket], block_tables=self.block_tables[:bucket], max_query_len=1,
            max_seq_len=max(seq_lens_list), query_lens_list=[1] * bucket, seq_lens_list=seq_lens_list,
            is_decode_only=True)

    def _forward(self, bucket: int, meta: AttentionMetadata) -> torch.Tensor:
        model = self.runner.model
        hidden = model(self.input_ids[:bucket], self.positions[:bucket], self.runner.kv_caches, meta)
        return model.compute_logits(hidden)

    # -- run -------------------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, inputs) -> torch.Tensor | None:
        """Logits [B, vocab] of a decode step through its bucket, or None when the step must run eagerly."""
        bucket = self.bucket_for(inputs)
        if bucket is None:
            return None
        B = len(inputs.query_lens)
        self._fill(inputs, bucket)
        if self.runner.lora is not None:
            self.runner.lora.prepare_padded(inputs.lora_slot_ids, inputs.lora_token_slots, bucket,
                                            captured=self.backend != "eager")
        self.num_padded_steps += 1
        if self.backend == "eager":
            # Host-side values are exact here (nothing is baked into a graph): backends may plan from them.
            lens = list(inputs.seq_lens_list) + [1] * (bucket - B)
            return self._forward(bucket, self._meta(bucket, lens))[:B]
        entry = self.graphs.get(bucket)
        if entry is None:
            entry = self._capture(bucket)
            if entry is None:
                self.num_padded_steps -= 1
                return None
        graph, logits = entry
        if self.backend == "cpu-graph":
            return graph.replay()[:B]
        graph.replay()
        return logits[:B]

    def _capture(self, bucket: int):
        """Warm up, then capture one bucket's forward; None (and eager from now on) if that fails."""
        # Host-side values become constants of the graph: every sequence is taken to be max_model_len long, an
        # upper bound that backends which support capture only use to size their work (see graph_capture_safe).
        meta = self._meta(bucket, [self.max_model_len] * bucket)
        if self.backend == "cpu-graph":
            return self._capture_cpu(bucket, meta)
        try:
            stream = torch.cuda.Stream(self.runner.device)
            stream.wait_stream(torch.cuda.current_stream(self.runner.device))
            with torch.cuda.stream(stream), startup.timed("warmup"):
                for _ in range(2):  # warm-up: lazy initialisation and autotuning must not happen under capture
                    self._forward(bucket, meta)
            torch.cuda.current_stream(self.runner.device).wait_stream(stream)
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with startup.timed("graph_capture"), torch.cuda.graph(graph, pool=self.pool):
                logits = self._forward(bucket, meta)
        except Exception as e:  # any capture failure: warn once and keep serving eagerly
            self.failed = True
            logger.warning("decode graph capture failed for batch size %d (%s: %s); running decode steps eagerly",
                           bucket, e.__class__.__name__, e)
            return None
        self.graphs[bucket] = (graph, logits)
        logger.info("captured the decode graph for batch size %d", bucket)
        return graph, logits

    def _capture_cpu(self, bucket: int, meta: AttentionMetadata):
        import time

        from shoal.engine.execution import cpu_graph, graph_cache

        start = time.perf_counter()
        try:
            with startup.timed("warmup"):
                for _ in range(2):  # warm-up: kernels are built and loaded, lazy state is set, before recording
                    warm = self._forward(bucket, meta)
            with startup.timed("graph_capture"):
                key = self._cache_key(bucket)
            graph = self._load_cpu(bucket, key, warm) if key else None
            if graph is not None:
                self.graphs[bucket] = (graph, None)
                self.num_loaded += 1
                logger.info("loaded the CPU decode graph for batch size %d from the cache (%d ops) in %.2f s",
                            bucket, graph.num_ops, time.perf_counter() - start)
                return graph, None
            recorded = []
            with startup.timed("graph_capture"):
                graph = cpu_graph.capture(lambda: recorded.append(
                    self._forward(bucket, self._meta(bucket, meta.seq_lens_list))) or recorded[0])
            # The same ops on the same inputs: the replay must give the recorded logits to the last bit.
            if not torch.equal(graph.replay(), recorded[0]):
                raise cpu_graph.CaptureError("the replayed forward differs from the recorded one")
        except Exception as e:  # CaptureError, or TorchScript refusing the program: warn once, stay eager
            self.failed = True
            logger.warning("decode graph capture failed for batch size %d (%s: %s); running decode steps eagerly",
                           bucket, e.__class__.__name__, e)
            return None
        self.graphs[bucket] = (graph, None)
        logger.info("captured the CPU decode graph for batch size %d (%d ops) in %.2f s", bucket, graph.num_ops,
                    time.perf_counter() - start)
        if key:
            with startup.timed("graph_capture"):
                self._save_cpu(bucket, key, graph)
        return graph, None

    # -- the persistent cache of CPU graphs (execution/graph_cache.py) -----------------------------------------------
    def _cache_key(self, bucket: int) -> str | None:
        from shoal.engine.execution import graph_cache

        if not graph_cache.enabled():
            return None
        if self._key_parts is None:
            self._key_parts = self._shared_key_parts() or {}
        return graph_cache.entry_key({**self._key_parts, "bucket": bucket}) if self._key_parts else None

    def _shared_key_parts(self) -> dict | None:
        """What every bucket's key shares, worked out once: a bucket is captured during serving, on its first step,
        and the model's identity (a stat of every file, a GGUF's metadata digest) need not be read again each time."""
        from shoal.engine.execution import graph_cache
        from shoal.engine.execution.cpu_features import cpu_features

        r = self.runner
        model_dir, quantization = r._load_args[0], r._load_args[7]
        try:
            identity = graph_cache.model_identity(model_dir)
        except Exception as e:  # files that cannot be read or stat'ed: nothing to key on, so no cache (never eager)
            logger.debug("no CPU graph cache key for %s (%s: %s)", model_dir, e.__class__.__name__, e)
            return None
        ps = r.model.ps
        lora = None if r.lora is None else [r.lora.max_loras, r.lora.max_rank]
        kv = [[list(getattr(c, f).shape) if getattr(c, f, None) is not None else None
               for f in ("k", "v", "k_scale", "v_scale")] if c is not None else None for c in r.kv_caches]
        to_json = getattr(r.hf_config, "to_json_string", None)
        return {
            "format": graph_cache.FORMAT, "model": identity, "hf_config": to_json() if to_json else repr(r.hf_config),
            "dtype": str(r.dtype), "quantization": quantization, "kv_cache_dtype": r.kv_cache_dtype, "kv": kv,
            "block_size": self.block_size, "max_model_len": self.max_model_len,
            "static_rows": self.buckets[-1], "pad_block": self.pad_block, "attention": r.backend_name, "lora": lora,
            "hidden_sink": r.keep_hidden,  # speculative MTP: the graph also writes the hidden states
            "parallel": [ps.tp_rank, ps.tp_size, ps.pp_rank, ps.pp_size, ps.expert_parallel],
            "torch": torch.__version__, "cpu_tier": cpu_features().tier, "threads": torch.get_num_threads(),
            "engine": graph_cache.engine_source_digest()}

    def _load_cpu(self, bucket: int, key: str, warm: torch.Tensor):
        """The cached graph of this key if it replays the warm-up's logits bit for bit; None otherwise (a bad entry
        is discarded with a warning, and the caller records afresh)."""
        from shoal.engine.execution import cpu_graph, graph_cache

        try:
            with startup.timed("graph_capture"):
                entry = graph_cache.load(key)
                if entry is None:
                    return None
                constants = graph_cache.rebuild_constants(entry["constants"], graph_cache.named_bases(self))
                graph = cpu_graph.CpuGraph(entry["source"], constants, int(entry.get("num_ops", 0)))
                # Same static inputs as the last warm-up (which wrote the same KV slot with the same values).
                if not torch.equal(graph.replay(), warm):
                    raise graph_cache.EntryError("its replay differs from the warm-up's logits")
        except Exception as e:  # anything: a cache entry must never cost more than a fresh recording
            logger.warning("discarding the cached CPU decode graph for batch size %d (%s: %s); recording it afresh",
                           bucket, e.__class__.__name__, e)
            graph_cache.discard(key)
            return None
        return graph

    def _save_cpu(self, bucket: int, key: str, graph) -> None:
        from shoal.engine.execution import graph_cache

        try:
            manifest = graph_cache.describe_constants(graph.constants, graph_cache.named_bases(self))
        except Exception as e:  # the graph is captured and serving: a failure to describe it only loses the cache
            logger.warning("not caching the CPU decode graph for batch size %d (%s: %s)", bucket,
                           e.__class__.__name__, e)
            return
        if manifest is None:
            logger.debug("not caching the CPU decode graph for batch size %d: a constant is a view of no tensor "
                         "that outlives a step", bucket)
            return
        graph_cache.save(key, graph.source, manifest, graph.num_ops)
