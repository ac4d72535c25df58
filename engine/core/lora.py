"""LoRA adapters on the engine side: which adapters exist (registered by name), which are loaded on every rank
(resident, at most --max-cpu-loras, least recently used evicted), and which device slot each of a step's adapters
runs in (--max-loras).

vLLM's meanings: an adapter is registered by --lora-modules or /v1/load_lora_adapter (validated and loaded then);
a request names it as `model`; a registered adapter that was evicted is loaded again when a request needs it.
An adapter with unfinished requests is never evicted, and unloading it only unregisters its name (new requests
get 404): its weights stay until its last request finishes, so nothing in flight is lost.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

from shoal.engine.execution.lora import LoRAError, inspect_adapter

logger = logging.getLogger(__name__)


class LoRANotFoundError(LoRAError):
    """No adapter of that name is registered (404)."""


class LoRACapacityError(LoRAError):
    """Every resident adapter is in use, so no other one can be loaded now (429: retry later)."""


@dataclass(eq=False)
class LoRARequest:
    name: str
    id: int  # unique for the engine's lifetime: a name loaded again gets a new id (and a new prefix-cache root)
    path: str
    rank: int
    created: int = field(default_factory=lambda: int(time.time()))


class LoRARegistry:
    def __init__(self, executor, hf_config, max_loras: int, max_rank: int, max_cpu_loras: int, base_name: str):
        self.executor, self.hf_config = executor, hf_config
        self.max_loras, self.max_rank, self.max_cpu_loras = max_loras, max_rank, max_cpu_loras
        self.base_name = base_name
        self.registered: dict[str, LoRARequest] = {}
        self.resident: OrderedDict[int, LoRARequest] = OrderedDict()  # least recently used first
        self.users: Counter[int] = Counter()  # unfinished requests per adapter id
        self.slot_ids: list[int | None] = [None] * max_loras
        self.load_seconds: list[float] = []
        self._ids = itertools.count(1)

    # -- names
    def register(self, name: str, path: str) -> LoRARequest:
        """Validate and load an adapter under `name` (LoRAError: a clear reason, nothing changed)."""
        if not name:
            raise LoRAError("lora_name must not be empty")
        if name == self.base_name:
            raise LoRAError(f"{name!r} is the base model's name")
        if name in self.registered:
            raise LoRAError(f"The lora adapter '{name}' has already been loaded.")
        info = inspect_adapter(path, self.hf_config, self.max_rank)
        lora = LoRARequest(name, next(self._ids), path, info.rank)
        self._make_resident(lora)
        self.registered[name] = lora
        logger.info("LoRA adapter %s loaded from %s (rank %d, %s)", name, path, info.rank, ", ".join(info.targets))
        return lora

    def unregister(self, name: str) -> None:
        lora = self.registered.pop(name, None)
        if lora is None:
            raise LoRANotFoundError(f"The lora adapter '{name}' cannot be found.")
        if not self.users[lora.id]:
            self._evict(lora)
        logger.info("LoRA adapter %s unloaded%s", name,
                    f" (its {self.users[lora.id]} running requests finish first)" if self.users[lora.id] else "")

    def get(self, name: str) -> LoRARequest:
        lora = self.registered.get(name)
        if lora is None:
            raise LoRANotFoundError(f"The model `{name}` does not exist.")
        return lora

    # -- requests
    def acquire(self, lora: LoRARequest) -> None:
        """A request starts under `lora`: load it if it was evicted (LoRACapacityError when nothing can make room)."""
        self._make_resident(lora)
        self.users[lora.id] += 1

    def release(self, lora: LoRARequest) -> None:
        self.users[lora.id] -= 1
        if self.users[lora.id] <= 0:
            del self.users[lora.id]
            if self.registered.get(lora.name) is not lora:  # unloaded while it ran
                self._evict(lora)

    # -- residency
    def _make_resident(self, lora: LoRARequest) -> None:
        if lora.id in self.resident:
            self.resident.move_to_end(lora.id)
            return
        while len(self.resident) >= self.max_cpu_loras:
            victim = next((v for v in self.resident.values() if not self.users[v.id]), None)
            if victim is None:
                raise LoRACapacityError(f"all {self.max_cpu_loras} loaded LoRA adapters (--max-cpu-loras) have "
                                        f"requests running; cannot load {lora.name!r} now")
            logger.info("LoRA adapter %s evicted (least recently used)", victim.name)
            self._evict(victim)
        t0 = time.perf_counter()
        self.executor.add_lora(lora.id, lora.path)
        self.load_seconds.append(time.perf_counter() - t0)
        self.resident[lora.id] = lora

    def _evict(self, lora: LoRARequest) -> None:
        if self.resident.pop(lora.id, None) is not None:
            self.executor.remove_lora(lora.id)
            self.slot_ids = [None if s == lora.id else s for s in self.slot_ids]

    # -- steps
    def assign_slots(self, adapter_ids: set[int]) -> dict[int, int]:
        """{adapter id: slot} for a step's adapters (at most max_loras: the scheduler's guarantee). Adapters keep
        their slot from step to step; a new one takes a slot no adapter of this step holds."""
        free = [s for s, held in enumerate(self.slot_ids) if held not in adapter_ids]
        out = {}
        for adapter_id in adapter_ids:
            if adapter_id in self.slot_ids:
                out[adapter_id] = self.slot_ids.index(adapter_id)
            else:
                slot = free.pop(0)
                self.slot_ids[slot] = adapter_id
                out[adapter_id] = slot
        return out

    # -- introspection
    def running_waiting(self, scheduler) -> tuple[list[str], list[str]]:
        """Names of the adapters of running and of waiting sequences (vLLM's lora_requests_info)."""
        names = {v.id: v.name for v in self.resident.values()}
        running = sorted({names[s.lora_id] for s in scheduler.running if s.lora_id in names})
        waiting = sorted({names[s.lora_id] for s in scheduler.waiting if s.lora_id in names})
        return running, waiting
