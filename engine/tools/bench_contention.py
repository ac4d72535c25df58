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
Every (condition, policy) cell runs once per round; rounds repeat (--rounds) and the median is reported, so load
that drifts hits every cell alike. Measured, never timed in tests.

    python -m shoal.engine.tools.bench_contention --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
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
_POLICY_VARS = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "SHOAL_SET_WAIT_POLICY")


def make_quota_cgroup(cpus: float, name: str = "shoal-bench-quota") -> Path | None:
    """A cgroup limited to `cpus` CPUs that this process may move children into, or None where it cannot."""
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


def run_engine(bench: str, env: dict[str, str], cgroup: Path | None, pin: set[int] | None, args) -> float:
    if bench == "latency":
        cmd = ["bench", "latency", "--preset", args.preset, "--skip-speculative", "--repeat", "1", "--json",
               "--prompt-len", str(args.prompt_len), "--output-len", str(args.output_len)]
    else:
        cmd = ["bench", "throughput", "--preset", args.preset, "--skip-hf", "--skip-vllm", "--json",
               "--num-prompts", str(args.num_prompts), "--prompt-len", str(args.prompt_len), str(args.prompt_len),
               "--output-len", str(args.output_len), str(args.output_len)]

    def enter():  # in the child, before exec: into the quota, onto the core
        if cgroup is not None:
            (cgroup / "cgroup.procs").write_text(str(os.getpid()))
        if pin is not None:
            os.sched_setaffinity(0, pin)

    proc = subprocess.run([sys.executable, "-m", "shoal.engine.cli", *cmd], env=env, capture_output=True, text=True,
                          preexec_fn=enter, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    if bench == "latency":
        return out["rows"][0]["shoal"]["decode_tok_s"]
    return out["output_tokens_per_s"]["shoal"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m shoal.engine.tools.bench_contention", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conditions", nargs="+", default=["quiet", "busy1", "busy2", "quota"],
                    choices=["quiet", "busy1", "busy2", "quota", "one-core"])
    ap.add_argument("--policies", nargs="+", default=["before", "auto"], choices=sorted(POLICIES))
    ap.add_argument("--benches", nargs="+", default=["latency", "throughput"], choices=["latency", "throughput"])
    ap.add_argument("--quota", type=float, default=1.5, help="CPUs of the quota condition (default 1.5: a 1500m limit)")
    ap.add_argument("--preset", default="bench")
    ap.add_argument("--prompt-len", type=int, default=64, help="prompt tokens of every request (both benches)")
    ap.add_argument("--output-len", type=int, default=64, help="output tokens of every request (both benches)")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    base = {k: v for k, v in os.environ.items() if k not in _POLICY_VARS}
    cgroup = make_quota_cgroup(args.quota) if "quota" in args.conditions else None
    if "quota" in args.conditions and cgroup is None:
        print("quota: no writable cgroup here (skipped; --conditions one-core pins to one CPU instead)")
    results: dict[tuple[str, str, str], list[float]] = {}
    loads: list[float] = []
    for rnd in range(args.rounds):
        for condition in args.conditions:
            if condition == "quota" and cgroup is None:
                continue
            busy = [subprocess.Popen([sys.executable, "-c", "while 1: pass"])
                    for _ in range({"busy1": 1, "busy2": 2}.get(condition, 0))]
            try:
                for policy in args.policies:
                    for bench in args.benches:
                        load = os.getloadavg()[0]
                        value = run_engine(bench, {**base, **POLICIES[policy]}, cgroup if condition == "quota" else None,
                                           {min(os.sched_getaffinity(0))} if condition == "one-core" else None, args)
                        loads.append(load)
                        results.setdefault((condition, policy, bench), []).append(value)
                        print(f"round {rnd + 1} {condition:<8} {policy:<10} {bench:<10} {value:8.1f} tok/s  "
                              f"(load {load:.1f})", flush=True)
            finally:
                for p in busy:
                    p.kill()
                    p.wait()
    table = {f"{c}/{p}/{b}": round(statistics.median(v), 1) for (c, p, b), v in results.items()}
    if args.json:
        print(json.dumps({"median_tok_s": table, "runs": {f"{c}/{p}/{b}": v for (c, p, b), v in results.items()},
                          "load_min": min(loads, default=0), "load_max": max(loads, default=0)}))
        return 0
    print(f"\nmedian of {args.rounds} round(s); 1-min load {min(loads, default=0):.1f}-{max(loads, default=0):.1f}")
    print(f"{'condition':<10}{'policy':<12}" + "".join(f"{b + ' tok/s':>18}" for b in args.benches))
    for condition in args.conditions:
        for policy in args.policies:
            cells = [table.get(f"{condition}/{policy}/{b}") for b in args.benches]
            if any(c is not None for c in cells):
                print(f"{condition:<10}{policy:<12}" + "".join(f"{c if c is not None else '-':>18}" for c in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
