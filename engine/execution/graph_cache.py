"""A persistent cache of captured CPU decode graphs (execution/cpu_graph.py), so a restart replays instead of recording.

Recording a bucket's forward under TorchDispatchMode costs far more than compiling the TorchScript it yields
(measured on SmolLM2-135M GGUF at batch 1: ~0.84 s of graph_capture, ~0.13 s of it the compile), and every
restart paid it on its first request's second token. A graph is its TorchScript source plus its constants, and
every constant is a view of a tensor that outlives a step — a weight, a KV cache, a static input buffer — so an
entry stores the source and, per constant, the tensor it is a view of (by name, found by storage) with the view's
dtype, size, stride and storage offset. Loading rebuilds the views on this process's tensors; nothing else
carries over. A constant whose base cannot be named is never guessed at: that graph is not cached.

Entries live in $SHOAL_CACHE/cpu-graphs/ (default ~/.cache/shoal), one JSON file per key; the key is a digest of
everything that shapes the trace (model files, dtype, quantization, KV cache, block size, max_model_len, bucket,
attention backend, LoRA, torch version, CPU tier, threads, the engine's own source). A loaded graph must still
replay the warm-up's logits bit for bit (graph_capture.DecodeGraphs checks), so a stale or tampered entry costs
one discarded load, never a wrong token. SHOAL_GRAPH_CACHE=0 turns the cache off.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

FORMAT = 1
_ENGINE_DIR = Path(__file__).resolve().parent  # engine/execution: its .py files and csrc are the trace's code


class EntryError(ValueError):
    """A cache entry that cannot be used here (unreadable, another format, or constants that do not fit)."""


def enabled() -> bool:
    return os.environ.get("SHOAL_GRAPH_CACHE", "1").strip().lower() not in ("0", "false", "no", "off")


def cache_dir() -> Path:
    from shoal.engine.tools.demo_model import cache_root

    return cache_root() / "cpu-graphs"


@functools.cache
def engine_source_digest() -> str:
    """sha256 over the engine's execution code (Python and C++ sources): a change to any may change a trace."""
    h = hashlib.sha256()
    files = sorted(p for p in _ENGINE_DIR.rglob("*")
                   if p.is_file() and p.suffix in (".py", ".cpp", ".h", ".cu") and "__pycache__" not in p.parts)
    for p in files:
        h.update(str(p.relative_to(_ENGINE_DIR)).encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def model_identity(model_dir) -> list:
    """The model's files as (resolved path, size, mtime); a GGUF file also by its metadata digest."""
    path = Path(model_dir).resolve()
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file()
                                                   and not any(part.startswith(".") for part in p.parts))
    out = []
    for p in files:
        st = p.stat()
        out.append([str(p), st.st_size, st.st_mtime_ns])
    if path.is_file() and path.suffix == ".gguf":
        from shoal.engine.execution.gguf_reader import GGUFFile

        out.append(["gguf-metadata", GGUFFile(path).metadata_digest()])
    return out


def entry_key(parts: dict) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:40]


# -- naming constants ------------------------------------------------------------------------------------------
def _walk(obj, prefix: str, out: dict, seen: set) -> None:
    """Tensors reachable from obj through attributes, lists, tuples and dicts of the engine's own objects and torch
    modules, named by their path (the first path that reaches a storage names it)."""
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        if obj.untyped_storage().nbytes() and obj.untyped_storage().data_ptr() not in out:
            out[obj.untyped_storage().data_ptr()] = (prefix, obj)
        return
    if isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _walk(v, f"{prefix}[{i}]", out, seen)
        return
    if isinstance(obj, dict):
        for k, v in obj.items():
            if isinstance(k, (str, int)):
                _walk(v, f"{prefix}[{k!r}]", out, seen)
        return
    module = type(obj).__module__ or ""
    if isinstance(obj, torch.nn.Module) or module.startswith("shoal."):
        for k, v in vars(obj).items() if hasattr(obj, "__dict__") else ():
            _walk(v, f"{prefix}.{k}", out, seen)


def named_bases(graphs) -> dict[int, tuple[str, torch.Tensor]]:
    """storage data_ptr -> (name, tensor) of every tensor that outlives a step, most specific names first."""
    runner = graphs.runner
    out: dict[int, tuple[str, torch.Tensor]] = {}
    seen: set = set()
    for name, t in list(runner.model.named_parameters()) + list(runner.model.named_buffers()):
        _walk(t, f"model:{name}", out, seen)
    _walk(list(runner.kv_caches), "kv", out, seen)
    for attr in ("input_ids", "positions", "slot_mapping", "seq_lens", "query_start_loc", "block_tables"):
        _walk(getattr(graphs, attr), f"graphs.{attr}", out, seen)
    if runner.lora is not None:
        _walk(runner.lora, "lora", out, seen)
    _walk(runner.model, "model", out, seen)  # every other tensor attribute of the modules (caches, packed weights)
    return out


def describe_constants(constants: list[torch.Tensor], bases: dict) -> list[list] | None:
    """Each constant as [base name, dtype, size, stride, storage_offset]; None when one has no named base."""
    manifest = []
    for t in constants:
        if not t.untyped_storage().nbytes():
            manifest.append(["", str(t.dtype), list(t.shape), list(t.stride()), 0])  # no data: any storage will do
            continue
        base = bases.get(t.untyped_storage().data_ptr())
        if base is None:
            return None
        manifest.append([base[0], str(t.dtype), list(t.shape), list(t.stride()), t.storage_offset()])
    return manifest


def rebuild_constants(manifest: list, bases: dict) -> list[torch.Tensor]:
    """The constants of an entry as views of this process's tensors; EntryError when one does not fit."""
    by_name = {name: t for name, t in bases.values()}
    out = []
    for item in manifest:
        name, dtype_name, size, stride, offset = item
        dtype = getattr(torch, str(dtype_name).removeprefix("torch."), None)
        if not isinstance(dtype, torch.dtype):
            raise EntryError(f"unknown dtype {dtype_name!r}")
        if name == "":
            out.append(torch.empty_strided(size, stride, dtype=dtype))
            continue
        base = by_name.get(name)
        if base is None:
            raise EntryError(f"no tensor named {name!r} here")
        storage = base.untyped_storage()
        itemsize = torch.empty((), dtype=dtype).element_size()
        if any(s < 0 for s in size) or any(s < 0 for s in stride) or offset < 0:
            raise EntryError(f"a negative size, stride or offset for {name!r}")
        if all(size):
            end = (offset + sum((n - 1) * s for n, s in zip(size, stride)) + 1) * itemsize
            if end > storage.nbytes():
                raise EntryError(f"a view of {name!r} reaches byte {end}, past its {storage.nbytes()} bytes")
        view = torch.empty(0, dtype=dtype, device=base.device)
        view.set_(storage, offset, size, stride)
        out.append(view)
    return out


# -- the files -------------------------------------------------------------------------------------------------
def load(key: str) -> dict | None:
    """The entry saved under key, None when there is none; EntryError when it is unreadable."""
    path = cache_dir() / f"{key}.json"
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise EntryError(f"cannot read {path}: {e}") from None
    try:
        entry = json.loads(text)
    except ValueError as e:
        raise EntryError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(entry, dict) or entry.get("format") != FORMAT or entry.get("key") != key \
            or not isinstance(entry.get("source"), str) or not isinstance(entry.get("constants"), list):
        raise EntryError(f"{path} is not a format-{FORMAT} entry for this key")
    return entry


def save(key: str, source: str, manifest: list, num_ops: int) -> None:
    """Write the entry atomically (a reader sees the old file or the whole new one); an error is only logged."""
    folder = cache_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{key}.", suffix=".tmp")
        try:
            os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide it from another user's engine on a shared volume
            with os.fdopen(fd, "w") as f:
                json.dump({"format": FORMAT, "key": key, "source": source, "constants": manifest,
                           "num_ops": num_ops}, f)
            os.replace(tmp, folder / f"{key}.json")
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError as e:  # a read-only or full cache volume: serving goes on, the next start records again
        logger.warning("could not save the CPU decode graph to %s (%s)", folder, e)


def discard(key: str) -> None:
    try:
        (cache_dir() / f"{key}.json").unlink()
    except OSError:
        pass
