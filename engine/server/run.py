"""Run the HTTP server around an AsyncEngine: bind first, load the model on the engine thread, drain on SIGTERM.

Order of events:
  1. the socket is bound at once, so /startupz, /livez and /metrics answer while the model loads (startup 503);
  2. the engine thread builds LLMEngine; a load failure is logged and the process exits 1; a signal while it
     loads exits 0 at once (the CLI's own handler covers the imports before this);
  3. SIGTERM (or SIGINT): readiness fails immediately, new requests get 503 + Retry-After, in-flight requests run
     to completion for up to `shutdown_timeout` seconds, then the process exits 0. A second signal, or the
     timeout, aborts whatever is left (streams end with finish_reason "abort") and exits promptly.
  4. If the engine loop dies (an exception in a step, e.g. a lost tensor-parallel rank), in-flight requests get
     an error, /livez fails at once, and after `fatal_exit_grace` seconds (so probes and clients see it) the
     process exits 1, like vLLM's server does when its engine dies.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass

from aiohttp import web

from shoal.engine import startup
from shoal.engine.core.async_engine import DEFAULT_HEARTBEAT_TIMEOUT, ENGINE_THREAD, AsyncEngine
from shoal.engine.config import EngineConfig
from shoal.engine.server.app import AccessLogger, build_app
from shoal.engine.server.common import STATE_KEY
from shoal.engine.server.metrics import ServerMetrics
from shoal.engine.server.response_store import ResponseStore
from shoal.engine.server.tracing import RequestTracer, tracing_configured

logger = logging.getLogger("shoal.engine.server")


@dataclass
class ServerOptions:
    host: str | None = "0.0.0.0"
    port: int = 8000
    api_key: str | None = None
    shutdown_timeout: float = 30.0
    access_log: bool = True
    heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT
    fatal_exit_grace: float = 2.0
    tool_call_parser: str | None = None  # set: tool_choice "auto" is enabled with this parser
    response_store_size: int = 1000  # stored Responses API responses (previous_response_id), oldest dropped first
    response_store_ttl: float = 3600.0  # seconds a stored response lives
    otlp_traces_endpoint: str | None = None  # tracing on (also by the OTEL_* variables: see tracing.py)


async def serve(config: EngineConfig, opts: ServerOptions, *, engine_factory=None) -> int:
    """Serve until a signal; returns the process exit code."""
    loop = asyncio.get_running_loop()
    metrics = ServerMetrics(config.model_name, config.tensor_parallel_size, config.pipeline_parallel_size)
    engine = AsyncEngine(config, engine_factory=engine_factory, heartbeat_timeout=opts.heartbeat_timeout,
                         metrics=metrics)
    metrics.attach(engine)
    tracer = None
    if tracing_configured(opts.otlp_traces_endpoint):
        try:
            tracer = RequestTracer(endpoint=opts.otlp_traces_endpoint)
        except RuntimeError as e:
            logger.error("%s", e)
            return 1
    app = build_app(engine, metrics, api_key=opts.api_key, tool_call_parser=opts.tool_call_parser,
                    response_store=ResponseStore(opts.response_store_size, opts.response_store_ttl), tracer=tracer)
    state = app[STATE_KEY]
    runner_kw = {"access_log_class": AccessLogger} if opts.access_log else {"access_log": None}
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=2.0, **runner_kw)
    await runner.setup()
    host = opts.host or "0.0.0.0"  # for display; no --host binds every interface (IPv4 and IPv6)
    try:
        site = web.TCPSite(runner, opts.host or None, opts.port, reuse_address=True)
        await site.start()
    except OSError as e:
        logger.error("cannot listen on %s:%s: %s", host, opts.port, e)
        await runner.cleanup()
        return 1
    port = opts.port
    try:
        port = site._server.sockets[0].getsockname()[1]  # the real port when --port 0
    except Exception:  # noqa: BLE001
        pass
    logger.info("listening on http://%s:%d (model %s loading)", host, port, config.model_name)

    signals = asyncio.Queue()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, signals.put_nowait, sig)
        except (NotImplementedError, RuntimeError):  # not the main thread / not POSIX
            pass

    engine.start()
    load = asyncio.create_task(engine.wait_loaded())
    first_signal = asyncio.create_task(signals.get())
    done, _ = await asyncio.wait({load, first_signal}, return_when=asyncio.FIRST_COMPLETED)
    code = 0
    if load in done:
        if load.exception() is not None:
            logger.error("%s", load.exception())
            first_signal.cancel()
            _remove_signal_handlers(loop)
            await runner.cleanup()
            return 1
        startup.ready()
        logger.info("ready: serving %s at http://%s:%d (max_model_len %s)", engine.model_name, host, port,
                    engine.max_model_len)
        logger.info("start-up: %s", startup.summary())
        death = asyncio.create_task(_engine_death(engine))
        done, _ = await asyncio.wait({first_signal, death}, return_when=asyncio.FIRST_COMPLETED)
        if first_signal in done:
            death.cancel()
            sig = first_signal.result()
            logger.info("received %s: draining (up to %.0fs); readiness now fails", signal.Signals(sig).name,
                        opts.shutdown_timeout)
            engine.start_draining()
            code = await _drain(engine, state, signals, opts.shutdown_timeout)
        else:
            first_signal.cancel()
            logger.error("engine loop died (%s): /livez fails; exiting with code 1 in %.1fs", engine.fatal_error,
                         opts.fatal_exit_grace)
            engine.start_draining()
            await asyncio.sleep(opts.fatal_exit_grace)
        if engine.fatal_error is not None:
            code = 1
    else:
        load.cancel()
        engine.start_draining()
        logger.info("received %s while the model was loading: exiting without serving",
                    signal.Signals(first_signal.result()).name)
    _remove_signal_handlers(loop)
    await runner.cleanup()
    await asyncio.to_thread(engine.shutdown, 5.0 if engine.is_loaded else 0.0)
    if tracer is not None:
        await asyncio.to_thread(tracer.shutdown)
    logger.info("shut down")
    return code


def _remove_signal_handlers(loop: asyncio.AbstractEventLoop) -> None:
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.remove_signal_handler(sig)
        except (NotImplementedError, RuntimeError, ValueError):
            pass


async def _engine_death(engine: AsyncEngine, poll: float = 0.1) -> None:
    while engine.fatal_error is None:
        await asyncio.sleep(poll)


async def _drain(engine: AsyncEngine, state, signals: asyncio.Queue, timeout: float) -> int:
    deadline = time.monotonic() + timeout

    async def idle():
        while engine.num_in_flight() or state.active_handlers:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.05)
        return True

    waiter = asyncio.create_task(idle())
    second = asyncio.create_task(signals.get())
    done, _ = await asyncio.wait({waiter, second}, return_when=asyncio.FIRST_COMPLETED)
    if waiter in done and waiter.result():
        second.cancel()
        logger.info("drained: all in-flight requests finished")
        return 0
    waiter.cancel()
    second.cancel()
    why = "second signal" if second in done and not second.cancelled() else "shutdown timeout"
    logger.warning("%s: aborting %d in-flight request(s)", why, engine.num_in_flight())
    engine.abort_all()
    # Let the handlers write their final "abort" chunks.
    end = time.monotonic() + 1.0
    while state.active_handlers and time.monotonic() < end:
        await asyncio.sleep(0.02)
    return 0


def run(config: EngineConfig, opts: ServerOptions, *, engine_factory=None) -> int:
    code = asyncio.run(serve(config, opts, engine_factory=engine_factory))
    if any(t.name == ENGINE_THREAD and t.is_alive() for t in threading.enumerate()):
        # Stopped mid-load: a model load cannot be interrupted, and finalizing the interpreter under it aborts
        # the process (C++ code in a daemon thread), so leave without finalizing; nothing is left to flush but
        # the worker ranks the load may have started.
        from shoal.engine.distributed.spawn import kill_spawned_workers

        kill_spawned_workers()
        logging.shutdown()
        os._exit(code)
    return code
