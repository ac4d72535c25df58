"""No tenant starves the others: each tenant's share of the gateway's global limits, and per-tenant quotas.

Shares. The gateway's memory bounds are global — requests inside (`max_pending`), request bodies held
(`max_buffered_bytes`), requests waiting for a slot (`max_queued`). While the gateway tells tenants apart, a tenant
may hold at most 1/(n + 2) of each, n being the other tenants holding some of it: a tenant alone holds at most half,
so a flood always leaves room for a cold start of another tenant, and the more tenants are active the smaller each
one's part. With one tenant (a gateway that identifies nobody) the limits are its own.

Quotas (`--tenant-requests-per-minute`, `--tenant-tokens-per-minute`, `--tenant-max-concurrent`; 0: none), each a
token bucket per tenant refilled continuously (a minute's quota is also the largest burst). Tokens are the request's
estimated work (admission.request_cost: prompt characters / 4 + max_tokens), charged when it is admitted. Past a
quota the answer is 429 with Retry-After (whole seconds until the bucket holds enough) and the `x-ratelimit-*`
headers OpenAI clients read, which every answer carries while quotas are on.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from shoal.operator.gateway.options import ChartValue, non_negative_int, option


def share_cap(limit: float, others: int) -> float:
    """What one tenant may hold of `limit` while `others` other tenants hold some of it."""
    return limit / (others + 2)


class Shares:
    """Per-tenant usage of one global limit (requests, bytes, ...)."""

    def __init__(self):
        self.used: dict[str, float] = {}

    def admits(self, tenant: str, amount: float, limit: float) -> bool:
        others = len(self.used) - (1 if tenant in self.used else 0)
        return self.used.get(tenant, 0.0) + amount <= share_cap(limit, others)

    def take(self, tenant: str, amount: float) -> None:
        self.used[tenant] = self.used.get(tenant, 0.0) + amount

    def give(self, tenant: str, amount: float) -> None:
        left = self.used.get(tenant, 0.0) - amount
        if left > 1e-9:
            self.used[tenant] = left
        else:
            self.used.pop(tenant, None)


def _duration(seconds: float) -> str:
    """OpenAI's reset format: "1s", "6m0s", "0.5s"."""
    if seconds < 60:
        return f"{math.ceil(seconds * 10) / 10:g}s"
    minutes, rest = divmod(math.ceil(seconds), 60)
    return f"{minutes}m{rest}s"


@dataclass
class Bucket:
    """A token bucket holding at most `per_minute`, refilled at per_minute / 60 a second."""

    per_minute: float
    level: float = -1.0
    stamp: float = field(default_factory=time.monotonic)

    def refill(self, now: float) -> None:
        if self.level < 0:
            self.level = self.per_minute
        self.level = min(self.per_minute, self.level + (now - self.stamp) * self.per_minute / 60.0)
        self.stamp = now

    def wait_for(self, amount: float) -> float:
        """Seconds until `amount` fits (0: now). A request larger than the whole quota waits for a full bucket."""
        need = min(amount, self.per_minute) - self.level
        return 0.0 if need <= 0 else need * 60.0 / self.per_minute

    def reset_in(self) -> float:
        return (self.per_minute - self.level) * 60.0 / self.per_minute


class OverQuota(Exception):
    def __init__(self, reason: str, message: str, retry_after: float, headers: dict[str, str]):
        super().__init__(message)
        self.reason, self.retry_after, self.headers = reason, retry_after, headers


@dataclass
class QuotaPolicy:
    """Every tenant's quotas (0: none); past one, 429 with Retry-After and x-ratelimit-* headers."""

    requests_per_minute: int = option(0, "quotas", "requests a tenant may start per minute",
                                      flag="--tenant-requests-per-minute", type=non_negative_int, metavar="N",
                                      chart=ChartValue("tenantQuotas.requestsPerMinute"))
    tokens_per_minute: int = option(0, "quotas", "tokens a tenant may use per minute, estimated per request as "
                                    "prompt characters / 4 + max_tokens", flag="--tenant-tokens-per-minute",
                                    type=non_negative_int, metavar="N", chart=ChartValue("tenantQuotas.tokensPerMinute"))
    max_concurrent: int = option(0, "quotas", "a tenant's requests inside the gateway at once (waiting or running)",
                                 flag="--tenant-max-concurrent", type=non_negative_int, metavar="N",
                                 chart=ChartValue("tenantQuotas.maxConcurrent"))

    @property
    def on(self) -> bool:
        return bool(self.requests_per_minute or self.tokens_per_minute or self.max_concurrent)


class Quotas:
    """Every tenant's buckets and concurrent requests (forgotten once full and idle, so memory follows the active
    tenants)."""

    def __init__(self, policy: QuotaPolicy):
        self.policy = policy
        self.requests: dict[str, Bucket] = {}
        self.tokens: dict[str, Bucket] = {}
        self.concurrent: dict[str, int] = {}

    def _bucket(self, table: dict[str, Bucket], tenant: str, per_minute: int, now: float) -> Bucket:
        b = table.get(tenant)
        if b is None:
            b = table[tenant] = Bucket(per_minute, stamp=now)
        b.refill(now)
        return b

    def headers(self, tenant: str, now: float | None = None) -> dict[str, str]:
        now = time.monotonic() if now is None else now
        out: dict[str, str] = {}
        for kind, table, per_minute in (("requests", self.requests, self.policy.requests_per_minute),
                                        ("tokens", self.tokens, self.policy.tokens_per_minute)):
            if per_minute:
                b = self._bucket(table, tenant, per_minute, now)
                out[f"x-ratelimit-limit-{kind}"] = str(per_minute)
                out[f"x-ratelimit-remaining-{kind}"] = str(max(0, int(b.level)))
                out[f"x-ratelimit-reset-{kind}"] = _duration(b.reset_in())
        return out

    def admit(self, tenant: str, cost: float) -> dict[str, str]:
        """Charge one request of `cost` tokens to `tenant` (and count it as running): its x-ratelimit headers.
        Raises OverQuota, charging nothing."""
        p, now = self.policy, time.monotonic()
        if p.max_concurrent and self.concurrent.get(tenant, 0) >= p.max_concurrent:
            raise OverQuota("tenant_concurrency", f"your requests in flight are at your limit of {p.max_concurrent};"
                            " retry when one ends", 1.0, self.headers(tenant, now))
        waits = []
        if p.requests_per_minute:
            waits.append(("requests", self._bucket(self.requests, tenant, p.requests_per_minute, now).wait_for(1)))
        if p.tokens_per_minute:
            waits.append(("tokens", self._bucket(self.tokens, tenant, p.tokens_per_minute, now).wait_for(cost)))
        over = [(kind, wait) for kind, wait in waits if wait > 0]
        if over:
            kind, wait = max(over, key=lambda x: x[1])
            limit = p.requests_per_minute if kind == "requests" else p.tokens_per_minute
            raise OverQuota(f"tenant_{kind}_per_minute", f"rate limit of {limit} {kind} per minute reached; retry "
                            f"in {wait:.1f} s", wait, self.headers(tenant, now))
        if p.requests_per_minute:
            self.requests[tenant].level -= 1
        if p.tokens_per_minute:
            t = self.tokens[tenant]
            t.level -= min(cost, t.level)
        if p.max_concurrent:
            self.concurrent[tenant] = self.concurrent.get(tenant, 0) + 1
        headers = self.headers(tenant, now)
        self._forget(now)
        return headers

    def release(self, tenant: str) -> None:
        if self.policy.max_concurrent:
            left = self.concurrent.get(tenant, 0) - 1
            if left > 0:
                self.concurrent[tenant] = left
            else:
                self.concurrent.pop(tenant, None)

    def _forget(self, now: float) -> None:
        """Drop buckets that are full again (a new bucket starts full: the same)."""
        if len(self.requests) + len(self.tokens) < 4096:
            return
        for table in (self.requests, self.tokens):
            for tenant in [t for t, b in table.items() if (b.refill(now), b.level >= b.per_minute)[1]]:
                del table[tenant]
