"""Runs batches through the gateway's pools at the lowest priority: batch work takes only capacity that no
interactive request wants.

A batch request is sent to an engine only when all of these hold (checked again whenever a batch request ends,
and every POLL seconds, since interactive load changes without telling us):
  * no interactive request waits in the pool's admission queue (admission.py) — they always go first;
  * the engine has a free slot (the pool's `max_inflight`, when set) — a batch request takes a free slot, never
    a queued request's place;
  * the engine reports no request waiting in its own queue (fresh poll data) — an engine that queues is
    saturated, so a batch request would delay the interactive ones behind it;
  * this gateway runs fewer than `per_engine` batch requests there;
  * with `share="idle"` (the default), this gateway has no interactive request in flight there: a batch request
    shares every engine step with what runs beside it, so an interactive request arriving next to it has a later
    first token (measured ×0.7–×1.7 on a CPU engine); `"spare"` lets batch requests fill any free slot.
A pool with no engine at all (scaled to zero) is woken through its `on_hold` hooks, as a held request wakes it
(at most every WAKE_EVERY seconds while the batch waits; no client is held), and `pending()` (exported as
shoal:gateway_batch_pending_requests) tells the operator's autoscaler that work remains, so it neither leaves the
service at zero nor scales it to zero while a batch runs.
Batch requests never enter the admission queue and never count as the gateway's pending requests or buffered
bytes, so they cannot cause an interactive request to be shed or refused (429). Engines that schedule by priority
are sent the lowest rank (Ticket.priority = BATCH_PRIORITY, below every spec.priority).

An engine answering 429/503 or a connection failing before an answer puts the request back (it never ran); any
other answer is the request's result: 2xx lines go to the output file, others to the error file (OpenAI's batch
output line: {"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}). Each result is
fsynced (batch_store.Store.append, grouped with the results that finished meanwhile) before it counts.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import weakref
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from shoal.operator.gateway.admission import Ticket, request_cost
from shoal.operator.gateway.batch_store import TERMINAL, BatchError, Line, Store, new_id

log = logging.getLogger("shoal.gateway.batch")

BATCH_PRIORITY = -(2**31) - 1  # below the lowest spec.priority (-2^31)
POLL = 0.05  # seconds between checks for free capacity while batch requests wait for it
RESCAN = 5.0  # seconds between looks for batches no process runs (created elsewhere, or their runner died)
SAVE_EVERY = 0.5  # seconds between saves of a running batch's counts (they are rebuilt from its files on resume)
RETRY_BACKOFF = 1.0  # seconds before a request the engines refused (429/503, connection) is tried again
WAKE_EVERY = 1.0  # seconds between wake-ups of a pool with no engine while a batch waits for it
SHARES = ("idle", "spare")  # --batch-share


@dataclass(frozen=True)
class Refusal:
    """A batch request answered without an engine (its model is unknown to the caller)."""

    status: int
    body: dict


@dataclass(eq=False)
class Running:
    """A batch this process runs (holding its lock)."""

    record: dict
    lock_fd: int
    lines: list[Line] = field(default_factory=list)
    pending: list[tuple[str, bytes, asyncio.Future]] = field(default_factory=list)  # results not yet fsynced
    flushing: asyncio.Task | None = None
    saved: float = 0.0
    remaining: Counter = field(default_factory=Counter)  # requests not finished yet, by model

    @property
    def batch(self) -> dict:
        return self.record["batch"]


class BatchRunner:
    def __init__(self, gateway, store: Store, per_engine: int = 2, share: str = "idle"):
        if share not in SHARES:
            raise ValueError(f"batch share must be one of {', '.join(SHARES)}, got {share!r}")
        self.gateway = gateway
        self.store = store
        self.per_engine = per_engine
        self.share = share
        self.woken: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Pool -> when a batch last woke it
        self.running: dict[str, Running] = {}
        self.by_engine: dict[Any, int] = {}  # batch requests in flight per Backend
        self.tasks: set[asyncio.Task] = set()
        self.freed = asyncio.Event()
        self._scan_task: asyncio.Task | None = None

    # ---- lifecycle -------------------------------------------------------------------------------------------
    async def start(self) -> None:
        self._scan_task = asyncio.create_task(self._scan_forever(), name="batch-scan")

    async def stop(self) -> None:
        """Stop running batches: requests in flight are abandoned (not finished, so they run again on resume)."""
        tasks = [t for t in (self._scan_task, *self.tasks) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for run in self.running.values():
            os.close(run.lock_fd)
        self.running.clear()

    def _spawn(self, coro, name: str) -> asyncio.Task:
        task = asyncio.create_task(coro, name=name)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    async def _scan_forever(self) -> None:
        while True:
            try:
                await self.scan()
            except Exception:  # noqa: BLE001 - a bad directory entry must not stop every batch
                log.exception("looking for batches to run")
            await asyncio.sleep(RESCAN)

    async def scan(self) -> None:
        """Run every unfinished batch that no process runs (at start: resume this volume's batches)."""
        for batch_id in await asyncio.to_thread(self.store.batch_ids):
            if batch_id in self.running:
                continue
            try:
                record = await asyncio.to_thread(self.store.load, batch_id)
            except BatchError:
                continue
            if record["batch"]["status"] not in TERMINAL:
                await self.adopt(batch_id)

    async def adopt(self, batch_id: str) -> bool:
        """Take the batch's lock and run it; False when another process runs it."""
        if batch_id in self.running:
            return True
        fd = await asyncio.to_thread(self.store.lock, batch_id)
        if fd is None:
            return False
        record = await asyncio.to_thread(self.store.load, batch_id)  # read under the lock: the latest
        if record["batch"]["status"] in TERMINAL:
            os.close(fd)
            return False
        run = self.running[batch_id] = Running(record, fd)
        self._spawn(self._run(run), f"batch-{batch_id}")
        return True

    # ---- a batch ---------------------------------------------------------------------------------------------
    async def _run(self, run: Running) -> None:
        batch_id = run.batch["id"]
        try:
            await self._execute(run)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - the batch fails, the gateway goes on
            log.exception("batch %s failed", batch_id)
            await self._transition(run, "failed", errors={"object": "list", "data": [
                {"code": "internal_error", "message": f"the batch could not run: {e}", "param": None,
                 "line": None}]})
        finally:
            if self.running.get(batch_id) is run:
                del self.running[batch_id]
                os.close(run.lock_fd)

    async def _execute(self, run: Running) -> None:
        batch = run.batch
        batch_id = batch["id"]
        if batch["status"] in ("validating", "in_progress"):
            run.lines = await asyncio.to_thread(self.store.input_lines, run.record)
            completed, failed = await asyncio.to_thread(self.store.finished, batch_id)
            batch["request_counts"] = {"total": len(run.lines), "completed": len(completed), "failed": len(failed)}
            todo = [line for line in run.lines if line.custom_id not in completed and line.custom_id not in failed]
            run.remaining = Counter(line.body["model"] for line in todo)
            if batch["status"] == "validating":
                await self._transition(run, "in_progress")
            else:
                await self._save(run)
            if todo:
                log.info("batch %s: %d of %d requests to run", batch_id, len(todo), len(run.lines))
            await self._dispatch_all(run, todo)
        if batch["status"] == "in_progress":
            if time.time() >= batch["expires_at"]:
                await self._expire(run)
                return
            await self._transition(run, "finalizing")
        if batch["status"] in ("finalizing", "cancelling"):
            final = "completed" if batch["status"] == "finalizing" else "cancelled"
            suffix = batch_id[len("batch_"):]
            for name, key, file_id in (("output.jsonl", "output_file_id", f"file-{suffix}output"),
                                       ("errors.jsonl", "error_file_id", f"file-{suffix}errors")):
                batch[key] = await asyncio.to_thread(self.store.publish_result, run.record, name, file_id)
            await self._transition(run, final)

    async def _dispatch_all(self, run: Running, todo: list[Line]) -> None:
        batch = run.batch
        queue = list(reversed(todo))  # popped from the end: input order
        retry_at: dict[str, float] = {}
        workers: set[asyncio.Task] = set()
        checked = 0.0
        broken: list[BaseException] = []  # a result that could not be written: the batch cannot go on

        def done(task: asyncio.Task) -> None:
            workers.discard(task)
            if not task.cancelled() and task.exception() is not None:
                broken.append(task.exception())

        while (queue or workers) and not broken:
            if batch["status"] == "in_progress" and time.monotonic() - checked >= POLL:
                checked = time.monotonic()  # a cancel may come through another replica: look at the volume
                if await asyncio.to_thread(self.store.cancel_asked, batch["id"]):
                    await self._transition(run, "cancelling")
            if batch["status"] != "in_progress" or time.time() >= batch["expires_at"]:
                queue.clear()  # cancelling or expired: what is in flight finishes, nothing more starts
                if not workers:
                    return
            now = time.monotonic()
            line = queue[-1] if queue and retry_at.get(queue[-1].custom_id, 0.0) <= now else None
            admitted = self._take_capacity(run, line) if line is not None else None
            if admitted is not None:
                queue.pop()
                work = self._finish(run, line, admitted.status, admitted.body, None) \
                    if isinstance(admitted, Refusal) else self._one(run, line, *admitted, queue, retry_at)
                task = self._spawn(work, f"batch-req-{line.custom_id}")
                workers.add(task)
                task.add_done_callback(done)
                continue
            self.freed.clear()
            try:
                await asyncio.wait_for(self.freed.wait(), POLL)
            except asyncio.TimeoutError:
                pass
            if queue and retry_at.get(queue[-1].custom_id, 0.0) > now and len(queue) > 1:
                queue.insert(0, queue.pop())  # a request waiting out its backoff lets the next one go
        if broken:
            for w in workers:
                w.cancel()  # their results could not be recorded either; they run again on a resume
            raise broken[0]

    def _take_capacity(self, run: Running, line: Line):
        """(pool, backend, ticket) for the line when capacity is free for batch work now, else None; a Refusal
        (the answer the proxy would give, no engine involved) for a model the caller cannot reach."""
        gw = self.gateway
        model = line.body["model"]
        try:
            pool = gw.pools.resolve(model, run.record.get("namespace"))
        except LookupError as e:  # fleet.ModelAmbiguous
            return Refusal(409, {"error": {"message": str(e), "type": "invalid_request_error", "param": "model",
                                           "code": "model_ambiguous"}})
        if pool is None:
            return Refusal(404, {"error": {"message": f"The model `{model}` does not exist.",
                                           "type": "invalid_request_error", "param": "model",
                                           "code": "model_not_found"}})
        if pool.queue or pool.draining:  # interactive requests wait for a slot: they go first
            return None
        now = time.monotonic()
        eligible = pool.backends.eligible(now)
        if not eligible:
            self._wake(pool, now)
            return None
        busy = tuple(b for b in eligible if not self._may_take(b, now))
        body = json.dumps(line.body).encode()
        ticket = Ticket(priority=BATCH_PRIORITY, tenant=run.record["owner"], cost=request_cost(len(body), line.body),
                        model=model, hashes=gw.prompt_hashes(line.url, line.body, model, pool))
        backend = pool.pick(ticket, busy)
        if backend is None:
            return None
        self.by_engine[backend] = self.by_engine.get(backend, 0) + 1
        return pool, backend, ticket

    def _may_take(self, backend, now: float) -> bool:
        """May the engine take one more batch request now (`share`, `per_engine`, its own queue)?"""
        ours = self.by_engine.get(backend, 0)
        if ours >= self.per_engine or (backend.fresh(now) and backend.waiting > 0):
            return False
        return self.share == "spare" or backend.inflight <= ours  # idle: no interactive request of ours there

    def _wake(self, pool, now: float) -> None:
        """Ask for the pool's engines as a held request does (scale from zero), without holding a client."""
        if now - self.woken.get(pool, -WAKE_EVERY) < WAKE_EVERY:
            return
        self.woken[pool] = now
        for hook in pool.on_hold:
            hook()

    def pending(self) -> dict[str, int]:
        """Batch requests not finished yet (waiting for capacity or at an engine), by model."""
        total: Counter = Counter()
        for run in self.running.values():
            if run.batch["status"] == "in_progress":
                total.update(run.remaining)
        return {model: n for model, n in total.items() if n > 0}

    async def _one(self, run: Running, line: Line, pool, backend, ticket, queue: list[Line],
                   retry_at: dict[str, float]) -> None:
        metrics = self.gateway.metrics
        metrics.batch_running.inc()
        result = None
        try:
            result = await self._send(pool, backend, ticket, line, run)
        finally:
            metrics.batch_running.dec()
            self.by_engine[backend] -= 1
            if not self.by_engine[backend]:
                del self.by_engine[backend]
            pool.release(backend, ticket)
            self.freed.set()
        if result is None:  # refused before running: again later
            metrics.batch_requests.labels("requeued").inc()
            retry_at[line.custom_id] = time.monotonic() + RETRY_BACKOFF
            queue.append(line)
            return
        await self._finish(run, line, *result)

    async def _send(self, pool, backend, ticket, line: Line, run: Running):
        """(status, body, request id) of the engine's answer, or None when it refused or never got the request."""
        gw = self.gateway
        body = gw.engine_body(pool, ticket, json.dumps(line.body).encode(), line.body)
        headers = {"Content-Type": "application/json", **gw.poll_headers(pool)}
        trace = None
        if gw.tracer is not None:  # tracing.py: a span per batch request, the engine's nested under its attempt
            trace = gw.tracer.batch_request(run.batch["id"], line.custom_id, line.body["model"], run.record["owner"])
            trace.attempt_started(backend.url, headers, None)
        outcome: int | str = "failed"
        try:
            result = await self._post(backend, pool, line, body, headers)
            outcome = result[0] if result is not None else "requeued"
            return result
        finally:
            if trace is not None:
                trace.attempt_ended(outcome)
                trace.end(outcome if isinstance(outcome, int) else None)

    async def _post(self, backend, pool, line: Line, body: bytes, headers: dict[str, str]):
        gw = self.gateway
        timeout = aiohttp.ClientTimeout(total=gw.config.response_timeout, sock_connect=gw.config.connect_timeout)
        try:
            async with gw.session.post(backend.url + line.url, data=body, headers=headers, timeout=timeout) as r:
                raw = await r.read()
                status, request_id = r.status, r.headers.get("x-request-id")
        except aiohttp.ClientConnectorError:
            backend.on_refused(time.monotonic())
            pool.backends.notify()
            return None
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            log.warning("batch request %s to %s failed: %r", line.custom_id, backend.url, e)
            backend.on_failure(time.monotonic())
            return None
        if status < 500:
            backend.on_success()
        if status in (429, 503):
            return None
        try:
            parsed = json.loads(raw)
        except ValueError:
            parsed = raw.decode("utf-8", "replace")
        return status, parsed, request_id

    async def _finish(self, run: Running, line: Line, status: int, body: Any, request_id: str | None) -> None:
        ok = 200 <= status < 300
        result = {"id": new_id("batch_req_"), "custom_id": line.custom_id,
                  "response": {"status_code": status, "request_id": request_id or new_id("req_"), "body": body},
                  "error": None}
        await self._append(run, "output.jsonl" if ok else "errors.jsonl", result)
        run.batch["request_counts"]["completed" if ok else "failed"] += 1
        run.remaining[line.body["model"]] -= 1
        self.gateway.metrics.batch_requests.labels("completed" if ok else "failed").inc()
        if time.monotonic() - run.saved >= SAVE_EVERY:
            await self._save(run)

    async def _append(self, run: Running, name: str, result: dict) -> None:
        """Durably append one result; results finishing meanwhile share the write and its fsync."""
        future = asyncio.get_running_loop().create_future()
        run.pending.append((name, json.dumps(result, separators=(",", ":")).encode(), future))
        if run.flushing is None or run.flushing.done():
            run.flushing = asyncio.create_task(self._flush(run))
        await future

    async def _flush(self, run: Running) -> None:
        while run.pending:
            group, run.pending = run.pending, []
            try:
                await asyncio.to_thread(self.store.append, run.batch["id"], [(n, line) for n, line, _ in group])
            except Exception as e:  # each waiting result fails with it (its request is not done)
                for _, _, f in group:
                    if not f.done():
                        f.set_exception(e)
                continue
            for _, _, f in group:
                if not f.done():
                    f.set_result(None)

    async def _expire(self, run: Running) -> None:
        """Past the completion window: the requests never run get an error line each, the batch is expired."""
        batch = run.batch
        completed, failed = await asyncio.to_thread(self.store.finished, batch["id"])
        if not run.lines:
            run.lines = await asyncio.to_thread(self.store.input_lines, run.record)
        left = [line for line in run.lines if line.custom_id not in completed and line.custom_id not in failed]
        if left:
            await asyncio.to_thread(self.store.append, batch["id"], [("errors.jsonl", json.dumps({
                "id": new_id("batch_req_"), "custom_id": line.custom_id, "response": None,
                "error": {"code": "batch_expired", "message": "This request could not be executed before the "
                                                              "completion window expired."}}).encode())
                for line in left])
        batch["request_counts"]["failed"] = len(failed) + len(left)
        suffix = batch["id"][len("batch_"):]
        batch["output_file_id"] = await asyncio.to_thread(self.store.publish_result, run.record, "output.jsonl",
                                                          f"file-{suffix}output")
        batch["error_file_id"] = await asyncio.to_thread(self.store.publish_result, run.record, "errors.jsonl",
                                                         f"file-{suffix}errors")
        await self._transition(run, "expired")

    async def _transition(self, run: Running, status: str, **fields: Any) -> None:
        batch = run.batch
        batch["status"] = status
        batch[f"{status}_at"] = int(time.time())
        batch.update(fields)
        await self._save(run)
        log.info("batch %s: %s", batch["id"], status)

    async def _save(self, run: Running) -> None:
        run.saved = time.monotonic()
        record = json.loads(json.dumps(run.record))  # a snapshot: the counts move on while it is written
        await asyncio.to_thread(self.store.save, record)

    # ---- what the API asks -----------------------------------------------------------------------------------
    def current(self, batch_id: str) -> dict | None:
        """The live record of a batch this process runs (counts newer than on disk)."""
        run = self.running.get(batch_id)
        return run.record if run is not None else None

    def wake(self) -> None:
        self.freed.set()
