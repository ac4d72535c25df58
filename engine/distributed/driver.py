"""DistributedExecutor: rank 0's Executor when world_size > 1 (see shoal.engine.execution.executor).

Rank 0 runs the scheduler and drives the other ranks by method name: `collective_rpc("name", *args)` sends the call
on the control group (wire.py) and every rank runs Worker.name(*args) (worker.py), rank 0 included, for its own
part (it runs its shard, pipeline.py, like every other rank). When rank 0 is not the last pipeline stage, the
last stage's tensor-parallel rank 0 samples: the step's call carries the sampling rows (parameters; token
histories only where penalties read them; seeded rows' draws made ahead from the generators rank 0 keeps) and
rank 0 receives the SamplerOutput. The sampler's constants went to every rank once, in the start-up spec.

A speculative draft model runs whole on rank 0 (execution/drafter.py says why): `propose` sends no call, and
sampled proposals' distributions reach a remote sampler in the rows like every other row field.

Failures (comm.py explains the detection) mark the executor failed: check_health() and every later command raise
DistributedError, and when serving (exit_on_failure) the process exits 1 after exit_grace seconds.
"""

from __future__ import annotations

import atexit
import logging
import os
import subprocess
import threading
import time

import torch
import torch.distributed as dist

from shoal.engine.contracts import StepInputs
from shoal.engine.distributed.comm import (DistributedError, HeartbeatMonitor, init_group, pick_backend, rank_label,
                                           rendezvous_port, tag_logs)
from shoal.engine.distributed.pipeline import Shard, build_runner
from shoal.engine.distributed.spawn import spawn_workers
from shoal.engine.distributed.wire import broadcast_call
from shoal.engine.distributed.worker import Worker
from shoal.engine.execution.cpu_budget import rank_threads
from shoal.engine.execution.drafter import DraftHost
from shoal.engine.execution.sampling import Sampler, SamplerOutput, SamplingRow

logger = logging.getLogger("shoal.engine.distributed.driver")


class DistributedExecutor(DraftHost):
    def __init__(self, config, model_dir, hf_config, dtype: torch.dtype, device: torch.device, max_model_len: int,
                 sampler: Sampler):
        dcfg = config.distributed.model_copy(update={"backend": pick_backend(device, config.distributed.backend)})
        self.config = dcfg
        tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
        world = tp * pp
        if dcfg.node_rank != 0:
            raise ValueError("the engine (rank 0) runs on node 0; other nodes run `shoal-engine serve --headless`")
        per_node = world // dcfg.nnodes
        port = rendezvous_port(dcfg)
        tag_logs(rank_label(0, tp, pp))
        self.failure: str | None = None
        self._rank_nbytes: list[int] | None = None  # one KV block's bytes per rank (asked once, for KV transfer)
        self._lock = threading.Lock()
        self._closed = False
        self._threads_before = None
        if device.type == "cpu" and per_node > 1:
            self._threads_before = torch.get_num_threads()
            torch.set_num_threads(rank_threads(per_node))
        self.children: list[tuple[int, subprocess.Popen]] = []
        try:
            self.children = spawn_workers([(r, r) for r in range(1, per_node)], tp, pp, port, dcfg, device.type)
            self.group = init_group(0, world, tp, pp, 0, device, dcfg, port)
            self.group.monitor = HeartbeatMonitor(self.group, self._on_failure, lambda: self.children).start()
            spec = {"config": config.model_dump(), "dtype": str(dtype).removeprefix("torch."),
                    "max_model_len": max_model_len, "vocab_size": sampler.vocab_size,
                    "eos_token_ids": list(sampler.eos_token_ids)}
            dist.broadcast_object_list([spec], src=0, group=self.group.control)
            runner = build_runner(self.group, config, model_dir, hf_config, dtype, device, max_model_len)
        except BaseException:
            self._closed = True
            self._kill_children()
            if hasattr(self, "group"):
                self.group.destroy()
            elif dist.is_initialized():
                dist.destroy_process_group()
            tag_logs(None)
            raise
        atexit.register(self.shutdown)  # an engine that is never shut down leaves no workers behind
        self.shard = Shard(self.group, runner, hf_config.hidden_size, dcfg.micro_batches or pp, sampler)
        self.worker = Worker(self.group, self.shard)
        self.sampler = sampler
        self.engine_config = config
        self.backend_name = runner.backend_name
        logger.info("distributed engine: tp %d x pp %d = %d ranks over %d node(s), backend %s, %d micro-batches "
                    "per step", tp, pp, world, dcfg.nnodes, self.group.backend, self.shard.micro_batches)

    @property
    def runner(self):
        """Rank 0's own ModelRunner."""
        return self.shard.runner

    # -- failure handling ---------------------------------------------------------------------------------
    def _on_failure(self, reason: str) -> None:
        if self.failure is not None:
            return
        self.failure = reason
        logger.error("distributed engine failed: %s", reason)
        self.group.report_failure(reason)
        if self.config.exit_on_failure:
            def exit_later():
                time.sleep(self.config.exit_grace)  # /livez answers 503 meanwhile
                self._kill_children(log=True)
                logger.error("exiting with code 1 after a rank failure")
                logging.shutdown()
                os._exit(1)

            threading.Thread(target=exit_later, name="shoal-exit", daemon=True).start()

    def check_health(self) -> None:
        if self.failure is not None:
            raise DistributedError(f"a rank failed: {self.failure}")

    def _call(self, method: str, *args):
        """Send the call to every other rank, then run rank 0's own part; rank 0's result."""
        self.check_health()
        if self._closed:
            raise DistributedError("the distributed executor was shut down")
        self.worker.received_at = time.perf_counter()
        broadcast_call(self.group.control, method, args)
        return getattr(self.worker, method)(*args)

    def collective_rpc(self, method: str, *args):
        """Run Worker.<method>(*args) on every rank, this one included; returns rank 0's result. A failure of
        the group marks this executor failed and raises DistributedError."""
        return self._guarded(lambda: self._call(method, *args))

    def _guarded(self, fn):
        with self._lock:
            try:
                return fn()
            except DistributedError:
                raise
            except Exception as e:  # a peer closed its connection, or a collective timed out
                self._on_failure(f"{type(e).__name__}: {e}")
                raise DistributedError(f"distributed step failed: {e}") from e

    # -- the Executor protocol ----------------------------------------------------------------------------
    def bytes_per_block(self, block_size: int) -> int:
        return self.runner.bytes_per_block(block_size)

    @property
    def padding_blocks(self) -> int:
        """Every rank of a group runs its steps eagerly (no decode capture, no padding block); rank 0's draft
        model is a one-process runner and captures its decode rounds."""
        return self.drafter.padding_blocks if self.drafter is not None else 0

    def add_lora(self, adapter_id: int, path: str) -> None:
        self.collective_rpc("add_lora", adapter_id, path)

    def remove_lora(self, adapter_id: int) -> None:
        self.collective_rpc("remove_lora", adapter_id)

    def allocate_kv_cache(self, num_blocks: int, block_size: int, num_state_slots: int = 1) -> None:
        self.collective_rpc("allocate_kv_cache", num_blocks, block_size, num_state_slots)
        if self.drafter is not None:
            self.drafter.allocate_kv_cache(num_blocks, block_size)

    def enable_kv_offload(self, spec) -> None:
        self.collective_rpc("enable_kv_offload", spec)

    def kv_lookup(self, block_hashes: list[int]) -> list[str]:
        return self.worker.offload.lookup(block_hashes)  # rank 0's tiers: every rank stores the same hashes

    def kv_transfer(self, saves: list[tuple[int, int]], loads: list[tuple[int, int]]) -> int:
        return self.collective_rpc("kv_transfer", saves, loads)

    def kv_clear(self) -> None:
        self.collective_rpc("kv_clear")

    def kv_offload_stats(self) -> dict[str, dict[str, int]]:
        return self.worker.offload.stats()

    def kv_take_changes(self) -> list[tuple[str, str, int]]:
        return self.worker.offload.take_changes()  # rank 0's: every rank's tiers change alike

    def kv_rank_nbytes(self) -> list[int]:
        if self._rank_nbytes is None:
            self._rank_nbytes = self.collective_rpc("kv_rank_nbytes")
        return self._rank_nbytes

    def kv_export(self, pairs: list[tuple[int, int]]) -> list[bytes]:
        return self.collective_rpc("kv_export", pairs)

    def kv_import(self, items: list[tuple[int, bytes]]) -> None:
        self.collective_rpc("kv_import", items, self.kv_rank_nbytes())

    def sleep(self, level: int) -> None:
        self.collective_rpc("sleep", level)

    def wake_up(self) -> None:
        self.collective_rpc("wake_up")

    def memory_bytes(self) -> dict[str, int]:
        return self.collective_rpc("memory_bytes")

    def profile_peak_memory(self, num_tokens: int, block_size: int) -> int:
        return self.collective_rpc("profile_peak_memory", num_tokens, block_size)

    def execute(self, inputs: StepInputs, rows: list[SamplingRow]) -> SamplerOutput | None:
        """Run the step on every rank and sample its rows: here when rank 0 is also the last stage, else on the
        last stage's sampler rank. None when nothing samples this step."""
        def run():
            remote = self.shard.sampler is None and len(rows) > 0
            logits = self._call("execute_model", inputs, [r.for_remote() for r in rows] if remote else None)
            if remote:
                result = [None]
                dist.recv_object_list(result, src=self.shard.sampler_rank, group=self.group.control)
                return result[0]
            return self.sampler(logits, rows) if rows else None
        return self._guarded(run)

    def pipeline_stats(self, reset: bool = False) -> list[dict]:
        """Per rank: steps, busy seconds (its layers), wall seconds (plan received to step end), bubble fraction."""
        rows = self.collective_rpc("pipeline_stats", reset)
        return [{"rank": r, "pp_rank": r // self.group.tp_size, "tp_rank": r % self.group.tp_size,
                 "steps": int(s), "busy_s": b, "wall_s": w, "bubble": (1 - b / w) if w else 0.0}
                for r, (s, b, w) in enumerate(rows)]

    def shutdown(self) -> None:
        """Tell every rank to stop, wait until all have confirmed (so no worker mistakes the store closing for a
        failure), then reap the local workers and tear the group down."""
        if self._closed:
            return
        atexit.unregister(self.shutdown)
        self.group.monitor.stop()
        if self.failure is None:
            try:
                with self._lock:
                    self._call("shutdown")
                logger.info("all %d ranks confirmed the shutdown", self.group.world_size)
            except Exception as e:  # noqa: BLE001
                logger.warning("could not stop every rank cleanly: %s", e)
        self._closed = True
        self.runner.free_kv_cache()
        if self.drafter is not None:
            self.drafter.free_kv_cache()
        deadline = time.monotonic() + 15
        for rank, proc in self.children:
            try:
                code = proc.wait(max(0.1, deadline - time.monotonic()))
                logger.info("local worker rank %d exited with code %d", rank, code)
            except subprocess.TimeoutExpired:
                logger.warning("rank %d did not stop in time; killing it", rank)
        self._kill_children()
        self.group.destroy()
        tag_logs(None)
        if self._threads_before is not None:
            torch.set_num_threads(self._threads_before)

    def _kill_children(self, log: bool = False) -> None:
        for rank, proc in self.children:
            if proc.poll() is None:
                proc.kill()
            code = proc.wait()
            if log:
                logger.error("local worker rank %d exited with code %d", rank, code)
