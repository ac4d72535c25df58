"""What every attention backend sees: a flat batch of query tokens over a paged KV cache.

A step's batch is "flat": the new tokens of every scheduled sequence are concatenated (prefill chunks and single
decode tokens alike). Sequence i owns rows query_start_loc[i]:query_start_loc[i+1] of q/k/v; its whole context
(cached tokens followed by the new ones) is `seq_lens[i]` tokens long and lives in the blocks listed in
block_tables[i]. Keys and values of the new tokens are written to the cache (slot_mapping) before attention
runs, so a backend reads every key/value from the cache.

Cache layout per layer (a KVCache): k, v of shape [num_blocks, block_size, num_kv_heads, head_dim].
A token at position p of sequence i sits in block block_tables[i][p // block_size], offset p % block_size;
its slot is block * block_size + offset.

Sliding-window layers (`sliding_window` W) let the query at position p see keys p - W + 1 .. p only. For a model
whose every layer is windowed, the scheduler frees the blocks that slid out of the window and leaves block 0 in
their table entries: a backend must never read keys before a query's window (it skips them or masks them out).
Attention-logit soft-capping (`softcap` c, Gemma 2) turns each scaled score s into c * tanh(s / c).
Attention sinks (`sinks` [num_heads] float32, gpt-oss) add a learned logit per head to every softmax denominator:
p_j = exp(s_j) / (exp(sink) + sum_i exp(s_i)), so a head may attend to nothing; the sink weighs no value.

FP8 KV cache (--kv-cache-dtype fp8): k and v are stored as float8_e4m3fn, each (slot, kv head) row with its own
float32 scale in k_scale / v_scale [num_blocks, block_size, num_kv_heads]: the stored row is x / s with
s = amax(|x|) / 448 (448 is e4m3's largest finite value), so every row uses e4m3's whole range, whatever the
model, without calibration. A backend reads x = float(stored) * s; the scale folds into attention cheaply:
score_j = (q . k_j) * ks_j and out += (p_j * vs_j) * v_j.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: cache slot of each new token
    query_start_loc: torch.Tensor  # [B+1] int32: prefix sums of query lengths
    seq_lens: torch.Tensor  # [B] int32: context length of each sequence after this step's tokens
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0
    max_query_len: int
    max_seq_len: int
    # Python copies of the small per-sequence vectors, for backends that loop or plan on the host.
    query_lens_list: list[int] = field(default_factory=list)
    seq_lens_list: list[int] = field(default_factory=list)
    # True when every sequence has query length 1 (a pure decode step).
    is_decode_only: bool = False
    # Per-step scratch shared by all layers (a backend stores index tensors or masks it builds once per step).
    scratch: dict = field(default_factory=dict)
    # Hybrid models: each sequence's recurrent-state slot ([B] int64; StepInputs.state_slots).
    state_slots: torch.Tensor | None = None
    # Bidirectional image attention (Gemma 3; StepInputs.image_spans): (sequence, first position, end) of each image
    # whose tokens see every token of the same image. A step with spans runs the masked SDPA path (layer.py).
    image_spans: list[tuple[int, int, int]] | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_list)


FP8_DTYPE = torch.float8_e4m3fn
# torch.ops.shoal_cpu_paged.write_fp8 once the C++ cpu attention extension is loaded (cpu_paged.load_kernel sets
# it): quantize + scatter in one pass, bit for bit what the torch ops below produce. None: the torch ops.
fused_cpu_fp8_write = None
fused_cpu_kv_write = None  # torch.ops.shoal_cpu_paged.write_kv likewise: both index_copy_ in one call
FP8_MAX = 448.0  # largest finite float8_e4m3fn value
KV_CACHE_DTYPES = ("auto", "fp8")


_FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., head_dim] -> (float8_e4m3fn values, float32 scales [...]) with x ~= values * scales[..., None].

    One scale per row (per token and kv head): amax / 448, so the row's largest element lands on e4m3's largest
    value. An all-zero row gets scale 1 (0 / 1 = 0 exactly) rather than a 0 that would divide 0 by 0."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    # Clamped: x / scale can round a hair past 448, and e4m3fn has no infinity (out of range would become NaN).
    q = (xf / scale.unsqueeze(-1)).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def dequantize_fp8(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of quantize_fp8, in `dtype` (values [..., head_dim], scales [...])."""
    return (values.float() * scales.unsqueeze(-1)).to(dtype)


@dataclass
class KVCache:
    """One layer's paged cache: k, v [num_blocks, block_size, kv_heads, head_dim]; with an fp8 cache also the
    per-(slot, kv head) float32 scales k_scale, v_scale [num_blocks, block_size, kv_heads] (None otherwise)."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    @classmethod
    def allocate(cls, num_blocks: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, kv_cache_dtype: str = "auto") -> "KVCache":
        shape = (num_blocks, block_size, kv_heads, head_dim)
        if kv_cache_dtype == "auto":
            return cls(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        if kv_cache_dtype != "fp8":
            raise ValueError(f"unknown kv cache dtype {kv_cache_dtype!r}; choose from {', '.join(KV_CACHE_DTYPES)}")
        scales = shape[:3]
        return cls(torch.zeros(shape, dtype=FP8_DTYPE, device=device),
                   torch.zeros(shape, dtype=FP8_DTYPE, device=device),
                   torch.ones(scales, dtype=torch.float32, device=device),
                   torch.ones(scales, dtype=torch.float32, device=device))

    @staticmethod
    def bytes_per_token_head(head_dim: int, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> int:
        """Bytes one token of one kv head takes for K and V together (values plus scales)."""
        if kv_cache_dtype == "fp8":
            return 2 * (head_dim + 4)  # one byte per value, one float32 scale per row
        return 2 * head_dim * torch.finfo(dtype).bits // 8

    @property
    def is_fp8(self) -> bool:
        return self.k_scale is not None

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.k, self.v, self.k_scale, self.v_scale) if t is not None]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def write(self, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        write_kv(k, v, self.k, self.v, slot_mapping, self.k_scale, self.v_scale)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None) -> None:
    """Scatter the new tokens' keys/values ([T, kv_heads, head_dim]) into their cache slots; into an fp8 cache
    (scales given) quantized per (token, kv head), their scales into the same slots of k_scale / v_scale."""
    nb, bs, h, d = k_cache.shape
    if k_scale is None:
        if (fused_cpu_kv_write is not None and k_cache.device.type == "cpu" and k.dtype == k_cache.dtype
                and v.dtype == k.dtype and k.stride(-1) == 1 and v.stride(-1) == 1 and not slot_mapping.is_cuda
                and slot_mapping.dtype == torch.int64):
            fused_cpu_kv_write(k, v, k_cache, v_cache, slot_mapping)
            return
        k_cache.view(nb * bs, h, d).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
        v_cache.view(nb * bs, h, d).index_copy_(0, slot_mapping, v.to(v_cache.dtype))
        return
    if fused_cpu_fp8_write is not None and k_cache.device.type == "cpu" and k.dtype in _FUSED_DTYPES:
        k = k if k.stride(-1) == 1 else k.contiguous()
        v = v if v.stride(-1) == 1 else v.contiguous()
        fused_cpu_fp8_write(k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping)
        return
    for x, cache, scales in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        values, s = quantize_fp8(x)
        # Scattered as bytes: index_copy_ has no float8 kernel on every device.
        cache.view(torch.uint8).view(nb * bs, h, d).index_copy_(0, slot_mapping, values.view(torch.uint8))
        scales.view(nb * bs, h).index_copy_(0, slot_mapping, s)


class AttentionBackend:
    """Computes attention for a flat batch; keys/values are already in the cache."""

    name: str = "base"
    supports_alibi: bool = True
    # A decode step's forward reads only tensor metadata (host-side values at most as upper bounds that size the
    # work), so it can be captured into a graph once and replayed (see execution/graph_capture.py).
    graph_capture_safe: bool = False
    # Reads a float8_e4m3fn cache with per-(slot, kv head) scales (--kv-cache-dtype fp8).
    supports_fp8_kv: bool = False
    fp8_kv_refusal: str = ""  # why not, for the error message
    supports_sinks: bool = False  # adds per-head sink logits to the softmax denominator (gpt-oss)

    @classmethod
    def is_available(cls, device: torch.device) -> tuple[bool, str]:
        """(usable, reason when not) on this device."""
        return True, ""

    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        alibi_slopes: torch.Tensor | None = None,  # [num_heads] float32, this rank's heads only
        k_scale: torch.Tensor | None = None,  # fp8 caches: [num_blocks, block_size, kv_heads] float32
        v_scale: torch.Tensor | None = None,
        sliding_window: int | None = None,  # a query at position p sees keys p - window + 1 .. p only
        softcap: float | None = None,  # scores become softcap * tanh(score / softcap) (Gemma 2)
        sinks: torch.Tensor | None = None,  # [num_heads] float32 sink logits, this rank's heads (gpt-oss)
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        raise NotImplementedError


def check_blocks_and_heads(block_size: int, num_heads: int | None, num_kv_heads: int | None) -> tuple[bool, str]:
    """What every paged backend's check_config asks of the cache and the heads: (usable, reason when not)."""
    if block_size < 1:
        return False, f"block_size must be positive (got {block_size})"
    if num_heads is not None and num_kv_heads is not None and num_heads % num_kv_heads:
        return False, f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
    return True, ""


def explicit_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scale: float,
                       softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention with explicit matmuls in float32, for what SDPA cannot express (soft-capping, sinks): q [B, H, Q, D],
    k/v [B, kvh, L, D] (kvh dividing H), visible: a bool mask broadcastable to [B, H, Q, L]. Returns q's dtype."""
    H, kvh = q.shape[1], k.shape[1]
    if H != kvh:
        k, v = k.repeat_interleave(H // kvh, dim=1), v.repeat_interleave(H // kvh, dim=1)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1)
    else:  # the sink as one more column of the softmax, dropped after it
        sink = sinks.float().view(1, H, 1, 1).expand(*scores.shape[:3], 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return torch.matmul(probs, v.float()).to(q.dtype)
