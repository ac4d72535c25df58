"""Multi-process execution: what LLMEngine talks to instead of a bare ModelRunner when world_size > 1.

The driver (rank 0) runs the scheduler and sampler; every step it broadcasts the step's plan (StepInputs packed into
one int64 tensor) on the control group, runs its own shard, and gets the last stage's logits back. Workers loop:
receive a plan, run their shard, pass hidden states on.

Pipeline parallelism: each step's batch is split into up to M micro-batches (contiguous runs of sequences with
balanced token counts) and pushed through the stages GPipe-style: stage s works on micro-batch m while stage s+1
works on m-1. Hidden states go stage to stage with point-to-point isend/recv (tensor-parallel rank t of stage s
talks to rank t of stage s+1). The last stage's tensor-parallel rank 0 samples: with the plan, rank 0 sends it the
step's sampling rows (parameters; token histories only where penalties read them; seeded rows' draws made ahead
from the generators rank 0 keeps), and gets back only the sampled tokens and logprobs, never [batch, vocab] logits.
The pipeline drains at the end of every step (rank 0 needs the tokens before it can schedule the next one), so
the ideal bubble is (P - 1) / (M + P - 1) of a step; every rank measures its own (`pipeline_stats`).

M defaults to P, one micro-batch per stage in flight (`--pipeline-micro-batches` / `SHOAL_PP_MICROBATCHES`
override it). On the 2-core CPU benchmark more micro-batches lowered the ideal bubble but not the time: smaller
matmuls and more messages cost more than the idle time they save (PP=2: M=2 ~390 tok/s, M=4 ~280, M=8 ~175);
on GPUs with large batches a larger M pays off.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from shoal.engine.distributed.comm import (DistributedError, DistributedSettings, Group, HeartbeatMonitor, get_settings, init_group,
                          pick_backend, rank_label, tag_logs)
from shoal.engine.distributed.parallel_state import get_parallel_state, set_parallel_state
from shoal.engine.execution.runner import ModelRunner, StepInputs

logger = logging.getLogger("shoal.engine.distributed.executor")

CMD_STEP, CMD_ALLOC, CMD_PROFILE, CMD_STATS, CMD_SHUTDOWN = 1, 2, 3, 4, 5
_HEADER = 8  # [cmd, T, B, max_blocks, S, arg1, arg2, reserved]


# ------------------------------------------------------------------------------------------------ step plans
def pack_plan(inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
    B, max_blocks = inputs.block_tables.shape
    header = torch.tensor([CMD_STEP, inputs.input_ids.numel(), B, max_blocks, inputs.logits_indices.numel(), 0, 0, 0],
                          dtype=torch.int64)
    body = torch.cat([inputs.input_ids, inputs.positions, inputs.slot_mapping, inputs.query_start_loc.long(),
                      inputs.seq_lens.long(), inputs.block_tables.long().flatten(), inputs.logits_indices]).cpu()
    return header, body


def body_size(header: torch.Tensor) -> int:
    _, T, B, max_blocks, S = header[:5].tolist()
    return 3 * T + (B + 1) + B + B * max_blocks + S


def unpack_plan(header: torch.Tensor, body: torch.Tensor) -> StepInputs:
    _, T, B, max_blocks, S = header[:5].tolist()
    parts = body.split([T, T, T, B + 1, B, B * max_blocks, S])
    qsl, seq_lens = parts[3].to(torch.int32), parts[4].to(torch.int32)
    seq_lens_list = seq_lens.tolist()
    q = qsl.tolist()
    return StepInputs(input_ids=parts[0], positions=parts[1], slot_mapping=parts[2], query_start_loc=qsl,
                      seq_lens=seq_lens, block_tables=parts[5].view(B, max_blocks).to(torch.int32),
                      logits_indices=parts[6], query_lens=[q[i + 1] - q[i] for i in range(B)],
                      seq_lens_list=seq_lens_list)


def split_micro_batches(inputs: StepInputs, m: int) -> list[StepInputs]:
    """Up to m micro-batches of whole sequences with about equal token counts, in order (so their logits
    concatenate to the step's logits). Deterministic: every rank computes the same split from the same plan."""
    B = len(inputs.query_lens)
    m = max(1, min(m, B))
    if m == 1:
        return [inputs]
    q = inputs.query_start_loc.tolist()
    total = q[-1]
    cuts = [0]
    for k in range(1, m):
        target = total * k / m
        i = cuts[-1] + 1
        while i < B - (m - k) and q[i] < target:
            i += 1
        cuts.append(i)
    cuts.append(B)
    out = []
    li = inputs.logits_indices
    for a, b in zip(cuts, cuts[1:]):
        t0, t1 = q[a], q[b]
        sel = li[(li >= t0) & (li < t1)] - t0
        out.append(StepInputs(
            input_ids=inputs.input_ids[t0:t1], positions=inputs.positions[t0:t1],
            slot_mapping=inputs.slot_mapping[t0:t1], query_start_loc=inputs.query_start_loc[a:b + 1] - t0,
            seq_lens=inputs.seq_lens[a:b], block_tables=inputs.block_tables[a:b], logits_indices=sel,
            query_lens=inputs.query_lens[a:b], seq_lens_list=inputs.seq_lens_list[a:b]))
    return out


# ------------------------------------------------------------------------------------------------ one shard
@dataclass
class PipelineStats:
    steps: int = 0
    busy_s: float = 0.0  # time spent computing this rank's layers
    wall_s: float = 0.0  # time from receiving the plan to the end of the step

    def as_list(self) -> list[float]:
        return [float(self.steps), self.busy_s, self.wall_s]


class Shard:
    """This rank's model shard and the pipelined execution of one step (the same code on every rank)."""

    def __init__(self, group: Group, runner: ModelRunner, hidden_size: int, vocab_size: int, micro_batches: int):
        self.group = group
        self.runner = runner
        self.hidden_size = hidden_size
        self.vocab_size = vocab_size
        self.micro_batches = micro_batches if group.pp_size > 1 else 1
        ps = group.state
        self.first, self.last = ps.is_first_stage, ps.is_last_stage
        self.prev = group.stage_rank(ps.pp_rank - 1, ps.tp_rank) if not self.first else None
        self.next = group.stage_rank(ps.pp_rank + 1, ps.tp_rank) if not self.last else None
        self.sampler_rank = group.stage_rank(group.pp_size - 1, 0)  # last stage, tensor rank 0: samples
        self.stats = PipelineStats()
        self._samplers: dict = {}

    @torch.inference_mode()
    def run_step(self, inputs: StepInputs, started: float) -> torch.Tensor | None:
        """Run this shard over the step; the sampler rank gets the step's logits [S, vocab], other ranks None."""
        runner, device = self.runner, self.runner.device
        rank = self.group.rank
        mbs = split_micro_batches(inputs, self.micro_batches)
        pending, logits = [], []
        busy = 0.0
        for mb in mbs:
            hidden = None
            if not self.first:
                hidden = torch.empty(mb.input_ids.numel(), self.hidden_size, dtype=runner.dtype, device=device)
                dist.recv(hidden, src=self.prev)
            t0 = time.perf_counter()
            out = runner.execute(mb, hidden)
            busy += time.perf_counter() - t0
            if not self.last:  # keep each sent tensor referenced until its send completes
                out = out.contiguous()
                pending.append((dist.isend(out, dst=self.next), out))
            elif rank == self.sampler_rank:
                logits.append(out)
        for work, _ in pending:
            work.wait()
        self.stats.steps += 1
        self.stats.busy_s += busy
        self.stats.wall_s += time.perf_counter() - started
        if rank != self.sampler_rank:
            return None
        return logits[0] if len(logits) == 1 else torch.cat(logits)

    def sample_remote(self, logits: torch.Tensor, request: tuple) -> None:
        """On the sampler rank of a pipeline: sample what rank 0 asked for and send back the SamplerOutput."""
        from shoal.engine.execution.sampling import Sampler

        vocab_size, eos_ids, rows = request
        key = (vocab_size, tuple(eos_ids))
        if key not in self._samplers:
            self._samplers = {key: Sampler(vocab_size, eos_ids)}
        dist.send_object_list([self._samplers[key](logits, rows)], dst=0, group=self.group.control)

    def profile(self, num_tokens: int, block_size: int) -> int:
        """Peak activation bytes of one pipelined step of num_tokens (CUDA; every rank runs it together)."""
        if self.runner.device.type != "cuda":
            return 0
        return self.runner.profile_peak_memory(num_tokens, block_size,
                                               execute=lambda inputs: self.run_step(inputs, time.perf_counter()))


def _build_runner(group: Group, config, model_dir, hf_config, dtype, device, max_model_len: int,
                  layer_partition: list[int] | None) -> ModelRunner:
    previous = get_parallel_state()
    set_parallel_state(group.state)  # the layers read it while they are built
    try:
        return ModelRunner(model_dir, hf_config, dtype, device, config.attention_backend, max_model_len,
                           layer_partition, block_size=config.block_size)
    finally:
        set_parallel_state(previous)


def _broadcast_header(group: Group, header: torch.Tensor, body: torch.Tensor | None = None) -> None:
    dist.broadcast(header, src=0, group=group.control)
    if body is not None and body.numel():
        dist.broadcast(body, src=0, group=group.control)


def _micro_batches(settings: DistributedSettings, pp_size: int) -> int:
    return settings.micro_batches or pp_size


# ------------------------------------------------------------------------------------------------ workers
def worker_command(rank: int, local_rank: int, world_size: int, tp: int, pp: int, master: tuple[str, int],
                   nnodes: int, ready_dir: str | None = None) -> list[str]:
    cmd = [sys.executable, "-m", "shoal.engine.distributed.worker", "--rank", str(rank), "--local-rank", str(local_rank),
           "--world-size", str(world_size), "--tensor-parallel-size", str(tp), "--pipeline-parallel-size", str(pp),
           "--master-addr", master[0], "--master-port", str(master[1]), "--nnodes", str(nnodes)]
    if ready_dir:
        cmd += ["--ready-dir", ready_dir]
    return cmd


def worker_env(settings: DistributedSettings, local_world: int, device_type: str) -> dict[str, str]:
    env = dict(os.environ)
    if device_type != "cuda":
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // local_world)))
    for name, value in (("SHOAL_DIST_TIMEOUT", settings.collective_timeout),
                        ("SHOAL_HEARTBEAT_TIMEOUT", settings.heartbeat_timeout),
                        ("SHOAL_HEARTBEAT_INTERVAL", settings.heartbeat_interval),
                        ("SHOAL_STARTUP_TIMEOUT", settings.startup_timeout)):
        env[name] = str(value)
    # every rank of a node uses the backend (and so the device type) its parent chose
    env["SHOAL_DIST_BACKEND"] = pick_backend(torch.device(device_type), settings.backend)
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


def spawn_workers(ranks: list[tuple[int, int]], world_size: int, tp: int, pp: int, master: tuple[str, int],
                  settings: DistributedSettings, device_type: str, ready_dir: str | None = None,
                  die_with_parent: bool = False):
    """Start `python -m shoal.engine.distributed.worker` for each (rank, local_rank); returns [(rank, Popen)].
    die_with_parent: the workers are killed when the spawning *thread* ends (use it from a main thread only)."""
    env = worker_env(settings, max(local_rank for _, local_rank in ranks) + 1 if ranks else 1, device_type)
    procs = []
    for rank, local_rank in ranks:
        cmd = worker_command(rank, local_rank, world_size, tp, pp, master, settings.nnodes, ready_dir)
        procs.append((rank, subprocess.Popen(cmd, env=env, preexec_fn=_die_with_parent if die_with_parent else None)))
    logger.info("started local workers %s (pids %s)", [r for r, _ in procs], [p.pid for _, p in procs])
    return procs


def run_worker(rank: int, local_rank: int, world_size: int, tp: int, pp: int, master: tuple[str, int],
               settings: DistributedSettings, ready_dir: str | None = None) -> int:
    """A worker's whole life: join the group, load its shard, run plans until told to stop. Returns 0 on a clean
    shutdown; any failure ends the process with exit code 1 (os._exit: a broken group cannot be torn down)."""
    label = rank_label(rank, tp, pp)
    tag_logs(label)
    device = torch.device("cpu")
    if settings.backend == "nccl":  # set by the parent from its own device (gloo: CPU ranks)
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
        group = init_group(rank, world_size, tp, pp, local_rank, device, settings, master[1])
        group.monitor = HeartbeatMonitor(group, die).start()
        payload = [None]
        dist.broadcast_object_list(payload, src=0, group=group.control)
        spec = payload[0]
        from shoal.engine.config import EngineConfig
        from shoal.engine.execution.model_loader import load_hf_config, resolve_model_dir

        config = EngineConfig(**spec["config"])
        model_dir = resolve_model_dir(config.model, config.revision)
        hf_config = load_hf_config(model_dir, config.trust_remote_code)
        dtype = getattr(torch, spec["dtype"])
        runner = _build_runner(group, config, model_dir, hf_config, dtype, device, spec["max_model_len"],
                               spec["layer_partition"])
        shard = Shard(group, runner, hf_config.hidden_size, hf_config.vocab_size, spec["micro_batches"])
        if ready_dir:
            Path(ready_dir, f"rank-{rank}").write_text(str(os.getpid()))
        logger.info("shard loaded (layers %d-%d); waiting for step plans", runner.model.start_layer,
                    runner.model.end_layer - 1)
        header = torch.empty(_HEADER, dtype=torch.int64)
        while True:
            dist.broadcast(header, src=0, group=group.control)
            started = time.perf_counter()
            cmd = int(header[0])
            if cmd == CMD_STEP:
                body = torch.empty(body_size(header), dtype=torch.int64)
                dist.broadcast(body, src=0, group=group.control)
                sampling = rank == shard.sampler_rank and int(header[4]) > 0
                request = [None]
                if sampling:  # posted before the step, so rank 0's send never waits on this stage's compute
                    dist.recv_object_list(request, src=0, group=group.control)
                logits = shard.run_step(unpack_plan(header, body), started)
                if sampling:
                    shard.sample_remote(logits, request[0])
            elif cmd == CMD_ALLOC:
                runner.allocate_kv_cache(int(header[5]), int(header[6]))
            elif cmd == CMD_PROFILE:
                peak = torch.tensor([shard.profile(int(header[5]), int(header[6]))], dtype=torch.int64)
                dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group.control)
            elif cmd == CMD_STATS:
                dist.gather_object(shard.stats.as_list(), None, dst=0, group=group.control)
                if int(header[5]):
                    shard.stats = PipelineStats()
            elif cmd == CMD_SHUTDOWN:
                logger.info("shutting down")
                group.monitor.stop()
                break
            else:
                raise DistributedError(f"unknown command {cmd}")
    except BaseException as e:  # noqa: BLE001 - any failure (a peer died, a timeout) ends this process
        die(f"{type(e).__name__}: {e}")
    group.destroy()
    return 0


# ------------------------------------------------------------------------------------------------ the driver
class DistributedExecutor:
    """Rank 0's side: the ModelRunner interface LLMEngine uses (execute, allocate_kv_cache, bytes_per_block,
    profile_peak_memory, backend_name, check_health, shutdown), backed by the whole group."""

    def __init__(self, config, model_dir, hf_config, dtype: torch.dtype, device: torch.device, max_model_len: int,
                 settings: DistributedSettings | None = None):
        settings = settings or get_settings()
        self.settings = settings
        tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
        world = tp * pp
        if world % settings.nnodes:
            raise ValueError(f"world size {world} (tp {tp} x pp {pp}) is not divisible by --nnodes {settings.nnodes}")
        if settings.node_rank != 0:
            raise ValueError("the engine (rank 0) runs on node 0; other nodes run `shoal-engine serve --headless`")
        per_node = world // settings.nnodes
        master = (settings.master_addr, settings.port())
        tag_logs(rank_label(0, tp, pp))
        self.failure: str | None = None
        self._lock = threading.Lock()
        self._closed = False
        self._threads_before = None
        if device.type == "cpu" and per_node > 1:
            self._threads_before = torch.get_num_threads()
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // per_node))
        self.children: list = []
        try:
            self.children = spawn_workers([(r, r) for r in range(1, per_node)], world, tp, pp, master, settings,
                                          device.type)
            self.group = init_group(0, world, tp, pp, 0, device, settings, master[1])
            self.group.monitor = HeartbeatMonitor(self.group, self._on_failure, lambda: self.children).start()
            spec = {"config": config.model_dump(), "dtype": str(dtype).removeprefix("torch."),
                    "max_model_len": max_model_len, "micro_batches": _micro_batches(settings, pp),
                    "layer_partition": settings.layer_partition}
            dist.broadcast_object_list([spec], src=0, group=self.group.control)
            self.runner = _build_runner(self.group, config, model_dir, hf_config, dtype, device, max_model_len,
                                        settings.layer_partition)
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
        self.shard = Shard(self.group, self.runner, hf_config.hidden_size, hf_config.vocab_size,
                           spec["micro_batches"])
        self.device, self.dtype = device, dtype
        self.backend_name = self.runner.backend_name
        logger.info("distributed engine: tp %d x pp %d = %d ranks over %d node(s), backend %s, %d micro-batches "
                    "per step", tp, pp, world, settings.nnodes, self.group.backend, self.shard.micro_batches)

    # -- failure handling ---------------------------------------------------------------------------------
    def _on_failure(self, reason: str) -> None:
        if self.failure is not None:
            return
        self.failure = reason
        logger.error("distributed engine failed: %s", reason)
        self.group.report_failure(reason)
        if self.settings.exit_on_failure:
            def exit_later():
                time.sleep(self.settings.exit_grace)  # /livez answers 503 meanwhile
                self._kill_children(log=True)
                logger.error("exiting with code 1 after a rank failure")
                logging.shutdown()
                os._exit(1)

            threading.Thread(target=exit_later, name="shoal-exit", daemon=True).start()

    def check_health(self) -> None:
        if self.failure is not None:
            raise DistributedError(f"a rank failed: {self.failure}")

    def _command(self, header: torch.Tensor, body: torch.Tensor | None = None):
        self.check_health()
        if self._closed:
            raise DistributedError("the distributed executor was shut down")
        _broadcast_header(self.group, header, body)

    def _guarded(self, fn, *args):
        with self._lock:
            try:
                return fn(*args)
            except DistributedError:
                raise
            except Exception as e:  # a peer closed its connection, or a collective timed out
                self._on_failure(f"{type(e).__name__}: {e}")
                raise DistributedError(f"distributed step failed: {e}") from e

    # -- the ModelRunner interface ------------------------------------------------------------------------
    def bytes_per_block(self, block_size: int) -> int:
        return self.runner.bytes_per_block(block_size)

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        def run():
            self._command(torch.tensor([CMD_ALLOC, 0, 0, 0, 0, num_blocks, block_size, 0]))
            self.runner.allocate_kv_cache(num_blocks, block_size)
        self._guarded(run)

    def profile_peak_memory(self, num_tokens: int, block_size: int) -> int:
        def run():
            self._command(torch.tensor([CMD_PROFILE, 0, 0, 0, 0, num_tokens, block_size, 0]))
            peak = torch.tensor([self.shard.profile(num_tokens, block_size)], dtype=torch.int64)
            dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=self.group.control)
            return int(peak)
        return self._guarded(run)

    def execute_and_sample(self, inputs: StepInputs, rows: list, sampler):
        """Run the step on every rank and sample its rows: here when rank 0 is also the last stage, else on the
        last stage's sampler rank (see the module docstring). None when nothing samples this step."""
        def run():
            started = time.perf_counter()
            header, body = pack_plan(inputs)
            self._command(header, body)
            remote = self.shard.sampler_rank != 0 and len(rows) > 0
            if remote:
                request = (sampler.vocab_size, list(sampler.eos_token_ids), [r.for_remote() for r in rows])
                dist.send_object_list([request], dst=self.shard.sampler_rank, group=self.group.control)
            logits = self.shard.run_step(inputs, started)
            if remote:
                result = [None]
                dist.recv_object_list(result, src=self.shard.sampler_rank, group=self.group.control)
                return result[0]
            return sampler(logits, rows) if rows else None
        return self._guarded(run)

    def pipeline_stats(self, reset: bool = False) -> list[dict]:
        """Per rank: steps, busy seconds (its layers), wall seconds (plan received to step end), bubble fraction."""
        def run():
            self._command(torch.tensor([CMD_STATS, 0, 0, 0, 0, int(reset), 0, 0]))
            out = [None] * self.group.world_size
            dist.gather_object(self.shard.stats.as_list(), out, dst=0, group=self.group.control)
            if reset:
                self.shard.stats = PipelineStats()
            return out
        rows = self._guarded(run)
        return [{"rank": r, "pp_rank": r // self.group.tp_size, "tp_rank": r % self.group.tp_size,
                 "steps": int(s), "busy_s": b, "wall_s": w, "bubble": (1 - b / w) if w else 0.0}
                for r, (s, b, w) in enumerate(rows)]

    def shutdown(self) -> None:
        if self._closed:
            return
        atexit.unregister(self.shutdown)
        self.group.monitor.stop()
        if self.failure is None:
            try:
                with self._lock:
                    _broadcast_header(self.group, torch.tensor([CMD_SHUTDOWN, 0, 0, 0, 0, 0, 0, 0]))
            except Exception as e:  # noqa: BLE001
                logger.warning("could not tell the workers to stop: %s", e)
        self._closed = True
        self.runner.kv_caches = []
        deadline = time.monotonic() + 15
        for rank, proc in self.children:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
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


def make_runner(config, model_dir, hf_config, dtype, device, max_model_len: int):
    """A ModelRunner for one process, a DistributedExecutor (which starts the local workers) for several."""
    if config.tensor_parallel_size * config.pipeline_parallel_size == 1:
        return ModelRunner(model_dir, hf_config, dtype, device, config.attention_backend, max_model_len,
                           block_size=config.block_size)
    return DistributedExecutor(config, model_dir, hf_config, dtype, device, max_model_len)

