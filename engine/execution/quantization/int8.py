"""int8 W8A8: per-output-channel int8 weights, per-token int8 activations, int32 accumulation."""

from __future__ import annotations

import functools
import logging

import torch

from shoal.engine.execution.layers import amx_gemm
from shoal.engine.execution.quantization.base import QuantizedWeight

logger = logging.getLogger(__name__)


# Weight range of the oneDNN path on x86 CPUs without VNNI. There oneDNN's u8 x s8 GEMM multiplies with
# vpmaddubsw, which adds each pair of byte products into a *saturating* int16: with activations up to 255 (u8,
# zero point 128) and weights up to 127 a pair reaches 2 * 255 * 127 = 64770 > 32767 and is silently clipped
# (measured: errors of 0.24 on 10% of outputs). Weights within +-63 keep every pair below 2 * 255 * 63 = 32130,
# so the integer result is exact again, at one bit less of weight precision. VNNI (vpdpbusd) sums in int32.
NO_VNNI_WEIGHT_LIMIT = 63


def quantize_rows_int8(t: torch.Tensor, limit: int = 127) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric round-to-nearest per row into [-limit, limit]: (int8 values, float32 scale per row)."""
    t = t.float()
    scale = t.abs().amax(dim=-1, keepdim=True).clamp(min=1e-8) / float(limit)
    return torch.round(t / scale).clamp_(-limit, limit).to(torch.int8), scale


def gemm_is_exact(kernel, limit: int, pack=None) -> bool:
    """Whether `kernel` (int8_linear) gives the exact integer product for weights within +-limit, on operands that
    reach every corner of the range: activations whose per-token quantization is the integers themselves (a +-127
    in every row makes the scale 1), next to weights at +-limit and mixed ones, at a decode (1 row) and a batch
    (33 rows) shape with widths of real layers. Saturating int16 pairs (no VNNI), a wrong zero-point compensation
    or any other kernel that is not exact shows as a difference; the sums stay below 2**24, so float32 holds them
    exactly. `pack` lays the int8 weight out for the kernel (default: oneDNN's prepack)."""
    pack = pack or (lambda w: torch.ops.onednn.qlinear_prepack(w, None))
    g = torch.Generator().manual_seed(0)
    for m, k, n in ((1, 576, 64), (33, 512, 48)):
        w = torch.randint(-limit, limit + 1, (n, k), generator=g, dtype=torch.int32)
        w[0], w[1], w[2, ::2], w[2, 1::2] = limit, -limit, limit, -limit
        x = torch.randint(-127, 128, (m, k), generator=g, dtype=torch.int32)
        x[:, 0] = 127
        x[0, 1:] = 127  # with weights at +limit: every pair at its largest
        if m > 1:
            x[1, 1:] = -127
        packed = pack(w.to(torch.int8))
        got = kernel(x.float(), packed, torch.ones(n), torch.zeros(n, dtype=torch.int64), None)
        if not torch.equal(got.double(), x.double() @ w.double().t()):
            return False
    return True


@functools.cache
def _probed_limit(kernel, first_guess: int) -> int | None:
    """The widest weight range this process's int8 GEMM sums exactly (the CPU flags' guess first), or None when
    not even 7-bit weights are exact: then the portable path runs. Checked once, because what oneDNN runs depends on
    its build, its ISA cap and the CPU, and a GEMM that is not exact answers wrong, not slow."""
    for limit in dict.fromkeys((first_guess, NO_VNNI_WEIGHT_LIMIT)):
        if gemm_is_exact(kernel, limit):
            if limit != first_guess:
                logger.warning("int8: the oneDNN GEMM here does not sum %d-bit weights exactly; using 7-bit weights",
                               8 if first_guess == 127 else 7)
            return limit
    logger.warning("int8: the oneDNN GEMM here is not exact even for 7-bit weights; using torch._int_mm")
    return None


def _cpu_kernel(weight: torch.Tensor):
    """(the fused C++ int8_linear op, the weight range it is exact for) on an x86 CPU where it and oneDNN's int8
    prepack are available and exact, else (None, 127): torch._int_mm then runs, exact everywhere."""
    from shoal.engine.execution.cpu_features import cpu_features
    from shoal.engine.execution.layers.fused import load_kernels

    features = cpu_features()
    if weight.device.type != "cpu" or features.arch != "x86_64" or not hasattr(torch.ops.onednn, "qlinear_prepack"):
        return None, 127
    ops = load_kernels()[0]
    if ops is None:
        return None, 127
    limit = _probed_limit(ops.int8_linear, 127 if features.int8_vnni else NO_VNNI_WEIGHT_LIMIT)
    return (None, 127) if limit is None else (ops.int8_linear, limit)


class Int8Weight(QuantizedWeight):
    """On AMX CPUs (layers/amx_gemm.py) the weight is kept in the tiles' int8 layout and one C++ call per layer
    quantizes the activations, multiplies on the tiles (TDPBSSD: signed bytes, int32 sums) and scales back; that
    needs out % 16 == 0 and in % 64 == 0, and other layers take the next path. On other x86 CPUs the weight is prepacked once into oneDNN's int8 layout and one C++ call per layer quantizes the
    activations, runs the int8 GEMM and scales back (measured 1.2-1.9x a prepacked bf16 matmul at batch 32 on two
    threads; the same arithmetic as separate torch ops around torch._int_mm, which also re-lays the weight out on
    every call, gained nothing). Elsewhere (CUDA) the torch ops around torch._int_mm (cuBLASLt) run."""

    quantizes_embedding = True

    def __init__(self, q: torch.Tensor, scale: torch.Tensor):
        """q: int8 [out, in] within this device's weight_limit(q.device), scale: float32 [out]."""
        self.scale = scale  # float32 [out]
        self.amx = amx_gemm.int8_kernel_for(q)
        if self.amx is not None:  # AMX tiles: int8 quads, exact int32 sums, per-token quantization in the same call
            self.kernel = "dynamic W8A8 int8 (AMX tiles, fused per-token quantization)"
            self.amx_packed = amx_gemm.pack(q)
            self.packed = self.weight_t = None
            return
        self.kernel_fn, limit = _cpu_kernel(q)
        if q.numel() and int(q.abs().max()) > limit:
            raise ValueError(f"int8 weights beyond +-{limit} would saturate this CPU's int8 GEMM; "
                             "build them with Int8Weight.from_dense")
        if self.kernel_fn is not None:
            bits = "8-bit weights, VNNI" if limit == 127 else "7-bit weights: no VNNI"
            self.kernel = f"dynamic W8A8 int8 (oneDNN prepacked, fused per-token quantization; {bits})"
            self.packed = torch.ops.onednn.qlinear_prepack(q, None)  # oneDNN's blocked layout, [in, out] bytes
            self.zero_points = torch.zeros(q.shape[0], dtype=torch.int64)
            self.weight_t = None
        else:
            self.kernel = "dynamic W8A8 int8 (torch._int_mm)"
            self.packed = None
            self.weight_t = q.t().contiguous()  # int8 [in, out]: the right-hand operand _int_mm wants

    @staticmethod
    def weight_limit(device: torch.device) -> int:
        """The largest weight magnitude the int8 kernel on `device` sums exactly (see NO_VNNI_WEIGHT_LIMIT)."""
        return _cpu_kernel(torch.empty(0, device=device))[1]

    @classmethod
    def from_dense(cls, weight: torch.Tensor) -> "Int8Weight":
        q, scale = quantize_rows_int8(weight, cls.weight_limit(weight.device))
        return cls(q, scale.reshape(-1))

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self.amx is not None and x2.dtype in (torch.bfloat16, torch.float32):
            if x2.stride(-1) != 1:
                x2 = x2.contiguous()
            if bias is not None and bias.dtype != x2.dtype:
                bias = bias.to(x2.dtype)
            return self.amx.int8_linear(x2, self.amx_packed, self.scale, bias).reshape(*shape[:-1], -1)
        if self.amx is not None:  # float16 activations: the same arithmetic in torch ops
            q = amx_gemm.unpack(self.amx_packed)
            xq, xs = quantize_rows_int8(x2)
            y = (xq.float() @ q.float().t()).mul_(self.scale).mul_(xs)
            if bias is not None:
                y += bias
            return y.to(x.dtype).reshape(*shape[:-1], -1)
        if self.packed is not None:
            if x2.stride(-1) != 1:
                x2 = x2.contiguous()
            if bias is not None and bias.dtype != x2.dtype:
                bias = bias.to(x2.dtype)
            y = self.kernel_fn(x2, self.packed, self.scale, self.zero_points, bias)
            return y.reshape(*shape[:-1], -1)
        xq, xs = quantize_rows_int8(x2)
        if xq.is_cuda and xq.shape[0] <= 16:  # cuBLASLt's int8 GEMM wants more than 16 rows
            xq = torch.nn.functional.pad(xq, (0, 0, 0, 17 - xq.shape[0]))
        y = torch._int_mm(xq, self.weight_t)[: xs.shape[0]].float().mul_(xs).mul_(self.scale)
        if bias is not None:
            y += bias
        return y.to(x.dtype).reshape(*shape[:-1], -1)

    def dequantize(self) -> torch.Tensor:
        if self.amx is not None:
            return amx_gemm.unpack(self.amx_packed).float() * self.scale[:, None]
        if self.packed is None:
            return self.weight_t.t().float() * self.scale[:, None]
        # The packed layout is oneDNN's own: read it back by multiplying the identity (exact in int8 arithmetic).
        k = self.packed.numel() // self.scale.numel()
        eye = torch.eye(k, dtype=torch.uint8) + 128  # zero point 128: the unsigned form of the identity
        ones = torch.ones_like(self.scale)
        w_t = torch.ops.onednn.qlinear_pointwise(eye, 1.0, 128, self.packed, ones, self.zero_points, None, 1.0, 0,
                                                  torch.float32, "none", [], "")
        return w_t.t() * self.scale[:, None]

    def tensors(self) -> list[torch.Tensor]:
        if self.amx is not None:
            return [self.scale, self.amx_packed]
        return [self.scale] + [self.packed if self.packed is not None else self.weight_t]
