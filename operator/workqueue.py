"""A keyed work queue: what controller-runtime's workqueue gives a Kubernetes controller, and kopf does not for
events of *other* objects (a child's event must reconcile its owner).

`add(key)` marks a key dirty and makes sure one worker task runs for it. The worker calls `work(key)` until the
key stays clean: adds that arrive while a pass runs are coalesced into one more pass, passes of one key never
overlap, different keys run concurrently. A pass that raises is retried with exponential backoff (`first_backoff`
doubling up to `max_backoff`); a pass that succeeds resets it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Hashable

logger = logging.getLogger("shoal.operator")


class WorkQueue:
    def __init__(self, work: Callable[[Hashable], Awaitable[None]], *, name: str = "work",
                 first_backoff: float = 0.2, max_backoff: float = 10.0):
        self.work = work
        self.name = name
        self.first_backoff = first_backoff
        self.max_backoff = max_backoff
        self._dirty: set[Hashable] = set()
        self._tasks: dict[Hashable, asyncio.Task] = {}

    def add(self, key: Hashable) -> None:
        self._dirty.add(key)
        task = self._tasks.get(key)
        if task is None or task.done():
            self._tasks[key] = asyncio.get_running_loop().create_task(self._worker(key), name=f"{self.name} {key}")

    def busy(self, key: Hashable) -> bool:
        """A pass for `key` is running or pending."""
        return key in self._dirty or key in self._tasks

    def cancel(self) -> None:
        for task in list(self._tasks.values()):
            task.cancel()

    def backoff(self, failures: int) -> float:
        return min(self.first_backoff * 2 ** (failures - 1), self.max_backoff)

    async def _worker(self, key: Hashable) -> None:
        failures = 0
        try:
            while key in self._dirty:
                self._dirty.discard(key)
                try:
                    await self.work(key)
                    failures = 0
                except asyncio.CancelledError:
                    raise
                except Exception as e:  # API errors, conflicts, timeouts: retry the whole pass
                    failures += 1
                    delay = self.backoff(failures)
                    level = logging.WARNING if failures > 2 else logging.INFO
                    logger.log(level, "%s %s failed (%s); retrying in %.1fs", self.name, _label(key), e, delay)
                    self._dirty.add(key)
                    await asyncio.sleep(delay)
        finally:
            if self._tasks.get(key) is asyncio.current_task():
                del self._tasks[key]


def _label(key: Hashable) -> str:
    """('ns', 'name') -> ns/name, as kubectl writes it."""
    return "/".join(map(str, key)) if isinstance(key, tuple) else str(key)
