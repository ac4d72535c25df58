"""Read tensors (or just this rank's slices of them) from a directory of safetensors shards.

Shards are memory-mapped and read tensor by tensor, so peak host memory stays near one copy of the weights
(the model's own parameters) and a tensor-parallel rank reads only the rows or columns it owns.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch
from safetensors import safe_open


class WeightError(ValueError):
    """A model directory whose weights cannot be loaded; the message names the file and the tensor."""


class WeightSource:
    def __init__(self, model_dir: Path):
        self.model_dir = Path(model_dir)
        self._file_of: dict[str, Path] = {}
        self._handles: dict[Path, object] = {}
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
        return [k for k in header if k != "__metadata__"]

    def names(self) -> set[str]:
        return set(self._file_of)

    def has(self, name: str) -> bool:
        return name in self._file_of

    def _handle(self, path: Path):
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

    def shape(self, name: str) -> tuple[int, ...]:
        _, sl = self._slice(name)
        return tuple(sl.get_shape())

    def load(self, name: str, expected_shape: tuple[int, ...] | None = None,
             dim: int | None = None, start: int = 0, length: int | None = None) -> torch.Tensor:
        """The tensor `name`, or rows/columns [start, start+length) along `dim`, checked against the full shape."""
        path, sl = self._slice(name)
        full = tuple(sl.get_shape())
        if expected_shape is not None and full != tuple(expected_shape):
            raise WeightError(
                f"{path}: tensor {name!r} has shape {list(full)} but the config implies {list(expected_shape)}"
            )
        try:
            if dim is None:
                return sl[:]
            index = [slice(None)] * len(full)
            index[dim] = slice(start, start + (full[dim] - start if length is None else length))
            return sl[tuple(index)]
        except Exception as e:
            raise WeightError(f"{path}: cannot read tensor {name!r} ({e})") from e

    def close(self) -> None:
        self._handles.clear()
