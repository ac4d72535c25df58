"""Starting worker processes: `python -m shoal.engine.distributed.worker`, one per local rank.

Rank 0 starts the other ranks of its node; a --headless node starts all of its own. A worker gets its identity
(rank, local rank, layout) as flags and the group's DistributedConfig as JSON, with the backend already resolved
from the parent's device so every rank of a node agrees on it.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys

from shoal.engine.config import DistributedConfig
from shoal.engine.execution.cpu_budget import rank_threads

logger = logging.getLogger("shoal.engine.distributed.spawn")
_spawned: list[subprocess.Popen] = []  # every worker this process started (see kill_spawned_workers)


def worker_command(rank: int, local_rank: int, tp: int, pp: int, master_port: int, config: DistributedConfig,
                   ready_dir: str | None = None) -> list[str]:
    cmd = [sys.executable, "-m", "shoal.engine.distributed.worker", "--rank", str(rank), "--local-rank",
           str(local_rank), "--tensor-parallel-size", str(tp), "--pipeline-parallel-size", str(pp),
           "--master-port", str(master_port), "--distributed-config", config.model_dump_json()]
    if ready_dir:
        cmd += ["--ready-dir", ready_dir]
    return cmd


def worker_env(local_world: int, device_type: str) -> dict[str, str]:
    env = dict(os.environ)
    if device_type != "cuda":  # the node's CPU budget shared between its ranks
        env["OMP_NUM_THREADS"] = str(rank_threads(local_world))
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("SHOAL_LOG_LEVEL", logging.getLevelName(logging.getLogger().getEffectiveLevel()).lower())
    return env


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL when the parent dies (Linux prctl PR_SET_PDEATHSIG)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)
    except Exception:  # noqa: BLE001 - not Linux: the workers still notice through the heartbeat
        pass


def spawn_workers(ranks: list[tuple[int, int]], tp: int, pp: int, master_port: int, config: DistributedConfig,
                  device_type: str, ready_dir: str | None = None,
                  die_with_parent: bool = False) -> list[tuple[int, subprocess.Popen]]:
    """Start a worker for each (rank, local_rank); returns [(rank, Popen)]. `config.backend` must be resolved.
    die_with_parent: the workers are killed when the spawning *thread* ends (use it from a main thread only)."""
    env = worker_env(max(local_rank for _, local_rank in ranks) + 1 if ranks else 1, device_type)
    procs = []
    for rank, local_rank in ranks:
        cmd = worker_command(rank, local_rank, tp, pp, master_port, config, ready_dir)
        procs.append((rank, subprocess.Popen(cmd, env=env, preexec_fn=_die_with_parent if die_with_parent else None)))
    logger.info("started local workers %s (pids %s)", [r for r, _ in procs], [p.pid for _, p in procs])
    _spawned.extend(p for _, p in procs)
    return procs


def kill_spawned_workers() -> None:
    """SIGKILL the workers this process started that still run: for an exit that skips the engine's shutdown
    (a server stopped while the model loads), which would otherwise leave them waiting for a rank 0 that is gone."""
    for p in _spawned:
        if p.poll() is None:
            p.kill()
            p.wait()
