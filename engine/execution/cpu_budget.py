"""How much CPU this engine really has, and the OpenMP threads and wait policy that follow: decided once at start.

A pod's CPUs are rarely the machine's: a CPU limit becomes a CFS quota (cgroup v2 `cpu.max`, v1
`cpu.cfs_quota_us`/`cpu.cfs_period_us`) that lets the process run `quota` CPU-seconds per period and then stops all
its threads until the next one; the static CPU manager or `taskset` narrows the CPUs it may run on
(`sched_getaffinity`); and other processes may be busy on those CPUs. OpenMP sees none of this: it starts one thread
per online CPU and each thread spins after every parallel region. Under a 1.5-CPU quota two spinning threads burn
the quota in 2/3 of a period and the whole process is then stopped for the rest; beside a busy neighbour every
parallel region waits for the thread the scheduler put behind it.

So the budget is `min(affinity, quota)` CPUs, and:
- threads = the budget rounded to the nearest whole CPU, halves up (1500m -> 2, 1200m -> 1): a thread whose share
  of the quota runs out before the period ends stalls the step for the rest of it, but under 1.5 CPUs two threads
  still did ~30 % more work than one (measured on SmolLM2's shape, batch 1 and 32, docs/performance.md);
- the wait policy is a short spin (GOMP_SPINCOUNT=10000, measured best on an idle machine) while the threads have
  their CPUs to themselves, and passive (sleep at once) when the quota is below the threads' CPUs or the CPUs we may
  run on were busy with other work when the engine started, because a spinning thread then takes time from the
  thread or process that the region is waiting for;
- work inside a step is already split for late threads: the small-M GEMM hands out its rows dynamically.
The load is sampled once at start (per-CPU busy time in /proc/stat over a short window, on the CPUs we may use,
less this process's own CPU time in it: `shoal-engine` opens the window first thing and parses its flags and
imports what needs no torch inside it, instead of sleeping through it); later changes are not followed (the wait
policy cannot change once OpenMP has started).

Explicit settings win: OMP_NUM_THREADS (or SHOAL_CPU_THREADS) for the thread count, OMP_WAIT_POLICY or
GOMP_SPINCOUNT for the wait. The operator renders integer CPU requests == limits and OMP_NUM_THREADS to match, so a
Guaranteed pod on a node with the static CPU manager policy gets exclusive cores and the spin stays cheap.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

SPINCOUNT = "10000"
# Other work on our CPUs, in CPUs, above which a spinning thread would steal from it or be preempted by it.
BUSY_THRESHOLD = 0.5
THREAD_VARS = ("OMP_NUM_THREADS", "SHOAL_CPU_THREADS")
WAIT_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _own_cgroups(proc_cgroup: str) -> tuple[str | None, str | None]:
    """This process's cgroup v2 path and its v1 cpu-controller path, from /proc/self/cgroup."""
    v2 = v1 = None
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            v2 = parts[2]
        elif "cpu" in parts[1].split(","):
            v1 = parts[2]
    return v2, v1


def _ancestors(root: Path, rel: str) -> list[Path]:
    """`root/rel` and each directory above it up to root: a limit set on any ancestor applies to us."""
    path, out = root / rel.strip("/"), []
    while True:
        out.append(path)
        if path == root or root not in path.parents:
            return out
        path = path.parent


def cgroup_quota(root: str | Path = "/sys/fs/cgroup", proc_cgroup: str | None = None) -> tuple[float | None, str]:
    """The tightest CFS quota over this process's cgroup and its ancestors, in CPUs (None: unlimited), and where
    it was read. Inside a container the cgroup namespace makes our own cgroup the root, so the root's files count."""
    root = Path(root)
    if proc_cgroup is None:
        proc_cgroup = _read(Path("/proc/self/cgroup")) or ""
    v2, v1 = _own_cgroups(proc_cgroup)
    best: tuple[float | None, str] = (None, "no CPU quota")

    def consider(cpus: float, where: str) -> None:
        nonlocal best
        if best[0] is None or cpus < best[0]:
            best = (cpus, where)

    if v2 is not None:
        for d in _ancestors(root, v2):
            text = _read(d / "cpu.max")
            if text is None:
                continue
            fields = text.split()
            if len(fields) >= 1 and fields[0] != "max":
                try:
                    period = int(fields[1]) if len(fields) > 1 else 100_000
                    consider(int(fields[0]) / period, f"cgroup v2 cpu.max {text!r} in {d}")
                except ValueError:
                    continue
    for v1_root in (root / "cpu,cpuacct", root / "cpu", root / "cpuacct,cpu"):
        if v1 is None or not v1_root.is_dir():
            continue
        for d in _ancestors(v1_root, v1):
            quota, period = _read(d / "cpu.cfs_quota_us"), _read(d / "cpu.cfs_period_us")
            try:
                q, p = int(quota or "-1"), int(period or "0")
            except ValueError:
                continue
            if q > 0 and p > 0:
                consider(q / p, f"cgroup v1 cpu.cfs_quota_us {q} / cpu.cfs_period_us {p} in {d}")
        break
    return best


def _cpu_times(stat: str, cpus: set[int]) -> tuple[int, int]:
    """(busy, total) jiffies summed over the given CPUs' lines of /proc/stat."""
    busy = total = 0
    for line in stat.splitlines():
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cpus:
            continue
        v = [int(x) for x in rest.split()]
        idle = v[3] + (v[4] if len(v) > 4 else 0)  # idle + iowait
        t = sum(v[:8])  # guest time is already inside user
        busy, total = busy + t - idle, total + t
    return busy, total


def _read_stat() -> str:
    return _read(Path("/proc/stat")) or ""


@dataclass(frozen=True)
class LoadSample:
    """Where a load sample's window opened: /proc/stat, this process's CPU seconds and the monotonic clock."""
    stat: str
    own_cpu: float
    at: float

    @classmethod
    def now(cls, read_stat=None, own_cpu=time.process_time, clock=time.monotonic) -> LoadSample:
        return cls((read_stat or _read_stat)(), own_cpu(), clock())


def other_load(cpus: set[int], window: float = 0.25, read_stat=None, sleep=time.sleep, opened: LoadSample | None = None,
               own_cpu=time.process_time, clock=time.monotonic) -> float:
    """CPUs' worth of other processes' work on `cpus` over a window of `window` seconds, opened now and slept
    through; or opened earlier (`opened`), slept for what is left of it, and this process's own CPU time in it (the
    work done meanwhile) taken off."""
    read_stat = read_stat or _read_stat
    b0, t0 = _cpu_times(opened.stat if opened else read_stat(), cpus)
    sleep(window if opened is None else max(0.0, window - (clock() - opened.at)))
    b1, t1 = _cpu_times(read_stat(), cpus)
    own = 0.0 if opened is None else (own_cpu() - opened.own_cpu) * os.sysconf("SC_CLK_TCK")  # in clock ticks
    return 0.0 if t1 <= t0 else max(0.0, len(cpus) * (b1 - b0 - own) / (t1 - t0))


@dataclass(frozen=True)
class CpuBudget:
    affinity: int  # CPUs this process may run on
    quota: float | None  # CFS quota in CPUs, None when unlimited
    busy: float  # other work observed on our CPUs at start, in CPUs
    threads: int
    passive: bool
    reasons: list[str] = field(default_factory=list)

    def env(self) -> dict[str, str]:
        """The settings that carry this budget into OpenMP (read when torch loads it)."""
        wait = {"OMP_WAIT_POLICY": "passive"} if self.passive else {"GOMP_SPINCOUNT": SPINCOUNT}
        return {"OMP_NUM_THREADS": str(self.threads), **wait}

    def describe(self) -> str:
        return (f"{self.threads} thread(s), {'passive' if self.passive else f'{SPINCOUNT}-spin'} OpenMP waits: "
                + "; ".join(self.reasons))


def decide(affinity: int, quota: float | None, busy: float, quota_where: str = "") -> CpuBudget:
    """The policy, from what was observed (pure: the tests drive it directly)."""
    reasons = [f"{affinity} CPU(s) in the affinity mask"]
    cpus = float(affinity)
    if quota is not None:
        reasons.append(f"quota {quota:g} CPUs ({quota_where})" if quota_where else f"quota {quota:g} CPUs")
        cpus = min(cpus, quota)
    threads = max(1, min(affinity, math.floor(cpus + 0.5 + 1e-9)))
    passive = busy >= BUSY_THRESHOLD
    if passive:
        reasons.append(f"{busy:.1f} CPUs busy with other work at start")
    reasons.append("passive waits: a spinning thread would take CPU from the work it waits for" if passive
                   else "short spin: the threads have their CPUs to themselves")
    return CpuBudget(affinity=affinity, quota=quota, busy=busy, threads=threads, passive=passive, reasons=reasons)


def observe(root: str | Path = "/sys/fs/cgroup", window: float = 0.25, opened: LoadSample | None = None) -> CpuBudget:
    affinity = os.sched_getaffinity(0)
    quota, where = cgroup_quota(root)
    return decide(len(affinity), quota, other_load(affinity, window, opened=opened), where)


SET_BY_SHOAL = "SHOAL_SET_WAIT_POLICY"  # names the variables Shoal set (comma-separated), not the user
_decision: str | None = None
_opened: LoadSample | None = None  # the load sample's window, once open_load_sample() opened it


def open_load_sample() -> None:
    """Open the load sample's window now: what runs until apply_cpu_budget() (no torch yet) overlaps it, and only
    what is left of the window is slept."""
    global _opened
    _opened = LoadSample.now()


def apply_cpu_budget(environ=None, budget: CpuBudget | None = None) -> str:
    """Put the budget's thread count and wait policy into the environment where it did not set them; returns the
    decision, also kept for the start-up log. Must run before torch loads its OpenMP runtime (`shoal-engine` calls
    it once its flags are parsed, before anything imports torch)."""
    global _decision, _opened
    environ = os.environ if environ is None else environ
    if "SHOAL_CPU_THREADS" in environ and "OMP_NUM_THREADS" not in environ:
        environ["OMP_NUM_THREADS"] = environ["SHOAL_CPU_THREADS"]
    user = [k for k in ("OMP_NUM_THREADS", *WAIT_VARS) if k in environ]
    if "OMP_NUM_THREADS" in user and set(user) & set(WAIT_VARS):
        _decision = "from the environment: " + ", ".join(f"{k}={environ[k]}" for k in user)
        return _decision
    if budget is None:
        opened, _opened = _opened, None
        budget = observe(opened=opened)
    chosen = {k: v for k, v in budget.env().items()
              if not (k == "OMP_NUM_THREADS" and "OMP_NUM_THREADS" in user)
              and not (k in WAIT_VARS and set(user) & set(WAIT_VARS))}
    environ.update(chosen)
    environ[SET_BY_SHOAL] = ",".join(chosen)
    _decision = budget.describe() + "".join(f"; {k}={environ[k]} from the environment wins" for k in user)
    return _decision


def apply_thread_count() -> str:
    """For an engine started without `shoal-engine` (the Python API), after torch has loaded: the thread count
    still can be set (the wait policy no longer can), so a quota or an affinity mask is still respected."""
    global _decision
    if _decision is not None or "OMP_NUM_THREADS" in os.environ:
        return decision()
    import torch

    quota, where = cgroup_quota()
    budget = decide(len(os.sched_getaffinity(0)), quota, 0.0, where)
    if torch.get_num_threads() != budget.threads:
        torch.set_num_threads(budget.threads)
    _decision = f"{budget.threads} thread(s) (set after torch started: the OpenMP wait policy is the environment's)"
    return _decision


def rank_threads(local_ranks: int, environ=None) -> int:
    """Threads for each of a node's `local_ranks` CPU ranks: an OMP_NUM_THREADS the user set is per process (as
    with torchrun) and wins; otherwise the node's whole CPUs (affinity within the cgroup quota, the budget above)
    split evenly, so the ranks together never oversubscribe the quota."""
    environ = os.environ if environ is None else environ
    shoal_set = environ.get(SET_BY_SHOAL, "").split(",")
    if "OMP_NUM_THREADS" in environ and "OMP_NUM_THREADS" not in shoal_set:
        try:
            return max(1, int(environ["OMP_NUM_THREADS"]))
        except ValueError:
            pass
    quota, where = cgroup_quota()
    node = decide(len(os.sched_getaffinity(0)), quota, 0.0, where).threads
    return max(1, node // max(1, local_ranks))


def decision() -> str:
    """What decided this process's threads and waits, for the start-up log."""
    if _decision is not None:
        return _decision
    return "not decided by Shoal (torch's default thread count)" if "OMP_NUM_THREADS" not in os.environ \
        else f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']} from the environment"
