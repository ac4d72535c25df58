"""Where a decode step's time goes, measured on a live LLMEngine: `shoal-engine bench throughput --profile`.

StepProfiler attaches timers to an engine from the outside (wrapped methods and forward hooks, all removed by
detach), so the engine carries no profiling code: scheduler, host-side batch building, the model forward split
into embedding / each decoder layer (its linear layers, its attention — KV write plus kernel —, its MoE blocks —
router, experts, shared expert and their all-reduce — and the rest: norms, RoPE, activations, residual adds) /
final norm; then the LM head (logits), the sampler, detokenization, and
the engine's own bookkeeping (what is left of the step). Steps whose every sequence decodes one token are
reported apart from steps that carry prompt tokens.

The memory-traffic floor of a decode step is the bytes it must read at least once (every weight matrix, the
embedding rows of its tokens, the whole KV context of every sequence and, for hybrid models, every sequence's
recurrent state, read and written back) divided by the machine's measured read bandwidth; the compute floor is its matmul FLOPs divided by the measured matmul throughput at that batch size.
The MoE blocks get a floor of their own: the weights of the experts a decode step's tokens were actually routed to
(counted per block and step), the routers and shared experts, over the same bandwidth.
Hooks cost a few microseconds each, so profiled steps run slightly slower than unprofiled ones; and they run
eagerly: a captured decode graph (graph_capture.py) replays the same ops without the modules the timers hook, so
the unprofiled run's tokens/s is the one to compare with the breakdown's step time.
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager

import torch

from shoal.engine.execution.attention.layer import PagedAttention
from shoal.engine.execution.layers.linear import PackedMatmul
from shoal.engine.execution.layers.moe import SparseMoeBlock
from shoal.engine.execution.layers.weight_format import AmxBf16Weight, OneDNNBf16Weight
from shoal.engine.execution.sampling import Sampler


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def engine_runner(engine):
    """The ModelRunner this process steps (rank 0's own shard under tensor/pipeline parallelism)."""
    return engine.executor.runner


class StepProfiler:
    def __init__(self, engine):
        self.engine = engine
        self.runner = engine_runner(engine)
        self.model = getattr(self.runner, "model", None)
        if self.model is None:
            raise RuntimeError("--profile needs a single-process engine (tensor/pipeline parallel size 1)")
        self.device = self.runner.device
        self.current: dict[str, float] = defaultdict(float)
        self.totals = {"decode": defaultdict(float), "prefill": defaultdict(float)}
        self.steps = {"decode": 0, "prefill": 0}
        self.decode_batch = 0  # summed over decode steps
        self.decode_context = 0  # tokens of KV context read, summed over decode steps
        self.moe_bytes = 0  # weight bytes the MoE blocks had to read, summed over decode steps
        self._undo: list = []
        self._starts: dict[int, float] = {}
        self._step_kind = "prefill"

    # -- instrumentation --------------------------------------------------------------------------------------
    def _timed(self, bucket: str, fn):
        def wrapper(*a, **kw):
            _sync(self.device)
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                _sync(self.device)
                self.current[bucket] += time.perf_counter() - t
        return wrapper

    def _patch(self, obj, name: str, bucket: str) -> None:
        original = getattr(obj, name)
        had_own = name in getattr(obj, "__dict__", {})
        setattr(obj, name, self._timed(bucket, original))
        self._undo.append(lambda: setattr(obj, name, original) if had_own else delattr(obj, name))

    def _hook(self, module: torch.nn.Module, bucket: str) -> None:
        def pre(mod, args):
            _sync(self.device)
            self._starts[id(mod)] = time.perf_counter()

        def post(mod, args, out):
            _sync(self.device)
            self.current[bucket] += time.perf_counter() - self._starts.pop(id(mod))

        self._undo.append(module.register_forward_pre_hook(pre).remove)
        self._undo.append(module.register_forward_hook(post).remove)

    def attach(self) -> "StepProfiler":
        import shoal.engine.core.engine as engine_module
        from shoal.engine.core.tokenizer import IncrementalDetokenizer
        import shoal.engine.execution.runner as runner_module

        e, m = self.engine, self.model
        # Decode graphs replay their ops without running the modules the timers hook: profiled steps run eagerly.
        runner, graphs = self.runner, self.runner.decode_graphs
        runner.decode_graphs = None
        self._undo.append(lambda: setattr(runner, "decode_graphs", graphs))
        sched = e.scheduler
        original_schedule = sched.schedule

        def schedule(*a, **kw):
            t = time.perf_counter()
            out = original_schedule(*a, **kw)
            self.current["scheduler"] += time.perf_counter() - t
            decode = bool(out.scheduled) and all(s.num_new_tokens == 1 for s in out.scheduled)
            self._step_kind = "decode" if decode else "prefill"
            if decode:
                self.decode_batch += len(out.scheduled)
                self.decode_context += sum(s.seq.num_computed_tokens + 1 for s in out.scheduled)
            return out

        sched.schedule = schedule
        self._undo.append(lambda: delattr(sched, "schedule"))
        self._patch(sched, "after_step", "scheduler")
        if hasattr(engine_module, "build_step_inputs"):
            self._patch(engine_module, "build_step_inputs", "build inputs")
        self._patch(runner_module, "attention_metadata", "build inputs")
        self._patch(IncrementalDetokenizer, "append", "detokenize")
        self._patch(IncrementalDetokenizer, "flush", "detokenize")
        self._patch(Sampler, "__call__", "sampler")
        self._hook(m, "model")
        if hasattr(m, "embed_tokens"):
            self._hook(m.embed_tokens, "model/embedding")
        for layer in m.layers:
            self._hook(layer, "model/layers")
        in_moe = {id(sub) for block in m.layers.modules() if isinstance(block, SparseMoeBlock)
                  for sub in block.modules()}
        for module in m.layers.modules():
            if isinstance(module, SparseMoeBlock):
                self._hook(module, "model/layers/moe")
                count = lambda experts, args, block=module: self._count_moe_reads(block, args[2])  # noqa: E731
                self._undo.append(module.experts.register_forward_pre_hook(count).remove)
            elif id(module) in in_moe:
                continue  # counted in its MoE block's time
            elif isinstance(module, PagedAttention):
                self._hook(module, "model/layers/attention")
            elif isinstance(module, PackedMatmul):
                self._hook(module, "model/layers/linear")
        if getattr(m, "lm_head", None) is not None:
            self._hook(m.lm_head, "lm head")  # runs after the model's forward (compute_logits)
        original_step = e.step

        def step(*a, **kw):
            self.current.clear()
            t = time.perf_counter()
            out = original_step(*a, **kw)
            self.current["step"] += time.perf_counter() - t
            kind = self._step_kind
            self.steps[kind] += 1
            for k, v in self.current.items():
                self.totals[kind][k] += v
            return out

        e.step = step
        self._undo.append(lambda: delattr(e, "step"))
        return self

    def _count_moe_reads(self, block: SparseMoeBlock, ids: torch.Tensor) -> None:
        """Bytes a MoE block reads in a decode step: its router and shared expert, and each routed expert once."""
        if self._step_kind != "decode":
            return
        experts = block.experts
        local = ids[(ids >= experts.expert_start) & (ids < experts.expert_start + experts.num_local)]
        per_expert = sum(p[0].numel() * p.element_size() for p in (experts.w13, experts.w2, experts.b13, experts.b2)
                         if p is not None and p.numel())
        if not experts.format.runs_on_parameter:  # quantized or packed: what its format holds, per expert
            per_expert = experts.format.nbytes() // experts.num_local
        rest = sum(p.numel() * p.element_size() for name, p in block.named_parameters()
                   if not name.startswith("experts."))
        self.moe_bytes += rest + int(local.unique().numel()) * per_expert

    def detach(self) -> None:
        while self._undo:
            self._undo.pop()()

    @contextmanager
    def attached(self):
        self.attach()
        try:
            yield self
        finally:
            self.detach()

    # -- report -------------------------------------------------------------------------------------------------
    def breakdown(self, kind: str = "decode") -> dict[str, float]:
        """Mean milliseconds per step of this kind, by component (nested names use '/')."""
        n = self.steps[kind]
        if not n:
            return {}
        t = {k: 1e3 * v / n for k, v in self.totals[kind].items()}
        model = t.get("model", 0.0)
        layers = t.get("model/layers", 0.0)
        rows = {
            "step": t.get("step", 0.0),
            "scheduler": t.get("scheduler", 0.0),
            "build inputs": t.get("build inputs", 0.0),
            "model forward": model,
            "model/embedding": t.get("model/embedding", 0.0),
            "model/layers": layers,
            "model/layers/linear": t.get("model/layers/linear", 0.0),
            "model/layers/attention": t.get("model/layers/attention", 0.0),
            "model/layers/moe": t.get("model/layers/moe", 0.0),
            "model/layers/other": layers - t.get("model/layers/linear", 0.0) - t.get("model/layers/attention", 0.0)
            - t.get("model/layers/moe", 0.0),
            "model/final norm": model - layers - t.get("model/embedding", 0.0),
            "lm head (logits)": t.get("lm head", 0.0),
            "sampler": t.get("sampler", 0.0),
            "detokenize": t.get("detokenize", 0.0),
        }
        accounted = sum(rows[k] for k in ("scheduler", "build inputs", "model forward", "lm head (logits)",
                                          "sampler", "detokenize"))
        rows["engine other"] = rows["step"] - accounted
        return rows

    def weight_bytes(self) -> int:
        """Bytes of weights one decode step reads: every parameter except an untied embedding table (only the
        batch's rows of it are read), prepacked copies counted in place of the originals they replaced."""
        m = self.model
        embed = getattr(m, "embed_tokens", None)
        lm_head = getattr(m, "lm_head", None)
        tied = bool(getattr(lm_head, "tied", False))
        skip = set()
        if embed is not None and not tied:
            skip.add(id(embed.weight))
        total, seen = 0, set()
        for module in m.modules():
            for p in module.parameters(recurse=False):
                if id(p) in seen or id(p) in skip:
                    continue
                seen.add(id(p))
                total += p.numel() * p.element_size()
            packed = isinstance(module, PackedMatmul) and isinstance(module.format, (AmxBf16Weight, OneDNNBf16Weight))
            if packed and not module.weight.numel():
                out_f, in_f = module.weight_shape
                total += out_f * in_f * module.weight.element_size()
        return total

    def kv_bytes_per_token(self) -> int:
        return self.runner.bytes_per_block(1)

    def matmul_flops_per_token(self) -> int:
        total = 0
        for module in self.model.modules():
            if isinstance(module, PackedMatmul):
                out_f, in_f = module.weight_shape
                total += 2 * out_f * in_f
            elif isinstance(module, SparseMoeBlock):  # a token runs top_k of the experts: gate, up and down
                e = module.experts
                total += 2 * module.top_k * 3 * e.hidden * e.inter_local * e.num_local // e.num_experts
        return total

    def report(self, bandwidth: float | None = None, matmul_flops: float | None = None) -> str:
        lines = []
        decode = self.breakdown("decode")
        if decode.get("model/layers/moe"):
            lines.append(f"MoE blocks (router, experts, shared expert): {decode['model/layers/moe']:.2f} ms of a "
                         f"{decode['step']:.2f} ms decode step = {100 * decode['model/layers/moe'] / decode['step']:.1f}%"
                         f" ({100 * decode['model/layers/moe'] / decode['model forward']:.1f}% of the model forward)")
            if bandwidth and self.moe_bytes:
                read = self.moe_bytes / self.steps["decode"]
                floor = 1e3 * read / bandwidth
                lines.append(f"MoE floor of a decode step: the routed experts' weights, routers and shared experts "
                             f"{read / 1e6:.1f} MB / {bandwidth / 1e9:.1f} GB/s = {floor:.2f} ms; measured "
                             f"{decode['model/layers/moe']:.2f} ms = {decode['model/layers/moe'] / floor:.2f}x its floor")
        for kind in ("decode", "prefill"):
            rows = self.breakdown(kind)
            if not rows:
                continue
            total = rows["step"] or 1e-9
            label = ("decode-only steps" if kind == "decode" else "steps with prompt tokens")
            extra = ""
            if kind == "decode":
                b = self.decode_batch / self.steps["decode"]
                c = self.decode_context / self.decode_batch
                extra = f", mean batch {b:.1f}, mean context {c:.0f} tokens"
            lines.append(f"{label}: {self.steps[kind]}{extra}; mean ms per step:")
            nlayers = len(self.model.layers)
            if not self.totals[kind].get("model/layers/moe"):
                rows.pop("model/layers/moe")  # a dense model: no MoE row
            for name, ms in rows.items():
                depth = name.count("/")
                short = name.rsplit("/", 1)[-1]
                if short == "layers":
                    short = f"{nlayers} decoder layers ({ms / max(nlayers, 1):.3f} ms each)"
                lines.append(f"  {'  ' * depth}{short:<{44 - 2 * depth}} {ms:8.2f} ms {100 * ms / total:5.1f}%")
        if self.steps["decode"] and bandwidth:
            n = self.steps["decode"]
            step_ms = self.breakdown("decode")["step"]
            w = self.weight_bytes()
            kv = self.decode_context / n * self.kv_bytes_per_token()
            emb = self.decode_batch / n * self.model.config.hidden_size * 2
            # A hybrid's recurrent state: read and written back once per sequence and step.
            state = 2 * self.decode_batch / n * getattr(self.engine, "state_bytes", 0)
            floor_ms = 1e3 * (w + kv + emb + state) / bandwidth
            state_part = f" + recurrent state {state / 1e6:.1f} MB (read and written)" if state else ""
            lines.append(
                f"memory-traffic floor of a decode step: weights {w / 1e6:.1f} MB + KV {kv / 1e6:.1f} MB{state_part} = "
                f"{(w + kv + emb + state) / 1e6:.1f} MB / {bandwidth / 1e9:.1f} GB/s measured = {floor_ms:.2f} ms; "
                f"measured step {step_ms:.2f} ms = {step_ms / floor_ms:.2f}x the floor")
            if matmul_flops:
                flops = self.matmul_flops_per_token() * self.decode_batch / n
                lines.append(
                    f"compute floor of a decode step: {flops / 1e9:.2f} GFLOP of matmuls / {matmul_flops / 1e9:.0f} "
                    f"GFLOP/s measured at this batch = {1e3 * flops / matmul_flops:.2f} ms")
        return "\n".join(lines)


def measure_read_bandwidth(device: torch.device | str = "cpu", nbytes: int | None = None, repeats: int = 5) -> float:
    """Bytes per second one pass of reading a buffer far larger than the caches achieves on `device` (the model's:
    host memory, or a GPU's HBM), best of `repeats`."""
    device = torch.device(device)
    if nbytes is None:  # many times the last-level cache: 256 MiB on a CPU, 2 GiB on a GPU (an H200 has 60 MB of L2)
        nbytes = (2048 if device.type == "cuda" else 256) * 2**20
    x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    x.sum()
    _sync(device)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        _sync(device)
        best = min(best, time.perf_counter() - t)
    return nbytes / best


def measure_matmul_flops(model, batch: int, repeats: int = 5) -> float | None:
    """FLOP/s of the model's own (possibly prepacked) linear layers at this batch size, all of one layer."""
    layers = getattr(model, "layers", None)
    if not layers or batch < 1:
        return None
    mods = [m for m in layers[0].modules() if isinstance(m, PackedMatmul)]
    if not mods:
        return None
    w = mods[0].weight
    inputs = [torch.randn(batch, mod.weight_shape[1], dtype=w.dtype, device=w.device) for mod in mods]
    flops = sum(2 * batch * mod.weight_shape[0] * mod.weight_shape[1] for mod in mods)
    best = float("inf")
    with torch.inference_mode():
        for _ in range(repeats + 1):
            t = time.perf_counter()
            for mod, x in zip(mods, inputs):
                mod.matmul(x)
            best = min(best, time.perf_counter() - t)
    return flops / best
