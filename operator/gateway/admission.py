"""Which waiting request goes next when a pool's engines are full: by priority, then fairly across tenants.

A request waits in the gateway only when its pool (the engines of one InferenceService) has no free slot
(pool.py: `--max-inflight-per-engine`), or no engine at all (scale from zero). Waiting requests are ordered:

* strict priority between levels: a higher `priority` always goes first (the inference extension's
  InferenceObjective meaning: higher is more important, 0 by default, negative below it);
* within a level, start-time fair queuing (Goyal, Vin and Cheng, SIGCOMM 1996) across tenants. Each request gets
  a start tag max(V, its tenant's last finish tag) and a finish tag start + cost, where V is the start tag of the
  request dispatched last and cost estimates the request's work (its body's characters / 4 + max_tokens). The
  smallest start tag goes first. A tenant that floods the queue pushes only its own tags forward: another
  tenant's next request starts at V, so it is dispatched as soon as a slot frees, whatever the flood's length —
  and a tenant that was idle gets no credit to burst with. Idle capacity is never withheld (work conserving):
  with one tenant waiting, it gets every slot.

Shedding under saturation takes the newest request of the lowest level below the newcomer's (`victim`), so the
lowest priority goes first and, within it, the requests that waited least.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

# Costs: a request's work in tokens, roughly. Without max_tokens an answer may run to the context's end; count a
# typical one rather than the worst case so such requests are not starved behind bounded ones.
CHARS_PER_TOKEN = 4
DEFAULT_MAX_TOKENS = 256
MAX_COUNTED_TOKENS = 8192


def request_cost(body_bytes: int, parsed: Any) -> float:
    """The work a completion request asks for, in tokens: its prompt (body characters / 4) and its answer."""
    answer = DEFAULT_MAX_TOKENS
    if isinstance(parsed, dict):
        for key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):  # the last: Responses
            value = parsed.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                answer = value
                break
    return 1.0 + body_bytes / CHARS_PER_TOKEN + min(answer, MAX_COUNTED_TOKENS)


class Shed(Exception):
    """The request was refused to make room (or found none): 429 + Retry-After."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason  # shed | queue_full | queue_timeout


@dataclass(eq=False)
class Ticket:
    """One request's place in admission: what decides its order, and where it ends up."""

    priority: int = 0
    tenant: str = ""
    cost: float = 1.0
    model: str | None = None  # what the router needs to pick the engine at admission time
    hashes: list[bytes] = field(default_factory=list)
    tokens: list[int] | None = None  # the prompt's token ids (precise-prefix routing), None when unknown
    revision: str | None = None  # stable | canary: the engines it may go to (gateway/canary.py); None: any
    # the one engine it may go to: the one storing the response it continues or reads (Backend.instance)
    instance: str | None = None
    arrived: float = field(default_factory=time.monotonic)
    start: float = 0.0  # start-time fair queuing tags
    finish: float = 0.0
    seq: int = 0
    queued: bool = False
    future: asyncio.Future | None = None  # resolved with the engine picked for it, or an exception
    # How far its tenant was above its fair share of the engine when it was sent there: (the tenant's requests
    # there) x (tenants there, itself included) - (all requests there). 0 at the share, negative below it.
    share: int = 0
    pick: Any = None  # the router's latest decision for it (routing.Pick): what its trace names

    def grant(self, result: Any) -> None:
        if self.future is not None and not self.future.done():
            self.future.set_result(result)

    def refuse(self, error: BaseException) -> None:
        if self.future is not None and not self.future.done():
            self.future.set_exception(error)


class _Level:
    """The waiting requests of one priority: a heap by start tag, and the same tickets in arrival order."""

    def __init__(self):
        self.heap: list[tuple[float, int, Ticket]] = []
        self.live: dict[Ticket, None] = {}  # insertion-ordered: the newest is the last
        self.virtual = 0.0  # V: the start tag of the request dispatched last
        self.finish: dict[str, float] = {}  # tenant -> the finish tag of its last request

    def tag(self, t: Ticket) -> None:
        t.start = max(self.virtual, self.finish.get(t.tenant, 0.0))
        t.finish = t.start + t.cost
        self.finish[t.tenant] = t.finish

    def push(self, t: Ticket) -> None:
        self.tag(t)
        heapq.heappush(self.heap, (t.start, t.seq, t))
        self.live[t] = None

    def peek(self) -> Ticket | None:
        while self.heap and self.heap[0][2] not in self.live:
            heapq.heappop(self.heap)  # removed earlier (shed, timed out, client gone): dropped lazily
        return self.heap[0][2] if self.heap else None

    def pop(self) -> Ticket | None:
        t = self.peek()
        if t is not None:
            heapq.heappop(self.heap)
            del self.live[t]
            self.virtual = t.start
            if len(self.finish) > 1024:  # tenants whose tags V has passed are as if new: forget them
                self.finish = {k: v for k, v in self.finish.items() if v > self.virtual}
        return t

    def remove(self, t: Ticket) -> None:
        if self.live.pop(t, ...) is not ...:
            if self.finish.get(t.tenant) == t.finish:
                self.finish[t.tenant] = t.start  # give back the reservation of a request that never ran
            if not self.live:
                self.heap.clear()


class FairQueue:
    """Waiting requests of one pool: `pop` the next to dispatch, `remove` one that left, `victim` to shed."""

    def __init__(self):
        self._levels: dict[int, _Level] = {}
        self._order: list[int] = []  # priorities with a level, highest first
        self._seq = itertools.count()
        self._size = 0
        self.tenants: dict[str, int] = {}  # waiting requests per tenant (its share of the waiting room)

    def __len__(self) -> int:
        return self._size

    def by_priority(self) -> dict[int, int]:
        return {p: len(level.live) for p, level in self._levels.items() if level.live}

    def _level(self, priority: int) -> _Level:
        level = self._levels.get(priority)
        if level is None:
            level = self._levels[priority] = _Level()
            self._order = sorted(self._levels, reverse=True)
        return level

    def push(self, t: Ticket) -> None:
        level = self._level(t.priority)
        t.seq = next(self._seq)
        t.queued = True
        level.push(t)
        self._size += 1
        self.tenants[t.tenant] = self.tenants.get(t.tenant, 0) + 1

    def charge(self, t: Ticket) -> None:
        """Account a request dispatched without waiting (a slot was free): its work counts toward its tenant's
        share as if it had queued, so a tenant that took the free slots first waits behind the others later."""
        level = self._level(t.priority)
        level.tag(t)
        level.virtual = t.start

    def peek(self) -> Ticket | None:
        for p in self._order:
            t = self._levels[p].peek()
            if t is not None:
                return t
        return None

    def pop(self) -> Ticket | None:
        for p in self._order:
            t = self._levels[p].pop()
            if t is not None:
                t.queued = False
                self._size -= 1
                self._left(t)
                return t
        return None

    def _left(self, t: Ticket) -> None:
        left = self.tenants.get(t.tenant, 1) - 1
        if left > 0:
            self.tenants[t.tenant] = left
        else:
            self.tenants.pop(t.tenant, None)

    def remove(self, t: Ticket) -> None:
        if t.queued:
            t.queued = False
            self._levels[t.priority].remove(t)
            self._size -= 1
            self._left(t)

    def victim(self, below: int) -> Ticket | None:
        """The newest waiting request of the lowest priority lower than `below`, if any."""
        for p in reversed(self._order):
            if p >= below:
                return None
            live = self._levels[p].live
            if live:
                return next(reversed(live))
        return None
