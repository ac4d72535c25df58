"""The engine's CPU budget: the quota read from fake cgroup trees (v2 and v1, nested, absent, unlimited, garbage),
the thread count and wait policy decided from it, the affinity mask and the observed load, and the environment
always winning."""

import os
import subprocess
import sys

import pytest

from shoal.engine.execution import cpu_budget
from shoal.engine.execution.cpu_budget import apply_cpu_budget, cgroup_quota, decide, other_load
from shoal.engine.execution.cpu_features import peer_environ


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.mark.parametrize("content, cpus", [("150000 100000\n", 1.5), ("max 100000\n", None), ("200000 50000", 4.0),
                                          ("50000", 0.5), ("garbage here", None)])
def test_cgroup_v2_cpu_max_at_the_namespace_root(tmp_path, content, cpus):
    write(tmp_path / "cpu.max", content)
    quota, where = cgroup_quota(tmp_path, proc_cgroup="0::/\n")
    assert quota == cpus
    if cpus is not None:
        assert "cgroup v2 cpu.max" in where and str(tmp_path) in where


def test_no_cgroup_files_means_no_quota(tmp_path):
    assert cgroup_quota(tmp_path, proc_cgroup="0::/\n") == (None, "no CPU quota")
    assert cgroup_quota(tmp_path, proc_cgroup="") == (None, "no CPU quota")


def test_the_tightest_limit_over_the_cgroup_and_its_ancestors_counts(tmp_path):
    # a pod-level limit above an unlimited container cgroup, as the kubelet lays them out without a namespace
    write(tmp_path / "cpu.max", "max 100000")
    write(tmp_path / "kubepods" / "pod1" / "cpu.max", "150000 100000")
    write(tmp_path / "kubepods" / "pod1" / "ctr" / "cpu.max", "max 100000")
    assert cgroup_quota(tmp_path, proc_cgroup="0::/kubepods/pod1/ctr\n")[0] == 1.5
    write(tmp_path / "kubepods" / "pod1" / "ctr" / "cpu.max", "120000 100000")
    quota, where = cgroup_quota(tmp_path, proc_cgroup="0::/kubepods/pod1/ctr\n")
    assert quota == 1.2 and "ctr" in where


def test_cgroup_v1_cfs_quota(tmp_path):
    proc = "12:memory:/x\n4:cpu,cpuacct:/kubepods/pod1\n0::/\n"
    write(tmp_path / "cpu,cpuacct" / "kubepods" / "pod1" / "cpu.cfs_quota_us", "150000\n")
    write(tmp_path / "cpu,cpuacct" / "kubepods" / "pod1" / "cpu.cfs_period_us", "100000\n")
    quota, where = cgroup_quota(tmp_path, proc_cgroup=proc)
    assert quota == 1.5 and "cgroup v1" in where
    write(tmp_path / "cpu,cpuacct" / "kubepods" / "pod1" / "cpu.cfs_quota_us", "-1\n")  # unlimited
    assert cgroup_quota(tmp_path, proc_cgroup=proc)[0] is None
    # a separately mounted cpu controller (as on hosts that mount each controller on its own)
    write(tmp_path / "cpu" / "job" / "cpu.cfs_quota_us", "250000")
    write(tmp_path / "cpu" / "job" / "cpu.cfs_period_us", "100000")
    other = tmp_path / "other"
    write(other / "cpu" / "job" / "cpu.cfs_quota_us", "250000")
    write(other / "cpu" / "job" / "cpu.cfs_period_us", "100000")
    assert cgroup_quota(other, proc_cgroup="3:cpu:/job\n")[0] == 2.5


@pytest.mark.parametrize("affinity, quota, threads", [(2, None, 2), (2, 1.5, 2), (2, 1.2, 1), (2, 1.0, 1),
                                                      (2, 0.5, 1), (2, 4.0, 2), (16, 3.9, 4), (16, 3.4, 3),
                                                      (1, None, 1), (1, 1.5, 1), (8, 8.0, 8)])
def test_threads_are_the_quota_rounded_half_up_within_the_affinity(affinity, quota, threads):
    budget = decide(affinity, quota, busy=0.0)
    assert budget.threads == threads
    assert budget.env()["OMP_NUM_THREADS"] == str(threads)


def test_waits_spin_briefly_on_own_cpus_and_sleep_beside_other_work():
    quiet = decide(2, None, busy=0.1)
    assert not quiet.passive and quiet.env() == {"OMP_NUM_THREADS": "2", "GOMP_SPINCOUNT": "10000"}
    busy = decide(2, None, busy=1.0)
    assert busy.passive and busy.env()["OMP_WAIT_POLICY"] == "passive" and "GOMP_SPINCOUNT" not in busy.env()
    assert "1.0 CPUs busy" in busy.describe()


def test_other_load_is_read_from_the_cpus_we_may_use():
    # cpu0 busy for the whole window, cpu1 idle, cpu2 (not ours) busy
    stats = iter(["cpu  0 0 0 0\ncpu0 100 0 0 100 0 0 0 0\ncpu1 0 0 0 200\ncpu2 100 0 0 100\n",
                  "cpu  0 0 0 0\ncpu0 200 0 0 100 0 0 0 0\ncpu1 0 0 0 300\ncpu2 200 0 0 100\n"])
    assert other_load({0, 1}, read_stat=lambda: next(stats), sleep=lambda s: None) == pytest.approx(1.0)
    stats = iter(["cpu1 0 0 0 200\n", "cpu1 0 0 0 300\n"])
    assert other_load({1}, read_stat=lambda: next(stats), sleep=lambda s: None) == 0.0


def test_a_window_opened_earlier_is_slept_only_for_its_rest_and_our_own_cpu_time_is_not_other_load():
    # opened at t=10 with 100 of our CPU ticks' worth used since: cpu0 300 jiffies busier, 100 of them ours
    tick = os.sysconf("SC_CLK_TCK")
    opened = cpu_budget.LoadSample("cpu0 100 0 0 100\ncpu1 0 0 0 200\n", own_cpu=5.0, at=10.0)
    slept = []
    load = other_load({0, 1}, window=0.25, opened=opened, sleep=slept.append, clock=lambda: 10.1,
                      read_stat=lambda: "cpu0 400 0 0 100\ncpu1 0 0 0 500\n", own_cpu=lambda: 5.0 + 100 / tick)
    assert slept == [pytest.approx(0.15)]  # the rest of the window only
    assert load == pytest.approx(2 * 200 / 600)
    # a window already over is not slept at all; never below zero (our ticks counted a little high)
    slept.clear()
    assert other_load({0, 1}, window=0.25, opened=opened, sleep=slept.append, clock=lambda: 11.0,
                      read_stat=lambda: "cpu0 150 0 0 100\ncpu1 0 0 0 250\n", own_cpu=lambda: 5.0 + 60 / tick) == 0.0
    assert slept == [0.0]


def run_without_openmp_settings(code: str) -> list[str]:
    """stdout lines of `code` run in a fresh interpreter whose environment sets no thread count or wait policy."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().splitlines()


def test_shoal_engine_opens_the_window_before_its_flags_and_applies_the_budget_before_torch():
    """Through main(): the window opens first, and when the budget is applied for `serve` the flags are parsed and
    the server's torch-free modules imported, torch still not."""
    code = (
        "import sys; from shoal.engine import cli; from shoal.engine.execution import cpu_budget as c\n"
        "apply = c.apply_cpu_budget\n"
        "def check(*a, **k):\n"
        "    print(c._opened is not None, 'torch' in sys.modules, 'aiohttp.web' in sys.modules); apply(*a, **k)\n"
        "    print(c._opened is None, c.decision()); raise SystemExit(0)\n"
        "c.apply_cpu_budget = check\n"
        "cli.main(['serve', '--model', 'no-such-model', '--port', '0'])\n")
    before, after = run_without_openmp_settings(code)
    assert before == "True False True"
    assert after.startswith("True ") and "CPU(s) in the affinity mask" in after


def test_the_environment_wins_and_peers_get_it_back(monkeypatch):
    monkeypatch.setattr(cpu_budget, "_decision", None)
    busy = decide(2, 1.2, busy=1.0)
    env = {"PATH": "/bin"}
    assert "1 thread(s), passive" in apply_cpu_budget(env, busy)
    assert env["OMP_NUM_THREADS"] == "1" and env["OMP_WAIT_POLICY"] == "passive"
    assert peer_environ(env) == {"PATH": "/bin"}  # a peer engine runs with its own defaults
    # the user's thread count stays; Shoal still picks the waits
    env = {"OMP_NUM_THREADS": "2"}
    line = apply_cpu_budget(env, busy)
    assert env["OMP_NUM_THREADS"] == "2" and env["OMP_WAIT_POLICY"] == "passive"
    assert "OMP_NUM_THREADS=2 from the environment wins" in line
    assert peer_environ(env) == {"OMP_NUM_THREADS": "2"}
    # both chosen: nothing observed, nothing changed
    env = {"OMP_NUM_THREADS": "3", "GOMP_SPINCOUNT": "0"}
    assert apply_cpu_budget(env, None).startswith("from the environment") and env == {
        "OMP_NUM_THREADS": "3", "GOMP_SPINCOUNT": "0"}
    env = {"SHOAL_CPU_THREADS": "1", "OMP_WAIT_POLICY": "active"}
    apply_cpu_budget(env, busy)
    assert env["OMP_NUM_THREADS"] == "1" and env["OMP_WAIT_POLICY"] == "active"


def test_an_affinity_mask_of_one_cpu_gives_torch_one_thread():
    """Through the real process start: the mask is read, the choice reaches torch's OpenMP."""
    code = ("import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))});"
            "from shoal.engine.execution.cpu_budget import apply_cpu_budget; print(apply_cpu_budget());"
            "import torch; print(torch.get_num_threads())")
    line, threads = run_without_openmp_settings(code)
    assert threads == "1" and "1 CPU(s) in the affinity mask" in line


def test_a_nodes_cpu_ranks_split_its_budget_unless_the_user_set_threads(monkeypatch):
    from shoal.engine.distributed.spawn import worker_env

    monkeypatch.setattr(cpu_budget, "cgroup_quota", lambda *a, **k: (3.0, "a 3-CPU quota"))
    monkeypatch.setattr(cpu_budget.os, "sched_getaffinity", lambda pid: set(range(8)))
    # Shoal set OMP_NUM_THREADS for rank 0 from the whole budget: the workers must not each take all of it
    shoal = {"OMP_NUM_THREADS": "3", "GOMP_SPINCOUNT": "10000", cpu_budget.SET_BY_SHOAL: "OMP_NUM_THREADS,GOMP_SPINCOUNT"}
    assert cpu_budget.rank_threads(2, shoal) == 1  # 3 CPUs of quota over 2 ranks, never 4 on 8 visible CPUs
    assert cpu_budget.rank_threads(1, shoal) == 3
    assert cpu_budget.rank_threads(8, shoal) == 1
    # a user's OMP_NUM_THREADS is per process, as with torchrun
    assert cpu_budget.rank_threads(2, {"OMP_NUM_THREADS": "5"}) == 5
    monkeypatch.setattr(os, "environ", {**shoal, "PATH": os.environ.get("PATH", "")})
    assert worker_env(2, "cpu")["OMP_NUM_THREADS"] == "1"
    assert worker_env(2, "cuda")["OMP_NUM_THREADS"] == "3"  # GPU ranks keep the parent's setting
