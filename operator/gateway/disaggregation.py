"""Prefill/decode disaggregation at the gateway: a request's prefill runs on a prefill engine (a KV producer), its
decode on the engine the pool picked (a KV consumer), which pulls the prompt's KV from the producer
(engine/core/kv_transfer.py). The gateway speaks vLLM's `kv_transfer_params`, so vLLM engines started with a NIXL
connector could sit behind it as well.

1. The pool admits the request and picks its decode engine as for any request.
2. The prefill goes to the least-loaded prefill engine: the same body with max_tokens 1, not streamed, one choice,
   and kv_transfer_params {"do_remote_decode": true}. Its answer's kv_transfer_params say where the KV is.
3. The request goes to the decode engine with those kv_transfer_params.
No prefill engine usable, or one that fails or answers without kv_transfer_params: the request goes to the decode
engine unchanged, which prefills it itself (counted, never an error to the client). Clients never set
kv_transfer_params themselves: the gateway drops theirs (Gateway.engine_body), so nobody can make an engine pull
from an address of their choosing.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

import aiohttp

from shoal.operator.gateway.backends import Backend, BackendSet

log = logging.getLogger(__name__)

ROUTES = ("/v1/completions", "/v1/chat/completions")


class RemotePrefill:
    def __init__(self, backends: BackendSet, timeout: float, metrics):
        self.backends = backends
        self.timeout = timeout
        self.metrics = metrics  # GatewayMetrics: remote_prefills{outcome}, remote_prefill_seconds

    def applies(self, path: str, parsed: Any) -> bool:
        return path in ROUTES and isinstance(parsed, dict)

    def pick(self) -> Backend | None:
        now = time.monotonic()
        eligible = self.backends.eligible(now)
        return min(eligible, key=lambda b: (b.load(now), b.url)) if eligible else None

    async def prefill(self, session: aiohttp.ClientSession, path: str, parsed: dict,
                      headers: dict[str, str]) -> dict | None:
        """The producer's kv_transfer_params for this request, or None (the decode engine prefills itself)."""
        backend = self.pick()
        if backend is None:
            self.metrics.remote_prefills.labels("unavailable").inc()
            return None
        body = {k: v for k, v in parsed.items() if k not in ("stream_options", "logprobs", "top_logprobs", "n")}
        body.update(stream=False, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
        if "max_completion_tokens" in body:
            body["max_completion_tokens"] = 1
        backend.inflight += 1
        started = time.monotonic()
        outcome, params = "failed", None
        try:
            async with session.post(backend.url + path, data=json.dumps(body).encode(),
                                    headers={**{k: v for k, v in headers.items() if k.lower() != "accept-encoding"},
                                             "Content-Type": "application/json"},
                                    timeout=aiohttp.ClientTimeout(total=self.timeout)) as resp:
                if resp.status == 200:
                    answer = await resp.json(content_type=None)
                    params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
                    outcome = "ok" if isinstance(params, dict) and params.get("do_remote_prefill") else "no_params"
                else:
                    outcome = f"status_{resp.status}" if resp.status in (400, 401, 404, 429, 500, 503) else "failed"
                    if resp.status >= 500:
                        backend.on_failure(time.monotonic())
        except asyncio.TimeoutError:
            outcome = "timeout"
            backend.on_failure(time.monotonic())
        except aiohttp.ClientConnectorError:
            outcome = "refused"
            backend.on_refused(time.monotonic())
        except (aiohttp.ClientError, ValueError, OSError):
            backend.on_failure(time.monotonic())
        finally:
            backend.inflight -= 1
            self.backends.notify()
        self.metrics.remote_prefills.labels(outcome).inc()
        if outcome != "ok":
            log.warning("%s: prefill on %s failed (%s); the decode engine prefills it", path, backend.url, outcome)
            return None
        backend.on_success()
        self.metrics.remote_prefill_seconds.observe(time.monotonic() - started)
        return params
