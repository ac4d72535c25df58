"""The gateway's wake-up for scale from zero: a merge patch of the wake annotation on its wake-up ConfigMap, at most
once per interval, never blocking the held request, and a failure only logged."""

from __future__ import annotations

import importlib
import asyncio
import json

import pytest
from aiohttp import web
from webkit import configmap_api

importlib.import_module("shoal.operator.gateway.discovery")

from shoal.operator.k8s.client import KubeAPI  # noqa: E402
from shoal.operator.gateway.wake import ANNOTATION, Waker  # noqa: E402


async def _api_server(status: int = 200):
    seen: list[dict] = []

    async def record(request: web.Request) -> None:
        seen.append({"path": request.path, "type": request.content_type, "auth": request.headers.get("Authorization"),
                     "body": json.loads(await request.read())})

    runner, url = await configmap_api(record, status)
    return runner, url, seen


async def test_held_requests_wake_the_operator_once_per_interval():
    runner, url, seen = await _api_server()
    waker = Waker("team-a", "chat-wake", api=KubeAPI(url, token="tok"), min_interval=0.3)
    try:
        await waker.start()
        for _ in range(5):  # five requests start holding at once: one patch
            waker()
        await asyncio.sleep(0.2)
        assert len(seen) == 1
        assert seen[0]["path"] == "/api/v1/namespaces/team-a/configmaps/chat-wake"
        assert seen[0]["type"] == "application/merge-patch+json" and seen[0]["auth"] == "Bearer tok"
        stamp = seen[0]["body"]["metadata"]["annotations"][ANNOTATION]
        assert stamp.endswith("Z") and "T" in stamp
        await asyncio.sleep(0.3)
        waker()  # after the interval: a new patch with a new stamp
        await asyncio.sleep(0.2)
        assert len(seen) == 2 and waker.sent == 2
    finally:
        await waker.close()
        await runner.cleanup()


async def test_a_refused_patch_is_logged_not_raised(caplog):
    runner, url, seen = await _api_server(status=403)
    waker = Waker("team-a", "chat-wake", api=KubeAPI(url), min_interval=0.0)
    try:
        waker()
        await asyncio.sleep(0.3)
        assert len(seen) == 1 and waker.failed == 1 and waker.sent == 0
        assert "could not wake the autoscaler through configmap team-a/chat-wake" in caplog.text and "403" in caplog.text
    finally:
        await waker.close()
        await runner.cleanup()
