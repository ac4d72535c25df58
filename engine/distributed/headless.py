"""A headless node: `shoal-engine serve --headless --nnodes N --node-rank R ...` (R > 0).

It runs no OpenAI API: it starts one worker process per local rank and serves /livez, /readyz (and /health) and
/metrics (`shoal:worker_rank_info`, one series per local rank) on --port. It exits 0 when its workers stop cleanly
(rank 0 called `shutdown`), and 1 as soon as any of them fails (after stopping the rest).

Drain: SIGTERM / SIGINT do not reach the workers. Rank 0 gets the same signal (the whole group is being stopped),
finishes its in-flight requests with every rank still serving, then shuts the group down, and this node exits 0
with its workers. If that has not happened `drain_timeout` seconds after the signal (rank 0's --shutdown-timeout
plus a margin), or on a second signal, the workers are killed and the node exits 1.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import tempfile
from pathlib import Path

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from shoal.engine.config import DistributedConfig
from shoal.engine.distributed.comm import pick_backend, rendezvous_port
from shoal.engine.distributed.spawn import spawn_workers

logger = logging.getLogger("shoal.engine.distributed.headless")

DRAIN_MARGIN_S = 15.0  # after rank 0's own drain: its shutdown broadcast and the workers' exit


class HeadlessNode:
    """This node's worker processes."""

    def __init__(self, config: DistributedConfig, tp: int, pp: int, device_type: str):
        world = tp * pp
        if world % config.nnodes:
            raise ValueError(f"world size {world} is not divisible by --nnodes {config.nnodes}")
        per_node = world // config.nnodes
        self.tp, self.node_rank = tp, config.node_rank
        first = config.node_rank * per_node
        self.ranks = list(range(first, first + per_node))
        self.ready_dir = tempfile.mkdtemp(prefix="shoal-ready-")
        import torch

        config = config.model_copy(update={"backend": pick_backend(torch.device(device_type), config.backend)})
        self.procs = spawn_workers([(r, r - first) for r in self.ranks], tp, pp, rendezvous_port(config), config,
                                   device_type, self.ready_dir, die_with_parent=True)

    def alive(self) -> bool:
        return all(p.poll() in (None, 0) for _, p in self.procs)

    def ready(self) -> bool:
        return self.alive() and all(Path(self.ready_dir, f"rank-{r}").exists() for r in self.ranks)

    def exit_code(self) -> int | None:
        """None while the workers run; 0 once all stopped cleanly; 1 once any failed."""
        codes = [p.poll() for _, p in self.procs]
        failed = [(r, c) for (r, _), c in zip(self.procs, codes) if c not in (None, 0)]
        if failed:
            logger.error("node %d: rank %d exited with code %d; stopping the others", self.node_rank, *failed[0])
            return 1
        return 0 if all(c == 0 for c in codes) else None

    def kill(self) -> None:
        for _, p in self.procs:
            if p.poll() is None:
                p.kill()
        for _, p in self.procs:
            p.wait()


class _RankCollector:
    def __init__(self, node: HeadlessNode):
        self.node = node

    def describe(self):
        return []

    def collect(self):
        node = self.node
        g = GaugeMetricFamily("shoal:worker_rank_info", "1 while this node's worker rank runs.",
                              labels=["rank", "pp_rank", "tp_rank", "node_rank"])
        for rank, proc in node.procs:
            g.add_metric([str(rank), str(rank // node.tp), str(rank % node.tp), str(node.node_rank)],
                         1.0 if proc.poll() is None else 0.0)
        yield g


def health_app(node: HeadlessNode) -> web.Application:
    registry = CollectorRegistry()
    registry.register(_RankCollector(node))

    def probe(check, ok: str, bad: str):
        async def handler(request: web.Request) -> web.Response:
            healthy = check()
            return web.json_response({"status": ok if healthy else bad, "ranks": node.ranks},
                                     status=200 if healthy else 503)
        return handler

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application()
    app.router.add_get("/livez", probe(node.alive, "alive", "dead"))
    app.router.add_get("/health", probe(node.alive, "alive", "dead"))
    app.router.add_get("/readyz", probe(node.ready, "ready", "not_ready"))
    app.router.add_get("/metrics", metrics)
    return app


async def serve_headless(config: DistributedConfig, tp: int, pp: int, device_type: str, host: str | None,
                         port: int, drain_timeout: float) -> int:
    loop = asyncio.get_running_loop()
    node = HeadlessNode(config, tp, pp, device_type)
    runner = web.AppRunner(health_app(node), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host or None, port, reuse_address=True)
    await site.start()
    logger.info("headless node %d of %d: ranks %s, health on :%d, master %s:%d", config.node_rank, config.nnodes,
                node.ranks, port, config.master_addr, rendezvous_port(config))
    signals: asyncio.Queue = asyncio.Queue()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, signals.put_nowait, sig)
    deadline = None
    try:
        while (code := node.exit_code()) is None:
            if not signals.empty():
                sig = signals.get_nowait()
                if deadline is not None:
                    logger.warning("second %s: killing the workers", signal.Signals(sig).name)
                    code = 1
                    break
                deadline = loop.time() + drain_timeout
                logger.info("received %s: workers serve on until rank 0 has drained and stops the group (at most "
                            "%.0fs)", signal.Signals(sig).name, drain_timeout)
            if deadline is not None and loop.time() > deadline:
                logger.error("rank 0 did not stop the group within %.0fs of the signal: killing the workers",
                             drain_timeout)
                code = 1
                break
            await asyncio.sleep(0.2)
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        node.kill()
        await runner.cleanup()
    if code == 0:
        logger.info("node %d: all workers stopped", config.node_rank)
    return code


def run_headless(config: DistributedConfig, tp: int, pp: int, device: str, host: str | None, port: int,
                 shutdown_timeout: float) -> int:
    """`shoal-engine serve --headless`: this node's worker ranks plus the health endpoints on `port`."""
    import torch

    use_cuda = torch.cuda.is_available() and device != "cpu" and config.backend != "gloo"
    device_type = "cuda" if use_cuda else "cpu"  # as node 0 picks its device (gloo means CPU ranks)
    return asyncio.run(serve_headless(config, tp, pp, device_type, host, port, shutdown_timeout + DRAIN_MARGIN_S))
