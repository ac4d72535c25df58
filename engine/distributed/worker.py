"""One worker rank: `python -m shoal.engine.distributed.worker` (started by rank 0 or by a --headless node).

A worker's whole life: join the group, receive the engine's spec from rank 0, load its shard, then run the methods
rank 0 calls (Worker below; wire.py carries the calls) until `shutdown`. It exits 0 after `shutdown` and 1 on any
failure of the group.

Drain: SIGTERM and SIGINT do not stop a worker. A pod's (or a terminal's) signal reaches every process of the
group at once, and rank 0 needs all of its ranks while it finishes the in-flight requests; it calls `shutdown`
once it has drained. If rank 0 never does, the heartbeat (rank 0 gone) or the kubelet's SIGKILL ends the worker.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from shoal.engine.config import DistributedConfig
from shoal.engine.contracts import StepInputs
from shoal.engine.distributed.comm import DistributedError, HeartbeatMonitor, init_group, rank_label, tag_logs
from shoal.engine.distributed.pipeline import PipelineStats, Shard, build_runner
from shoal.engine.distributed.wire import SHUTDOWN_BARRIER_TIMEOUT, receive_call

logger = logging.getLogger("shoal.engine.distributed.worker")


class Worker:
    """One rank's part of every collective call, rank 0's included: the driver's `collective_rpc("name", ...)`
    runs Worker.name(...) on every rank (here after receiving the call; on rank 0 in the driver itself)."""

    def __init__(self, group, shard: Shard):
        self.group = group
        self.shard = shard
        self.received_at = 0.0  # when the current call arrived: a step's wall time counts from there
        self.offload = None  # execution/kv_offload.KVOffloader with KV offloading on

    def serve(self) -> None:
        """A worker's loop: run rank 0's calls until `shutdown`."""
        while True:
            method, args = receive_call(self.group.control)
            self.received_at = time.perf_counter()
            fn = getattr(self, method, None)
            if method.startswith("_") or not callable(fn):
                raise DistributedError(f"rank 0 called {method!r}, which a Worker does not have")
            fn(*args)
            if method == "shutdown":
                return

    def execute_model(self, inputs: StepInputs, rows: list | None) -> torch.Tensor | None:
        """Run this shard over the step. `rows`, the step's sampling rows, come along only when rank 0 does not
        sample itself: then the sampler rank (the last stage's tensor rank 0) samples them and sends rank 0 the
        SamplerOutput. Returns the logits on the rank that samples, else None."""
        logits = self.shard.run_step(inputs, self.received_at)
        if rows and self.shard.sampler is not None:
            self.shard.sample_for_rank0(logits, rows)
        return logits

    def add_lora(self, adapter_id: int, path: str) -> None:
        """Read a LoRA adapter (validated on rank 0 first) and keep this rank's shard of it."""
        self.shard.runner.add_lora(adapter_id, path)

    def remove_lora(self, adapter_id: int) -> None:
        self.shard.runner.remove_lora(adapter_id)

    def allocate_kv_cache(self, num_blocks: int, block_size: int, num_state_slots: int = 1) -> None:
        self.shard.runner.allocate_kv_cache(num_blocks, block_size, num_state_slots)

    def enable_kv_offload(self, spec) -> None:
        from shoal.engine.execution.kv_offload import KVOffloader

        self.offload = KVOffloader(self.shard.runner, spec, self.group.rank)

    def kv_transfer(self, saves: list[tuple[int, int]], loads: list[tuple[int, int]]) -> int:
        """This rank's copies, then the loads every rank completed (the fewest); a block some rank could not load
        is dropped everywhere, so the next lookup stops before it."""
        done = self.offload.transfer(saves, loads)
        if not loads:
            return 0
        n = torch.tensor([done], dtype=torch.int64)
        dist.all_reduce(n, op=dist.ReduceOp.MIN, group=self.group.control)
        n = int(n)
        if n < len(loads):
            self.offload.remove([loads[n][0]])
        return n

    def kv_clear(self) -> None:
        self.offload.clear()

    def kv_rank_nbytes(self) -> list[int] | None:
        """One block's bytes on every rank, gathered on rank 0 (None elsewhere)."""
        from shoal.engine.execution.kv_offload import block_nbytes

        return self._gather(block_nbytes(self.shard.runner))

    def kv_export(self, pairs: list[tuple[int, int]]) -> list[bytes] | None:
        """Every rank's bytes of the blocks, concatenated in rank order on rank 0 (None elsewhere), up to the first
        block some rank cannot give."""
        from shoal.engine.execution.kv_offload import export_blocks

        mine = [row.numpy().tobytes() for row in export_blocks(self.shard.runner, self.offload, pairs)]
        ranks = self._gather(mine)
        if ranks is None:
            return None
        n = min(len(r) for r in ranks)
        return [b"".join(r[i] for r in ranks) for i in range(n)]

    def kv_import(self, items: list[tuple[int, bytes]], rank_nbytes: list[int]) -> None:
        """Each rank keeps its own slice of every block (rank_nbytes: the slices' sizes, in rank order)."""
        r = self.group.rank
        start = sum(rank_nbytes[:r])
        self.offload.put([(h, torch.frombuffer(bytearray(data[start:start + rank_nbytes[r]]), dtype=torch.uint8))
                          for h, data in items])

    def _gather(self, obj):
        out = [None] * self.group.world_size if self.group.rank == 0 else None
        dist.gather_object(obj, out, dst=0, group=self.group.control)
        return out

    def sleep(self, level: int) -> None:
        self.shard.runner.sleep(level)

    def wake_up(self) -> None:
        self.shard.runner.wake_up()

    def memory_bytes(self) -> dict[str, int]:
        return self.shard.runner.memory_bytes()

    def profile_peak_memory(self, num_tokens: int, block_size: int) -> int:
        """Every rank runs a dummy step of num_tokens; the peak over all ranks."""
        peak = torch.tensor([self.shard.profile(num_tokens, block_size)], dtype=torch.int64)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=self.group.control)
        return int(peak)

    def pipeline_stats(self, reset: bool) -> list[list[float]] | None:
        """Every rank's PipelineStats, gathered on rank 0 (None elsewhere); reset zeroes them afterwards."""
        out = [None] * self.group.world_size if self.group.rank == 0 else None
        dist.gather_object(self.shard.stats.as_list(), out, dst=0, group=self.group.control)
        if reset:
            self.shard.stats = PipelineStats()
        return out

    def shutdown(self) -> None:
        """Meet every rank at a barrier (SHUTDOWN_BARRIER_TIMEOUT); a worker then leaves its loop and exits 0."""
        logger.info("shutting down")
        if self.offload is not None:
            self.offload.close()
        self.group.monitor.stop()  # rank 0 closes the store after the barrier: that is no failure
        dist.monitored_barrier(self.group.control, timeout=SHUTDOWN_BARRIER_TIMEOUT)


def keep_serving_on_signals() -> None:
    """SIGTERM / SIGINT: log and keep serving; rank 0 ends the group once it has drained."""
    def note(signum, frame):
        logger.info("received %s: serving on until rank 0 has drained and stops the group",
                    signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, note)
    signal.signal(signal.SIGINT, note)


def run_worker(rank: int, local_rank: int, tp: int, pp: int, master_port: int, config: DistributedConfig,
               ready_dir: str | None = None) -> int:
    """Returns 0 after `shutdown`; any failure ends the process with exit code 1 (os._exit: a broken group cannot
    be torn down)."""
    tag_logs(rank_label(rank, tp, pp))
    device = torch.device("cpu")
    if config.backend == "nccl":  # resolved by the parent from its own device (gloo: CPU ranks)
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    group = None

    def die(reason: str) -> None:
        logger.error("%s; exiting with code 1", reason)
        if group is not None:
            group.report_failure(reason)
        logging.shutdown()
        os._exit(1)

    try:
        group = init_group(rank, tp * pp, tp, pp, local_rank, device, config, master_port)
        group.monitor = HeartbeatMonitor(group, die).start()
        shard = _load_shard(group, device)
        if ready_dir:
            Path(ready_dir, f"rank-{rank}").write_text(str(os.getpid()))
        logger.info("shard loaded (layers %d-%d); waiting for rank 0's calls", shard.runner.model.start_layer,
                    shard.runner.model.end_layer - 1)
        Worker(group, shard).serve()
    except BaseException as e:  # noqa: BLE001 - any failure (a peer died, a timeout) ends this process
        die(f"{type(e).__name__}: {e}")
    group.destroy()
    return 0


def _load_shard(group, device: torch.device) -> Shard:
    """Receive the engine's spec from rank 0 and build this rank's shard (and the sampler, on the sampler rank)."""
    from shoal.engine.config import EngineConfig
    from shoal.engine.execution.model_loader import load_hf_config, resolve_model_dir
    from shoal.engine.execution.sampling import Sampler

    payload = [None]
    dist.broadcast_object_list(payload, src=0, group=group.control)
    spec = payload[0]
    config = EngineConfig(**spec["config"])
    model_dir = resolve_model_dir(config.model, config.revision)
    hf_config = load_hf_config(model_dir, config.trust_remote_code)
    runner = build_runner(group, config, model_dir, hf_config, getattr(torch, spec["dtype"]), device,
                          spec["max_model_len"])
    sampler = Sampler(spec["vocab_size"], spec["eos_token_ids"])
    return Shard(group, runner, hf_config.hidden_size, config.distributed.micro_batches or group.pp_size, sampler)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m shoal.engine.distributed.worker", description="one Shoal worker rank")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--local-rank", type=int, required=True)
    p.add_argument("--tensor-parallel-size", type=int, required=True)
    p.add_argument("--pipeline-parallel-size", type=int, required=True)
    p.add_argument("--master-port", type=int, required=True)
    p.add_argument("--distributed-config", type=DistributedConfig.model_validate_json, required=True,
                   help="the group's DistributedConfig as JSON")
    p.add_argument("--ready-dir", default=None, help="write rank-<rank> here once the shard is loaded")
    p.add_argument("--log-level", default=os.environ.get("SHOAL_LOG_LEVEL", "info"))
    args = p.parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    keep_serving_on_signals()
    return run_worker(args.rank, args.local_rank, args.tensor_parallel_size, args.pipeline_parallel_size,
                      args.master_port, args.distributed_config, args.ready_dir)


if __name__ == "__main__":
    code = main()
    # Nothing is left to clean up: skip the interpreter's teardown (seconds with torch on a busy machine), so
    # rank 0 sees its workers gone well within its own shutdown.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
