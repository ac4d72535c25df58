"""Process groups for tensor and pipeline parallelism, rendezvous, and failure detection.

Rank layout (vLLM's): ``rank = pp_rank * tp_size + tp_rank``; node ``n`` of ``nnodes`` hosts the contiguous ranks
``[n * L, (n + 1) * L)`` with ``L = world_size / nnodes`` local ranks. Rank 0 (node 0, local rank 0) is the driver:
it owns the scheduler, the sampler and the HTTP server, and broadcasts every step's plan.

Groups
  - the default (world) group, backend NCCL on CUDA and gloo on CPU (``--distributed-backend`` overrides): the
    tensor-parallel all-reduces / all-gathers (one subgroup per pipeline stage) and the pipeline's point-to-point
    sends of hidden states and logits. Its timeout is the *collective timeout* (``--distributed-timeout``, 20 s).
  - a gloo "control" group on CPU for rank 0's calls (wire.py; every step's plan among them). Workers block in it
    while the server is idle, so it has no practical timeout; liveness there comes from the heartbeat below.

Start-up: rank 0 hosts a TCPStore at ``master_addr:master_port``. Every rank connects (retrying until the master is
up), announces itself, and waits until all ``world_size`` ranks have joined, logging which ranks are still missing
every few seconds, up to the start-up timeout (``--distributed-startup-timeout``, 600 s). Only then are the process groups
created, so ranks started minutes apart still form the group.

Failure detection. The bound, with the defaults: a dead, stopped or unreachable rank is noticed by every other
process within ``heartbeat_timeout + 2 * heartbeat_interval`` = 12 s (a killed process usually at once: its peers'
sockets close); a rank stuck inside a step while its process lives on, within the collective timeout, 20 s. Rank
0's /livez fails at that moment; it exits 1 ``exit_grace`` = 2 s later, the workers at once. So every process has
exited non-zero within 22 s (< 30 s); the flags --heartbeat-timeout and --distributed-timeout move the bound.
  - every rank bumps a counter ``hb/<rank>`` in the store each second (a separate store connection on a daemon
    thread, so a busy step does not delay it);
  - rank 0 watches the counters (and the exit codes of the workers it spawned itself): a counter that has not moved
    for ``heartbeat_timeout`` (``--heartbeat-timeout``, 10 s) means that rank is dead, hung or cut off. It then
    sets the key ``failed`` with the reason;
  - workers poll ``failed`` every second; a store that stops answering means rank 0 (which hosts it) is gone;
  - a collective or send/recv that raises (peer closed the connection) or times out fails the step at once.
  Workers exit 1 on any of these. Rank 0 marks its executor dead (the next ``step()`` raises, so the AsyncEngine's
  loop dies and /livez answers 503) and, when serving, exits 1 after ``exit_grace`` seconds.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from shoal.engine.config import DistributedConfig
from shoal.engine.distributed.parallel_state import ParallelState

logger = logging.getLogger("shoal.engine.distributed.comm")

_PREFIX = "shoal/"


class DistributedError(RuntimeError):
    """A rank died, hung or lost its network: this engine cannot continue."""


class StartupTimeoutError(DistributedError):
    """Not every rank joined within the start-up timeout."""


def rendezvous_port(config: DistributedConfig) -> int:
    """The master port: the configured one, else a free local port (one node) or 29500 (several nodes must
    agree on it without talking)."""
    if config.master_port is not None:
        return config.master_port
    return 29500 if config.nnodes > 1 else free_port()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pick_backend(device: torch.device, override: str | None = None) -> str:
    if override:
        return override
    return "nccl" if device.type == "cuda" else "gloo"


def rank_label(rank: int, tp_size: int, pp_size: int) -> str:
    return f"rank {rank} (pp stage {rank // tp_size}/{pp_size}, tp {rank % tp_size}/{tp_size})"


class RankLogFilter(logging.Filter):
    """Prefixes every log record of this process with its rank and stage."""

    def __init__(self, label: str):
        super().__init__()
        self.label = label

    def filter(self, record: logging.LogRecord) -> bool:
        if not getattr(record, "_shoal_rank", False):
            record.msg = f"[{self.label}] {record.msg}"
            record._shoal_rank = True
        return True


def tag_logs(label: str | None) -> None:
    """Prefix this process's log lines with `label` (None: stop prefixing)."""
    for handler in logging.getLogger().handlers:
        for f in [f for f in handler.filters if isinstance(f, RankLogFilter)]:
            handler.removeFilter(f)
        if label is not None:
            handler.addFilter(RankLogFilter(label))


# ------------------------------------------------------------------------------------------------ rendezvous
def _store_client(host: str, port: int, timeout: float):
    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout))


def connect_store(rank: int, world_size: int, host: str, port: int, config: DistributedConfig):
    """Rank 0 hosts the store; the others connect, retrying until the start-up deadline."""
    deadline = time.monotonic() + config.startup_timeout
    if rank == 0:
        return dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                             timeout=timedelta(seconds=config.collective_timeout))
    last_log = 0.0
    while True:
        try:
            store = _store_client(host, port, min(5.0, config.startup_timeout))
            store.set_timeout(timedelta(seconds=config.collective_timeout))
            return store
        except Exception as e:  # noqa: BLE001 - connection refused / timeout while the master is not up yet
            now = time.monotonic()
            if now >= deadline:
                raise StartupTimeoutError(
                    f"rank {rank}: the master at {host}:{port} did not come up within {config.startup_timeout:.0f}s"
                ) from e
            if now - last_log >= 5.0:
                logger.info("waiting for the master (rank 0) at %s:%d (%s)", host, port, type(e).__name__)
                last_log = now
            time.sleep(0.5)


def wait_for_ranks(store, rank: int, world_size: int, config: DistributedConfig) -> None:
    """Announce this rank and wait until all world_size ranks have, logging the missing ones."""
    store.set(f"{_PREFIX}join/{rank}", f"{socket.gethostname()}:{os.getpid()}")
    deadline = time.monotonic() + config.startup_timeout
    started = time.monotonic()
    last_log = started
    keys = [f"{_PREFIX}join/{r}" for r in range(world_size)]
    while not store.check(keys):
        now = time.monotonic()
        if now - last_log >= 5.0 or now >= deadline:
            missing = [r for r, k in enumerate(keys) if not store.check([k])]
            if now >= deadline:
                raise StartupTimeoutError(
                    f"rank {rank}: ranks {missing} of {world_size} did not join within "
                    f"{config.startup_timeout:.0f}s (--distributed-startup-timeout)")
            logger.info("waiting for ranks %s of %d to join (%.0fs so far, start-up timeout %.0fs)", missing,
                        world_size, now - started, config.startup_timeout)
            last_log = now
        time.sleep(0.2)
    logger.info("all %d ranks joined after %.1fs", world_size, time.monotonic() - started)


@dataclass
class Group:
    """Everything one rank knows about its group."""

    rank: int
    world_size: int
    tp_size: int
    pp_size: int
    local_rank: int
    backend: str
    store: object
    master: tuple[str, int]
    control: object  # gloo group for rank 0's calls (wire.py)
    state: ParallelState
    config: DistributedConfig
    monitor: "HeartbeatMonitor | None" = None

    @property
    def label(self) -> str:
        return rank_label(self.rank, self.tp_size, self.pp_size)

    def stage_rank(self, pp_rank: int, tp_rank: int) -> int:
        return pp_rank * self.tp_size + tp_rank

    def report_failure(self, reason: str) -> None:
        """Tell every rank (best effort) that the group has failed."""
        try:
            client = _store_client(*self.master, 2.0)
            client.set(f"{_PREFIX}failed", f"{self.label}: {reason}")
        except Exception:  # noqa: BLE001 - the store may be gone with rank 0
            pass

    def destroy(self) -> None:
        if self.monitor is not None:
            self.monitor.stop()
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception as e:  # noqa: BLE001
            logger.debug("destroy_process_group: %s", e)
        self.store = None


def init_group(rank: int, world_size: int, tp_size: int, pp_size: int, local_rank: int, device: torch.device,
               config: DistributedConfig, master_port: int) -> Group:
    if world_size != tp_size * pp_size:
        raise ValueError(f"world size {world_size} != tensor_parallel_size {tp_size} x pipeline_parallel_size {pp_size}")
    if dist.is_initialized():
        raise DistributedError("torch.distributed is already initialised in this process (one engine per process)")
    host = config.master_addr
    store = connect_store(rank, world_size, host, master_port, config)
    wait_for_ranks(store, rank, world_size, config)
    backend = pick_backend(device, config.backend)
    timeout = timedelta(seconds=config.collective_timeout)
    dist.init_process_group(backend, store=dist.PrefixStore(f"{_PREFIX}pg", store), rank=rank,
                            world_size=world_size, timeout=timeout)
    control = dist.new_group(backend="gloo", timeout=timedelta(days=7))
    tp_group = None
    for pp in range(pp_size):
        ranks = [pp * tp_size + t for t in range(tp_size)]
        g = dist.new_group(ranks, backend=backend, timeout=timeout) if tp_size > 1 else None
        if rank in ranks:
            tp_group = g
    state = ParallelState(tp_rank=rank % tp_size, tp_size=tp_size, pp_rank=rank // tp_size, pp_size=pp_size,
                          tp_group=tp_group)
    group = Group(rank, world_size, tp_size, pp_size, local_rank, backend, store, (host, master_port), control,
                  state, config)
    logger.info("process group formed (backend %s, collective timeout %.0fs, heartbeat timeout %.0fs)", backend,
                config.collective_timeout, config.heartbeat_timeout)
    return group


# ------------------------------------------------------------------------------------------------ heartbeats
class HeartbeatMonitor:
    """A daemon thread with its own store connection: bumps this rank's heartbeat, and on rank 0 watches everyone
    else's (plus local child processes); on workers watches the group's `failed` flag. Calls on_failure(reason)
    once."""

    def __init__(self, group: Group, on_failure: Callable[[str], None],
                 children: Callable[[], list] | None = None):
        self.group = group
        self.on_failure = on_failure
        self.children = children or (lambda: [])
        self._stop = threading.Event()
        self._fired = False
        self._thread = threading.Thread(target=self._run, name=f"shoal-heartbeat-{group.rank}", daemon=True)

    def start(self) -> "HeartbeatMonitor":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _fire(self, reason: str) -> None:
        if not self._fired and not self._stop.is_set():
            self._fired = True
            self.on_failure(reason)

    def _run(self) -> None:
        g, s = self.group, self.group.config
        try:
            store = _store_client(*g.master, max(2.0, s.heartbeat_timeout / 2))
        except Exception as e:  # noqa: BLE001
            self._fire(f"cannot reach the rendezvous store at {g.master[0]}:{g.master[1]}: {e}")
            return
        last_value = {r: -1 for r in range(g.world_size) if r != g.rank}
        last_change = {r: time.monotonic() for r in last_value}
        while not self._stop.wait(s.heartbeat_interval):
            try:
                store.add(f"{_PREFIX}hb/{g.rank}", 1)
                if store.check([f"{_PREFIX}failed"]):
                    self._fire("the group failed: " + store.get(f"{_PREFIX}failed").decode(errors="replace"))
                    return
                if g.rank != 0:
                    continue
                for child_rank, proc in self.children():
                    code = proc.poll()
                    if code is not None:
                        self._fire(f"rank {child_rank} (pid {proc.pid}) exited with code {code}")
                        return
                now = time.monotonic()
                for r in last_value:
                    value = store.add(f"{_PREFIX}hb/{r}", 0)
                    if value != last_value[r]:
                        last_value[r], last_change[r] = value, now
                    elif now - last_change[r] > s.heartbeat_timeout:
                        self._fire(f"{rank_label(r, g.tp_size, g.pp_size)} sent no heartbeat for "
                                   f"{now - last_change[r]:.1f}s (dead, hung or unreachable)")
                        return
            except Exception as e:  # noqa: BLE001 - the store is rank 0's: it is gone or unreachable
                if self._stop.is_set():
                    return
                self._fire(f"lost the rendezvous store at {g.master[0]}:{g.master[1]} (rank 0 gone?): {e}")
                return
