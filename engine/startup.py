"""The engine's start-up breakdown: where the seconds from process start to serving go.

Phases (the names are the `phase` label of shoal:startup_seconds, and the keys of /startupz's `startup`):
  process       the interpreter's own start, until shoal-engine's main runs
  imports       flags parsed; torch and the server's modules imported
  config        the model folder resolved and its config read (transformers' config machinery imported)
  tokenizer     the tokenizer loaded
  weights       building the model and loading its weights (model_loader.load_model)
  kernel_build  compiling or loading the JIT-built CPU kernels (native_build; a cached build only loads)
  kv_cache      allocating the KV cache
  warmup        the warm-up forwards before a decode graph is recorded (lazy: the first steps of each batch size)
  graph_capture recording decode graphs (lazy, as warm-up)
  other         the rest of the time to ready (device and CPU-tier checks, the server's set-up, the engine thread)
  total         process start to ready (model loaded), fixed then
Seconds add up per phase in this process (rank 0; other ranks load their own shards at the same time).
"""

from __future__ import annotations

import contextlib
import gc
import os
import threading
import time
from typing import Iterator

PHASES = ("process", "imports", "config", "tokenizer", "weights", "kernel_build", "kv_cache", "warmup",
          "graph_capture")

_lock = threading.Lock()
_seconds: dict[str, float] = {}
_ready_age: float | None = None  # the process's age when ready() ran
_main_t0: float | None = None
_at_ready = 0.0  # the phases' sum when ready() ran (lazy phases after it are not part of `total`)
_gc_held = False


def process_age() -> float | None:
    """Seconds since this process started, from /proc (None where there is no /proc). Both ends are on the boot
    clock: /proc/stat's btime is whole seconds, so a Unix start time built from it is off by up to a second."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, after the command name
        return time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def add(phase: str, seconds: float) -> None:
    with _lock:
        _seconds[phase] = _seconds.get(phase, 0.0) + max(0.0, seconds)


def seconds(phase: str) -> float:
    with _lock:
        return _seconds.get(phase, 0.0)


@contextlib.contextmanager
def timed(phase: str) -> Iterator[None]:
    t0 = time.perf_counter()
    try:
        yield
    finally:
        add(phase, time.perf_counter() - t0)


def main_started() -> None:
    """Called first thing in main: the time before it is the interpreter's start."""
    global _main_t0
    _main_t0 = time.perf_counter()
    age = process_age()
    if age is not None and "process" not in _seconds:
        add("process", age)


def imports_done() -> None:
    """Called once the server's modules are imported: main's time so far (flags parsed, modules imported)."""
    if _main_t0 is not None and "imports" not in _seconds:
        add("imports", time.perf_counter() - _main_t0)


def hold_gc() -> None:
    """No cyclic garbage collection until ready() (or release_gc()): importing torch and transformers and building
    the model make ~500k long-lived objects, and every collection their allocations trigger walks them again
    (~15 % of the imports' CPU time, measured)."""
    global _gc_held
    if gc.isenabled():
        gc.disable()
        _gc_held = True


def release_gc() -> None:
    """What the start made is frozen, then collection resumes: a collection never walks those objects again (one
    full one took 0.28 s with the SmolLM2 GGUF loaded: a stall while serving). The few thousand objects the start
    left unreachable stay with them, which is cheaper than collecting them on the way to ready."""
    global _gc_held
    if _gc_held:
        gc.freeze()
        gc.enable()
        _gc_held = False


def ready() -> None:
    """The model is loaded: `total` and `other` are fixed now (the first call counts), and garbage collection held
    since the start resumes."""
    global _ready_age, _at_ready
    release_gc()
    if _ready_age is None:
        with _lock:
            _at_ready = sum(_seconds.values())
        _ready_age = process_age()


def breakdown() -> dict[str, float]:
    """{phase: seconds} for the phases seen so far, in PHASES order, and `total` once ready."""
    with _lock:
        out = {p: round(_seconds[p], 3) for p in PHASES if p in _seconds}
    if _ready_age is not None:
        total = _ready_age
        out["other"] = round(max(0.0, total - _at_ready), 3)
        out["total"] = round(total, 3)
    return out


def summary() -> str:
    return ", ".join(f"{phase} {seconds:.2f}s" for phase, seconds in breakdown().items())
