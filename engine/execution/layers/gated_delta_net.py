"""Gated DeltaNet (Qwen3-Next's linear-attention layer) over a flat batch, with each sequence's state in a slot.

Per token t of a sequence, with the state S (one [k_dim, v_dim] matrix per value head):
    S <- exp(g_t) S;   u_t = beta_t (v_t - S^T k_t);   S <- S + k_t u_t^T;   o_t = S^T q_t
where q and k are L2-normalised (q also scaled by k_dim^-1/2), beta = sigmoid(b) and the log-decay
g = -exp(A_log) * softplus(a + dt_bias). Before that, q|k|v go through a depthwise causal conv1d (kernel K, SiLU)
whose last K-1 inputs are the sequence's conv state; after it, o is RMS-normalised per head and gated by SiLU(z).

On CPU prefill runs the recurrence token by token in C++ and decode the conv and delta-rule step fused, in place on
the slots (layers/ssm_scan.py); on CUDA decode runs the Triton kernels of layers/ssm_triton.py (the same interface).
Elsewhere, and without a compiler, prefill uses the chunked form (chunks of CHUNK tokens, one triangular solve each;
derivation in `chunk_delta_rule`), decode the single-step recurrence batched over sequences. Both read and write
the sequence's slot of the layer's `RecurrentState`, so a prompt split over several steps (chunked prefill) carries
its state from one step to the next; a sequence whose step starts at position 0 starts from a zero state.

Tensor parallelism splits the key heads (and the value heads each serves): in_proj_qkvz and in_proj_ba keep their
rows grouped by key head, so a rank's rows are one contiguous range; the conv channels, A_log and dt_bias are
sliced to the same heads and out_proj is row-parallel (one all-reduce).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from shoal.engine.distributed.parallel_state import divide, get_parallel_state
from shoal.engine.execution.layers import ssm_scan
from shoal.engine.execution.layers.causal_conv import causal_conv_chunk, causal_conv_step
from shoal.engine.execution.layers.linear import ColumnParallelLinear, RowParallelLinear
from shoal.engine.execution.models.base import reader

CHUNK = 64


@dataclass
class RecurrentState:
    """One linear layer's per-sequence state, indexed by state slot."""

    conv: torch.Tensor  # [slots, channels, K - 1], the model's dtype
    ssm: torch.Tensor  # [slots, v_heads, k_dim, v_dim], float32

    @property
    def nbytes(self) -> int:
        return self.conv.nbytes + self.ssm.nbytes

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """State of slots src into slots dst (prefix-cache checkpoints: take one, or start a sequence from one;
        speculative decoding's backups)."""
        if self.ssm.device.type == "cuda":  # one gather/scatter kernel per tensor, not a launch per slot
            self.conv[dst] = self.conv[src]
            self.ssm[dst] = self.ssm[src]
            return
        # On the CPU a copy_ per slot moves each state once (indexing gathers into a temporary first): ~4x faster
        # for Qwen3-Next-sized states (2 MiB a layer).
        for a, b in zip(src.tolist(), dst.tolist()):
            self.conv[b].copy_(self.conv[a])
            self.ssm[b].copy_(self.ssm[a])

    def zero_new_sequences(self, meta) -> None:
        """Sequences of this step starting at position 0 start from a zero state (their slot may hold another's)."""
        fresh = [i for i, (n, s) in enumerate(zip(meta.query_lens_list, meta.seq_lens_list)) if s == n]
        if fresh:
            idx = meta.state_slots[fresh]
            self.conv.index_fill_(0, idx, 0)
            self.ssm.index_fill_(0, idx, 0)


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6)


def chunk_delta_rule(q, k, v, g, beta, state, chunk: int = CHUNK):
    """One sequence, float32. q, k: [H, T, dk]; v: [H, T, dv]; g, beta: [H, T]; state: [H, dk, dv] (updated in
    place). Returns o [H, T, dv].

    Within a chunk let G_t = g_1 + ... + g_t and S0 the state before it. Unrolling the recurrence,
        u_t = beta_t v_t - beta_t e^{G_t} S0^T k_t - sum_{s<t} beta_t e^{G_t - G_s} (k_t . k_s) u_s
    i.e. (I + A) U = beta V - (beta e^G K) S0 with A strictly lower triangular: one unit-triangular solve. Then
        o_t = e^{G_t} S0^T q_t + sum_{s<=t} e^{G_t - G_s} (q_t . k_s) u_s,
        S_end = e^{G_L} S0 + sum_s e^{G_L - G_s} k_s u_s^T."""
    H, T, dk = q.shape
    out = torch.empty(H, T, v.shape[-1], dtype=torch.float32, device=q.device)
    for a in range(0, T, chunk):
        b = min(a + chunk, T)
        qc, kc, vc, bc = q[:, a:b], k[:, a:b], v[:, a:b], beta[:, a:b, None]
        G = g[:, a:b].cumsum(-1)  # [H, L]
        L = b - a
        diff = G[:, :, None] - G[:, None, :]  # G_t - G_s
        lower = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
        decay = torch.where(lower, diff, float("-inf")).exp()  # e^{G_t - G_s} for s <= t, else 0
        eye = torch.eye(L, dtype=torch.float32, device=q.device)
        system = eye + bc * (kc @ kc.transpose(1, 2)) * decay * (1 - eye)
        rhs = bc * vc - (bc * G.exp()[..., None] * kc) @ state
        u = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
        out[:, a:b] = (G.exp()[..., None] * qc) @ state + ((qc @ kc.transpose(1, 2)) * decay) @ u
        last = G[:, -1:]
        state.mul_(last.exp()[..., None]).add_(((last - G).exp()[..., None] * kc).transpose(1, 2) @ u)
    return out


def recurrent_step(q, k, v, g, beta, state):
    """One token of each of B sequences, float32. q, k: [B, H, dk]; v: [B, H, dv]; g, beta: [B, H];
    state: [B, H, dk, dv] (a gathered copy, returned updated). Returns (o [B, H, dv], state)."""
    state = state * g.exp()[..., None, None]
    u = beta[..., None] * (v - torch.einsum("bhkv,bhk->bhv", state, k))
    state = state + k[..., :, None] * u[..., None, :]
    return torch.einsum("bhkv,bhk->bhv", state, q), state


class GatedDeltaNet(nn.Module):
    def __init__(self, config, dtype: torch.dtype):
        super().__init__()
        ps = get_parallel_state()
        self.hidden = config.hidden_size
        self.nk, self.nv = config.linear_num_key_heads, config.linear_num_value_heads
        self.dk, self.dv = config.linear_key_head_dim, config.linear_value_head_dim
        self.kernel = config.linear_conv_kernel_dim
        if self.nv % self.nk:
            raise ValueError(f"linear_num_value_heads ({self.nv}) must be a multiple of linear_num_key_heads "
                             f"({self.nk})")
        self.ratio = self.nv // self.nk
        self.nk_local = divide(self.nk, ps.tp_size, "linear_num_key_heads")
        self.nv_local = self.nk_local * self.ratio
        self.head_start = ps.tp_rank * self.nk_local  # first key head of this rank
        self.eps = config.rms_norm_eps
        self.channels = 2 * self.nk_local * self.dk + self.nv_local * self.dv
        self.make_in_proj(dtype)
        self.conv_weight = nn.Parameter(torch.empty(self.channels, self.kernel, dtype=dtype), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(self.nv_local, dtype=torch.float32), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(self.nv_local, dtype=torch.float32), requires_grad=False)
        self.norm_weight = nn.Parameter(torch.ones(self.dv, dtype=dtype), requires_grad=False)
        self.out_proj = RowParallelLinear(self.nv * self.dv, self.hidden, False, dtype)
        self.dtype = dtype

    # ---- the state

    def state_bytes(self) -> int:
        """Bytes of one sequence's state in this layer (conv in the model's dtype, recurrence in float32)."""
        conv = self.channels * (self.kernel - 1) * torch.finfo(self.dtype).bits // 8
        return conv + self.nv_local * self.dk * self.dv * 4

    def allocate_state(self, slots: int, device) -> RecurrentState:
        return RecurrentState(torch.zeros(slots, self.channels, self.kernel - 1, dtype=self.dtype, device=device),
                              torch.zeros(slots, self.nv_local, self.dk, self.dv, dtype=torch.float32, device=device))

    # ---- the input projections (a checkpoint layout: Qwen3.5's keeps them apart, models/qwen3_5.py)

    def make_in_proj(self, dtype: torch.dtype) -> None:
        """Qwen3-Next's two fused projections, their rows grouped by key head."""
        self.in_proj_qkvz = ColumnParallelLinear(self.hidden, self.nk * (2 * self.dk + 2 * self.ratio * self.dv),
                                                 False, dtype)
        self.in_proj_ba = ColumnParallelLinear(self.hidden, self.nk * 2 * self.ratio, False, dtype)

    def load_in_proj(self, src, p: str) -> None:
        h, nk, dk, dv, r = self.hidden, self.nk, self.dk, self.dv, self.ratio
        self.in_proj_qkvz.load(reader(src, p + "in_proj_qkvz.weight", (nk * (2 * dk + 2 * r * dv), h)))
        self.in_proj_ba.load(reader(src, p + "in_proj_ba.weight", (nk * 2 * r, h)))

    def _split(self, h: torch.Tensor):
        """Project and regroup: mixed q|k|v [T, channels] (the conv's input), z [T, nv, dv], b and a [T, nv]."""
        T, nk, dk, dv, r = h.shape[0], self.nk_local, self.dk, self.dv, self.ratio
        qkvz = self.in_proj_qkvz(h).view(T, nk, 2 * dk + 2 * r * dv)
        q, k, v, z = qkvz.split([dk, dk, r * dv, r * dv], dim=-1)
        ba = self.in_proj_ba(h).view(T, nk, 2 * r)
        b, a = ba.split([r, r], dim=-1)
        mixed = torch.cat([q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)], dim=-1)
        return mixed, z.reshape(T, self.nv_local, dv), b.reshape(T, -1), a.reshape(T, -1)

    # ---- the step

    def _qkv_heads(self, mixed: torch.Tensor, repeat: bool = True):
        """Conv output [..., channels] -> float32 q, k (L2-normalised, q scaled, repeated per value head unless
        `repeat` is False: [..., nk, dk]) and v [..., nv, dv]."""
        kd = self.nk_local * self.dk
        q, k, v = mixed.float().split([kd, kd, self.nv_local * self.dv], dim=-1)
        shape = mixed.shape[:-1]
        q = _l2norm(q.reshape(*shape, self.nk_local, self.dk)) * self.dk ** -0.5
        k = _l2norm(k.reshape(*shape, self.nk_local, self.dk))
        if self.ratio > 1 and repeat:
            q, k = q.repeat_interleave(self.ratio, dim=-2), k.repeat_interleave(self.ratio, dim=-2)
        return q, k, v.reshape(*shape, self.nv_local, self.dv)

    def forward(self, h: torch.Tensor, positions, state: RecurrentState, meta) -> torch.Tensor:
        mixed, z, b, a = self._split(h)
        slots = meta.state_slots
        qlens = meta.query_lens_list
        state.zero_new_sequences(meta)
        fused = ssm_scan.decode_kernels(h.device) if meta.is_decode_only else None
        if fused is not None:
            out = self._decode_fused(fused, mixed, a, b, state, slots)
        elif meta.is_decode_only:
            out = self._decode(mixed, *self._gates(a, b), state, slots)
        else:
            g, beta = self._gates(a, b)
            out = torch.empty(h.shape[0], self.nv_local, self.dv, dtype=torch.float32, device=h.device)
            start = 0
            for i, n in enumerate(qlens):
                sl = slice(start, start + n)
                out[sl] = self._prefill(mixed[sl], g[sl], beta[sl], state, int(slots[i]))
                start += n
        return self.out_proj(self._gated_norm(out, z).reshape(h.shape[0], -1))

    def _gates(self, a, b):
        """The log-decay g = -exp(A_log) softplus(a + dt_bias) and beta = sigmoid(b), float32 [T, nv]."""
        return -self.A_log.exp() * F.softplus(a.float() + self.dt_bias), b.float().sigmoid()

    def _decode_fused(self, fused, mixed, a, b, state, slots):
        """The decode step in fused kernels (Triton's on GPU, C++ on CPU: layers/ssm_scan.decode_kernels), the state
        updated in its slots in place."""
        conv = fused.causal_conv1d_update(mixed, state.conv, self.conv_weight, None, slots)
        return fused.gated_delta_rule_step(conv, a, b, self.A_log, self.dt_bias, state.ssm, slots, self.nk_local)

    def _decode(self, mixed, g, beta, state, slots):
        conv = causal_conv_step(mixed, state, slots, self.conv_weight, None)
        q, k, v = self._qkv_heads(conv)
        o, new = recurrent_step(q, k, v, g, beta, state.ssm[slots])
        state.ssm[slots] = new
        return o

    def _prefill(self, mixed, g, beta, state, slot: int):
        conv = causal_conv_chunk(mixed, state, slot, self.conv_weight, None)
        kernels = ssm_scan.kernels_for(mixed)
        if kernels is not None:  # the recurrence token by token in C++, each head's state kept in cache
            q, k, v = self._qkv_heads(conv, repeat=False)
            return ssm_scan.gated_delta_scan(kernels, q, k, v, g, beta, state.ssm[slot])
        q, k, v = self._qkv_heads(conv)
        o = chunk_delta_rule(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), g.t(), beta.t(),
                             state.ssm[slot])
        return o.transpose(0, 1)

    def _gated_norm(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """RMSNorm over each head's dv (rounded to the model's dtype before its weight), then * SiLU(z). The
        recurrence's output is rounded to the model's dtype first, as the reference does."""
        o = o.to(self.dtype).float()
        normed = (o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + self.eps)).to(self.dtype)
        return (self.norm_weight * normed * F.silu(z.float())).to(self.dtype)

    # ---- the checkpoint

    def load(self, src, p: str) -> None:
        """Weights under the prefix `p` ('model.layers.0.linear_attn.'), this rank's key heads only."""
        h, nk, nv, dk, dv, r = self.hidden, self.nk, self.nv, self.dk, self.dv, self.ratio
        self.load_in_proj(src, p)
        channels = 2 * nk * dk + nv * dv
        conv = src.load(p + "conv1d.weight", (channels, 1, self.kernel))[:, 0]
        s, n = self.head_start, self.nk_local
        kd = nk * dk
        parts = [conv[s * dk:(s + n) * dk], conv[kd + s * dk:kd + (s + n) * dk],
                 conv[2 * kd + s * r * dv:2 * kd + (s + n) * r * dv]]
        self.conv_weight.data.copy_(torch.cat(parts))
        heads = dict(dim=0, start=s * r, length=n * r)
        self.A_log.data.copy_(src.load(p + "A_log", (nv,), **heads))
        self.dt_bias.data.copy_(src.load(p + "dt_bias", (nv,), **heads))
        self.norm_weight.data.copy_(src.load(p + "norm.weight", (dv,)))
        self.out_proj.load(reader(src, p + "out_proj.weight", (h, nv * dv)))
