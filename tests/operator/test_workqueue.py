"""operator/workqueue.py: one pass at a time per key, coalesced adds, other keys concurrent, backoff on failure."""

from __future__ import annotations

import asyncio

from shoal.operator.workqueue import WorkQueue


async def _idle(q: WorkQueue, *keys) -> None:
    for _ in range(500):
        if not any(q.busy(k) for k in keys):
            return
        await asyncio.sleep(0.002)
    raise AssertionError("the queue did not drain")


async def test_adds_during_a_pass_coalesce_into_one_more_pass():
    passes: list[str] = []
    started, release = asyncio.Event(), asyncio.Event()

    async def work(key):
        passes.append(key)
        started.set()
        await release.wait()

    q = WorkQueue(work)
    q.add("a")
    await started.wait()
    for _ in range(5):  # five events while the first pass runs
        q.add("a")
    assert q.busy("a")
    release.set()
    await _idle(q, "a")
    assert passes == ["a", "a"]  # the running pass, then exactly one for everything that came meanwhile


async def test_keys_run_concurrently_but_one_key_never_overlaps_itself():
    running: dict[str, int] = {"a": 0, "b": 0}
    both = asyncio.Event()
    most = {"a": 0, "b": 0}

    async def work(key):
        running[key] += 1
        most[key] = max(most[key], running[key])
        if running["a"] and running["b"]:
            both.set()
        await asyncio.wait_for(both.wait(), 2)  # each pass waits until the other key's pass runs too
        running[key] -= 1

    q = WorkQueue(work)
    q.add("a")
    q.add("b")
    q.add("a")
    await _idle(q, "a", "b")
    assert both.is_set() and most == {"a": 1, "b": 1}


async def test_failures_back_off_exponentially_up_to_the_cap_and_success_resets():
    times: list[float] = []
    loop = asyncio.get_running_loop()

    async def work(key):
        times.append(loop.time())
        if len(times) <= 4:
            raise RuntimeError("conflict")

    q = WorkQueue(work, first_backoff=0.02, max_backoff=0.05)
    assert [q.backoff(n) for n in (1, 2, 3, 4)] == [0.02, 0.04, 0.05, 0.05]
    q.add("k")
    await _idle(q, "k")
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert len(times) == 5  # four failures, then the pass that succeeds; nothing after it
    assert all(gap >= want * 0.9 for gap, want in zip(gaps, [0.02, 0.04, 0.05, 0.05])), gaps


async def test_cancel_stops_the_workers():
    blocked = asyncio.Event()

    async def work(key):
        blocked.set()
        await asyncio.sleep(60)

    q = WorkQueue(work)
    q.add("k")
    await blocked.wait()
    q.cancel()
    await _idle(q, "k")
    assert not q.busy("k")
