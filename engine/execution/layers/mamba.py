"""The Mamba (v1) mixer of Jamba's Mamba layers over a flat batch, with each sequence's state in a slot.

in_proj maps a token to x and the gate z (one row each per inner channel). x goes through a depthwise causal conv1d
(kernel K, bias, SiLU) whose last K-1 inputs are the sequence's conv state. x_proj maps the conv output to a
low-rank time step (dt_rank), B and C (d_state each); Jamba RMS-normalises all three (dt_layernorm, b_layernorm,
c_layernorm). dt_proj lifts the time step back to one value per channel. Then per channel d, with its state
s [d_state] and A = -exp(A_log) [inner, d_state] (a decay per channel *and* state: Mamba2 has one per head):
    dt = softplus(dt_proj(t));   s <- exp(dt A_d) * s + dt x_d B;   y_d = s . C + D_d x_d;   out = y * SiLU(z)
and out_proj maps back to the hidden size.

Prefill runs the scan of layers/ssm_scan.py per sequence, decode its single-step update batched over sequences (C++
kernels on CPU, in place on the state slots, the conv update too; torch elsewhere); both read and write the
sequence's slot of the layer's RecurrentState (conv [K-1] inputs, the SSM state [inner, d_state] in float32), so
chunked prefill carries the state across steps.

Tensor parallelism splits the inner channels: a rank holds its channels' rows of in_proj (x and z), conv, dt_proj,
A_log and D, and the matching columns of x_proj and out_proj (both row-parallel: x_proj's all-reduce gives every
rank the whole time step, B and C, which are replicated).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from shoal.engine.distributed.parallel_state import divide, get_parallel_state
from shoal.engine.execution.layers import ssm_scan
from shoal.engine.execution.layers.causal_conv import causal_conv_chunk, causal_conv_step
from shoal.engine.execution.layers.gated_delta_net import RecurrentState
from shoal.engine.execution.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear, RowParallelLinear
from shoal.engine.execution.layers.norm import RMSNorm
from shoal.engine.execution.models.base import fused_readers, reader


@dataclass(frozen=True)
class MambaShape:
    hidden: int
    inner: int  # mamba_expand x hidden
    d_state: int
    conv_kernel: int
    dt_rank: int
    conv_bias: bool
    proj_bias: bool
    eps: float
    inner_norms: bool = True  # Jamba's RMSNorm on the time step, B and C


class MambaMixer(nn.Module):
    def __init__(self, shape: MambaShape, dtype: torch.dtype):
        super().__init__()
        ps = get_parallel_state()
        self.shape, self.dtype = shape, dtype
        self.inner_local = divide(shape.inner, ps.tp_size, "Mamba inner channels (mamba_expand x hidden_size)")
        self.channel_start = ps.tp_rank * self.inner_local
        n, r, k = shape.d_state, shape.dt_rank, shape.conv_kernel
        self.in_proj = MergedColumnParallelLinear(shape.hidden, [shape.inner, shape.inner], shape.proj_bias, dtype)
        self.conv_weight = nn.Parameter(torch.empty(self.inner_local, k, dtype=dtype), requires_grad=False)
        self.conv_bias = (nn.Parameter(torch.empty(self.inner_local, dtype=dtype), requires_grad=False)
                          if shape.conv_bias else None)
        self.x_proj = RowParallelLinear(shape.inner, r + 2 * n, False, dtype)
        self.dt_proj = ColumnParallelLinear(r, shape.inner, True, dtype)
        self.norms = nn.ModuleList(RMSNorm(size, shape.eps, dtype) for size in (r, n, n)) if shape.inner_norms \
            else None
        self.A_log = nn.Parameter(torch.empty(self.inner_local, n, dtype=torch.float32), requires_grad=False)
        self.D = nn.Parameter(torch.empty(self.inner_local, dtype=torch.float32), requires_grad=False)
        self.out_proj = RowParallelLinear(shape.inner, shape.hidden, shape.proj_bias, dtype)

    # ---- the state

    def state_bytes(self) -> int:
        """Bytes of one sequence's state in this layer (conv inputs in the model's dtype, the SSM state float32)."""
        s = self.shape
        return (self.inner_local * (s.conv_kernel - 1) * torch.finfo(self.dtype).bits // 8
                + self.inner_local * s.d_state * 4)

    def allocate_state(self, slots: int, device) -> RecurrentState:
        s = self.shape
        return RecurrentState(
            torch.zeros(slots, self.inner_local, s.conv_kernel - 1, dtype=self.dtype, device=device),
            torch.zeros(slots, self.inner_local, 1, s.d_state, dtype=torch.float32, device=device))

    # ---- the step

    def forward(self, h: torch.Tensor, positions, state: RecurrentState, meta) -> torch.Tensor:
        x, z = self.in_proj(h).split([self.inner_local, self.inner_local], dim=-1)
        slots = meta.state_slots
        state.zero_new_sequences(meta)
        fused = ssm_scan.decode_kernels(h.device) if meta.is_decode_only else None
        if fused is not None:
            xc = fused.causal_conv1d_update(x, state.conv, self.conv_weight, self.conv_bias, slots)
        elif meta.is_decode_only:
            xc = causal_conv_step(x, state, slots, self.conv_weight, self.conv_bias)
        else:
            xc = torch.empty_like(x)
            start = 0
            for i, n in enumerate(meta.query_lens_list):
                sl = slice(start, start + n)
                xc[sl] = causal_conv_chunk(x[sl], state, int(slots[i]), self.conv_weight, self.conv_bias)
                start += n
        n, r = self.shape.d_state, self.shape.dt_rank
        t, B, C = self.x_proj(xc).split([r, n, n], dim=-1)
        if self.norms is not None:
            t, B, C = (norm(v.contiguous()) for norm, v in zip(self.norms, (t, B, C)))
        dt = F.softplus(self.dt_proj(t).float())  # [T, inner]
        A = -self.A_log.exp()  # [inner, N]
        u, B, C = xc.float(), B.float(), C.float()
        # each channel a head of one dim with its own decay per state, all reading the one B and C
        if meta.is_decode_only:
            y = ssm_scan.selective_state_update(u[:, :, None], dt, A, B[:, None], C[:, None], self.D[:, None],
                                                state.ssm, slots)[:, :, 0]
        else:
            y = torch.empty_like(u)
            start = 0
            for i, n_tok in enumerate(meta.query_lens_list):
                sl, slot = slice(start, start + n_tok), int(slots[i])
                y[sl] = ssm_scan.selective_scan(u[sl, :, None], dt[sl], A, B[sl, None], C[sl, None],
                                                self.D[:, None], state.ssm[slot])[:, :, 0]
                start += n_tok
        return self.out_proj((y * F.silu(z.float())).to(self.dtype))

    # ---- the checkpoint

    def load(self, src, p: str) -> None:
        """Weights under the prefix `p` ('model.layers.0.mamba.'), this rank's channels only."""
        s = self.shape
        c0, cl = self.channel_start, self.inner_local
        self.in_proj.load(fused_readers(src, p + "in_proj.weight", [s.inner, s.inner], s.hidden),
                          fused_readers(src, p + "in_proj.bias", [s.inner, s.inner]) if s.proj_bias else None)
        conv = src.load(p + "conv1d.weight", (s.inner, 1, s.conv_kernel), dim=0, start=c0, length=cl)
        self.conv_weight.data.copy_(conv[:, 0])
        if self.conv_bias is not None:
            self.conv_bias.data.copy_(src.load(p + "conv1d.bias", (s.inner,), dim=0, start=c0, length=cl))
        self.x_proj.load(reader(src, p + "x_proj.weight", (s.dt_rank + 2 * s.d_state, s.inner)))
        self.dt_proj.load(reader(src, p + "dt_proj.weight", (s.inner, s.dt_rank)),
                          reader(src, p + "dt_proj.bias", (s.inner,)))
        if self.norms is not None:
            for norm, name, size in zip(self.norms, ("dt", "b", "c"), (s.dt_rank, s.d_state, s.d_state)):
                norm.weight.data.copy_(src.load(f"{p}{name}_layernorm.weight", (size,)))
        self.A_log.data.copy_(src.load(p + "A_log", (s.inner, s.d_state), dim=0, start=c0, length=cl))
        self.D.data.copy_(src.load(p + "D", (s.inner,), dim=0, start=c0, length=cl))
        self.out_proj.load(reader(src, p + "out_proj.weight", (s.hidden, s.inner)),
                           reader(src, p + "out_proj.bias", (s.hidden,)) if s.proj_bias else None)
