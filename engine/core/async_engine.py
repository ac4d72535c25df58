"""AsyncEngine: the synchronous LLMEngine's step loop on its own thread, fed from an asyncio event loop.

The HTTP server (and anything else async) talks to the engine only through this class:

- requests and aborts go to the engine thread through one thread-safe queue and are applied between steps
  (LLMEngine is not thread-safe: only the engine thread ever calls it, including its constructor);
- each step's outputs come back in one `loop.call_soon_threadsafe` call and are spread over per-request
  asyncio queues, so a slow step never blocks HTTP, health or metrics. Outputs are deltas (every request runs
  in RequestOutputKind.DELTA): each carries only the tokens, text and logprobs new since the previous one;
  per-request timing is the engine's own record (`RequestOutput.metrics`);
- a heartbeat timestamp is refreshed on every loop iteration (idle too): `is_alive()` fails when it goes stale
  (a wedged step) or when the loop died (an exception in `step()` is fatal: every in-flight request gets
  `EngineDeadError` and liveness fails);
- `start_draining()` refuses new requests while in-flight ones finish; the waiting queue is capped
  (`EngineConfig.max_queue_len`), beyond which `QueueFullError` is raised.

Multi-process tensor/pipeline parallelism lives inside LLMEngine (rank 0 schedules and broadcasts); nothing here
depends on it.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import traceback
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from typing import Any

from shoal.engine.config import EngineConfig
from shoal.engine.contracts import PoolingParams, RequestOutputKind
from shoal.engine.core.outputs import RequestMetrics, RequestOutput

logger = logging.getLogger("shoal.engine.core.async_engine")

DEFAULT_HEARTBEAT_TIMEOUT = 5.0  # seconds without a loop iteration before liveness fails
ENGINE_THREAD = "shoal-engine-loop"  # the thread that loads the model, then runs the step loop
_IDLE_WAIT = 0.2  # the loop wakes at least this often when idle, to refresh the heartbeat


class EngineError(Exception):
    """Base class of the errors AsyncEngine raises to its callers."""


class EngineDeadError(EngineError):
    """The engine loop died (or never started); nothing will be generated."""


class EngineNotReadyError(EngineError):
    """The model is still loading."""


class RequestFailedError(EngineError):
    """The engine refused one request for a reason other than bad input (a bug, reported as a 500)."""


class QueueFullError(EngineError):
    """The waiting queue is at its cap; retry later."""


class DrainingError(EngineError):
    """The engine is shutting down and admits no new requests."""


class SleepingError(EngineError):
    """The engine is asleep (sleep mode): POST /wake_up before sending requests."""


class MetricsSink:
    """What AsyncEngine reports per request; the server's metrics implement it. All no-ops here."""

    def on_first_token(self, ttft: float) -> None: ...
    def on_inter_token(self, itl: float, num_tokens: int) -> None: ...
    def on_finished(self, output: RequestOutput, finished_time: float) -> None:
        """`output.metrics` is the request's timing record."""


@dataclass
class _Request:
    request_id: str
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    arrival: float  # for the timing record of a request aborted before the engine reported anything
    finished: bool = False


_ADD = "add"
_ABORT = "abort"
_CALL = "call"
_ACCEPTED = object()  # first item on a request's queue once LLMEngine.add_request succeeded
_FINISHED = object()  # end of a request's stream


class RequestStream:
    """The outputs of one request, as an async iterator. Closing it early aborts the request."""

    def __init__(self, engine: "AsyncEngine", req: _Request):
        self._engine = engine
        self._req = req
        self.request_id = req.request_id
        self.finished = False
        self.finished_normally = False  # True once the engine's final output came through
        self._pending: Any = None

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        q = self._req.queue
        if self._pending is not None:
            item, self._pending = self._pending, None
        else:
            item = await q.get()
        # Outputs are deltas: if several piled up while the consumer was busy, add them up so a slow reader
        # catches up in one write.
        while isinstance(item, RequestOutput) and not item.finished and not q.empty():
            nxt = q.get_nowait()
            if isinstance(nxt, RequestOutput):
                item.add(nxt)
            else:
                self._pending = nxt
                break
        if item is _FINISHED:
            self.finished = True
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
            self.finished_normally = True
        return item

    def abort(self) -> None:
        """Abort the request unless it already finished (idempotent)."""
        if not self.finished:
            self.finished = True
            self._engine.abort(self.request_id)


@dataclass
class StatsSnapshot:
    """The latest EngineStats (taken on the engine thread) plus when it was taken."""

    stats: Any = None
    time: float = 0.0


class AsyncEngine:
    """Runs LLMEngine on a dedicated thread. Construct, then `start()`; the model loads on the engine thread."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        engine_factory: Callable[[EngineConfig], Any] | None = None,
        heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT,
        metrics: MetricsSink | None = None,
    ):
        self.config = config
        self._factory = engine_factory
        self.heartbeat_timeout = heartbeat_timeout
        self.metrics = metrics or MetricsSink()
        self.max_queue_len = config.max_queue_len

        self.engine: Any = None  # the LLMEngine, once loaded (touch it only on the engine thread!)
        self.tokenizer: Any = None  # a private copy for the event-loop side (tokenize, chat templates)
        self.images: Any = None  # a vision-language model's core.images.ImageInputs (None: text only)
        self.max_model_len: int | None = None
        self.model_name: str = config.model_name
        self.chat_template: str | None = None  # resolved --chat-template, if any

        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._requests: dict[str, _Request] = {}
        self._lock = threading.Lock()
        self._pending_adds = 0
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._loaded = threading.Event()
        self._load_done = threading.Event()  # loaded or failed
        self._load_waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []  # woken when it is set
        self._load_waiters_lock = threading.Lock()
        self.fatal_error: BaseException | None = None
        self.heartbeat = time.monotonic()
        self.draining = False
        self.sleep_level = 0  # sleep mode: 0 awake, else the level it sleeps at (set by sleep() / wake_up())
        self._sleep_call = False  # a sleep or wake-up runs on the engine thread (a level-2 wake reloads the model)
        self.snapshot = StatsSnapshot()
        self.start_time = time.time()

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> None:
        if self._thread is not None:
            return
        self.heartbeat = time.monotonic()
        self._thread = threading.Thread(target=self._run, name=ENGINE_THREAD, daemon=True)
        self._thread.start()

    async def wait_loaded(self, timeout: float | None = None) -> None:
        """Wait until the model is loaded; raises EngineDeadError if loading failed."""
        # A future the engine thread resolves through the loop the moment the load ends (a poll added up to its
        # period to every start), not a worker thread blocked on the event: a server stopped mid-load must not
        # leave a thread for asyncio.run's executor shutdown to wait on until the load ends.
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        with self._load_waiters_lock:
            if self._load_done.is_set():
                done.set_result(None)
            else:
                self._load_waiters.append((loop, done))
        try:
            await asyncio.wait_for(done, timeout)
        except asyncio.TimeoutError:
            raise TimeoutError("engine did not load in time") from None
        finally:
            with self._load_waiters_lock:
                if (loop, done) in self._load_waiters:
                    self._load_waiters.remove((loop, done))
        if self.fatal_error is not None:
            raise EngineDeadError(f"engine failed to start: {self.fatal_error}") from self.fatal_error

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop (aborting whatever is left) and release the engine."""
        self._stop.set()
        self._inbox.put(None)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    # ---------------------------------------------------------------- health
    @property
    def is_loaded(self) -> bool:
        return self._loaded.is_set()

    @property
    def is_loading(self) -> bool:
        return not self._load_done.is_set()

    def heartbeat_age(self) -> float:
        return time.monotonic() - self.heartbeat

    def is_alive(self) -> bool:
        """Liveness: no fatal error, the loop thread runs, and (once loaded) its heartbeat is fresh."""
        if self.fatal_error is not None:
            return False
        if self._thread is None or not self._thread.is_alive():
            return False
        if self.is_loaded and self.heartbeat_age() > self.heartbeat_timeout and not self._sleep_call:
            return False  # (a wake-up that reloads weights holds the loop for as long as a load: not a hang)
        return True

    def is_healthy(self) -> bool:
        return self.is_loaded and self.is_alive()

    def queue_full(self) -> bool:
        return self.num_waiting() >= self.max_queue_len

    def is_ready(self) -> bool:
        """Readiness: loaded, loop alive, not draining. A full queue does not count: an overloaded replica must stay
        behind its Service and answer 429 (which a gateway retries elsewhere), not leave the EndpointSlice with
        its running requests, and have the load move to the others in a burst."""
        return self.is_healthy() and not self.draining and not self.sleep_level

    def num_waiting(self) -> int:
        stats = self.snapshot.stats
        with self._lock:
            return (getattr(stats, "num_waiting", 0) if stats is not None else 0) + self._pending_adds

    def num_in_flight(self) -> int:
        return len(self._requests)

    def start_draining(self) -> None:
        self.draining = True

    async def wait_idle(self, timeout: float | None = None, poll: float = 0.05) -> bool:
        """Wait until no request is in flight; False if the timeout expired first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._requests:
            if deadline is not None and time.monotonic() >= deadline:
                return False
            if not self.is_alive() and self.fatal_error is not None:
                return True
            await asyncio.sleep(poll)
        return True

    # ---------------------------------------------------------------- requests
    def _check_admission(self) -> None:
        if self.fatal_error is not None:
            raise EngineDeadError(f"engine loop died: {self.fatal_error}")
        if not self.is_loaded:
            raise EngineNotReadyError("the model is still loading")
        if self._thread is None or not self._thread.is_alive() or self._stop.is_set():
            raise EngineDeadError("engine loop is not running")
        if self.draining:
            raise DrainingError("the server is shutting down")
        if self.sleep_level:
            raise SleepingError(f"the engine is asleep (level {self.sleep_level}); POST /wake_up first")
        if self.queue_full():
            raise QueueFullError(f"too many waiting requests (max_queue_len={self.max_queue_len})")

    async def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: Any,
        *,
        priority: int = 0,
        arrival_time: float | None = None,
        lora_request: str | None = None,
        images: list | None = None,
    ) -> RequestStream:
        """Hand a request to the engine thread; returns once LLMEngine accepted it.

        Raises ValueError (bad input, from LLMEngine.add_request), QueueFullError, DrainingError,
        EngineNotReadyError or EngineDeadError.
        """
        self._check_admission()
        # An embedding request (PoolingParams) has one output, its vector, when it finishes.
        if not isinstance(params, PoolingParams) and params.output_kind is not RequestOutputKind.DELTA:
            params = params.clone(output_kind=RequestOutputKind.DELTA)
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        loop = asyncio.get_running_loop()
        arrival = arrival_time if arrival_time is not None else time.time()
        req = _Request(request_id, loop, asyncio.Queue(), arrival)
        self._requests[request_id] = req
        with self._lock:
            self._pending_adds += 1
        self._inbox.put((_ADD, req, prompt, params, priority, arrival, lora_request, images))
        stream = RequestStream(self, req)
        try:
            while True:
                try:
                    first = await asyncio.wait_for(req.queue.get(), 1.0)
                    break
                except asyncio.TimeoutError:
                    # A loop that died after our admission check never answers: do not wait forever.
                    if self._thread is None or not self._thread.is_alive():
                        self._requests.pop(request_id, None)
                        stream.finished = True
                        raise EngineDeadError(f"engine loop is not running: {self.fatal_error}") from None
        except BaseException:
            # Cancelled while waiting for acceptance: abort (the abort queues behind the add).
            stream.abort()
            raise
        if first is not _ACCEPTED:
            self._requests.pop(request_id, None)
            stream.finished = True
            assert isinstance(first, BaseException)
            raise first
        return stream

    async def generate(
        self, prompt: str | list[int], params: Any, request_id: str, priority: int = 0
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs (deltas) until it finishes. Cancelling or closing the iterator aborts
        the request, which frees its KV blocks at once."""
        stream = await self.add_request(request_id, prompt, params, priority=priority)
        try:
            async for out in stream:
                yield out
        finally:
            stream.abort()

    async def run_in_engine(self, fn: Callable[[Any], Any]) -> Any:
        """Run fn(LLMEngine) on the engine thread between two steps (e.g. loading a LoRA adapter) and return its
        result, or raise its exception."""
        if self._thread is None or not self._thread.is_alive() or self.engine is None:
            raise EngineNotReadyError("the engine is not running")
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._inbox.put((_CALL, fn, loop, future))
        return await future

    async def sleep(self, level: int) -> dict:
        """Sleep mode: new requests are refused from now on (SleepingError), then LLMEngine.sleep runs on the
        engine thread. It refuses while requests are in flight (those admitted before this call included, as the
        engine thread applies them first); then the engine stays awake. Returns the memory it holds asleep."""
        if self.sleep_level:
            return await self.run_in_engine(lambda engine: engine.sleep(level))  # the engine's own refusal
        self.sleep_level = level
        try:
            return await self._sleep_mode_call(lambda engine: (engine.sleep(level), engine.memory_bytes())[1])
        except BaseException:
            self.sleep_level = 0
            raise

    async def wake_up(self) -> dict:
        """Weights back, a fresh KV cache; requests are admitted again. Returns the memory it holds awake."""
        memory = await self._sleep_mode_call(lambda engine: (engine.wake_up(), engine.memory_bytes())[1])
        self.sleep_level = 0
        return memory

    async def _sleep_mode_call(self, fn: Callable[[Any], Any]) -> Any:
        self._sleep_call = True
        try:
            return await self.run_in_engine(fn)
        finally:
            self._sleep_call = False
            self.heartbeat = time.monotonic()

    async def memory_bytes(self) -> dict:
        return await self.run_in_engine(lambda engine: engine.memory_bytes())

    async def compile_grammar(self, spec: Any) -> Any:
        """Compile a StructuredOutputsParams (cached) on a worker thread, so neither the event loop nor the engine
        loop waits for a slow schema. Raises structured_outputs.GrammarError for an invalid one."""
        from shoal.engine.core.structured_outputs import GrammarError

        compiler = getattr(self.engine, "grammar_compiler", None)
        if compiler is None:
            raise GrammarError("this engine does not support structured outputs")
        return await asyncio.to_thread(compiler.compile, spec)

    def abort(self, request_ids: str | Iterable[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        live = [i for i in ids if i in self._requests]
        if live:
            self._inbox.put((_ABORT, live))

    def abort_all(self) -> None:
        self.abort(list(self._requests))

    # ---------------------------------------------------------------- engine thread
    def _build_engine(self) -> Any:
        if self._factory is not None:
            return self._factory(self.config)
        from shoal.engine.core.engine import LLMEngine

        return LLMEngine(self.config)

    def _finish_load(self) -> None:
        """Loaded or failed: the event set, and every wait_loaded woken on its own loop."""
        with self._load_waiters_lock:
            self._load_done.set()
            waiters, self._load_waiters = self._load_waiters, []
        for loop, done in waiters:
            try:
                loop.call_soon_threadsafe(_resolve, done)
            except RuntimeError:  # that loop is closed: nobody waits there any more
                pass

    def _run(self) -> None:
        try:
            self.engine = self._build_engine()
            self.max_model_len = getattr(self.engine, "max_model_len", None)
            self.model_name = getattr(self.engine, "model_name", None) or self.config.model_name
            self.tokenizer = _private_copy(getattr(self.engine, "tokenizer", None))
            self.images = getattr(self.engine, "images", None)  # its processor: used off the loop, read-only
            if self.config.chat_template is not None:
                from shoal.engine.core.tokenizer import load_chat_template

                self.chat_template = load_chat_template(self.config.chat_template)
            self._refresh_stats()
            self.heartbeat = time.monotonic()
            self._loaded.set()
        except BaseException as e:  # noqa: BLE001 - a failed load is fatal and reported, not raised here
            logger.error("engine failed to load: %s", e, exc_info=logger.isEnabledFor(logging.DEBUG))
            self.fatal_error = e
            self._finish_load()
            return
        self._finish_load()
        logger.info("engine loop started (model %s, max_model_len %s)", self.model_name, self.max_model_len)
        try:
            self._loop()
        except BaseException as e:  # noqa: BLE001
            self.fatal_error = e
            logger.error("engine loop died: %s\n%s", e, traceback.format_exc())
            self._fail_all(EngineDeadError(f"engine loop died: {e}"))
        finally:
            if self.fatal_error is None:
                self._fail_all(EngineDeadError("the engine was shut down"))
            try:
                self.engine.shutdown()
            except Exception as e:  # noqa: BLE001
                logger.warning("engine shutdown failed: %s", e)

    def _loop(self) -> None:
        engine = self.engine
        while not self._stop.is_set():
            self.heartbeat = time.monotonic()
            engine.check_health()  # a failed rank ends the loop even while idle (then /livez fails)
            busy = engine.has_unfinished_requests()
            items = self._take_inbox(block=not busy)
            if self._stop.is_set():
                break
            if items:
                self._apply(items)
            if engine.has_unfinished_requests():
                outputs = engine.step()
                self._refresh_stats()  # before the outputs: a client that saw its response sees its stats too
                if outputs:
                    self._dispatch(outputs)
            elif not items:
                if self._offload_backlog():
                    self._refresh_stats()  # copies drain off the step: the offload gauges must not freeze while idle
                if getattr(engine, "tiers", None) is not None:
                    engine.publish_kv_events()  # ... nor the tiers' KV events, which the copy thread logs

    def _offload_backlog(self) -> bool:
        stats = self.snapshot.stats
        tiers = getattr(stats, "kv_offload_tiers", None) or {}
        return any(t.get("pending") for t in tiers.values())

    def _take_inbox(self, block: bool) -> list:
        items = []
        try:
            if block:
                items.append(self._inbox.get(timeout=_IDLE_WAIT))
            while True:
                items.append(self._inbox.get_nowait())
        except queue.Empty:
            pass
        return [i for i in items if i is not None]

    def _apply(self, items: list) -> None:
        engine = self.engine
        accepted: list[tuple[_Request, Any]] = []
        num_adds = 0
        for item in items:
            if item[0] == _ADD:
                _, req, prompt, params, priority, arrival, lora, images = item
                num_adds += 1
                try:
                    engine.add_request(req.request_id, prompt, params, arrival_time=arrival, priority=priority,
                                       lora_request=lora, images=images)
                    accepted.append((req, _ACCEPTED))
                except (ValueError, TypeError, OverflowError) as e:  # bad input: the caller's 400
                    accepted.append((req, e if isinstance(e, ValueError) else ValueError(str(e))))
                except Exception as e:  # noqa: BLE001 - fails this request only, never the loop
                    logger.exception("add_request failed for %s", req.request_id)
                    accepted.append((req, RequestFailedError(f"the engine could not accept the request: {e}")))
            elif item[0] == _CALL:  # run_in_engine: fn(engine) between steps, its result to the caller
                _, fn, loop, future = item
                try:
                    result, error = fn(engine), None
                except Exception as e:  # noqa: BLE001 - the caller's error, never the loop's
                    result, error = None, e
                self._refresh_stats()  # what the caller changed shows in the snapshot before it hears back
                loop.call_soon_threadsafe(_settle, future, result, error)
            elif item[0] == _ABORT:
                ids = [i for i in item[1] if i in self._requests]
                if ids:
                    engine.abort_request(ids)
                    self._finish_aborted(ids)
        self._refresh_stats()
        with self._lock:
            self._pending_adds -= num_adds
        if accepted:
            self._post(accepted)

    def _finish_aborted(self, ids: list[str]) -> None:
        now = time.time()
        done = []
        for rid in ids:
            req = self._requests.pop(rid, None)
            if req is None or req.finished:
                continue
            req.finished = True
            out = RequestOutput(request_id=rid, prompt=None, prompt_token_ids=[], outputs=[], finished=True,
                                metrics=RequestMetrics(arrival_time=req.arrival))
            try:
                self.metrics.on_finished(out, now)
            except Exception:  # noqa: BLE001
                logger.exception("metrics failed")
            done.append((req, _FINISHED))
        if done:
            self._post(done)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        now = time.time()
        batch = []
        for out in outputs:
            req = self._requests.get(out.request_id)
            if req is None or req.finished:
                continue
            new_tokens = sum(len(c.token_ids) for c in out.outputs)
            m = out.metrics
            try:
                if new_tokens and m is not None:
                    if m.num_generation_tokens == new_tokens:  # the request's first tokens
                        self.metrics.on_first_token(m.first_token_time - m.arrival_time)
                    elif m.inter_token_latency is not None:
                        self.metrics.on_inter_token(m.inter_token_latency, new_tokens)
                if out.finished:
                    self.metrics.on_finished(out, now)
            except Exception:  # noqa: BLE001 - metrics must never kill the loop
                logger.exception("metrics failed")
            batch.append((req, out))
            if out.finished:
                req.finished = True
                self._requests.pop(out.request_id, None)
        if batch:
            self._post(batch)

    def _post(self, batch: list[tuple[_Request, Any]]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for req, item in batch:
            by_loop.setdefault(req.loop, []).append((req.queue, item))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                pass

    def _fail_all(self, error: BaseException) -> None:
        reqs = list(self._requests.values())
        self._requests.clear()
        if reqs:
            self._post([(r, error) for r in reqs])

    def _refresh_stats(self) -> None:
        try:
            self.snapshot = StatsSnapshot(self.engine.get_stats(), time.time())
        except Exception:  # noqa: BLE001
            logger.debug("get_stats failed", exc_info=True)


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def _deliver(items: list) -> None:
    for q, item in items:
        q.put_nowait(item)


def _resolve(done: asyncio.Future) -> None:
    if not done.done():  # (a waiter that timed out or was cancelled has its answer already)
        done.set_result(None)


def _private_copy(tokenizer: Any) -> Any:
    """A copy of the tokenizer for the event-loop thread (fast tokenizers are not safe to share across threads)."""
    if tokenizer is None:
        return None
    import copy

    try:
        return copy.deepcopy(tokenizer)
    except Exception:  # noqa: BLE001
        return tokenizer
