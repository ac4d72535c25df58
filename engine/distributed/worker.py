"""Worker processes: `python -m shoal.engine.distributed.worker` (one rank), and the headless node launcher.

A headless node (`shoal-engine serve --headless --nnodes N --node-rank R ...`, R > 0) runs no OpenAI API: it starts
one worker process per local rank and serves only /livez and /readyz on --port (plus /metrics with the node's
ranks). It exits 0 when its workers stop cleanly, and 1 as soon as any of them fails (after stopping the rest).
"""

from __future__ import annotations

import argparse
import http.server
import json
import logging
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

logger = logging.getLogger("shoal.engine.distributed.worker")


def add_distributed_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("multi-node (torch.distributed)")
    g.add_argument("--nnodes", type=int, default=1, help="number of nodes (pods) in this engine's group")
    g.add_argument("--node-rank", type=int, default=0, help="this node's index; node 0 runs the API server")
    g.add_argument("--master-addr", default="127.0.0.1", help="address of node 0 (rank 0 hosts the rendezvous)")
    g.add_argument("--master-port", type=int, default=None,
                   help="rendezvous port on node 0 (default: a free port on one node, 29500 on several)")
    g.add_argument("--headless", action="store_true",
                   help="run this node's worker ranks only (no OpenAI API; /livez and /readyz on --port)")
    g.add_argument("--distributed-backend", choices=["nccl", "gloo"], default=None,
                   help="torch.distributed backend (default: nccl on CUDA, gloo on CPU)")
    g.add_argument("--distributed-timeout", type=float, default=None,
                   help="seconds a collective or send/recv may wait before the group is declared failed (default 20)")
    g.add_argument("--distributed-startup-timeout", type=float, default=None,
                   help="seconds ranks wait for each other at start-up, logging who is missing (default 600)")
    g.add_argument("--heartbeat-timeout", type=float, default=None,
                   help="seconds without a rank's heartbeat before the group is declared failed (default 10)")
    g.add_argument("--pipeline-micro-batches", type=int, default=None,
                   help="micro-batches per step in flight through the pipeline (default: one per stage)")
    g.add_argument("--pipeline-layer-partition", type=_partition, default=None, metavar="N,N,...",
                   help="decoder layers per pipeline stage, e.g. 5,3 (default: an even split; the last stage also "
                        "runs the LM head, so giving it fewer layers can balance the stages)")


def _partition(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of layer counts: {text!r}") from None


def settings_from_args(args: argparse.Namespace, exit_on_failure: bool):
    from shoal.engine.distributed.comm import configure

    changes = dict(nnodes=args.nnodes, node_rank=args.node_rank, master_addr=args.master_addr,
                   master_port=args.master_port, exit_on_failure=exit_on_failure)
    for flag, name in (("distributed_backend", "backend"), ("distributed_timeout", "collective_timeout"),
                       ("distributed_startup_timeout", "startup_timeout"), ("heartbeat_timeout", "heartbeat_timeout"),
                       ("pipeline_micro_batches", "micro_batches"), ("pipeline_layer_partition", "layer_partition")):
        if getattr(args, flag, None) is not None:
            changes[name] = getattr(args, flag)
    if args.nnodes < 1 or not 0 <= args.node_rank < args.nnodes:
        raise ValueError(f"--node-rank {args.node_rank} must be in [0, --nnodes {args.nnodes})")
    if args.nnodes > 1 and args.node_rank > 0 and not args.headless:
        raise ValueError("nodes other than node 0 run workers only: pass --headless")
    if args.headless and args.node_rank == 0:
        raise ValueError("--headless is for nodes other than 0 (node 0 runs rank 0 and the API server)")
    return configure(**changes)


# ------------------------------------------------------------------------------------------------ one rank
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m shoal.engine.distributed.worker", description="one Shoal worker rank")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--local-rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--tensor-parallel-size", type=int, required=True)
    p.add_argument("--pipeline-parallel-size", type=int, required=True)
    p.add_argument("--master-addr", required=True)
    p.add_argument("--master-port", type=int, required=True)
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--ready-dir", default=None)
    p.add_argument("--log-level", default=os.environ.get("SHOAL_LOG_LEVEL", "info"))
    args = p.parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from shoal.engine.distributed.comm import configure
    from shoal.engine.distributed.executor import run_worker

    settings = configure(nnodes=args.nnodes, master_addr=args.master_addr, master_port=args.master_port)
    return run_worker(args.rank, args.local_rank, args.world_size, args.tensor_parallel_size,
                      args.pipeline_parallel_size, (args.master_addr, args.master_port), settings, args.ready_dir)


# ------------------------------------------------------------------------------------------------ headless node
class _HealthHandler(http.server.BaseHTTPRequestHandler):
    node: "HeadlessNode"

    def do_GET(self):  # noqa: N802 - http.server's naming
        node = self.node
        if self.path in ("/livez", "/health"):
            ok, body = node.alive(), {"status": "alive" if node.alive() else "dead", "ranks": node.ranks}
        elif self.path == "/readyz":
            ok, body = node.ready(), {"status": "ready" if node.ready() else "not_ready", "ranks": node.ranks}
        elif self.path == "/metrics":
            lines = ["# TYPE shoal:worker_rank_info gauge"]
            for rank, proc in node.procs:
                lines.append(f'shoal:worker_rank_info{{rank="{rank}",pp_rank="{rank // node.tp}",'
                             f'tp_rank="{rank % node.tp}",node_rank="{node.node_rank}"}} '
                             f'{1 if proc.poll() is None else 0}')
            data = ("\n".join(lines) + "\n").encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return
        else:
            ok, body = False, {"error": "not found"}
        data = json.dumps(body).encode()
        self.send_response(200 if ok else (404 if "error" in body else 503))
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):  # health probes are not worth a log line each
        pass


class HeadlessNode:
    def __init__(self, settings, tp: int, pp: int, device_type: str):
        from shoal.engine.distributed.executor import spawn_workers

        world = tp * pp
        if world % settings.nnodes:
            raise ValueError(f"world size {world} is not divisible by --nnodes {settings.nnodes}")
        per_node = world // settings.nnodes
        self.tp, self.node_rank = tp, settings.node_rank
        first = settings.node_rank * per_node
        self.ranks = list(range(first, first + per_node))
        self.ready_dir = tempfile.mkdtemp(prefix="shoal-ready-")
        master = (settings.master_addr, settings.port())
        self.procs = spawn_workers([(r, r - first) for r in self.ranks], world, tp, pp, master, settings,
                                   device_type, self.ready_dir, die_with_parent=True)

    def alive(self) -> bool:
        return all(p.poll() in (None, 0) for _, p in self.procs)

    def ready(self) -> bool:
        return self.alive() and all(Path(self.ready_dir, f"rank-{r}").exists() for r in self.ranks)

    def stop(self, sig=signal.SIGTERM) -> None:
        for _, p in self.procs:
            if p.poll() is None:
                p.send_signal(sig)

    def wait(self) -> int:
        """0 when every worker stopped cleanly; 1 as soon as one fails (the others are stopped)."""
        while True:
            codes = [p.poll() for _, p in self.procs]
            failed = [(r, c) for (r, _), c in zip(self.procs, codes) if c not in (None, 0)]
            if failed:
                logger.error("node %d: rank %d exited with code %d; stopping the others", self.node_rank, *failed[0])
                self.stop(signal.SIGKILL)
                for _, p in self.procs:
                    p.wait()
                return 1
            if all(c == 0 for c in codes):
                logger.info("node %d: all workers stopped", self.node_rank)
                return 0
            time.sleep(0.2)


def run_headless(args: argparse.Namespace, tp: int, pp: int) -> int:
    """`shoal-engine serve --headless`: this node's worker ranks plus a health endpoint on --port."""
    import torch

    settings = settings_from_args(args, exit_on_failure=True)
    use_cuda = torch.cuda.is_available() and getattr(args, "device", "auto") != "cpu" and settings.backend != "gloo"
    device_type = "cuda" if use_cuda else "cpu"  # as node 0 picks its device (gloo means CPU ranks)
    node = HeadlessNode(settings, tp, pp, device_type)
    handler = type("Handler", (_HealthHandler,), {"node": node})
    server = http.server.ThreadingHTTPServer((args.host or "0.0.0.0", args.port), handler)
    threading.Thread(target=server.serve_forever, name="shoal-health", daemon=True).start()
    logger.info("headless node %d of %d: ranks %s, health on :%d, master %s:%d", settings.node_rank,
                settings.nnodes, node.ranks, server.server_address[1], settings.master_addr, settings.port())

    def on_signal(signum, frame):
        logger.info("received %s: stopping workers", signal.Signals(signum).name)
        node.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    code = node.wait()
    server.shutdown()
    return code


def serve_hook(args: argparse.Namespace) -> int | None:
    """`shoal-engine serve`'s multi-process step, before it builds the engine: validates the multi-node flags and
    installs them (rank 0 exits 1 shortly after a rank failure). A --headless node runs its workers here and
    returns their exit code; otherwise returns None and serve goes on (a world size > 1 starts the local workers
    when the engine is built). Raises ValueError on inconsistent flags."""
    tp = getattr(args, "tensor_parallel_size", None) or 1
    pp = getattr(args, "pipeline_parallel_size", None) or 1
    settings = settings_from_args(args, exit_on_failure=True)
    if (tp * pp) % settings.nnodes:
        raise ValueError(f"--tensor-parallel-size {tp} x --pipeline-parallel-size {pp} is not divisible by "
                         f"--nnodes {settings.nnodes}")
    if args.headless:
        return run_headless(args, tp, pp)
    return None


if __name__ == "__main__":
    sys.exit(main())
