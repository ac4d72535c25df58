"""The canary judge: every second, for each InferenceService with a canary receiving traffic, read what its gateways
measured per revision, keep a sliding window of it, report both revisions' figures in status.canary, and roll the
canary back when it breaks spec.canary.rollback.

It rides on the autoscaler's machinery (autoscaler.py): the same watch-fed caches of InferenceServices and of the
EndpointSlices of the gateway Services (their "metrics" port), the same bounded scrapes, the same leadership — only
the operator replica that leads judges, like the one that scales. It needs no spec.autoscaling.

Counters, not gauges: each gateway's shoal:gateway_revision_requests_total (by revision and outcome) and
shoal:gateway_revision_first_byte_seconds histogram are differenced per gateway pod between scrapes (a restarted
gateway, whose counters went back, counts from zero), so the window's figures are those of every gateway together.

A rollback writes status.canary.rollback (the revision, why, when) and the CanaryRolledBack condition on the version
read, and posts a Warning Event; the reconciler then renders the canary's share as 0 (the gateways stop sending it
conversations at the next EndpointSlice event) and removes its Deployment (canary.py says why the spec is never
rewritten for a rollback).
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import kopf
from prometheus_client.parser import text_string_to_metric_families

from shoal.operator import api, canary, contract
from shoal.operator.kube import ApiError

logger = logging.getLogger("shoal.operator.canary")

INTERVAL = 1.0  # seconds between judgements
FIGURES_REFRESH = 10.0  # write status.canary's figures at most this often (and at a rollback)
REVISIONS = (contract.STABLE, contract.CANARY)


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")


@dataclass
class Tally:
    """One revision's counts: requests (answered or failed; the client leaving is not counted), errors, and the
    first-byte histogram as cumulative bucket counts by upper bound."""

    requests: float = 0.0
    errors: float = 0.0
    buckets: dict[float, float] = field(default_factory=dict)

    def add(self, other: "Tally", sign: float = 1.0) -> None:
        self.requests += sign * other.requests
        self.errors += sign * other.errors
        for le, n in other.buckets.items():
            self.buckets[le] = self.buckets.get(le, 0.0) + sign * n

    def minus(self, before: "Tally") -> "Tally":
        """The counts since `before` (all of them when the counters went back: a restarted gateway)."""
        if self.requests < before.requests or self.errors < before.errors:
            return Tally(self.requests, self.errors, dict(self.buckets))
        return Tally(self.requests - before.requests, self.errors - before.errors,
                     {le: max(0.0, n - before.buckets.get(le, 0.0)) for le, n in self.buckets.items()})

    def p95(self) -> float | None:
        """The 95th percentile of first-byte times: the upper bound of the bucket it falls in (None: no data;
        inf when past the last bound)."""
        total = self.buckets.get(math.inf, 0.0)
        if total <= 0:
            return None
        for le in sorted(self.buckets):
            if self.buckets[le] >= 0.95 * total:
                return le
        return math.inf


def parse_gateway(text: str) -> dict[str, Tally]:
    """One gateway's /metrics -> a Tally per revision (its counters since it started)."""
    tallies = {r: Tally() for r in REVISIONS}
    counter = contract.GATEWAY_REVISION_REQUESTS + "_total"
    bucket = contract.GATEWAY_REVISION_FIRST_BYTE + "_bucket"
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            revision = sample.labels.get("revision")
            if revision not in tallies or math.isnan(sample.value):
                continue
            if sample.name == counter and sample.labels.get("outcome") in ("ok", "error"):
                tallies[revision].requests += sample.value
                if sample.labels["outcome"] == "error":
                    tallies[revision].errors += sample.value
            elif sample.name == bucket:
                le = float(sample.labels.get("le", "inf"))
                tallies[revision].buckets[le] = tallies[revision].buckets.get(le, 0.0) + sample.value
    return tallies


def figures(t: Tally) -> dict[str, Any]:
    p95 = t.p95()
    return {"requests": int(t.requests), "errors": int(t.errors),
            "errorRate": round(t.errors / t.requests, 4) if t.requests else None,
            "p95FirstByteSeconds": (None if p95 is None else 1e9 if math.isinf(p95) else p95)}


def breach(slo: api.CanaryRollback, t: Tally) -> tuple[str, str] | None:
    """(reason, message) when the canary's window breaks its SLO; None while it holds or there is too little data."""
    if t.requests < slo.min_requests:
        return None
    rate = t.errors / t.requests
    if rate > slo.max_error_rate:
        return ("ErrorRateAboveSLO", f"{int(t.errors)} of the canary's {int(t.requests)} requests in the last "
                                     f"{slo.window_seconds} s failed ({rate:.1%} > maxErrorRate "
                                     f"{slo.max_error_rate:.1%})")
    p95 = t.p95()
    if slo.max_p95_first_byte_seconds is not None and p95 is not None and p95 > slo.max_p95_first_byte_seconds:
        shown = "beyond the last bucket" if math.isinf(p95) else f"{p95:g} s"
        return ("LatencyAboveSLO", f"the canary's p95 time to first byte over its last {int(t.requests)} requests "
                                   f"is {shown} > maxP95FirstByteSeconds {slo.max_p95_first_byte_seconds:g} s")
    return None


@dataclass
class Window:
    """The counts of one canary revision's last window_seconds, from every gateway pod."""

    revision: str = ""
    last: dict[str, dict[str, Tally]] = field(default_factory=dict)  # gateway URL -> its counters last seen
    samples: deque = field(default_factory=deque)  # (time, {revision: Tally of the increments})
    last_figures: float = 0.0

    def observe(self, now: float, scraped: dict[str, dict[str, Tally]], window: float) -> dict[str, Tally]:
        step = {r: Tally() for r in REVISIONS}
        for url, tallies in scraped.items():
            before = self.last.get(url)
            for r in REVISIONS:
                step[r].add(tallies[r].minus(before[r]) if before else Tally())  # first sight: a baseline only
            self.last[url] = tallies
        for gone in set(self.last) - set(scraped):  # a gateway pod that left (its counts are in the window)
            del self.last[gone]
        self.samples.append((now, step))
        while self.samples and self.samples[0][0] < now - window:
            self.samples.popleft()
        total = {r: Tally() for r in REVISIONS}
        for _, s in self.samples:
            for r in REVISIONS:
                total[r].add(s[r])
        return total


@dataclass
class CanaryJudge:
    autoscaler: Any  # autoscaler.Autoscaler: its caches, scrapes, leadership and API client
    interval: float = INTERVAL
    windows: dict[tuple[str, str], Window] = field(default_factory=dict)

    async def run(self) -> None:
        a = self.autoscaler
        await a.isvcs.wait_synced()
        while True:
            try:
                if a.leading():
                    await self.judge_all()
                else:
                    self.windows.clear()  # a new leader starts with no history, like the autoscaler
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - one bad pass never ends judging
                logger.exception("canary judge")
            await asyncio.sleep(self.interval)

    async def judge_all(self) -> None:
        seen = set()
        for isvc in list(self.autoscaler.isvcs.values()):
            meta = isvc["metadata"]
            if not (isvc.get("spec") or {}).get("canary") or meta.get("deletionTimestamp"):
                continue
            key = (meta["namespace"], meta["name"])
            seen.add(key)
            try:
                await self.judge(isvc)
            except api.SpecError:
                pass  # the reconciler reports it
            except ApiError as e:
                logger.warning("canary of %s/%s: %s", *key, e)
        for key in set(self.windows) - seen:
            del self.windows[key]

    async def judge(self, isvc: dict[str, Any]) -> None:
        meta = isvc["metadata"]
        ns, name = meta["namespace"], meta["name"]
        spec = self.autoscaler.spec_of(isvc)
        if spec.canary is None or not spec.gateway.enabled:
            return
        revision = canary.revision(spec)
        window = self.windows.get((ns, name))
        if window is None or window.revision != revision:
            window = self.windows[(ns, name)] = Window(revision)
        if canary.rolled_back(spec, isvc.get("status")):
            return
        gateways = [e for e in self.autoscaler._endpoints(ns, name, "metrics") if e.ready]
        texts = await asyncio.gather(*(self.autoscaler._scrape(g.url, "gateway") for g in gateways))
        scraped = {g.url: parse_gateway(t) for g, t in zip(gateways, texts) if t is not None}
        slo = spec.canary.rollback
        now = time.monotonic()
        total = window.observe(now, scraped, slo.window_seconds)
        found = breach(slo, total[contract.CANARY]) if canary.traffic_percent(spec, isvc.get("status")) else None
        if found is not None:
            await self.roll_back(isvc, revision, total, *found)
            window.last_figures = now
        elif now - window.last_figures >= FIGURES_REFRESH and await self.write_figures(isvc, revision, total):
            window.last_figures = now

    def _figures(self, total: dict[str, Tally]) -> dict[str, Any]:
        return {"stable": figures(total[contract.STABLE]), "canary": figures(total[contract.CANARY]),
                "figuresTime": _now()}

    async def write_figures(self, isvc: dict[str, Any], revision: str, total: dict[str, Tally]) -> bool:
        """status.canary's figures; -> False when they cannot be written yet (try again next second)."""
        meta = isvc["metadata"]
        old = (isvc.get("status") or {}).get("canary") or {}
        if old.get("revision") != revision:
            return False  # the reconciler has not reported this revision yet: figures follow its status
        new = self._figures(total)
        if all(old.get(k) == new[k] for k in ("stable", "canary")):
            return True
        try:
            await self.autoscaler.kube.merge_patch(api.KIND, meta["namespace"], meta["name"],
                                                   {"status": {"canary": new}}, subresource="status")
        except ApiError as e:
            if e.status != 404:
                raise
        return True

    async def roll_back(self, isvc: dict[str, Any], revision: str, total: dict[str, Tally], reason: str,
                        message: str) -> None:
        meta = isvc["metadata"]
        ns, name = meta["namespace"], meta["name"]
        now = _now()
        conditions = [c for c in (isvc.get("status") or {}).get("conditions") or []
                      if c.get("type") != canary.CONDITION_ROLLED_BACK]
        conditions.append({"type": canary.CONDITION_ROLLED_BACK, "status": "True", "reason": reason,
                           "message": f"revision {revision}: {message}; it gets no traffic and its Deployment is "
                                      "removed until its model, image or engine options change",
                           "lastTransitionTime": now, "observedGeneration": meta.get("generation")})
        patch = {"metadata": {"resourceVersion": meta.get("resourceVersion")},
                 "status": {"canary": {**self._figures(total), "trafficPercent": 0, "split": canary.split(0),
                                       "rollback": {"revision": revision, "reason": reason, "message": message,
                                                    "time": now}},
                            "conditions": conditions}}
        try:
            # on the version read: the conditions list is written whole (a 409: judged again next second)
            updated = await self.autoscaler.kube.merge_patch(api.KIND, ns, name, patch, subresource="status")
        except ApiError as e:
            if e.status in (404, 409):
                return
            raise
        logger.warning("%s/%s: canary %s rolled back: %s", ns, name, revision, message)
        await self.autoscaler.kube.event(updated, "Warning", "CanaryRolledBack", f"revision {revision}: {message}")


@kopf.on.startup()
async def start_canary_judge(memo: kopf.Memo, **_: Any) -> None:
    """Starts the judge once the autoscaler (autoscaler.py), whose caches it reads, exists: in a task, so that the
    operator's startup never waits on the order kopf runs its startup handlers in."""
    if "canary_judge_task" in memo:
        return

    async def run() -> None:
        while getattr(memo.get("autoscaler"), "isvcs", None) is None:  # its caches are being made
            await asyncio.sleep(0.05)
        memo.canary_judge = CanaryJudge(memo.autoscaler)
        logger.info("canary judge started")
        try:
            await memo.canary_judge.run()
        except Exception:  # pragma: no cover - run() catches what a pass raises; this is a bug, said loudly
            logger.exception("canary judge stopped")
            raise

    memo.canary_judge_task = asyncio.create_task(run(), name="canary judge")


@kopf.on.cleanup()
async def stop_canary_judge(memo: kopf.Memo, **_: Any) -> None:
    task = memo.get("canary_judge_task")
    if task is not None:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
