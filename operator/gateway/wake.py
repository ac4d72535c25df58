"""Scale from zero: when the gateway starts holding a request because no engine is ready, it tells the operator at
once by annotating its wake-up ConfigMap (`<inferenceservice>-wake`, rendered by the operator for fleets that
scale to zero) with `serving.shoal.dev/wake-requested-at` (a JSON merge patch).

Why an annotation and not a call to the operator: it goes through the API server the operator already watches, so
it reaches whichever operator replica is active, needs no Service or port on the operator, and survives an
operator restart (the annotation is still there when it lists). Why a ConfigMap of its own and not the
InferenceService: the gateway's only write permission is `patch` on that one ConfigMap (resourceNames), so a
compromised gateway cannot rewrite the service it fronts. The operator reacts within its watch latency
(milliseconds) instead of its next 1 s tick.

At most one patch per `min_interval` seconds per gateway process, sent in the background: holding a request never
waits for the API server, and a failed patch only logs (the operator's 1 s scrape of held requests still sees
the load).
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import time

import aiohttp

from shoal.operator.contract import A_WAKE
from shoal.operator.k8s.client import Client, KubeAPI, object_path

log = logging.getLogger("shoal.gateway.wake")

ANNOTATION = A_WAKE


def wake_patch(now: datetime.datetime | None = None) -> dict:
    now = now or datetime.datetime.now(datetime.timezone.utc)
    stamp = now.isoformat(timespec="milliseconds").replace("+00:00", "Z")
    return {"metadata": {"annotations": {ANNOTATION: stamp}}}


class Waker:
    """A `Gateway.on_hold` hook: call it (synchronously) whenever a request starts waiting for an engine."""

    def __init__(self, namespace: str, name: str, api: KubeAPI | None = None, min_interval: float = 1.0,
                 session: aiohttp.ClientSession | None = None):
        self.namespace = namespace
        self.name = name  # the wake-up ConfigMap
        self.api = api
        self.min_interval = min_interval
        self.last: float | None = None
        self.sent = 0
        self.failed = 0
        self._task: asyncio.Task | None = None
        self._session = session  # the shared gateway's wakers share one pool of connections (it closes it)
        self._own_session = session is None

    def __call__(self) -> None:
        now = time.monotonic()
        if (self.last is not None and now - self.last < self.min_interval) or \
                (self._task is not None and not self._task.done()):
            return
        self.last = now
        self._task = asyncio.get_running_loop().create_task(self._send(), name="gateway-wake")

    async def start(self) -> None:
        """Resolve credentials and open the connection pool before the first request is held (loading a
        kubeconfig takes a few hundred milliseconds: not on the scale-from-zero path)."""
        if self.api is None:
            self.api = await asyncio.to_thread(KubeAPI.from_environment)
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5))

    async def _send(self) -> None:
        try:
            await self.start()
            await Client(self.api, self._session, timeout=5).merge_patch(
                object_path("v1", "configmaps", self.namespace, self.name), wake_patch())
            self.sent += 1
            log.info("requests held: woke the autoscaler through configmap %s/%s", self.namespace, self.name)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - the operator's scrape of held requests is the fallback
            self.failed += 1
            log.warning("could not wake the autoscaler through configmap %s/%s: %s", self.namespace, self.name, e)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._session is not None and self._own_session:
            await self._session.close()


class EngineWaker:
    """A `Pool.on_hold` hook for fleets parked asleep (autoscaling.scaleToZero sleep): a request is held because no
    engine is Ready, so wake a parked one directly — POST /wake_up with the engines' key, the route clients can
    never reach through the gateway (proxy.ADMIN_PATHS) — and route to it the moment it answers, before its
    endpoint turns Ready (up to a readiness-probe period later). One wake-up at a time per pool: the requests held
    meanwhile go to the engine it wakes, and the autoscaler wakes more if the load needs them.

    Candidates are the pool's standby endpoints (not Ready, not terminating): an engine that is loading answers
    503 and one that is already awake (another gateway replica woke it) answers 400 `not_sleeping`; the latter is
    routed to once its /readyz says so."""

    def __init__(self, backends, headers, timeout: float = 600.0):
        self.backends = backends  # BackendSet
        self.headers = headers  # () -> the engines' Authorization header (Gateway.poll_headers)
        self.timeout = timeout  # a level-2 wake-up reads the weights again
        self.enabled = False  # set per pool: only fleets that park asleep
        self.session: aiohttp.ClientSession | None = None
        self.woken = 0
        self._task: asyncio.Task | None = None

    def __call__(self) -> None:
        if not self.enabled or self.session is None or not self.backends.standby or \
                (self._task is not None and not self._task.done()):
            return
        self._task = asyncio.get_running_loop().create_task(self._wake(), name="gateway-wake-engine")

    async def _wake(self) -> None:
        for url in sorted(self.backends.standby):
            if self.backends.eligible():
                return  # an engine became Ready meanwhile
            try:
                if await self._wake_one(url):
                    self.woken += 1
                    self.backends.add_woken(url)
                    log.info("requests held: woke the engine at %s", url)
                    return
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - the autoscaler wakes parked engines too
                log.warning("could not wake the engine at %s: %r", url, e)
        log.info("requests held: no parked engine to wake among %d standby endpoint(s)", len(self.backends.standby))

    async def _wake_one(self, url: str) -> bool:
        timeout = aiohttp.ClientTimeout(total=self.timeout)
        async with self.session.post(url + "/wake_up", headers=self.headers(), timeout=timeout) as r:
            if r.status == 200:
                return True
            body = await r.text()
        if "not_sleeping" not in body:
            return False  # loading, or no sleep mode: not ours to wake
        async with self.session.get(url + "/readyz", timeout=aiohttp.ClientTimeout(total=5)) as r:
            return r.status == 200

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
