"""Pre-quantized checkpoints (GPTQ, AWQ, compressed-tensors int8, MXFP4) named by `quantization_config` in config.json.

`PrequantizedSource` wraps a `WeightSource` and answers `load("...q_proj.weight")` with the dense [out, in]
weight rebuilt from the checkpoint's packed tensors, so every model loads them unchanged; the log says they were
dequantized on load (add `--quantization int8|int4` to run them through a quantized kernel again).

Layouts (both store W transposed, [in, out], with per-group scales and zero points):
- GPTQ: `qweight` int32 [in*bits/32, out] packs `32/bits` consecutive *input* rows per word, lowest bits first;
  `qzeros` int32 [groups, out*bits/32] packs consecutive *output* columns; `scales` [groups, out]; `g_idx` [in]
  gives each input row's group (act-order checkpoints permute it). Format "gptq" stores zero - 1.
- AWQ (GEMM): `qweight` int32 [in, out/8] and `qzeros` int32 [in/group, out/8] pack 8 output columns per word in
  the interleaved order 0 2 4 6 1 3 5 7; `scales` [in/group, out]; w = (q - zero) * scale.
- compressed-tensors ("int-quantized", e.g. llm-compressor's W8A8): `weight` is int8 [out, in] itself and
  `weight_scale` [out, 1] (per channel) or [1] (per tensor); w = q * scale, read slice by slice like a dense weight.
  Symmetric per-channel int8 is exactly what `--quantization int8` builds, so adding it re-quantizes each row to
  the checkpoint's own integers (whenever the row's largest |q| is 127, as round-to-nearest calibration gives).
- MXFP4 (gpt-oss's experts, quantization/mxfp4.py): `<name>_blocks` and `<name>_scales` stand for the tensor `<name>`
  as transformers names and shapes it ([experts, in, out]). A read of some experts (a slice along dim 0, how the
  MoE loader reads, expert by expert) dequantizes only their blocks, so memory holds one expert's dense copy at a
  time besides the model's own parameters.
"""

from __future__ import annotations

import logging

import torch

from shoal.engine.execution.weights import WeightError

logger = logging.getLogger(__name__)

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a word holds column AWQ_ORDER[i] of its 8


def _unpack_rows(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [n, m] -> [n * 32/bits, m]: word row r holds rows r*k .. r*k+k-1 (k = 32/bits), lowest bits first."""
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    vals = (packed.unsqueeze(1) >> shifts.view(1, per, 1)) & ((1 << bits) - 1)
    return vals.reshape(packed.shape[0] * per, packed.shape[1])


def _unpack_cols(packed: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """int32 [n, m] -> [n, m * 32/bits]: word column c holds columns c*k .. c*k+k-1 (nibble i -> column order[i])."""
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    vals = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [n, m, per], nibble i at index i
    if order is not None:
        vals = vals[..., torch.argsort(torch.tensor(order))]  # column j comes from nibble order.index(j)
    return vals.reshape(packed.shape[0], packed.shape[1] * per)


def dequantize_gptq(qweight, qzeros, scales, g_idx, bits: int, zero_minus_one: bool = True) -> torch.Tensor:
    q = _unpack_rows(qweight, bits)  # [in, out]
    z = _unpack_cols(qzeros, bits) + (1 if zero_minus_one else 0)  # [groups, out]
    g = g_idx.long()
    return ((q - z[g]).float() * scales.float()[g]).t().contiguous()  # [out, in]


def dequantize_awq(qweight, qzeros, scales, group: int) -> torch.Tensor:
    q = _unpack_cols(qweight, 4, AWQ_ORDER)  # [in, out]
    z = _unpack_cols(qzeros, 4, AWQ_ORDER)  # [in/group, out]
    g = torch.arange(q.shape[0]) // group
    return ((q - z[g]).float() * scales.float()[g]).t().contiguous()


def _get(config, key, default=None):
    return config.get(key, default) if isinstance(config, dict) else getattr(config, key, default)


class PrequantizedSource:
    """A WeightSource whose `<layer>.weight` of packed layers is dequantized from `<layer>.qweight` & co."""

    def __init__(self, src, quant_config):
        self.src, self.model_dir, self.used = src, src.model_dir, src.used
        method = str(_get(quant_config, "quant_method", "")).lower()
        self.method = method
        self.bits = int(_get(quant_config, "bits", _get(quant_config, "w_bit", 4)) or 4)
        self.group = int(_get(quant_config, "group_size", _get(quant_config, "q_group_size", 128)) or -1)
        if method == "gptq":
            if self.bits not in (2, 4, 8):
                raise WeightError(f"{self.model_dir}: GPTQ with {self.bits} bits is not supported (2, 4 or 8)")
            self.zero_minus_one = str(_get(quant_config, "checkpoint_format", "gptq")).lower() != "gptq_v2"
        elif method == "awq":
            version = str(_get(quant_config, "version", "gemm")).lower()
            if version != "gemm" or self.bits != 4:
                raise WeightError(f"{self.model_dir}: AWQ {version} with {self.bits} bits is not supported "
                                  f"(only 4-bit GEMM packing)")
        elif method == "compressed-tensors":
            strategy = self._check_compressed_tensors(quant_config)
            self.bits, self.group = 8, f"per {strategy}"
        elif method == "mxfp4":
            self.bits, self.group = 4, 32
        else:
            raise WeightError(f"{self.model_dir}: quantization_config quant_method {method!r} is not supported "
                              f"(supported: gptq, awq, compressed-tensors, mxfp4)")
        suffix = {"compressed-tensors": ".weight_scale", "mxfp4": "_blocks"}.get(method, ".qweight")
        self._dense_suffix = "" if method == "mxfp4" else ".weight"  # what the dense tensor's name adds to a stem
        packed = sorted(n[: -len(suffix)] for n in src.names() if n.endswith(suffix))
        self._packed = set(packed)
        logger.info("%s %d-bit checkpoint (group size %s): %d packed %s dequantized on load",
                    method.upper(), self.bits, self.group, len(packed),
                    "expert tensors" if method == "mxfp4" else "linear layers")

    def _check_compressed_tensors(self, quant_config) -> str:
        """Refuses what the loader cannot read; returns the weights' strategy (channel or tensor)."""
        fmt = str(_get(quant_config, "format", ""))
        groups = _get(quant_config, "config_groups") or {}
        if fmt not in ("int-quantized", "naive-quantized") or not groups:
            raise WeightError(f"{self.model_dir}: compressed-tensors format {fmt!r} is not supported (supported: "
                              f"int-quantized int8 weights)")
        for name, group in groups.items():
            w = _get(group, "weights") or {}
            ok = (str(_get(w, "type", "int")) == "int" and int(_get(w, "num_bits", 0) or 0) == 8
                  and _get(w, "symmetric", True) and str(_get(w, "strategy", "")) in ("channel", "tensor"))
            if not ok:
                raise WeightError(f"{self.model_dir}: compressed-tensors group {name!r} quantizes weights as "
                                  f"{dict(w)}; only symmetric int8 per channel or per tensor is supported")
        return str(_get(_get(next(iter(groups.values())), "weights"), "strategy"))

    def _layer(self, name: str) -> str | None:
        suffix = self._dense_suffix
        stem = name[: len(name) - len(suffix)] if name.endswith(suffix) else None
        return stem if stem in self._packed else None

    def names(self) -> set[str]:
        return self.src.names() | {p + self._dense_suffix for p in self._packed}

    def has(self, name: str) -> bool:
        return self._layer(name) is not None or self.src.has(name)

    def shape(self, name: str) -> tuple[int, ...]:
        layer = self._layer(name)
        if layer is None or self.method == "compressed-tensors":
            return self.src.shape(name)
        if self.method == "mxfp4":  # blocks [*, rows, cols / 32, 16] stand for [*, cols, rows]
            *lead, rows, groups, _ = self.src.shape(layer + "_blocks")
            return (*lead, groups * 32, rows)
        out = self.src.shape(layer + ".scales")[1]
        rows = self.src.shape(layer + ".qweight")[0]
        return (out, rows * 32 // self.bits if self.method == "gptq" else rows)

    def _dense(self, layer: str) -> torch.Tensor:
        qweight, qzeros, scales = (self.src.load(f"{layer}.{n}") for n in ("qweight", "qzeros", "scales"))
        if self.method == "awq":
            return dequantize_awq(qweight, qzeros, scales, self.group)
        in_features = qweight.shape[0] * 32 // self.bits
        if self.src.has(layer + ".g_idx"):
            g_idx = self.src.load(layer + ".g_idx")
        else:
            g_idx = torch.arange(in_features) // (self.group if self.group > 0 else in_features)
        return dequantize_gptq(qweight, qzeros, scales, g_idx, self.bits, self.zero_minus_one)

    def load(self, name: str, expected_shape=None, dim: int | None = None, start: int = 0,
             length: int | None = None) -> torch.Tensor:
        layer = self._layer(name)
        if layer is None:
            return self.src.load(name, expected_shape, dim=dim, start=start, length=length)
        if self.method == "compressed-tensors":
            return self._int8_slice(layer, expected_shape, dim, start, length)
        if self.method == "mxfp4":
            return self._mxfp4(layer, expected_shape, dim, start, length)
        try:
            w = self._dense(layer)
        except (RuntimeError, IndexError) as e:  # shapes of qweight/qzeros/scales/g_idx that do not fit together
            raise WeightError(f"{self.model_dir}: packed tensors of {layer!r} are inconsistent ({e})") from None
        if expected_shape is not None and tuple(w.shape) != tuple(expected_shape):
            raise WeightError(f"{self.model_dir}: {layer!r} dequantizes to {list(w.shape)} but the config implies "
                              f"{list(expected_shape)}")
        if dim is not None:
            w = w.narrow(dim, start, w.shape[dim] - start if length is None else length)
        return w

    def _mxfp4(self, layer: str, expected_shape, dim, start: int, length: int | None) -> torch.Tensor:
        """The dense tensor (or its slice along `dim`) in transformers' orientation: blocks and scales of the
        experts asked for (dim 0) only."""
        from shoal.engine.execution.quantization.mxfp4 import dequantize_mxfp4

        full = self.shape(layer)
        if expected_shape is not None and tuple(full) != tuple(expected_shape):
            raise WeightError(f"{self.model_dir}: {layer!r} dequantizes to {list(full)} but the config implies "
                              f"{list(expected_shape)}")
        lead = dim == 0 and len(full) == 3  # whole experts: read only theirs
        part = dict(dim=0, start=start, length=length) if lead else {}
        blocks, scales = self.src.load(layer + "_blocks", **part), self.src.load(layer + "_scales", **part)
        try:
            w = dequantize_mxfp4(blocks, scales).transpose(-1, -2)
        except ValueError as e:
            raise WeightError(f"{self.model_dir}: {layer!r}: {e}") from None
        if dim is not None and not lead:
            w = w.narrow(dim, start, w.shape[dim] - start if length is None else length)
        return w

    def _int8_slice(self, layer: str, expected_shape, dim, start: int, length: int | None) -> torch.Tensor:
        """w = q * scale for just the rows/columns asked for (each tensor-parallel rank reads its own)."""
        q = self.src.load(layer + ".weight", expected_shape, dim=dim, start=start, length=length)
        scale = self.src.load(layer + ".weight_scale").float().reshape(-1)
        if q.dtype != torch.int8:
            raise WeightError(f"{self.model_dir}: {layer}.weight is {q.dtype}, not the int8 a compressed-tensors "
                              f"int-quantized checkpoint holds")
        if scale.numel() > 1:  # per output channel
            full = self.src.shape(layer + ".weight")[0]
            if scale.numel() != full:
                raise WeightError(f"{self.model_dir}: {layer}.weight_scale has {scale.numel()} values for {full} "
                                  f"output channels")
            if dim == 0:
                scale = scale[start:start + q.shape[0]]
            scale = scale.view(-1, 1)
        return q.float() * scale

    def close(self) -> None:
        self.src.close()
