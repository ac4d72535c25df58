"""Read tensors (or just this rank's slices of them) from a directory of safetensors shards.

Shards are memory-mapped and a tensor is handed out as a view of the mapping (no copy): the model copies it
straight into its parameter, converting the dtype on the way, so the bytes go from the page cache to their final
layout once, peak host memory stays near one copy of the weights, and a tensor-parallel rank touches only the
rows or columns it owns. Dtypes torch cannot view, and misaligned data, go through safetensors' safe_open
(a copy per tensor). The source is safe to read from several threads: models load their layers in parallel
(`parallel_map`), which overlaps the page faults of a cold cache with the copies.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterable, TypeVar

import torch
from safetensors import safe_open

T = TypeVar("T")

_VIEW_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


def load_threads() -> int:
    """Threads that load a model's layers at once: $SHOAL_LOAD_THREADS (1 = serial), else up to 8 by CPU count."""
    value = os.environ.get("SHOAL_LOAD_THREADS", "")
    if value.isdigit() and int(value) > 0:
        return int(value)
    return max(1, min(8, os.cpu_count() or 1))


def parallel_map(fn: Callable[[T], None], items: Iterable[T], threads: int) -> None:
    """fn over items on `threads` threads (in order on one); the first failure is raised once all have stopped."""
    items = list(items)
    if threads <= 1 or len(items) <= 1:
        for item in items:
            fn(item)
        return
    with ThreadPoolExecutor(min(threads, len(items)), thread_name_prefix="load") as pool:
        for future in [pool.submit(fn, item) for item in items]:
            future.result()


class WeightError(ValueError):
    """A model directory whose weights cannot be loaded; the message names the file and the tensor."""


class WeightSource:
    def __init__(self, model_dir: Path, threads: int = 1):
        self.model_dir = Path(model_dir)
        self.threads = threads  # how many layers a model may load at once from this source
        self._file_of: dict[str, Path] = {}
        self._handles: dict[Path, object] = {}
        self._maps: dict[Path, tuple[mmap.mmap, int, dict]] = {}  # shard -> (mapping, data start, header)
        self._lock = threading.Lock()
        self.used: set[str] = set()
        index = self.model_dir / "model.safetensors.index.json"
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError) as e:
                raise WeightError(f"{index}: not a valid safetensors index ({e})") from e
            for name, fname in weight_map.items():
                self._file_of[name] = self.model_dir / fname
            for path in set(self._file_of.values()):
                if not path.exists():
                    raise WeightError(f"{path}: shard listed in {index.name} is missing")
        else:
            files = sorted(self.model_dir.glob("*.safetensors"))
            if not files:
                raise WeightError(f"{self.model_dir}: no *.safetensors files (only safetensors weights are supported)")
            for path in files:
                for name in self._read_header(path):
                    self._file_of[name] = path

    @staticmethod
    def _read_header(path: Path) -> list[str]:
        """Tensor names of one shard, read from its JSON header without touching the data."""
        return [k for k in WeightSource._header(path)[1] if k != "__metadata__"]

    @staticmethod
    def _header(path: Path) -> tuple[int, dict]:
        """(offset of the data, the JSON header) of one shard."""
        try:
            with open(path, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                if n > path.stat().st_size - 8:
                    raise ValueError(f"header length {n} exceeds the file size")
                header = json.loads(f.read(n))
            if not isinstance(header, dict):
                raise ValueError("header is not a JSON object")
        except (OSError, struct.error, ValueError) as e:
            raise WeightError(f"{path}: corrupt safetensors header ({e})") from e
        return 8 + n, header

    def _mapped(self, path: Path) -> tuple[mmap.mmap, int, dict]:
        with self._lock:
            if path not in self._maps:
                start, header = self._header(path)
                with open(path, "rb") as f:
                    # private and writable: torch views it without a copy or a warning, and a model that changes a
                    # tensor in place gets its own page, never the file's
                    mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
                self._maps[path] = (mapping, start, header)
            return self._maps[path]

    def _view(self, path: Path, name: str) -> torch.Tensor | None:
        """The whole tensor as a view of the shard's mapping; None where a view cannot be made."""
        mapping, start, header = self._mapped(path)
        meta = header.get(name)
        if not isinstance(meta, dict):
            return None
        dtype = _VIEW_DTYPES.get(meta.get("dtype"))
        try:
            shape = [int(d) for d in meta["shape"]]
            begin, end = (int(o) for o in meta["data_offsets"])
        except (KeyError, TypeError, ValueError):
            return None
        count = 1
        for d in shape:
            count *= d
        if dtype is None or count == 0 or (start + begin) % dtype.itemsize or end - begin != count * dtype.itemsize \
                or start + end > len(mapping):
            return None
        return torch.frombuffer(mapping, dtype=dtype, count=count, offset=start + begin).view(shape)

    def names(self) -> set[str]:
        return set(self._file_of)

    def has(self, name: str) -> bool:
        return name in self._file_of

    def _handle(self, path: Path):
        with self._lock:
            if path not in self._handles:
                try:
                    self._handles[path] = safe_open(str(path), framework="pt", device="cpu")
                except Exception as e:  # safetensors raises its own error types for truncated files
                    raise WeightError(f"{path}: cannot open safetensors shard ({e})") from e
            return self._handles[path]

    def _slice(self, name: str):
        if name not in self._file_of:
            raise WeightError(f"{self.model_dir}: tensor {name!r} is missing from the checkpoint")
        path = self._file_of[name]
        self.used.add(name)
        try:
            return path, self._handle(path).get_slice(name)
        except WeightError:
            raise
        except Exception as e:
            raise WeightError(f"{path}: cannot read tensor {name!r} ({e})") from e

    def _path(self, name: str) -> Path:
        if name not in self._file_of:
            raise WeightError(f"{self.model_dir}: tensor {name!r} is missing from the checkpoint")
        self.used.add(name)
        return self._file_of[name]

    def shape(self, name: str) -> tuple[int, ...]:
        view = self._view(self._path(name), name)
        if view is not None:
            return tuple(view.shape)
        _, sl = self._slice(name)
        return tuple(sl.get_shape())

    def load(self, name: str, expected_shape: tuple[int, ...] | None = None,
             dim: int | None = None, start: int = 0, length: int | None = None) -> torch.Tensor:
        """The tensor `name`, or rows/columns [start, start+length) along `dim`, checked against the full shape."""
        path = self._path(name)
        view = self._view(path, name)
        sl = None
        if view is None:
            path, sl = self._slice(name)
        full = tuple(view.shape) if view is not None else tuple(sl.get_shape())
        if expected_shape is not None and full != tuple(expected_shape):
            raise WeightError(
                f"{path}: tensor {name!r} has shape {list(full)} but the config implies {list(expected_shape)}"
            )
        try:
            if view is not None:
                if dim is None:
                    return view
                part = view.narrow(dim, start, full[dim] - start if length is None else length)
                return part if part.is_contiguous() else part.contiguous()  # this rank's columns only
            if dim is None:
                return sl[:]
            index = [slice(None)] * len(full)
            index[dim] = slice(start, start + (full[dim] - start if length is None else length))
            return sl[tuple(index)]
        except Exception as e:
            raise WeightError(f"{path}: cannot read tensor {name!r} ({e})") from e

    def close(self) -> None:
        # the mappings are not closed here: a model may keep a view as its parameter (they close with the last one)
        self._handles.clear()
        self._maps.clear()
