"""The gateway's aiohttp app: pick an engine per request and stream its answer back untouched.

Per proxied request:
  0. authentication: with an API key configured (the engines' key, from the same Secret), a request without it is
     answered 401 before anything else — it is never held, never counted as load and never wakes the autoscaler;
  1. admission: more than `max_pending` requests inside the gateway → 429; a body over `max_body_bytes` → 413;
     request bodies are kept until the answer starts (for a retry), so their sum is bounded too: a request whose
     body would take the bodies held above `max_buffered_bytes` → 429. Memory is bounded by construction;
  2. the prompt is rendered and hashed (prefix-load only), the router picks among eligible engines;
  3. no engine eligible → hold up to `hold_timeout` seconds for one (0: answer at once) → 503 + Retry-After;
  4. the request goes to the engine with the client's headers (Authorization included: the engines check keys);
     it is retried once on another engine only while the engine cannot be running it: a refused connection or
     connect timeout, a connection the engine dropped before answering, or a 429/503 answer (queue full,
     draining). A non-streaming generation sends nothing until it ends, so the engine's answer may take up to
     `response_timeout`; past it the request is cut at the engine (which aborts it) and the client gets 504 —
     never a second run elsewhere;
  5. status, headers and body chunks are relayed as they arrive (SSE is never buffered), each within
     `read_timeout` of the previous one; a client that goes away closes the engine connection, which aborts the
     request there.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import aiohttp
from aiohttp import web
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from shoal.engine.gateway.backends import Backend, BackendSet, HealthPolicy
from shoal.engine.gateway.metric_names import for_runtime
from shoal.engine.gateway.metrics import GatewayMetrics
from shoal.engine.gateway.poller import Poller
from shoal.engine.gateway.prefix import block_hashes, render_prompt
from shoal.engine.gateway.routing import make_router

log = logging.getLogger("shoal.gateway")

# Hop-by-hop headers (RFC 9110 §7.6.1) are per connection and never forwarded; Host and Content-Length are
# recomputed for the engine's connection.
HOP_BY_HOP = frozenset(h.lower() for h in (
    "Connection", "Keep-Alive", "Proxy-Authenticate", "Proxy-Authorization", "TE", "Trailer", "Trailers",
    "Transfer-Encoding", "Upgrade", "Host", "Content-Length"))
# The engine refused the request without running it: 429 (queue full) and 503 (draining, or a proxy in front of
# it could not connect). A 502/504 from a proxy in between may come while the engine still runs the request.
RETRY_STATUSES = frozenset({429, 503})
RETRY_REASONS = frozenset({"refused", "connect_timeout", "reset"})  # failures before the engine accepted it
ROUTED_PATHS = ("/v1/completions", "/v1/chat/completions")


@dataclass
class GatewayConfig:
    routing: str = "prefix-load"
    block_chars: int = 64  # about 16 tokens of English: the engine's default KV block
    max_blocks: int = 512  # hash at most the first block_chars * max_blocks characters
    load_factor: float = 1.25
    affinity_slack: float = 2.0
    cold_slack: float = 1.0
    index_size: int = 200_000
    max_pending: int = 4096
    max_body_bytes: int = 32 * 1024 * 1024
    max_buffered_bytes: int = 128 * 1024 * 1024  # request bodies held at once, all requests together
    hold_timeout: float = 0.0  # wait this long for an engine when none is ready (0: 503 at once)
    retry_after: int = 1
    connect_timeout: float = 3.0
    response_timeout: float = 3600.0  # request sent -> response headers: a whole non-streaming generation
    read_timeout: float = 600.0  # silence from an engine between response bytes, once it answered
    poll_interval: float = 0.25
    poll_timeout: float = 1.0
    runtime: str = "shoal"  # the engines' runtime: which readiness path and metric names to read (metric_names.py)
    api_key: str | None = None  # the engines' key: checked here first, so unauthenticated requests cost nothing
    health: HealthPolicy = field(default_factory=HealthPolicy)


def request_model(path: str, body: bytes) -> str | None:
    """The `model` a completion request names (a LoRA adapter routes by residency); None when it names none."""
    if path not in ROUTED_PATHS or not body or b'"model"' not in body:
        return None
    try:
        model = json.loads(body).get("model")
    except (ValueError, AttributeError):
        return None
    return model if isinstance(model, str) and model else None


def error_response(status: int, message: str, type_: str, code: str | None = None,
                   headers: dict[str, str] | None = None) -> web.Response:
    body = {"error": {"message": message, "type": type_, "param": None, "code": code}}
    return web.json_response(body, status=status, headers=headers)


def authorized(request: web.Request, key: str) -> bool:
    """The engine's rule (engine/server/app.py): `Authorization: Bearer <key>` or `X-API-Key: <key>`."""
    given = request.headers.get("Authorization", "")
    token = given[7:].strip() if given[:7].lower() == "bearer " else request.headers.get("X-API-Key", "")
    return bool(token) and hmac.compare_digest(token.encode(), key.encode())


class _Unavailable(Exception):
    """No engine could take the request."""


class Gateway:
    def __init__(self, config: GatewayConfig, backends: BackendSet | None = None):
        self.config = config
        self.backends = backends or BackendSet(config.health)
        self.router = make_router(config.routing, config.load_factor, config.affinity_slack, config.cold_slack,
                                  config.index_size)
        self.metrics = GatewayMetrics(self.backends)
        self.pending = 0
        self.buffered = 0  # bytes of request bodies reserved by the requests inside
        self.draining = False
        self.session: aiohttp.ClientSession | None = None
        self.tasks: list[asyncio.Task] = []
        # Called (synchronously) when a request starts waiting for an engine: a scale-from-zero hook.
        self.on_hold: list[Callable[[], None]] = []

    # ---- lifecycle -------------------------------------------------------------------------------------------
    async def start(self, discovery=None) -> None:
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=30),
            auto_decompress=False,  # bytes pass through as the engine sent them
            skip_auto_headers=("Accept", "Accept-Encoding", "User-Agent", "Content-Type"),
            cookie_jar=aiohttp.DummyCookieJar(),
        )
        if discovery is not None:
            self.tasks.append(asyncio.create_task(discovery.run(self.backends), name="gateway-discovery"))
        poller = Poller(self.backends, self.session, self.config.poll_interval, self.config.poll_timeout,
                        metrics=for_runtime(self.config.runtime))
        self._poller = poller
        self.tasks.append(asyncio.create_task(poller.run(), name="gateway-poller"))

    async def stop(self) -> None:
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self._poller.close()
        if self.session is not None:
            await self.session.close()

    def start_draining(self) -> None:
        """Readiness fails from now on, and requests held for an engine are answered 503 at once."""
        self.draining = True
        self.backends.notify()

    # ---- routing ---------------------------------------------------------------------------------------------
    def prompt_hashes(self, path: str, body: bytes, model: str | None = None) -> list[bytes]:
        if self.config.routing != "prefix-load" or path not in ROUTED_PATHS or not body:
            return []
        try:
            parsed = json.loads(body)
        except ValueError:
            return []  # the engine answers the 400
        text = render_prompt(path, parsed)
        if text and model and any(model in b.lora_resident for b in self.backends.all()):
            text = f"{model}\n{text}"  # engines cache each adapter's blocks apart: so does the prefix index
        return block_hashes(text, self.config.block_chars, self.config.max_blocks) if text else []

    async def choose(self, hashes: list[bytes], tried: tuple[Backend, ...], hold: bool,
                     model: str | None = None) -> Backend:
        candidates = self.backends.eligible(exclude=tried)
        if not candidates and hold and self.config.hold_timeout > 0:
            for hook in self.on_hold:
                hook()
            self.metrics.held.inc()
            deadline = time.monotonic() + self.config.hold_timeout
            try:
                # A draining gateway lets its held requests go at once (503 + Retry-After, which clients retry
                # on another gateway replica, where the hold goes on) instead of cutting them at exit.
                while not candidates and not self.draining and time.monotonic() < deadline:
                    candidates = await self.backends.wait_for_eligible(min(deadline, time.monotonic() + 0.5),
                                                                       exclude=tried)
            finally:
                self.metrics.held.dec()
        if not candidates:
            raise _Unavailable()
        start = time.perf_counter()
        now = time.monotonic()
        pick = self.router.pick(candidates, hashes, now, model)
        self.router.record(pick.backend, hashes, now)
        self.metrics.pick_latency.observe(time.perf_counter() - start)
        self.metrics.decisions.labels(pick.decision).inc()
        if pick.matched_blocks:
            self.metrics.affinity_hits.inc()
            self.metrics.matched_chars.inc(pick.matched_blocks * self.config.block_chars)
        return pick.backend

    # ---- handlers --------------------------------------------------------------------------------------------
    async def handle_proxy(self, request: web.Request) -> web.StreamResponse:
        if self.config.api_key and not authorized(request, self.config.api_key):
            self.metrics.rejected.labels("unauthenticated").inc()
            return error_response(401, "Invalid or missing API key (send 'Authorization: Bearer <key>').",
                                  "invalid_request_error", "invalid_api_key")
        if self.pending >= self.config.max_pending:
            self.metrics.rejected.labels("too_many_pending").inc()
            return error_response(429, f"the gateway has {self.pending} requests pending; retry later",
                                  "rate_limit_error", "too_many_pending",
                                  {"Retry-After": str(self.config.retry_after)})
        # a body of unknown length (chunked) may be as large as max_body_bytes: reserve that much
        reserve = 0 if not request.can_read_body else min(request.content_length or self.config.max_body_bytes,
                                                          self.config.max_body_bytes)
        if self.buffered + reserve > self.config.max_buffered_bytes:
            self.metrics.rejected.labels("too_much_buffered").inc()
            return error_response(429, f"the gateway holds {self.buffered} bytes of request bodies; retry later",
                                  "rate_limit_error", "too_much_buffered",
                                  {"Retry-After": str(self.config.retry_after)})
        self.pending += 1
        self.buffered += reserve
        self.metrics.pending.inc()
        try:
            return await self._forward(request)
        finally:
            self.pending -= 1
            self.buffered -= reserve
            self.metrics.pending.dec()

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            self.metrics.rejected.labels("body_too_large").inc()
            return error_response(413, f"request body exceeds {self.config.max_body_bytes} bytes",
                                  "invalid_request_error", "body_too_large")
        model = request_model(request.path, body)
        hashes = self.prompt_hashes(request.path, body, model)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        forwarded = request.headers.get("X-Forwarded-For")
        headers["X-Forwarded-For"] = f"{forwarded}, {request.remote}" if forwarded else (request.remote or "")
        tried: tuple[Backend, ...] = ()
        for attempt in range(2):
            last = attempt == 1
            try:
                backend = await self.choose(hashes, tried, hold=not tried, model=model)
            except _Unavailable:
                break
            tried += (backend,)
            backend.inflight += 1
            try:
                upstream = await self._send(backend, request, headers, body)
                if upstream == "timeout":  # the engine may still be running it: never a second run elsewhere
                    self.metrics.requests.labels(backend.url, "504").inc()
                    return error_response(504, f"the engine did not answer within {self.config.response_timeout:g}"
                                               " s; the request was cancelled", "timeout", "engine_timeout")
                if isinstance(upstream, str):
                    if not last:
                        self.metrics.retries.labels(upstream).inc()
                    continue
                if upstream.status in RETRY_STATUSES and not last and self.backends.eligible(exclude=tried):
                    self.metrics.retries.labels(f"status_{upstream.status}").inc()
                    upstream.release()
                    continue
                return await self._relay(request, backend, upstream)
            finally:
                backend.inflight -= 1
        self.metrics.rejected.labels("no_backend").inc()
        self.metrics.requests.labels("none", "503").inc()
        return error_response(503, "no ready backend can serve this request; retry shortly",
                              "service_unavailable", "no_backend", {"Retry-After": str(self.config.retry_after)})

    async def _send(self, backend: Backend, request: web.Request, headers: dict, body: bytes):
        """The engine's response (headers received), or why it failed: one of RETRY_REASONS (the engine never
        accepted the request; worth one retry elsewhere) or "timeout" (no answer within response_timeout; the
        request is cancelled there, and not retried)."""
        # Body silence is bounded in _relay, once the response started; until then only response_timeout holds.
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.config.connect_timeout, sock_read=None)
        deadline = asyncio.timeout(self.config.response_timeout)
        try:
            async with deadline:
                return await self.session.request(request.method, backend.url + request.rel_url.raw_path_qs,
                                                  headers=headers, data=body or None, timeout=timeout,
                                                  allow_redirects=False)
        except aiohttp.ClientConnectorError:
            backend.on_refused(time.monotonic())
            self.backends.notify()
            reason = "refused"
        except asyncio.TimeoutError:
            if deadline.expired():
                # a long generation, or an engine that hangs: its liveness probe and the poller judge it, not
                # the circuit breaker
                reason = "timeout"
            else:
                backend.on_failure(time.monotonic())
                reason = "connect_timeout"
        except (aiohttp.ClientError, OSError):
            backend.on_failure(time.monotonic())
            reason = "reset"
        log.warning("%s %s: engine %s failed before responding (%s)", request.method, request.path, backend.url,
                    reason)
        return reason

    async def _relay(self, request: web.Request, backend: Backend, upstream: aiohttp.ClientResponse):
        if upstream.status < 500:
            backend.on_success()
        code = str(upstream.status)
        out = web.StreamResponse(status=upstream.status, reason=upstream.reason)
        for k, v in upstream.headers.items():
            if k.lower() not in HOP_BY_HOP or k.lower() == "content-length":
                out.headers.add(k, v)
        try:
            await out.prepare(request)
            loop = asyncio.get_running_loop()
            async with asyncio.timeout(self.config.read_timeout) as silence:
                while chunk := await upstream.content.readany():
                    await out.write(chunk)
                    silence.reschedule(loop.time() + self.config.read_timeout)
            await out.write_eof()
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            # The engine failed mid-answer: bytes already reached the client, so no retry; cut the connection
            # so the client sees an incomplete response rather than a silently truncated one.
            log.warning("engine %s failed mid-response: %r", backend.url, e)
            backend.on_failure(time.monotonic())
            code = "broken"
            if request.transport is not None:
                request.transport.close()
        except (ConnectionResetError, asyncio.CancelledError):
            code = "client_closed"
            raise
        finally:
            upstream.close()  # no-op after a full read; otherwise the engine sees a disconnect and aborts
            self.metrics.requests.labels(backend.url, code).inc()
        return out

    async def readyz(self, request: web.Request) -> web.Response:
        ready = bool(self.backends.eligible())
        if self.draining:
            return web.json_response({"status": "draining"}, status=503)
        # While it may hold requests (scale from zero), the gateway is ready with no engine at all.
        if ready or self.config.hold_timeout > 0:
            return web.json_response({"status": "ready", "backends": len(self.backends.eligible())})
        return web.json_response({"status": "no_ready_backend"}, status=503)

    async def livez(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "alive"})

    async def metrics_route(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def not_found(self, request: web.Request) -> web.Response:
        return error_response(404, f"no route {request.method} {request.path} on the gateway",
                              "invalid_request_error", "not_found")


def build_metrics_app(gateway: Gateway) -> web.Application:
    """`--metrics-port`: /metrics alone, for a listener a service mesh leaves out of its mTLS (the operator's
    autoscaler, outside the mesh, reads the load there); nothing else is served on it."""
    app = web.Application()
    app.router.add_get("/metrics", gateway.metrics_route)
    return app


def build_app(gateway: Gateway) -> web.Application:
    app = web.Application(client_max_size=gateway.config.max_body_bytes)
    r = app.router
    for path in ("/v1/{tail:.*}", "/tokenize", "/detokenize", "/version"):
        r.add_route("*", path, gateway.handle_proxy)
    r.add_get("/readyz", gateway.readyz)
    r.add_get("/health", gateway.readyz)
    r.add_get("/livez", gateway.livez)
    r.add_get("/metrics", gateway.metrics_route)
    r.add_route("*", "/{tail:.*}", gateway.not_found)
    return app
