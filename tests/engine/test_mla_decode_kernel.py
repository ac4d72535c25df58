"""The AMX MLA decode kernel (csrc/cpu_amx_decode_attention.cpp): every head of a sequence against its latent cache entries
in tile products. Against attention written out in torch over the same bfloat16 entries (one-token queries, paged
blocks in shuffled order, head counts that are not a multiple of the kernel's 16, contexts from 1 token to several
key steps, DeepSeek V3's own widths: 576 values, past the generic kernel's 256), and in the engine: a bfloat16
DeepSeek V3 decodes through it with the same tokens and logprobs (to bfloat16's precision) as through the generic
attention backend. Skipped where the CPU tier has no AMX (the generic kernel, tested everywhere, serves there)."""

from __future__ import annotations

import pytest
import torch

from shoal.engine import LLM, SamplingParams
from shoal.engine.execution.layers import mla

pytestmark = pytest.mark.numerics


@pytest.fixture(scope="module")
def kernel():
    op = mla.amx_decode_op()
    if op is None:
        pytest.skip("this CPU tier has no AMX tiles: MLA decodes through the generic attention kernel")
    return op


def reference(q, cache, tables, lens, rank, scale):
    bs = cache.shape[1]
    out = torch.zeros(q.shape[0], q.shape[1], rank)
    for b, n in enumerate(lens.tolist()):
        pos = torch.arange(n)
        entries = cache[tables[b, pos // bs].long(), pos % bs, 0].float()  # [n, D]
        p = torch.softmax((q[b].float() @ entries.T) * scale, dim=-1)
        out[b] = p @ entries[:, :rank]
    return out


@pytest.mark.parametrize("heads,rank,rope,block_size,lens", [
    (16, 128, 32, 16, [1, 5, 33, 200]),  # the bench preset's widths; 1 key, a partial step, several steps
    (20, 64, 32, 4, [7, 64, 3]),  # a second, partial head group; small blocks
    (128, 512, 64, 16, [70, 31]),  # DeepSeek V3's 128 heads and 512 + 64 latent
])
def test_kernel_equals_attention_over_the_entries(kernel, heads, rank, rope, block_size, lens):
    torch.manual_seed(0)
    width = rank + rope
    blocks = [-(-n // block_size) for n in lens]
    cache = torch.randn(sum(blocks) + 2, block_size, 1, width).bfloat16()
    order = (torch.randperm(sum(blocks)) + 1).int()  # block 0 unused: a table's padding points there
    tables = torch.zeros(len(lens), max(blocks), dtype=torch.int32)
    start = 0
    for b, n in enumerate(blocks):
        tables[b, :n] = order[start:start + n]
        start += n
    q = torch.randn(len(lens), heads, width).bfloat16()
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    out = torch.full((len(lens), heads, rank), float("nan")).bfloat16()
    kernel(out, q, cache, tables, seq_lens, rank, width ** -0.5)
    want = reference(q, cache, tables, seq_lens, rank, width ** -0.5)
    # Probabilities are rounded to bfloat16 before P V (as the generic kernel and FlashAttention do).
    torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)


def test_a_padding_row_without_context_is_zero(kernel):
    q = torch.randn(2, 16, 96).bfloat16()
    cache = torch.randn(3, 4, 1, 96).bfloat16()
    out = torch.full((2, 16, 64), float("nan")).bfloat16()
    kernel(out, q, cache, torch.tensor([[1], [2]], dtype=torch.int32), torch.tensor([3, 0], dtype=torch.int32), 64,
           0.1)
    assert torch.isfinite(out[0].float()).all() and (out[1] == 0).all()


def test_bfloat16_deepseek_decodes_through_the_kernel(kernel, model_factory, monkeypatch):
    """Latent widths the kernel takes (64 + 32): its decode steps equal the generic backend's to bf16 precision."""
    model = model_factory("deepseek_v3", kv_lora_rank=64, qk_rope_head_dim=32)
    prompts = ["the cat sat on the mat", "Kubernetes runs pods on nodes", "one two three four"]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
    calls = []

    def counting():
        calls.append(1)
        return kernel

    runs = {}
    for name, op in (("kernel", counting), ("generic", lambda: None)):
        monkeypatch.setattr(mla, "amx_decode_op", op)
        with LLM(model=model, dtype="bfloat16", block_size=16, max_model_len=128) as llm:
            runs[name] = llm.generate(prompts, params, use_tqdm=False)
    assert calls, "the decode steps never reached the kernel"
    for a, b in zip(runs["kernel"], runs["generic"]):
        x, y = a.outputs[0], b.outputs[0]
        assert x.token_ids[:3] == y.token_ids[:3]  # random weights: a later near-tie may go either way in bf16
        for t, la, lb in zip(x.token_ids[:3], x.logprobs[:3], y.logprobs[:3]):
            assert la[t].logprob == pytest.approx(lb[t].logprob, abs=0.1)
