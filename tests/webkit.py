"""In-process HTTP stand-ins (a fake Kubernetes API, an engine's /metrics, a hub) served on a localhost port:
aiohttp apps, or http.server handlers for a server in a plain thread."""

from __future__ import annotations

import asyncio
import threading
from http.server import BaseHTTPRequestHandler
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestServer

from shoal.operator.gateway.backends import Backend, BackendSet


async def serve(app: web.Application, port: int = 0, **runner_options: Any) -> tuple[web.AppRunner, str]:
    """Serve `app` on 127.0.0.1:`port` (0: a free one); its runner (`cleanup()` stops it) and base URL."""
    runner = web.AppRunner(app, **runner_options)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"


async def configmap_api(record: Callable[[web.Request], Awaitable[None]],
                        status: int = 200) -> tuple[web.AppRunner, str]:
    """A Kubernetes API that takes ConfigMap PATCHes (the gateway's wake annotation): each is given to `record`,
    then answered `status`. Its runner and base URL."""
    async def patch(request: web.Request) -> web.Response:
        await record(request)
        return web.json_response({}, status=status)

    app = web.Application()
    app.router.add_patch("/api/v1/namespaces/{ns}/configmaps/{name}", patch)
    return await serve(app)


async def started(app: web.Application) -> tuple[TestServer, str]:
    """`app` served by aiohttp's TestServer (close it when done) and its base URL, as the gateway is given it."""
    server = TestServer(app)
    await server.start_server()
    return server, str(server.make_url("")).rstrip("/")


async def lone_backend(app: web.Application) -> tuple[TestServer, BackendSet, Backend]:
    """`app` (a stand-in engine) served and made the one backend of a BackendSet, as discovery does for a Ready
    pod; close the server when done."""
    engine, url = await started(app)
    backends = BackendSet()
    backends.replace([url])
    (b,) = backends.all()
    return engine, backends, b


def idle_engine(model: str) -> web.Application:
    """A stand-in engine, ready and idle: /readyz, and /metrics with no request of `model` running. Add its API."""
    async def readyz(request: web.Request) -> web.Response:
        return web.json_response({"status": "ready"})

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text=f'shoal:num_requests_running{{model_name="{model}"}} 0\n')

    app = web.Application()
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    return app


class LoopThread:
    """Stand-ins for tests that are not async themselves: an event loop in a daemon thread serves their apps."""

    def __init__(self, name: str = "stand-in-engines"):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True, name=name)
        self.thread.start()
        self.runners: list[web.AppRunner] = []

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(10)

    def serve(self, app: web.Application, port: int) -> None:
        """Serve `app` on 127.0.0.1:`port` until close()."""
        self.runners.append(self._run(serve(app, port))[0])

    def close(self) -> None:
        for r in self.runners:
            self._run(r.cleanup())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


class QuietHandler(BaseHTTPRequestHandler):
    """An http.server handler that logs nothing and answers in one call."""

    def reply(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass
