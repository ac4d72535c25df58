"""CPU decode graphs: a decode step's forward, recorded once as the dispatcher ops it runs, replayed without Python.

On CPU a decode step at small batch spends a sixth to a quarter of its time issuing ops from Python — module
calls, argument checks, ~25 ops per decoder layer, each crossing from Python into the dispatcher (measured on
SmolLM2-135M at batch 1: 4-5 ms of a 28-47 ms step, one thread). CUDA graphs remove that on GPUs; here a
TorchDispatchMode records every op the forward dispatches (aten ops, the engine's C++ kernels, oneDNN's) with its
arguments, and the trace becomes a straight-line TorchScript function that TorchScript's C++ interpreter runs:
the same kernels on the same tensors, in the same order, so the result is bit for bit the eager one.

Like a CUDA graph, the trace is only valid for inputs in the same static buffers (graph_capture.DecodeGraphs fills
them) and with the same shapes, and it bakes every host-side decision the Python made while recording. Recording
therefore fails (and the step stays eager) on anything that lets tensor values reach Python: an op that returns a
number or a bool (`.item()`, comparisons read on the host) or a tensor made from Python data (`torch.tensor`).
Views of tensors that outlive the step (weights, the KV cache, the static input buffers) are taken once at capture
and passed in as constants; every other op runs on each replay.
"""

from __future__ import annotations

import math

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# Ops that let a tensor's values decide what Python does next, or bring Python data in as a tensor.
_HOST_OPS = {"aten::_local_scalar_dense", "aten::lift_fresh", "aten::lift_fresh_copy", "aten::is_nonzero",
             "aten::equal", "aten::allclose"}


class CaptureError(RuntimeError):
    """The forward cannot be replayed from a trace (the message says which op let values reach the host)."""


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        if name in _HOST_OPS:
            raise CaptureError(f"{name} reads tensor values on the host")
        out = func(*args, **kwargs)
        outs = out if isinstance(out, (list, tuple)) else (out,)
        if not all(o is None or isinstance(o, torch.Tensor) for o in outs):
            raise CaptureError(f"{name} returns {type(out).__name__}, a value the host reads")
        self.calls.append((func, args, kwargs, out))
        return out


class CpuGraph:
    """One recorded forward: replay() runs it again on the same static inputs and returns its output tensor."""

    def __init__(self, source: str, constants: list[torch.Tensor], num_ops: int):
        self.source = source  # the generated TorchScript, for debugging
        self.constants = constants
        self.num_ops = num_ops
        self._step = torch.jit.CompilationUnit(source).step

    def replay(self) -> torch.Tensor:
        return self._step(self.constants)


def capture(forward) -> CpuGraph:
    """Record forward() (no arguments; it reads the static buffers and returns one tensor) and compile its trace.
    Raises CaptureError when it cannot be replayed from a trace."""
    recorder = _Recorder()
    with torch.inference_mode(), recorder:
        result = forward()
    if not isinstance(result, torch.Tensor):
        raise CaptureError(f"the forward returned {type(result).__name__}, not a tensor")
    return _compile(recorder.calls, result)


def _compile(calls, result: torch.Tensor) -> CpuGraph:
    names: dict[int, str] = {}  # id(tensor) -> its name in the program: c[i] (a constant) or v<n> (computed)
    constants: list[torch.Tensor] = []  # (`calls` holds every recorded tensor, so no id() is reused meanwhile)

    def constant(t: torch.Tensor) -> str:
        constants.append(t)
        names[id(t)] = f"c[{len(constants) - 1}]"
        return names[id(t)]

    def ref(t: torch.Tensor) -> str:
        return names.get(id(t)) or constant(t)  # a tensor no recorded op made: it outlives the step

    def literal(a) -> str:
        if isinstance(a, torch.Tensor):
            return ref(a)
        if a is None or isinstance(a, (bool, str)):
            return repr(a)
        if isinstance(a, int):
            return str(a)
        if isinstance(a, float):
            return repr(a) if math.isfinite(a) else f'float("{a}")'
        if isinstance(a, (torch.dtype, torch.layout, torch.memory_format)):
            return str(a)
        if isinstance(a, torch.device):
            return f'torch.device("{a}")'
        if isinstance(a, (list, tuple)):
            return "[" + ", ".join(literal(x) for x in a) + "]"
        raise CaptureError(f"cannot replay an argument of type {type(a).__name__}")

    lines = []
    for i, (func, args, kwargs, out) in enumerate(calls):
        tensors = [a for a in _flat(args) + _flat(list(kwargs.values())) if isinstance(a, torch.Tensor)]
        if _is_view(func) and tensors and all(names.get(id(t), "c[").startswith("c[") for t in tensors):
            constant(out)  # a view of tensors that outlive the step: take it once, here
            continue
        if func._schema.name in ("aten::detach", "aten::alias"):  # the same tensor as far as inference goes
            names[id(out)] = ref(args[0])
            continue
        ns, op = func._schema.name.split("::")
        call = f"torch.ops.{ns}.{op}(" + ", ".join(
            [literal(a) for a in args] + [f"{k}={literal(v)}" for k, v in kwargs.items()]) + ")"
        outs = out if isinstance(out, (list, tuple)) else [out]
        targets = []
        for j, o in enumerate(outs):
            if isinstance(o, torch.Tensor) and id(o) in names:  # an in-place op hands back its argument
                name = names[id(o)]
                targets.append(f"_{i}_{j}" if name.startswith("c[") else name)
            elif isinstance(o, torch.Tensor):
                names[id(o)] = f"v{i}_{j}"
                targets.append(names[id(o)])
            else:
                targets.append(f"_{i}_{j}")
        if out is None:
            lines.append(f"    {call}")
        else:
            lines.append(f"    {', '.join(targets)} = {call}")
    source = "def step(c: List[torch.Tensor]) -> torch.Tensor:\n" + "\n".join(lines) + f"\n    return {ref(result)}\n"
    return CpuGraph(source, constants, len(lines))


def _flat(values) -> list:
    out = []
    for v in values:
        out.extend(_flat(v) if isinstance(v, (list, tuple)) else [v])
    return out


def _is_view(func) -> bool:
    return bool(getattr(func, "is_view", False)) or func._schema.name in ("aten::detach", "aten::alias")
