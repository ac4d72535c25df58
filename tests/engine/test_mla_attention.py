"""MLA's weight-absorbed attention over the latent cache equals attention with up-projected keys and values (the
formulation transformers runs), on every CPU-reachable attention backend: the C++ cpu kernel, SDPA, and the Triton
kernel under its interpreter; for a prefill and a decode step, over a float32 and an fp8 latent cache."""

from __future__ import annotations

import os
import sys

import pytest
import torch

if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from shoal.engine.execution.attention import select_backend
from shoal.engine.execution.attention.base import AttentionMetadata
from shoal.engine.execution.layers.mla import LatentAttention, LatentKVCache, softmax_scale
from shoal.engine.execution.layers.rotary import RotaryEmbedding
from shoal.engine.execution.runner import attention_metadata, dummy_step_inputs

pytestmark = pytest.mark.numerics

T, BLOCK = 11, 4  # an 11-token prefill over 4-token blocks, then one decode token


def mla_config(kv_lora_rank: int = 32, rope: int = 8):
    from transformers import DeepseekV3Config

    return DeepseekV3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None,
                            kv_lora_rank=kv_lora_rank, qk_rope_head_dim=rope, qk_nope_head_dim=16, v_head_dim=12,
                            max_position_embeddings=64, rope_parameters={"rope_type": "default", "rope_theta": 1e4})


def make_layer(config, backend_name: str) -> LatentAttention:
    width = config.kv_lora_rank + config.qk_rope_head_dim
    backend = select_backend(backend_name, torch.device("cpu"), uses_alibi=False, dtype=torch.float32,
                             block_size=BLOCK, head_dim=width, num_heads=4, num_kv_heads=1)
    layer = LatentAttention(config, torch.float32, backend,
                            RotaryEmbedding(config, config.qk_rope_head_dim, 64, torch.float32))
    gen = torch.Generator().manual_seed(0)
    for p in layer.parameters():
        p.data.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return layer


def up_projected_reference(layer: LatentAttention, h: torch.Tensor) -> torch.Tensor:
    """Causal attention of all tokens of h, keys and values up-projected per head from the latent (transformers)."""
    n, H, r, nope, rope, v_dim = h.shape[0], layer.num_heads, layer.rank, layer.nope, layer.rope, layer.v_dim
    angles = torch.outer(torch.arange(n).float(), 1.0 / (1e4 ** (torch.arange(0, rope, 2).float() / rope)))
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)

    def rope_(x):  # x * cos + rotate_half(x) * sin
        shape = (n,) + (1,) * (x.dim() - 2) + (rope,)
        return x * cos.view(shape) + torch.cat([-x[..., rope // 2:], x[..., :rope // 2]], -1) * sin.view(shape)

    q = layer.q_proj(h).view(n, H, nope + rope)
    latent = layer.kv_a_proj_with_mqa(h)
    c = layer.kv_a_layernorm(latent[:, :r].contiguous())
    kv = (c @ layer.kv_b.t()).view(n, H, nope + v_dim)
    k = torch.cat([kv[..., :nope], rope_(latent[:, r:]).unsqueeze(1).expand(n, H, rope)], -1)
    query = torch.cat([q[..., :nope], rope_(q[..., nope:])], -1)
    scores = torch.einsum("qhd,khd->hqk", query, k) * layer.attn.scale
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), kv[..., nope:])
    return layer.o_proj(out.reshape(n, H * v_dim))


def decode_metadata(position: int) -> AttentionMetadata:
    blocks = -(-(position + 1) // BLOCK)
    return AttentionMetadata(slot_mapping=torch.tensor([position]), query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
                             seq_lens=torch.tensor([position + 1], dtype=torch.int32),
                             block_tables=torch.arange(blocks, dtype=torch.int32).unsqueeze(0), max_query_len=1,
                             max_seq_len=position + 1, query_lens_list=[1], seq_lens_list=[position + 1],
                             is_decode_only=True)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
@pytest.mark.parametrize("backend,width", [("cpu", 40), ("sdpa", 40), ("triton", 40),
                                           ("sdpa", 576)])  # DeepSeek V3's latent: 512 + 64 rope dims
def test_absorbed_attention_equals_up_projected(backend, width, kv_cache_dtype):
    config = mla_config(32, 8) if width == 40 else mla_config(512, 64)
    if backend == "triton":
        pytest.importorskip("triton")
        from shoal.engine.execution.attention.triton_attn import TritonAttentionBackend

        if not TritonAttentionBackend.is_available(torch.device("cpu"))[0]:
            pytest.skip("triton was imported without TRITON_INTERPRET=1")
    layer = make_layer(config, backend)
    assert layer.attn.scale == pytest.approx(softmax_scale(config)) == pytest.approx((16 + config.qk_rope_head_dim) ** -0.5)
    gen = torch.Generator().manual_seed(1)
    h = torch.randn(T + 1, 64, generator=gen)
    ref = up_projected_reference(layer, h)
    cache = LatentKVCache.allocate(4, BLOCK, 1, width, torch.float32, torch.device("cpu"), kv_cache_dtype)
    with torch.inference_mode():
        prefill = layer(h[:T], torch.arange(T), cache, attention_metadata(dummy_step_inputs(T, BLOCK)))
        decode = layer(h[T:], torch.tensor([T]), cache, decode_metadata(T))
    got = torch.cat([prefill, decode])
    if kv_cache_dtype == "auto":
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    else:  # e4m3 latents: a few percent of the output's scale
        assert (got - ref).norm() / ref.norm() < 0.08
        assert (got - ref).abs().max() > 0  # the fp8 cache was in use
