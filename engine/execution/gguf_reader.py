"""A GGUF file's metadata and tensor table, read in milliseconds.

gguf-py's GGUFReader makes a numpy view for every part of every metadata value: a 49k-token vocabulary and its
48k merges cost it ~3.5 s per open on a fast core (7 s on a slow one), and the engine's start opened the file
for its config, its weights and (through transformers) its tokenizer. This reader walks the header with
`struct`, keeps each value's place in the file and decodes a value only when asked; tensors are views of one
read-only memmap, shaped as gguf-py shapes them (quantized tensors as their rows of blocks in bytes), so the
loaders read them the same way.
"""

from __future__ import annotations

import hashlib
import mmap
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

GGUF_MAGIC = b"GGUF"

# GGUF value types: (struct code, size) for the fixed-size ones
_SCALARS = {0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4), 6: ("<f", 4),
            7: ("<?", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8)}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9
_PLAIN_TENSORS = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16,
                  "I32": np.int32, "I64": np.int64}


class GGUFFormatError(ValueError):
    """The bytes are not a GGUF file this reader understands (the message says where and why)."""


@dataclass(frozen=True)
class Field:
    """One metadata value, decoded on demand: contents() gives a str, a number, a bool or a list of them."""

    name: str
    _buf: Any
    _type: int
    _offset: int  # where the value starts (after its type; an array's element type and count included)
    _count: int = 1  # an array's length
    _item_type: int = -1  # an array's element type

    def contents(self) -> Any:
        if self._type == _STRING:
            return _read_str(self._buf, self._offset)[0]
        if self._type != _ARRAY:
            return struct.unpack_from(_SCALARS[self._type][0], self._buf, self._offset)[0]
        if self._item_type == _STRING:
            out, offs = [], self._offset
            for _ in range(self._count):
                s, offs = _read_str(self._buf, offs)
                out.append(s)
            return out
        if self._item_type == _ARRAY:
            raise GGUFFormatError(f"{self.name}: nested arrays are not supported")
        return np.frombuffer(self._buf, _NUMPY[self._item_type], self._count, self._offset).tolist()


@dataclass(frozen=True)
class Tensor:
    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: np.ndarray  # dimensions innermost first, as the file lists them
    n_elements: int
    n_bytes: int
    data_offset: int
    data: np.ndarray  # read-only view of the file


def _read_str(buf, offs: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", buf, offs)
    offs += 8
    if offs + n > len(buf):
        raise GGUFFormatError(f"a string at byte {offs} runs past the end of the file")
    return bytes(buf[offs:offs + n]).decode("utf-8", errors="replace"), offs + n


def _skip_value(buf, offs: int, vtype: int) -> tuple[int, int, int]:
    """(end offset, array count, array element type) of the value at offs."""
    if vtype in _SCALARS:
        return offs + _SCALARS[vtype][1], 1, -1
    if vtype == _STRING:
        (n,) = struct.unpack_from("<Q", buf, offs)
        return offs + 8 + n, 1, -1
    if vtype == _ARRAY:
        item_type, count = struct.unpack_from("<IQ", buf, offs)
        offs += 12
        if item_type in _SCALARS:
            return offs + count * _SCALARS[item_type][1], count, item_type
        if item_type == _STRING:
            unpack = struct.Struct("<Q").unpack_from
            for _ in range(count):
                offs += 8 + unpack(buf, offs)[0]
            return offs, count, item_type
        raise GGUFFormatError(f"array of value type {item_type} at byte {offs} is not supported")
    raise GGUFFormatError(f"unknown value type {vtype} at byte {offs}")


class GGUFFile:
    """`fields` {key: Field} and `tensors` [Tensor] of one GGUF file (version 2 or 3, little-endian)."""

    def __init__(self, path: str):
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        with open(path, "rb") as f:
            try:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError:  # an empty file cannot be mapped
                raise GGUFFormatError("the file is empty") from None
        buf = memoryview(self._map)
        try:
            if bytes(buf[:4]) != GGUF_MAGIC:
                raise GGUFFormatError("no GGUF magic at the start")
            version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
            if version not in (2, 3):
                raise GGUFFormatError(f"GGUF version {version} (a big-endian file reads as a huge version); "
                                      "versions 2 and 3 are supported")
            offs = 24
            self.fields: dict[str, Field] = {}
            for _ in range(n_kv):
                key, offs = _read_str(buf, offs)
                (vtype,) = struct.unpack_from("<I", buf, offs)
                offs += 4
                end, count, item_type = _skip_value(buf, offs, vtype)
                start = offs + 12 if vtype == _ARRAY else offs
                self.fields[key] = Field(key, buf, vtype, start, count, item_type)
                offs = end
            self._metadata_end = offs
            infos = []
            for _ in range(n_tensors):
                name, offs = _read_str(buf, offs)
                (n_dims,) = struct.unpack_from("<I", buf, offs)
                dims = np.frombuffer(buf, np.uint64, n_dims, offs + 4).copy()
                raw_type, rel = struct.unpack_from("<IQ", buf, offs + 4 + 8 * n_dims)
                offs += 4 + 8 * n_dims + 12
                infos.append((name, dims, raw_type, rel))
            align_field = self.fields.get("general.alignment")
            align = int(align_field.contents()) if align_field else 32
            data_start = -(-offs // align) * align
            self.tensors: list[Tensor] = []
            seen = set()
            for name, dims, raw_type, rel in infos:
                if name in seen:
                    raise GGUFFormatError(f"tensor {name!r} is listed twice")
                seen.add(name)
                try:
                    qtype = GGMLQuantizationType(raw_type)
                except ValueError:
                    raise GGUFFormatError(f"tensor {name!r} has unknown type id {raw_type}") from None
                n_elems = int(np.prod(dims, dtype=np.int64)) if n_dims else 1
                block, type_size = GGML_QUANT_SIZES[qtype]
                n_bytes = n_elems * type_size // block
                at = data_start + int(rel)
                if at + n_bytes > len(buf):
                    raise GGUFFormatError(f"tensor {name!r} runs past the end of the file (truncated?)")
                np_dims = tuple(int(d) for d in reversed(dims.tolist()))
                plain = _PLAIN_TENSORS.get(qtype.name)
                if plain is not None:
                    data = np.frombuffer(buf, plain, n_elems, at).reshape(np_dims)
                else:  # rows of blocks, in bytes: the innermost dimension counted in bytes
                    data = np.frombuffer(buf, np.uint8, n_bytes, at).reshape(
                        (*np_dims[:-1], np_dims[-1] // block * type_size))
                self.tensors.append(Tensor(name, qtype, dims, n_elems, n_bytes, at, data))
        except struct.error as e:
            raise GGUFFormatError(f"the file ends inside its header (truncated?): {e}") from None

    def metadata_digest(self) -> str:
        """sha256 of the header and metadata (vocabulary, merges, chat template; not the tensors): what a
        conversion of the tokenizer depends on."""
        return hashlib.sha256(memoryview(self._map)[:self._metadata_end]).hexdigest()


def field_value(reader, key: str, default=None):
    """A metadata key's value in a GGUF reader's fields (`default` when the file lacks the key)."""
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()
