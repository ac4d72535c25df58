"""The Mamba2 mixer (the state-space layer of Granite 4, Nemotron-H and Falcon-H1) over a flat batch, with each
sequence's state in a slot.

in_proj maps a token to z (the gate, one channel per head and head dim), xBC (the conv's input: x, then B and C,
one d_state vector per group of heads) and dt (one per head). xBC goes through a depthwise causal conv1d (kernel K,
bias, SiLU) whose last K-1 inputs are the sequence's conv state. Then, per head h with its group's B_t and C_t
(d_state vectors) and the state S ([head_dim, d_state]):
    dt_t = clamp(softplus(dt_t + dt_bias), time_step_limit);   S <- exp(dt_t A) S + dt_t x_t B_t^T;   y_t = S C_t + D x_t
with A = -exp(A_log). y is gated by SiLU(z), RMS-normalised within each of the config's groups of channels, scaled
by the norm's weight and projected back by out_proj.

On CPU both prefill (the sequential scan) and decode (conv and SSM step fused, in place on the slots) run C++
kernels (layers/ssm_scan.py); on CUDA decode runs the Triton kernels of layers/ssm_triton.py with the same interface
and prefill the chunked (SSD) form, `ssd_chunk_scan`; without either, the single-step recurrence in torch. All read
and write the sequence's slot of the layer's RecurrentState (the same state object as Gated DeltaNet's), so a
prompt split over several steps carries its state from one step to the next, and a sequence whose step starts at
position 0 starts from a zero state.

Tensor parallelism splits the heads: a rank holds its heads' rows of z, x and dt, the B/C rows of the groups those
heads read (its share of the groups when the ranks divide them, else the one group its heads sit in, replicated),
the matching conv channels, and out_proj's columns (row-parallel, one all-reduce). A norm group spanning several
ranks sums its squares over them (one small all-reduce of [tokens, groups]).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from shoal.engine.distributed.parallel_state import divide, get_parallel_state
from shoal.engine.execution.layers import ssm_scan
from shoal.engine.execution.layers.causal_conv import causal_conv_chunk, causal_conv_step
from shoal.engine.execution.layers.gated_delta_net import RecurrentState
from shoal.engine.execution.layers.linear import ColumnParallelLinear, RowParallelLinear
from shoal.engine.execution.models.base import reader

CHUNK = 64


@dataclass(frozen=True)
class Mamba2Shape:
    """What a family's config says about its Mamba2 layers (each family names the fields differently)."""

    hidden: int
    heads: int
    head_dim: int
    groups: int
    d_state: int
    conv_kernel: int
    conv_bias: bool
    proj_bias: bool
    eps: float
    norm_groups: int  # the gated RMSNorm's groups of channels (Granite / Nemotron-H: the B/C groups)
    time_step_limit: tuple[float, float] = (0.0, math.inf)
    # "gated": RMSNorm(y * SiLU(z)) (Granite, Nemotron-H); "norm_then_gate": RMSNorm(y) * SiLU(z); "gate_only":
    # y * SiLU(z), no norm (Falcon-H1 by mamba_rms_norm / mamba_norm_before_gate).
    norm: str = "gated"
    # Falcon-H1's muP: in_proj's z, x, B, C and dt rows scaled (its input multiplier included), out_proj's output
    # scaled; both folded into the weights at load.
    in_multipliers: tuple[float, float, float, float, float] = (1.0, 1.0, 1.0, 1.0, 1.0)
    out_multiplier: float = 1.0

    @property
    def inner(self) -> int:
        return self.heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.inner + 2 * self.groups * self.d_state


def ssd_chunk_scan(x, dt, A, B, C, state, chunk: int = CHUNK):
    """One sequence, float32. x: [T, H, P]; dt: [T, H] (after softplus); A: [H] (negative); B, C: [T, H, N] (each
    head's group's vectors); state: [H, P, N] (updated in place). Returns y [T, H, P] (without the D skip).

    Within a chunk let a_t = dt_t A and G_t = a_1 + ... + a_t, S0 the state before it. Unrolling the recurrence,
        y_t = e^{G_t} S0 C_t + sum_{s<=t} e^{G_t - G_s} (C_t . B_s) dt_s x_s,
        S_end = e^{G_L} S0 + sum_s e^{G_L - G_s} dt_s x_s B_s^T."""
    T = x.shape[0]
    out = torch.empty_like(x)
    for a in range(0, T, chunk):
        b = min(a + chunk, T)
        L = b - a
        xdt = x[a:b] * dt[a:b, :, None]  # [L, H, P]
        Bc, Cc = B[a:b], C[a:b]
        G = (dt[a:b] * A).cumsum(0).t()  # [H, L]
        lower = torch.ones(L, L, dtype=torch.bool, device=x.device).tril()
        decay = torch.where(lower, G[:, :, None] - G[:, None, :], float("-inf")).exp()  # [H, t, s]
        scores = torch.einsum("thn,shn->hts", Cc, Bc) * decay
        y = torch.einsum("hts,shp->thp", scores, xdt)
        y += torch.einsum("thn,hpn->thp", Cc, state) * G.t().exp()[..., None]
        out[a:b] = y
        last = G[:, -1:]  # [H, 1]
        state.mul_(last.exp()[..., None])
        state.add_(torch.einsum("hs,shp,shn->hpn", (last - G).exp(), xdt, Bc))
    return out


def ssm_step(x, dt, A, B, C, state):
    """One token of each of S sequences, float32. x: [S, H, P]; dt: [S, H]; B, C: [S, H, N]; state: [S, H, P, N]
    (a gathered copy, updated in place). Returns (y [S, H, P] without the D skip, the state)."""
    state.mul_((dt * A).exp()[..., None, None]).add_((x * dt[..., None])[..., None] * B[:, :, None, :])
    return torch.einsum("shpn,shn->shp", state, C), state


class Mamba2Mixer(nn.Module):
    def __init__(self, shape: Mamba2Shape, dtype: torch.dtype):
        super().__init__()
        ps = get_parallel_state()
        self.ps, self.shape, self.dtype = ps, shape, dtype
        H, G, P, N = shape.heads, shape.groups, shape.head_dim, shape.d_state
        if H % G:
            raise ValueError(f"mamba heads ({H}) must be a multiple of the mamba groups ({G})")
        if shape.inner % shape.norm_groups:
            raise ValueError(f"the Mamba norm's groups ({shape.norm_groups}) must divide heads x head_dim "
                             f"({shape.inner})")
        self.heads_local = divide(H, ps.tp_size, "number of mamba heads")
        self.head_start = ps.tp_rank * self.heads_local
        if G % ps.tp_size == 0:  # each rank its share of the groups
            self.groups_local, self.group_start = G // ps.tp_size, ps.tp_rank * (G // ps.tp_size)
        elif ps.tp_size % G == 0:  # each rank's heads inside one group: that group's B and C replicated
            self.groups_local, self.group_start = 1, self.head_start // (H // G)
        else:
            raise ValueError(f"mamba groups ({G}) and --tensor-parallel-size ({ps.tp_size}): one must divide the "
                             "other")
        self.inner_local = self.heads_local * P
        size = shape.inner // shape.norm_groups
        if self.inner_local % size and size % self.inner_local:
            raise ValueError(f"the Mamba norm's groups ({shape.norm_groups}) cannot be split over "
                             f"--tensor-parallel-size {ps.tp_size}")
        self.conv_local = self.inner_local + 2 * self.groups_local * N
        rows = self.inner_local + self.conv_local + self.heads_local
        self.in_proj = ColumnParallelLinear(shape.hidden, rows * ps.tp_size, shape.proj_bias, dtype)
        self.conv_weight = nn.Parameter(torch.empty(self.conv_local, shape.conv_kernel, dtype=dtype),
                                        requires_grad=False)
        self.conv_bias = (nn.Parameter(torch.empty(self.conv_local, dtype=dtype), requires_grad=False)
                          if shape.conv_bias else None)
        self.A_log = nn.Parameter(torch.empty(self.heads_local, dtype=torch.float32), requires_grad=False)
        self.D = nn.Parameter(torch.empty(self.heads_local, dtype=torch.float32), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(self.heads_local, dtype=torch.float32), requires_grad=False)
        self.norm_weight = nn.Parameter(torch.ones(self.inner_local, dtype=dtype), requires_grad=False)
        self.out_proj = RowParallelLinear(shape.inner, shape.hidden, shape.proj_bias, dtype)

    # ---- the state

    def state_bytes(self) -> int:
        """Bytes of one sequence's state in this layer (conv in the model's dtype, the SSM state in float32)."""
        s = self.shape
        conv = self.conv_local * (s.conv_kernel - 1) * torch.finfo(self.dtype).bits // 8
        return conv + self.heads_local * s.head_dim * s.d_state * 4

    def allocate_state(self, slots: int, device) -> RecurrentState:
        s = self.shape
        return RecurrentState(
            torch.zeros(slots, self.conv_local, s.conv_kernel - 1, dtype=self.dtype, device=device),
            torch.zeros(slots, self.heads_local, s.head_dim, s.d_state, dtype=torch.float32, device=device))

    # ---- the step

    def forward(self, h: torch.Tensor, positions, state: RecurrentState, meta) -> torch.Tensor:
        z, xbc, dt_raw = self.in_proj(h).split([self.inner_local, self.conv_local, self.heads_local], dim=-1)
        # The limit applies to every token here; transformers' (and mamba_ssm's) single-token decode skips it, which
        # differs only where softplus falls outside the limit (never with Granite's default (0, inf)).
        lo, hi = self.shape.time_step_limit
        A = -self.A_log.exp()
        slots = meta.state_slots
        qlens = meta.query_lens_list
        state.zero_new_sequences(meta)
        fused = ssm_scan.decode_kernels(h.device) if meta.is_decode_only else None
        if fused is not None:  # Triton's on GPU, C++ on CPU: in place on the slots
            conv = fused.causal_conv1d_update(xbc, state.conv, self.conv_weight, self.conv_bias, slots)
            y = fused.mamba2_ssm_step(conv, dt_raw, self.dt_bias, A, self.D, state.ssm, slots, self.groups_local,
                                      (lo, hi))
            return self.out_proj(self._gated_norm(y, z))
        dt = F.softplus(dt_raw.float() + self.dt_bias).clamp(lo, hi)
        kernels = ssm_scan.kernels_for(h)
        if meta.is_decode_only:
            x, B, C = self._heads(causal_conv_step(xbc, state, slots, self.conv_weight, self.conv_bias))
            per_group = self.heads_local // self.groups_local
            y, new = ssm_step(x, dt, A, B.repeat_interleave(per_group, dim=1), C.repeat_interleave(per_group, dim=1),
                              state.ssm.index_select(0, slots))
            state.ssm.index_copy_(0, slots, new)
            y += x * self.D[:, None]
        else:
            y = torch.empty(h.shape[0], self.heads_local, self.shape.head_dim, dtype=torch.float32, device=h.device)
            start = 0
            for i, n in enumerate(qlens):
                sl, slot = slice(start, start + n), int(slots[i])
                x, B, C = self._heads(causal_conv_chunk(xbc[sl], state, slot, self.conv_weight, self.conv_bias))
                if kernels is not None:  # the sequential scan in C++: faster than the SSD form on CPU, no [L, L] temps
                    y[sl] = ssm_scan.selective_scan(x, dt[sl], A[:, None], B, C, self.D[:, None].expand_as(x[0]),
                                                    state.ssm[slot])
                else:
                    per_group = self.heads_local // self.groups_local
                    y[sl] = ssd_chunk_scan(x, dt[sl], A, B.repeat_interleave(per_group, dim=1),
                                           C.repeat_interleave(per_group, dim=1), state.ssm[slot]) + x * self.D[:, None]
                start += n
        return self.out_proj(self._gated_norm(y, z))

    def _heads(self, conv: torch.Tensor):
        """Conv output [T, C] -> float32 x [T, H, P] and B, C [T, G, N] (one d_state vector per group)."""
        T, P, N = conv.shape[0], self.shape.head_dim, self.shape.d_state
        g = self.groups_local
        x, B, C = conv.float().split([self.inner_local, g * N, g * N], dim=-1)
        return x.reshape(T, self.heads_local, P), B.reshape(T, g, N), C.reshape(T, g, N)

    def _gated_norm(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """y * SiLU(z), RMS-normalised within each norm group, times the weight (float32, then the model's dtype).
        A group split over tensor-parallel ranks sums its squares over them."""
        s = self.shape
        T = y.shape[0]
        gate = F.silu(z.float())
        y = y.reshape(T, self.inner_local)
        if s.norm == "gate_only":
            return (y * gate).to(self.dtype)
        gated = y * gate if s.norm == "gated" else y
        size = s.inner // s.norm_groups  # channels per norm group
        if self.inner_local % size == 0:  # whole groups on this rank
            grouped = gated.view(T, -1, size)
            normed = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + s.eps)
        else:  # this rank holds part of one group: its share of the squares, summed over the group's ranks
            first = self.head_start * s.head_dim
            group = first // size
            sums = gated.new_zeros(T, s.norm_groups)
            sums[:, group] = gated.pow(2).sum(-1)
            self.ps.all_reduce(sums)
            normed = gated * torch.rsqrt(sums[:, group:group + 1] / size + s.eps)
        out = self.norm_weight * normed.reshape(T, -1)
        return (out if s.norm == "gated" else out * gate).to(self.dtype)

    # ---- the checkpoint

    def load(self, src, p: str) -> None:
        """Weights under the prefix `p` ('model.layers.0.mamba.'), this rank's heads and groups only."""
        s = self.shape
        inner, gn, P, N = s.inner, s.groups * s.d_state, s.head_dim, s.d_state
        h0, hn, g0, gl = self.head_start, self.heads_local, self.group_start, self.groups_local
        heads, xs = (h0 * P, hn * P), (inner + h0 * P, hn * P)  # rows of z / x in in_proj
        bs, cs = (2 * inner + g0 * N, gl * N), (2 * inner + gn + g0 * N, gl * N)
        dts = (2 * inner + 2 * gn + h0, hn)
        full = 2 * inner + 2 * gn + s.heads

        def rows(name, shape, ranges, scales=None):
            parts = [src.load(name, shape, dim=0, start=a, length=n) for a, n in ranges]
            if scales is not None and any(m != 1.0 for m in scales):
                parts = [t * m for t, m in zip(parts, scales)]
            return torch.cat(parts)

        def gathered(name, shape, ranges, scales):  # a Reader for in_proj: this rank's rows whatever it asks
            return lambda dim, start, length: rows(name, shape, ranges, scales)

        in_rows, scales = [heads, xs, bs, cs, dts], s.in_multipliers
        self.in_proj.load(gathered(p + "in_proj.weight", (full, s.hidden), in_rows, scales),
                          gathered(p + "in_proj.bias", (full,), in_rows, scales) if s.proj_bias else None)
        conv_rows = [(h0 * P, hn * P), (inner + g0 * N, gl * N), (inner + gn + g0 * N, gl * N)]
        conv = rows(p + "conv1d.weight", (s.conv_dim, 1, s.conv_kernel), conv_rows)
        self.conv_weight.data.copy_(conv[:, 0])
        if self.conv_bias is not None:
            self.conv_bias.data.copy_(rows(p + "conv1d.bias", (s.conv_dim,), conv_rows))
        for name in ("A_log", "D", "dt_bias"):
            getattr(self, name).data.copy_(src.load(p + name, (s.heads,), dim=0, start=h0, length=hn))
        if s.norm != "gate_only":
            self.norm_weight.data.copy_(src.load(p + "norm.weight", (inner,), dim=0, start=h0 * P, length=hn * P))
        out = scaled(reader(src, p + "out_proj.weight", (s.hidden, inner)), s.out_multiplier)
        self.out_proj.load(out, scaled(reader(src, p + "out_proj.bias", (s.hidden,)), s.out_multiplier)
                           if s.proj_bias else None)


def scaled(read, multiplier: float):
    """A Reader whose tensors come out times `multiplier` (a muP multiplier folded into a weight)."""
    if multiplier == 1.0:
        return read
    return lambda dim, start, length: read(dim, start, length) * multiplier
