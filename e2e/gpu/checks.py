"""The GPU run (issue 37): every check of Shoal's CUDA path in one bounded run, each stage printing PASS or FAIL
with its figures and the run going on after a failure.

    python e2e/gpu/checks.py --list                  # the stages, no CUDA needed
    python e2e/gpu/checks.py --out DIR [--only S ...] [--skip S ...] [--budget SECONDS]

e2e/gpu/run.sh is the way in on the device machine (it installs the project onto the image's torch first). Without
a CUDA device this exits 3 at once with "no CUDA device: ...". DIR receives the log (gpu-run.log, written by run.sh)
and gpu-summary.json, rewritten after every stage so that a run cut short still says how far it got.

Tolerances, stated once: float32 on CUDA must give transformers' (on CUDA, float32) greedy tokens exactly, and the
top logprobs within FP32_LOGPROB_TOL; bfloat16/float16 are checked teacher-forced (transformers in the same dtype
scores the engine's own tokens): each pick within HALF_TOL[dtype] of transformers' top logprob and its logprob within
HALF_TOL[dtype] of transformers'. The models are the tests' tiny random-weight ones (engine/tools/tiny_model.py),
the GGUF file the tests' writer (tests/engine/gguf_fixtures.py), the throughput workload `bench throughput`'s.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[2]
FP32_LOGPROB_TOL = 1e-3
HALF_TOL = {"bfloat16": 0.1, "float16": 0.05}
MAX_NEW = 12
FAMILIES = {"dense": "llama", "sliding-window": "gemma2", "moe": "mixtral", "gguf": "gguf",
            "hybrid-gdn": "qwen3_next", "hybrid-mamba2": "granitemoehybrid", "mla": "deepseek_v3"}
# Recurrent layers update per-sequence state in place, so these decode eagerly (runner.enable_decode_capture).
UNCAPTURED = {"hybrid-gdn", "hybrid-mamba2"}
# Small enough that every engine start is quick (few graph buckets, a small KV pool), GPU-sized blocks.
BASE = dict(max_model_len=128, block_size=16, max_num_seqs=16, kv_cache_memory=256 * 2**20)
MODES = {
    "batched": dict(),
    "chunked-prefill": dict(max_num_batched_tokens=16),
    "prefix-caching": dict(),  # a shared prefix, its first request alone, then the rest: blocks reused
    "preemption": dict(max_model_len=64, num_kv_blocks=6, max_num_batched_tokens=32),
}
DEVICE = "cuda"  # the CPU tests (tests/engine/test_gpu_script.py) run a stage on "cpu" to prove its code
SHARED = "Kubernetes runs pods on nodes; an operator reconciles custom resources into deployments and services."


class NoCuda(RuntimeError):
    pass


@dataclass
class Stage:
    name: str
    budget_s: int  # what the stage needs at most; it is skipped when less than this is left of the run
    run: Callable[["Context"], dict]
    what: str


STAGES: list[Stage] = []


def stage(name: str, budget_s: int, what: str):
    def register(fn):
        STAGES.append(Stage(name, budget_s, fn, what))
        return fn
    return register


class Failed(AssertionError):
    """A check that ran and found a difference; `figures` say by how much."""

    def __init__(self, message: str, figures: dict | None = None):
        super().__init__(message)
        self.figures = figures or {}


class Findings:
    """A stage's figures and the differences it found; the stage returns `done()`, which raises them as Failed."""

    def __init__(self):
        self.figures: dict = {}
        self.failures: list[str] = []

    def done(self) -> dict:
        if self.failures:
            raise Failed("; ".join(self.failures), self.figures)
        return self.figures


# ------------------------------------------------------------------------------------------------ the run itself
class Context:
    def __init__(self, out: Path, work: Path, deadline: float):
        self.out, self.work, self.deadline = out, work, deadline
        self._models: dict = {}

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def model(self, arch: str, **overrides) -> Path:
        """A tiny random-weight model directory (the tests' tiny_model), or for "gguf" a Q8_0 GGUF file of one."""
        key = (arch, tuple(sorted(overrides.items())))
        if key not in self._models:
            from shoal.engine.tools.tiny_model import make_model

            if arch == "gguf":
                from gguf_fixtures import write_gguf
                from test_gguf import SHAPE  # hidden 256 / intermediate 512: rows K-quants can hold too

                hf = self.model("llama", **SHAPE)
                self._models[key] = write_gguf(hf, self.work / "tiny-llama-Q8_0.gguf", weight_type="Q8_0")
            else:
                self._models[key] = make_model(self.work / f"{arch}-{len(self._models)}", arch=arch, **overrides)
        return self._models[key]


def cuda_or_die() -> str:
    """The device's name; NoCuda with what was found instead. Only torch is imported: this runs before installing."""
    try:
        import torch
    except ImportError as e:
        raise NoCuda(f"torch does not import in {sys.executable} ({e})") from None
    if not torch.cuda.is_available():
        raise NoCuda(f"torch {torch.__version__} (CUDA build {torch.version.cuda}) sees no GPU "
                     f"(torch.cuda.device_count() = {torch.cuda.device_count()}); this run needs one")
    return torch.cuda.get_device_name(0)


def run_stages(ctx: Context, stages: list[Stage], summary_path: Path) -> dict:
    results = []
    summary = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "stages": results}
    for st in stages:
        t0 = time.monotonic()
        if ctx.left() < st.budget_s:
            entry = {"stage": st.name, "status": "SKIP", "seconds": 0.0,
                     "error": f"out of time: {ctx.left():.0f}s left of the run, the stage needs up to {st.budget_s}s"}
        else:
            print(f"\n=== {st.name}: {st.what}", flush=True)
            try:
                figures, status, error = st.run(ctx) or {}, "PASS", None
            except Failed as e:
                figures, status, error = e.figures, "FAIL", str(e)
            except Exception as e:  # noqa: BLE001  a crash is a finding: record it and go on
                figures, status, error = {}, "FAIL", f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=8)}"
            entry = {"stage": st.name, "status": status, "seconds": round(time.monotonic() - t0, 1),
                     "figures": figures, "error": error}
            release_gpu_memory()
        results.append(entry)
        line = f"{entry['status']} {st.name} ({entry['seconds']}s)"
        if entry.get("figures"):
            line += " " + json.dumps(entry["figures"], default=str)
        print(line, flush=True)
        if entry.get("error"):
            print("  " + entry["error"].strip().replace("\n", "\n  "), flush=True)
        summary_path.write_text(json.dumps(summary, indent=2, default=str))
    counts = {s: sum(r["status"] == s for r in results) for s in ("PASS", "FAIL", "SKIP")}
    summary["counts"] = counts
    summary_path.write_text(json.dumps(summary, indent=2, default=str))
    print(f"\n{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped; summary: {summary_path}")
    return summary


def release_gpu_memory() -> None:
    gc.collect()
    if "torch" in sys.modules:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------------ helpers
@contextlib.contextmanager
def env(**values: str):
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def prompts_for(mode: str) -> list[str]:
    from test_engine_correctness import PROMPTS

    if mode == "prefix-caching":
        return [SHARED + tail for tail in (" Hello", " Once upon a time", " def add(a, b):", " numbers 0 1 2")]
    return list(PROMPTS)


def generate(model: Path, prompts: list[str], mode: str = "batched", logprobs: int = 3, **options):
    """(outputs, facts about the engine that ran them) on CUDA; prefix-caching runs the first prompt alone first."""
    from shoal.engine import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=logprobs)
    with LLM(model=str(model), **{"device": DEVICE, **BASE, **MODES.get(mode, {}), **options}) as llm:
        engine = llm.llm_engine
        if mode == "prefix-caching":
            outs = llm.generate(prompts[:1], params, use_tqdm=False) + llm.generate(prompts[1:], params, use_tqdm=False)
        else:
            outs = llm.generate(prompts, params, use_tqdm=False)
        graphs = engine.executor.runner.decode_graphs
        facts = {"backend": engine.executor.backend_name, "prefix_hits": engine.pool.prefix_hits,
                 "preemptions": engine.scheduler.num_preemptions,
                 "graphs": len(graphs.graphs) if graphs else 0, "graph_failed": bool(graphs and graphs.failed),
                 "tokenizer": llm.get_tokenizer()}
        engine.pool.check_all_free()
    return outs, facts


def oracle_args(model: Path) -> tuple[Path, str | None]:
    return (model.parent, model.name) if model.suffix == ".gguf" else (model, None)


def exact_vs_hf(model: Path, tok, prompts, outs) -> dict:
    """float32: the same greedy tokens as transformers on CUDA, top logprobs within FP32_LOGPROB_TOL."""
    import torch
    from hf_reference import hf_greedy

    where, gguf_file = oracle_args(model)
    worst, mismatches = 0.0, []
    for prompt, out in zip(prompts, outs):
        ref_ids, ref_lp = hf_greedy(where, tok.encode(prompt), MAX_NEW, torch.float32, DEVICE, gguf_file)
        got = out.outputs[0]
        if got.token_ids != ref_ids:
            mismatches.append(f"{prompt[:24]!r}: {got.token_ids} != transformers {ref_ids}")
            continue
        for step, entry in enumerate(got.logprobs or []):
            for tid, lp in entry.items():
                worst = max(worst, abs(lp.logprob - float(ref_lp[step, tid])))
    return {"sequences": len(prompts), "token_mismatches": mismatches, "max_logprob_diff": worst}


def close_to_hf(model: Path, tok, prompts, outs, dtype: str, tol: float | None = None) -> dict:
    """Teacher-forced: transformers in `dtype` on CUDA scores the engine's tokens (tolerance HALF_TOL[dtype])."""
    import torch
    from hf_reference import hf_model

    where, gguf_file = oracle_args(model)
    ref = hf_model(str(where), getattr(torch, dtype), DEVICE, gguf_file)
    tol = HALF_TOL[dtype] if tol is None else tol
    worst_lp = worst_pick = 0.0
    same_as_top = total = 0
    for prompt, out in zip(prompts, outs):
        ids, got = tok.encode(prompt), out.outputs[0]
        with torch.no_grad():
            logits = ref(torch.tensor([ids + got.token_ids], device=DEVICE)).logits[0].float()
        lp = torch.log_softmax(logits[len(ids) - 1:-1], dim=-1).cpu()
        for step, (tid, entry) in enumerate(zip(got.token_ids, got.logprobs)):
            worst_lp = max(worst_lp, abs(entry[tid].logprob - float(lp[step, tid])))
            worst_pick = max(worst_pick, float(lp[step].max() - lp[step, tid]))
            same_as_top += int(lp[step].argmax()) == tid
            total += 1
    return {"tolerance": tol, "max_logprob_diff": round(worst_lp, 4), "max_pick_below_top": round(worst_pick, 4),
            "picks_equal_to_transformers_top": f"{same_as_top}/{total}", "ok": worst_lp <= tol and worst_pick <= tol}


def pytest_stage(args: list[str], timeout: float) -> dict:
    cmd = [sys.executable, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider", *args]
    print("$ " + " ".join(cmd), flush=True)
    try:
        proc = subprocess.run(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired as e:
        partial = e.stdout or ""  # bytes, whatever text=True said
        print((partial.decode(errors="replace") if isinstance(partial, bytes) else partial)[-20000:], flush=True)
        raise Failed(f"pytest did not finish in {timeout:.0f}s") from None
    print(proc.stdout[-20000:], flush=True)
    tail = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", tail)}
    if proc.returncode != 0:
        raise Failed(f"pytest exited {proc.returncode}: {tail}", counts)
    return counts


def gpu_test_files() -> list[str]:
    """Every test file with a `gpu`-marked test (found by reading them, so a new one joins by itself)."""
    return sorted(str(p.relative_to(REPO)) for p in (REPO / "tests").rglob("test_*.py")
                  if "pytest.mark.gpu" in p.read_text(encoding="utf-8"))


# ------------------------------------------------------------------------------------------------ the stages
@stage("environment", 30, "the card, the image's torch/Triton/transformers, flash-attn present or not")
def check_environment(ctx: Context) -> dict:
    import torch
    import transformers

    props = torch.cuda.get_device_properties(0)
    figures = {"device": props.name, "capability": f"{props.major}.{props.minor}",
               "memory_gib": round(props.total_memory / 2**30, 1), "multiprocessors": props.multi_processor_count,
               "torch": torch.__version__, "cuda": torch.version.cuda, "transformers": transformers.__version__,
               "python": sys.version.split()[0]}
    try:
        import triton

        figures["triton"] = triton.__version__
    except ImportError:
        figures["triton"] = None
    from shoal.engine.execution.attention import backend_class

    for name in ("triton", "flash", "sdpa"):
        cls = backend_class(name)
        ok, why = cls.is_available(torch.device("cuda")) if cls else (False, "cannot be imported")
        figures[f"backend_{name}"] = "available" if ok else why
    import shoal.engine

    figures["shoal_from"] = str(Path(shoal.engine.__file__).parent)
    if figures["triton"] is None:
        raise Failed("Triton is not importable: the CUDA attention and GGUF kernels need it", figures)
    return figures


@stage("gpu-tests", 120, "the `gpu`-marked tests of tests/ (pytest -m gpu)")
def check_gpu_tests(ctx: Context) -> dict:
    return pytest_stage(["-m", "gpu", *gpu_test_files()], timeout=min(120, ctx.left()))


@stage("gguf-triton-kernels", 45, "the Triton GGUF matmul/dequantize kernels on CUDA vs gguf-py's CPU reference")
def check_gguf_kernels(ctx: Context) -> dict:
    return pytest_stage(["tests/engine/test_gguf_packed.py", "-k", "triton_kernels or triton_matmul"],
                        timeout=min(45, ctx.left()))


def family_stage(family: str):
    arch = FAMILIES[family]

    def run(ctx: Context) -> dict:
        model = ctx.model(arch)
        found = Findings()
        figures, failures = found.figures, found.failures
        # The GGUF file read dequantized is what transformers computes exactly; served packed (the default on
        # CUDA: Triton kernels, activations rounded to 16 bits) it is held to HALF_TOL's float16 bound below.
        with env(SHOAL_GGUF_DEQUANTIZE="1"):
            for mode in MODES:
                prompts = prompts_for(mode)
                outs, facts = generate(model, prompts, mode, dtype="float32")
                r = exact_vs_hf(model, facts.pop("tokenizer"), prompts, outs)
                figures[mode] = {**r, **facts}
                if r["token_mismatches"] or r["max_logprob_diff"] > FP32_LOGPROB_TOL:
                    failures.append(f"{mode}: {len(r['token_mismatches'])} token mismatches, max |dlogprob| "
                                    f"{r['max_logprob_diff']:.2e} (tolerance {FP32_LOGPROB_TOL})")
                if mode == "prefix-caching" and not facts["prefix_hits"]:
                    failures.append("prefix-caching: no prefix cache hit")
                if mode == "preemption" and not facts["preemptions"]:
                    failures.append("preemption: the pool never ran out (no preemption)")
                if family not in UNCAPTURED and (facts["graph_failed"] or not facts["graphs"]):
                    failures.append(f"{mode}: no CUDA graph was captured")
        if family == "gguf":
            prompts = prompts_for("batched")
            outs, facts = generate(model, prompts, "batched", dtype="float32")
            r = close_to_hf(model, facts.pop("tokenizer"), prompts, outs, "float32", tol=HALF_TOL["float16"])
            figures["packed-triton"] = {**r, **facts}
            if not r["ok"]:
                failures.append(f"packed-triton: beyond the float16 tolerance {r}")
        return found.done()

    return run


for _family, _arch in FAMILIES.items():
    stage(f"exact-fp32-{_family}", 45,
          f"{_family} ({_arch}) in float32 vs transformers on CUDA: {', '.join(MODES)}")(family_stage(_family))


@stage("half-precision", 45, "bfloat16 and float16 vs transformers in the same dtype, within HALF_TOL")
def check_half_precision(ctx: Context) -> dict:
    found = Findings()
    figures, failures = found.figures, found.failures
    for family in ("dense", "sliding-window", "moe"):
        model = ctx.model(FAMILIES[family])
        for dtype in ("bfloat16", "float16"):
            for mode in ("batched", "chunked-prefill"):
                prompts = prompts_for(mode)
                outs, facts = generate(model, prompts, mode, dtype=dtype)
                r = close_to_hf(model, facts.pop("tokenizer"), prompts, outs, dtype)
                figures[f"{family}/{dtype}/{mode}"] = r
                if not r["ok"]:
                    failures.append(f"{family}/{dtype}/{mode}: {r}")
    return found.done()


@stage("cuda-graphs", 30, "captured decode graphs vs --enforce-eager: the same tokens and logprobs")
def check_cuda_graphs(ctx: Context) -> dict:
    found = Findings()
    figures, failures = found.figures, found.failures
    model = ctx.model("llama")
    prompts = prompts_for("batched") + ["Hello", "Once"]  # 8 sequences finishing together, buckets 8 to 1 on the way
    for dtype in ("float32", "bfloat16"):
        graphs, g = generate(model, prompts, dtype=dtype)
        eager, e = generate(model, prompts, dtype=dtype, enforce_eager=True)
        diff = max((abs(a.logprob - eb[t].logprob) for x, y in zip(graphs, eager)
                    for ea, eb in zip(x.outputs[0].logprobs, y.outputs[0].logprobs) for t, a in ea.items()
                    if t in eb), default=0.0)
        same = sum(x.outputs[0].token_ids == y.outputs[0].token_ids for x, y in zip(graphs, eager))
        figures[dtype] = {"graphs_captured": g["graphs"], "eager_graphs": e["graphs"],
                          "same_tokens": f"{same}/{len(prompts)}", "max_logprob_diff": diff}
        if g["graph_failed"] or not g["graphs"]:
            failures.append(f"{dtype}: no decode graph was captured")
        if e["graphs"]:
            failures.append(f"{dtype}: --enforce-eager still captured graphs")
        if same != len(prompts) or diff > FP32_LOGPROB_TOL:
            failures.append(f"{dtype}: graphs and eager differ ({same}/{len(prompts)} equal, max |dlogprob| {diff:.2e})")
    return found.done()


@stage("sleep-mode", 30, "sleep levels 1 and 2 free the KV cache (and weights) on the GPU; wake-up gives the same tokens")
def check_sleep_mode(ctx: Context) -> dict:
    import torch
    from shoal.engine import LLM, SamplingParams

    found = Findings()
    figures, failures = found.figures, found.failures
    model = ctx.model("llama")
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    prompts = prompts_for("batched")
    on_cuda = DEVICE == "cuda"
    with LLM(model=str(model), device=DEVICE, dtype="bfloat16" if on_cuda else "float32", enable_sleep_mode=True,
             **{**BASE, "kv_cache_memory": 64 * 2**20}) as llm:
        engine = llm.llm_engine
        before = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        awake = engine.memory_bytes()
        for level in (1, 2):
            allocated = torch.cuda.memory_allocated() if on_cuda else 0
            engine.sleep(level)
            asleep = engine.memory_bytes()
            freed = allocated - torch.cuda.memory_allocated() if on_cuda else 0
            t0 = time.monotonic()
            engine.wake_up()
            wake_s = time.monotonic() - t0
            after = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            expected_freed = awake["kv_cache_bytes"] + awake["weight_bytes"] - asleep["weight_bytes"]
            figures[f"level{level}"] = {"reported_awake": awake, "reported_asleep": asleep,
                                        "cuda_bytes_freed": freed, "expected_freed": expected_freed,
                                        "wake_up_s": round(wake_s, 3), "same_tokens": after == before}
            if asleep["kv_cache_bytes"] or (level == 2 and asleep["weight_bytes"]):
                failures.append(f"level {level}: still holds {asleep}")
            if on_cuda and freed < 0.9 * expected_freed:
                failures.append(f"level {level}: CUDA memory fell by {freed} bytes, expected ~{expected_freed}")
            if after != before:
                failures.append(f"level {level}: greedy tokens changed after wake-up")
            if engine.memory_bytes() != awake:
                failures.append(f"level {level}: awake again with {engine.memory_bytes()}, not {awake}")
    return found.done()


@stage("attention-backends", 45, "every CUDA attention backend that applies (triton, flash, sdpa) vs transformers")
def check_backends(ctx: Context) -> dict:
    import torch
    from shoal.engine.execution.attention import backend_class

    found = Findings()
    figures, failures = found.figures, found.failures
    for name in ("triton", "flash", "sdpa"):
        cls = backend_class(name)
        ok, why = cls.is_available(torch.device(DEVICE)) if cls else (False, "cannot be imported")
        if not ok:
            figures[name] = f"not run: {why}"
            continue
        for family in ("dense", "sliding-window"):
            model = ctx.model(FAMILIES[family])
            # flash-attn computes in 16 bits only; the others run float32 too, exactly.
            for dtype in (["bfloat16"] if name == "flash" else ["float32", "bfloat16"]):
                for mode in ("batched", "chunked-prefill"):
                    prompts = prompts_for(mode)
                    try:
                        outs, facts = generate(model, prompts, mode, dtype=dtype, attention_backend=name)
                    except ValueError as e:  # refused for this model (e.g. a soft-cap it cannot apply): say so
                        figures[f"{name}/{family}/{dtype}/{mode}"] = f"refused: {e}"
                        continue
                    tok = facts.pop("tokenizer")
                    key = f"{name}/{family}/{dtype}/{mode}"
                    if dtype == "float32":
                        r = exact_vs_hf(model, tok, prompts, outs)
                        bad = r["token_mismatches"] or r["max_logprob_diff"] > FP32_LOGPROB_TOL
                    else:
                        r = close_to_hf(model, tok, prompts, outs, dtype)
                        bad = not r["ok"]
                    figures[key] = {**r, "backend": facts["backend"]}
                    if facts["backend"] != name:
                        failures.append(f"{key}: asked for {name}, the engine ran {facts['backend']}")
                    if bad:
                        failures.append(f"{key}: {r}")
    return found.done()


@stage("openai-serve", 60, "an openai-client round trip against `shoal-engine serve --device cuda`")
def check_serve(ctx: Context) -> dict:
    from openai import OpenAI
    from prockit import LoggedProcess, free_port

    model = ctx.model("llama")
    prompt = "Once upon a time there was a little shoal of fish"
    offline, _ = generate(model, [prompt], dtype="float32", logprobs=None)
    port = free_port()
    cmd = [sys.executable, "-m", "shoal.engine.cli", "serve", "--model", str(model), "--served-model-name", "tiny",
           "--host", "127.0.0.1", "--port", str(port), "--device", DEVICE, "--dtype", "float32",
           "--kv-cache-memory", "256MiB", "--max-num-seqs", "16"]
    server = LoggedProcess(cmd, port, log_prefix="shoal-gpu-serve-")
    try:
        t0 = time.monotonic()
        server.wait_ready(timeout=min(60, ctx.left()))
        ready_s = time.monotonic() - t0
        client = OpenAI(base_url=server.url + "/v1", api_key="none")
        done = client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_NEW, temperature=0,
                                         extra_body={"ignore_eos": True})
        t1 = time.monotonic()
        stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt}],
                                                max_tokens=MAX_NEW, temperature=0, stream=True)
        ttft, pieces = None, []
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                ttft = ttft if ttft is not None else time.monotonic() - t1
                pieces.append(chunk.choices[0].delta.content)
        figures = {"ready_s": round(ready_s, 1), "completion_tokens": done.usage.completion_tokens,
                   "chat_stream_ttft_ms": round(1e3 * ttft, 1) if ttft is not None else None,
                   "chat_stream_chars": len("".join(pieces))}
        if done.choices[0].text != offline[0].outputs[0].text:
            raise Failed(f"served text {done.choices[0].text!r} != offline engine's {offline[0].outputs[0].text!r}",
                         figures)
        if not pieces:
            raise Failed("the streamed chat completion carried no content", figures)
        return figures
    except RuntimeError as e:
        raise Failed(f"the server did not come up: {e}") from None
    finally:
        if server.proc.poll() is None:
            print(server.logs()[-3000:], flush=True)
        server.stop()


def throughput(ctx: Context, preset: str, extra: list[str], timeout: float) -> dict:
    """`bench throughput --profile` on 256 requests (Shoal, then transformers generate() in static batches of 64)."""
    cmd = [sys.executable, "-m", "shoal.engine.tools.bench_throughput", "--preset", preset, "--num-prompts", "256",
           "--hf-batch-sizes", "64", "--hf-sequential", "0", "--skip-vllm", "--profile", "--json", *extra]
    print("$ " + " ".join(cmd), flush=True)
    try:
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                              env=dict(os.environ, SHOAL_CACHE=str(ctx.work / "cache")))
    except subprocess.TimeoutExpired:
        raise Failed(f"bench throughput --preset {preset} did not finish in {timeout:.0f}s") from None
    if proc.returncode:
        raise Failed(f"bench throughput exited {proc.returncode}:\n{proc.stderr[-4000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    print(result.get("profile", ""), flush=True)
    figures = {k: result[k] for k in ("dtype", "requests", "output_tokens", "output_tokens_per_s",
                                      "speedup_vs_best_hf", "shoal_seconds")}
    m = re.search(r"= ([\d.]+) ms; measured step ([\d.]+) ms = ([\d.]+)x the floor", result.get("profile", ""))
    if m:
        figures.update(decode_floor_ms=float(m[1]), decode_step_ms=float(m[2]), step_over_floor=float(m[3]))
    m = re.search(r"mean batch ([\d.]+), mean context (\d+)", result.get("profile", ""))
    if m:
        figures.update(decode_mean_batch=float(m[1]), decode_mean_context=int(m[2]))
    m = re.search(r"/ ([\d.]+) GB/s measured", result.get("profile", ""))
    if m:
        figures["hbm_read_gb_s"] = float(m[1])
    return figures


@stage("throughput-bench", 60, "Shoal vs transformers static batches, the `bench` preset (bf16), 256 requests")
def check_throughput_bench(ctx: Context) -> dict:
    return throughput(ctx, "bench", ["--kv-cache-memory", str(8 * 2**30)], timeout=min(60, ctx.left()))


@stage("throughput-8b", 240, "the same on a Llama-3-8B-shaped random bf16 model at batch 64, with the HBM floor")
def check_throughput_8b(ctx: Context) -> dict:
    # Targets (issue 37): a decode step within 1.5x of its HBM floor at batch 64, >= 3x transformers' static batches.
    figures = throughput(ctx, "llama3-8b", ["--max-num-seqs", "64", "--kv-cache-memory", str(16 * 2**30)],
                         timeout=min(240, ctx.left()))
    missed = []
    if figures.get("step_over_floor") is None or figures["step_over_floor"] > 1.5:
        missed.append(f"decode step {figures.get('step_over_floor')}x its HBM floor (target <= 1.5x)")
    if (figures.get("speedup_vs_best_hf") or 0) < 3:
        missed.append(f"{figures.get('speedup_vs_best_hf')}x transformers' static batch of 64 (target >= 3x)")
    if missed:
        raise Failed("targets missed: " + "; ".join(missed), figures)
    return figures


# ------------------------------------------------------------------------------------------------ entry point
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--list", action="store_true", help="print the stages and exit (no CUDA needed)")
    ap.add_argument("--out", default=os.environ.get("OUT") or "gpu-out", help="folder for gpu-summary.json")
    ap.add_argument("--only", nargs="+", metavar="STAGE", help="run only these stages")
    ap.add_argument("--skip", nargs="+", metavar="STAGE", default=[], help="leave these stages out")
    ap.add_argument("--budget", type=float, default=480, help="seconds for the whole run (default 480)")
    args = ap.parse_args(argv)
    names = [s.name for s in STAGES]
    for name in (args.only or []) + args.skip:
        if name not in names:
            ap.error(f"unknown stage {name!r}; the stages are: {', '.join(names)}")
    if args.list:
        for s in STAGES:
            print(f"{s.name:<24} up to {s.budget_s:>3}s  {s.what}")
        return 0
    try:
        device = cuda_or_die()
    except NoCuda as e:
        print(f"no CUDA device: {e}", file=sys.stderr)
        return 3
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sys.path[:0] = [str(REPO / "tests" / "engine"), str(REPO / "tests")]  # the tests' helpers and fixtures
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import transformers

    transformers.logging.set_verbosity_error()
    print(f"GPU run on {device}; budget {args.budget:.0f}s", flush=True)
    chosen = [s for s in STAGES if (not args.only or s.name in args.only) and s.name not in args.skip]
    with tempfile.TemporaryDirectory(prefix="shoal-gpu-") as work:
        ctx = Context(out, Path(work), time.monotonic() + args.budget)
        summary = run_stages(ctx, chosen, out / "gpu-summary.json")
    return 1 if summary["counts"]["FAIL"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
