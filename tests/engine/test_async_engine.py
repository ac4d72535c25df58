"""AsyncEngine over the real LLMEngine: streaming deltas, cancellation aborts, drain, the queue cap, a wedged step
failing liveness and a fatal step error killing the loop."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from shoal.engine.config import EngineConfig
from shoal.engine.contracts import SamplingParams
from shoal.engine.core.async_engine import AsyncEngine, DrainingError, EngineDeadError, QueueFullError


@pytest.fixture
async def async_engine(llama_model):
    eng = AsyncEngine(EngineConfig(model=str(llama_model), num_kv_blocks=64, max_queue_len=2))
    eng.start()
    await eng.wait_loaded(120)
    yield eng
    eng.shutdown()


def _params(**kw):
    return SamplingParams(**{"temperature": 0.0, "max_tokens": 8, **kw})


async def test_async_engine_generates_and_cancellation_aborts(async_engine):
    eng = async_engine
    outs = [o async for o in eng.generate([5, 6, 7], _params(), "a")]
    # Deltas: every output carries only its new tokens; together they are the 8 generated.
    assert outs[-1].finished and not any(o.finished for o in outs[:-1])
    assert all(o.outputs[0].token_ids for o in outs) and sum(len(o.outputs[0].token_ids) for o in outs) == 8
    agen = eng.generate([5, 6, 7], _params(max_tokens=400, ignore_eos=True), "b")
    await agen.__anext__()
    await agen.aclose()  # GeneratorExit -> abort
    deadline = time.monotonic() + 5
    while (eng.num_in_flight() or eng.snapshot.stats.num_running) and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    assert eng.num_in_flight() == 0 and eng.snapshot.stats.num_running == 0
    assert eng.snapshot.stats.num_free_kv_blocks == eng.snapshot.stats.num_kv_blocks

    async def consume():
        async for _ in eng.generate([5, 6, 7], _params(max_tokens=400, ignore_eos=True), "c"):
            pass

    task = asyncio.create_task(consume())
    await asyncio.sleep(0.1)
    task.cancel()  # handler cancelled (client gone) -> abort
    with pytest.raises(asyncio.CancelledError):
        await task
    deadline = time.monotonic() + 5
    while eng.num_in_flight() and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    assert eng.num_in_flight() == 0
    with pytest.raises(ValueError):  # bad input comes back as ValueError (-> 400)
        await eng.add_request("d", [5] * 600, _params())


async def test_async_engine_drain_and_queue_cap(async_engine):
    eng = async_engine
    eng.max_queue_len = 1
    eng._lock.acquire()
    eng._pending_adds += 1  # one request handed over but not yet in the engine's queue
    eng._lock.release()
    assert eng.queue_full() and eng.is_ready()  # overloaded is still ready: it answers 429
    with pytest.raises(QueueFullError):
        await eng.add_request("q", [5, 6], _params())
    with eng._lock:
        eng._pending_adds -= 1
    assert eng.is_ready()
    eng.start_draining()
    assert not eng.is_ready() and eng.is_alive()
    with pytest.raises(DrainingError):
        await eng.add_request("x", [5, 6], _params())


async def test_async_engine_wedged_step_fails_liveness(async_engine):
    eng = async_engine
    real = eng.engine.step

    def slow():
        time.sleep(1.5)
        eng.engine.step = real
        return real()

    eng.heartbeat_timeout = 0.5
    eng.engine.step = slow
    stream = await eng.add_request("w", [5, 6, 7], _params(max_tokens=2))
    deadline = time.monotonic() + 3
    while eng.is_alive() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert not eng.is_alive()  # heartbeat stale while the step hangs
    outs = [o async for o in stream]
    assert outs[-1].finished
    eng.heartbeat_timeout = 5.0
    deadline = time.monotonic() + 5
    while not eng.is_alive() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert eng.is_alive()  # fresh again once the loop moves


async def test_async_engine_fatal_step_error_kills_loop(async_engine):
    eng = async_engine

    def boom():
        raise RuntimeError("CUDA error: device-side assert")

    eng.engine.step = boom
    stream = await eng.add_request("f", [5, 6, 7], _params())
    with pytest.raises(EngineDeadError, match="device-side assert"):
        async for _ in stream:
            pass
    assert not eng.is_alive() and not eng.is_ready() and isinstance(eng.fatal_error, RuntimeError)
    with pytest.raises(EngineDeadError):
        await eng.add_request("g", [5, 6, 7], _params())


async def test_offload_backlog_drains_in_the_snapshot_while_idle(llama_model):
    """Copies reach the offload tiers off the step: once the engine is idle, the snapshot (what /metrics shows)
    must follow the copy thread's backlog down to 0, not keep the value of the last step."""
    eng = AsyncEngine(EngineConfig(model=str(llama_model), block_size=4, max_model_len=64, num_kv_blocks=20,
                                   kv_offloading_size=0.01))
    eng.start()
    try:
        await eng.wait_loaded(120)
        tier = eng.engine.executor.offload.tiers[0]
        go, store = threading.Event(), tier.store
        tier.store = lambda *a: (go.wait(30), store(*a))  # the copy thread hands nothing to the tier until `go`
        for start in (5, 60):  # 40-token prompts: the second evicts the first's blocks from the 20-block pool
            async for _ in eng.generate(list(range(start, start + 40)), _params(max_tokens=2), f"p{start}"):
                pass
        assert eng.snapshot.stats.kv_offload_tiers["cpu"]["pending"] > 0
        go.set()
        deadline = time.monotonic() + 30
        while eng.snapshot.stats.kv_offload_tiers["cpu"]["pending"] and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert eng.snapshot.stats.kv_offload_tiers["cpu"]["pending"] == 0
        assert eng.snapshot.stats.kv_offload_tiers["cpu"]["blocks"] > 0
    finally:
        eng.shutdown()
