"""Shoal's speed when its CPUs are not its own: batch-1 decode (`bench latency`) and batch-32 offline throughput
(`bench throughput`) under each of several thread policies, in each of several conditions, interleaved.

Conditions:
  quiet      nothing added (other jobs already on the machine still count: the load is printed)
  busy1/2    beside 1 or 2 busy-looping processes (`while 1: pass`)
  quota      inside a CPU quota of --quota CPUs: a cgroup made for the run (v2 `cpu.max` or v1 `cpu.cfs_quota_us`,
             where this process may create one; a pod limit gives the same), else the condition is skipped, saying so
  one-core   pinned to one CPU (sched_setaffinity), the fallback where cgroups are not writable

Policies are environments for the engine process: `auto` (none: the engine picks from what it sees,
`execution/cpu_budget.py`), `before` (every CPU, a 10,000-iteration OpenMP spin: the default before that module)
and the explicit candidates `1-spin`, `1-passive`, `2-spin`, `2-passive` (threads, wait policy).
Peers, where given, meet the same conditions (started inside each one, after Shoal's runs of it):
`--llama-cpp-bin DIR --llama-cpp-model GGUF` runs llama.cpp's `llama-bench` decode-only (`-p 0 -n output-len`, its
--llama-cpp-threads, default every CPU we may use, as its users pass `-t`) for the batch-1 column, and
`--vllm-python PATH` runs the 32-request workload through vLLM's offline API (tools/vllm_workload.py, on the same
preset model in bfloat16) for the batch-32 column; the table then adds each peer's figure and the ratio of Shoal's
`auto` policy to it (the issue's bar: no condition below 0.9x llama.cpp at batch 1 or below 1.0x vLLM at batch 32).

Each policy runs in one engine process that loads the model once and then meets every condition in turn (it starts
the busy processes itself, and enters and leaves the quota cgroup by moving itself); `auto`, whose decision is made
at start from what the process sees, gets one process per condition, started inside it. Per condition: batch-1
decode tokens/s (one request) and batch-32 output tokens/s (32 requests), each --prompt-len/--output-len tokens,
the median of --repeat runs. Policies alternate condition by condition, so drifting load hits them alike.
Measured, never timed in tests.

    python -m shoal.engine.tools.bench_contention --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

POLICIES = {
    "auto": {},
    "before": {"OMP_NUM_THREADS": str(len(os.sched_getaffinity(0))), "GOMP_SPINCOUNT": "10000"},
    "1-spin": {"OMP_NUM_THREADS": "1", "GOMP_SPINCOUNT": "10000"},
    "1-passive": {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "passive"},
    "2-spin": {"OMP_NUM_THREADS": "2", "GOMP_SPINCOUNT": "10000"},
    "2-passive": {"OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "passive"},
}
_POLICY_VARS = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "SHOAL_SET_WAIT_POLICY", "SHOAL_CPU_THREADS")
QUOTA_CGROUP = "shoal-bench-quota"


def make_quota_cgroup(cpus: float, name: str = QUOTA_CGROUP) -> Path | None:
    """A cgroup limited to `cpus` CPUs that this process may move processes into, or None where it cannot."""
    period = 100_000
    v2 = Path("/sys/fs/cgroup")
    candidates = [(v2 / name, "cpu.max", f"{int(cpus * period)} {period}")] if (v2 / "cgroup.controllers").exists() else []
    candidates.append((Path("/sys/fs/cgroup/cpu") / name, "cpu.cfs_quota_us", str(int(cpus * period))))
    for path, knob, value in candidates:
        try:
            path.mkdir(exist_ok=True)
            if knob == "cpu.cfs_quota_us":
                (path / "cpu.cfs_period_us").write_text(str(period))
            (path / knob).write_text(value)
            return path
        except OSError:
            continue
    return None


class Condition:
    """Enter and leave one condition in this process: busy neighbours, a quota cgroup, or one pinned CPU."""

    def __init__(self, name: str, cgroup: Path | None):
        self.name, self.cgroup, self.busy, self.affinity = name, cgroup, [], None

    def __enter__(self):
        n = {"busy1": 1, "busy2": 2}.get(self.name, 0)
        self.busy = [subprocess.Popen([sys.executable, "-c", "while 1: pass"]) for _ in range(n)]
        if self.name == "quota":
            (self.cgroup / "cgroup.procs").write_text(str(os.getpid()))
        if self.name == "one-core":
            self.affinity = os.sched_getaffinity(0)
            os.sched_setaffinity(0, {min(self.affinity)})
        return self

    def __exit__(self, *exc):
        for p in self.busy:
            p.kill()
            p.wait()
        if self.name == "quota":
            (self.cgroup.parent / "cgroup.procs").write_text(str(os.getpid()))
        if self.affinity is not None:
            os.sched_setaffinity(0, self.affinity)


def worker(args) -> int:
    """One engine process: load once, warm up (the decode graphs are captured), then each condition in turn."""
    from shoal.engine.execution.cpu_budget import apply_cpu_budget

    apply_cpu_budget()  # as `shoal-engine` does first thing: before torch loads OpenMP
    import torch

    from shoal.engine.contracts import SamplingParams
    from shoal.engine.execution.cpu_budget import decision
    from shoal.engine.llm import LLM
    from shoal.engine.tools.bench_throughput import bench_model_dir

    cgroup = Path(args.cgroup) if args.cgroup else None
    rng = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 30000, (args.prompt_len,), generator=rng).tolist() for _ in range(32)]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)

    def timed(engine, batch: list[list[int]], tag: str) -> tuple[float, float, int]:
        for i, p in enumerate(batch):
            engine.add_request(f"{tag}-{i}", p, params)
        t0, first, tokens = time.perf_counter(), None, 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens += len(out.outputs[0].token_ids) if out.finished else 0
            first = first or time.perf_counter()
        return first - t0, time.perf_counter() - first, tokens

    out = {"policy": args.policy, "threads": torch.get_num_threads(), "decision": decision(), "conditions": {}}
    with LLM(model=str(bench_model_dir(args.preset)), max_model_len=256, max_num_seqs=32) as llm:
        engine = llm.llm_engine
        for size in (1, 2, 4, 8, 16, 32):  # every decode bucket captured before anything is timed
            timed(engine, [p[:8] for p in prompts[:size]], f"warm{size}")
        for name in args.conditions:
            with _Nothing() if args.entered else Condition(name, cgroup):
                b1, b32 = [], []
                for r in range(args.repeat):
                    _, rest, tokens = timed(engine, prompts[:1], f"{name}-b1-{r}")
                    b1.append((tokens - 1) / rest)
                    ttft, rest, tokens = timed(engine, prompts, f"{name}-b32-{r}")
                    b32.append(tokens / (ttft + rest))
                out["conditions"][name] = {"batch1_decode_tok_s": statistics.median(b1),
                                           "batch32_output_tok_s": statistics.median(b32),
                                           "load": os.getloadavg()[0]}
    print(json.dumps(out))
    return 0


class _Nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def run_worker(args, policy: str, conditions: list[str], cgroup: Path | None, entered: str | None) -> dict:
    base = {k: v for k, v in os.environ.items() if k not in _POLICY_VARS}
    cmd = [sys.executable, "-m", "shoal.engine.tools.bench_contention", "--worker", "--policy", policy,
           "--conditions", *conditions, "--preset", args.preset, "--prompt-len", str(args.prompt_len),
           "--output-len", str(args.output_len), "--repeat", str(args.repeat)]
    if cgroup is not None:
        cmd += ["--cgroup", str(cgroup)]
    if entered:
        cmd += ["--entered"]

    def enter():  # the auto policy decides at start: start it inside its condition
        if entered == "quota":
            (cgroup / "cgroup.procs").write_text(str(os.getpid()))
        if entered == "one-core":
            os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})

    if entered in ("busy1", "busy2"):
        cond = Condition(entered, None)
        cond.__enter__()
    else:
        cond = None
    try:
        proc = subprocess.run(cmd, env={**base, **POLICIES[policy]}, capture_output=True, text=True,
                              preexec_fn=enter, timeout=3600)
    finally:
        if cond is not None:
            cond.__exit__()
    if proc.returncode != 0:
        raise RuntimeError(f"{policy} {conditions} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def peer_rows(args, conditions: list[str], cgroup: Path | None) -> dict[str, dict]:
    """llama.cpp's batch-1 decode and vLLM's batch-32 output tokens/s in each condition, each started inside it."""
    from types import SimpleNamespace

    from shoal.engine.execution.cpu_features import peer_environ
    from shoal.engine.tools.bench_throughput import bench_model_dir, run_vllm

    rows: dict[str, dict] = {c: {} for c in conditions}
    rng = random.Random(0)
    reqs = [([rng.randrange(10, 30000) for _ in range(args.prompt_len)], args.output_len) for _ in range(32)]
    vllm_args = SimpleNamespace(dtype="bfloat16", max_model_len=256, max_num_seqs=32, repeat=args.repeat)
    threads = args.llama_cpp_threads or len(os.sched_getaffinity(0))
    for c in conditions:
        with Condition(c, cgroup):
            if args.llama_cpp_bin:
                cmd = [str(Path(args.llama_cpp_bin) / "llama-bench"), "-m", args.llama_cpp_model, "-p", "0", "-n",
                       str(args.output_len), "-t", str(threads), "-r", str(args.repeat), "-o", "json"]
                proc = subprocess.run(cmd, capture_output=True, text=True, env=peer_environ(), timeout=3600)
                if proc.returncode:
                    raise RuntimeError(f"{' '.join(cmd)} failed (exit {proc.returncode}): {proc.stderr[-800:]}")
                rows[c]["llama_cpp_batch1_decode_tok_s"] = json.loads(proc.stdout)[0]["avg_ts"]
            if args.vllm_python:
                seconds = run_vllm(args.vllm_python, bench_model_dir(args.preset), reqs, vllm_args)
                rows[c]["vllm_batch32_output_tok_s"] = 32 * args.output_len / seconds
            rows[c]["load"] = os.getloadavg()[0]
        print(f"peers in {c}: {rows[c]}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m shoal.engine.tools.bench_contention", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conditions", nargs="+", default=["quiet", "busy1", "busy2", "quota"],
                    choices=["quiet", "busy1", "busy2", "quota", "one-core"])
    ap.add_argument("--policies", nargs="+", default=["before", "auto"], choices=sorted(POLICIES))
    ap.add_argument("--quota", type=float, default=1.5, help="CPUs of the quota condition (default 1.5: a 1500m limit)")
    ap.add_argument("--preset", default="bench")
    ap.add_argument("--prompt-len", type=int, default=32, help="prompt tokens of every request")
    ap.add_argument("--output-len", type=int, default=64, help="output tokens of every request")
    ap.add_argument("--repeat", type=int, default=1, help="timed runs per condition (median)")
    ap.add_argument("--llama-cpp-bin", default=None, metavar="DIR", help="llama.cpp's bin/ (holding llama-bench)")
    ap.add_argument("--llama-cpp-model", default=None, metavar="GGUF",
                    help="the GGUF llama.cpp runs (the preset's model converted, e.g. with convert_hf_to_gguf.py)")
    ap.add_argument("--llama-cpp-threads", type=int, default=0, help="llama-bench -t (default: every CPU we may use)")
    ap.add_argument("--vllm-python", default=None, metavar="PATH", help="the interpreter of a vLLM virtualenv")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--policy", default="auto", help=argparse.SUPPRESS)
    ap.add_argument("--cgroup", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--entered", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)
    if bool(args.llama_cpp_bin) != bool(args.llama_cpp_model):
        ap.error("--llama-cpp-bin and --llama-cpp-model go together")

    conditions = list(args.conditions)
    cgroup = make_quota_cgroup(args.quota) if "quota" in conditions else None
    if "quota" in conditions and cgroup is None:
        print("quota: no writable cgroup here (skipped; --conditions one-core pins to one CPU instead)")
        conditions.remove("quota")
    results: dict[str, dict] = {}
    for policy in args.policies:
        if policy == "auto":
            for c in conditions:
                got = run_worker(args, policy, [c], cgroup, entered=c)
                results.setdefault(policy, {"conditions": {}, "decisions": {}})
                results[policy]["conditions"][c] = got["conditions"][c]
                results[policy]["decisions"][c] = got["decision"]
                print(f"auto in {c}: {got['decision']}: {got['conditions'][c]}", flush=True)
        else:
            got = run_worker(args, policy, conditions, cgroup, entered=None)
            results[policy] = {"conditions": got["conditions"], "decisions": {"all": got["decision"]}}
            print(f"{policy}: {got['conditions']}", flush=True)
    peers = peer_rows(args, conditions, cgroup) if args.llama_cpp_bin or args.vllm_python else {}
    if args.json:
        print(json.dumps({"shoal": results, "peers": peers}))
        return 0
    print(f"\n{'condition':<10}{'policy':<12}{'batch-1 decode tok/s':>22}{'batch-32 output tok/s':>23}{'load':>7}")
    for c in conditions:
        for policy in args.policies:
            row = results[policy]["conditions"].get(c)
            if row:
                print(f"{c:<10}{policy:<12}{row['batch1_decode_tok_s']:>22.1f}{row['batch32_output_tok_s']:>23.1f}"
                      f"{row['load']:>7.1f}")
        peer = peers.get(c, {})
        b1, b32 = peer.get("llama_cpp_batch1_decode_tok_s"), peer.get("vllm_batch32_output_tok_s")
        if peer:
            print(f"{c:<10}{'peers':<12}{'llama.cpp ' + format(b1, '.1f') if b1 else '-':>22}"
                  f"{'vLLM ' + format(b32, '.1f') if b32 else '-':>23}{peer['load']:>7.1f}")
            auto = results.get("auto", {}).get("conditions", {}).get(c)
            if auto:
                r1 = f"{auto['batch1_decode_tok_s'] / b1:.2f}x" if b1 else "-"
                r32 = f"{auto['batch32_output_tok_s'] / b32:.2f}x" if b32 else "-"
                print(f"{c:<10}{'auto/peer':<12}{r1:>22}{r32:>23}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
