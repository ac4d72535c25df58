"""In-process aiohttp stand-ins (a fake Kubernetes API, an engine's /metrics) served on a localhost port."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web


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
