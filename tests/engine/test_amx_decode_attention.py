"""The AMX decode kernel for grouped-query attention (csrc/cpu_amx_decode_attention.cpp, gqa_decode): each kv head's
query heads against its cached keys and values in tile products, chosen by attention/cpu_paged.py for bfloat16
decode steps with a sliding window or a large group. Against attention written out in torch over the same cache
(paged blocks in shuffled order; groups of 1 to 20 heads, past one 16-head tile; contexts from 1 token to several
1,024-key softmax chunks; windows shorter and longer than the context), which steps the backend routes to it, and
in the engine: bfloat16 Gemma 3 (sliding layers) and a Llama with 8 query heads per kv head decode through it with
the same tokens and logprobs (to bfloat16's precision) as through the streaming kernel. Skipped where the CPU tier
has no AMX (the streaming kernel, tested everywhere, serves there)."""

from __future__ import annotations

import pytest
import torch

from shoal.engine import LLM, SamplingParams
from shoal.engine.execution.attention import cpu_paged
from shoal.engine.execution.attention.base import AttentionMetadata

pytestmark = pytest.mark.numerics


@pytest.fixture(scope="module")
def ops():
    found = cpu_paged.amx_decode_ops()
    if found is None:
        pytest.skip("this CPU tier has no AMX tiles: decode attention runs on the streaming kernel")
    return found


def paged_case(lens, heads, kv_heads, head_dim, block_size, seed=0):
    torch.manual_seed(seed)
    blocks = [-(-n // block_size) for n in lens]
    k_cache = torch.randn(sum(blocks) + 2, block_size, kv_heads, head_dim).bfloat16()
    v_cache = torch.randn_like(k_cache)
    order = (torch.randperm(sum(blocks)) + 1).int()  # block 0 unused: a table's padding points there
    tables = torch.zeros(len(lens), max(blocks), dtype=torch.int32)
    start = 0
    for b, n in enumerate(blocks):
        tables[b, :n] = order[start:start + n]
        start += n
    q = torch.randn(len(lens), heads, head_dim).bfloat16()
    return q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32)


def reference(q, k_cache, v_cache, tables, lens, scale, window=0):
    bs, group = k_cache.shape[1], q.shape[1] // k_cache.shape[2]
    out = torch.zeros(q.shape)
    for b, n in enumerate(lens.tolist()):
        pos = torch.arange(max(0, n - window) if window else 0, n)
        blk, off = tables[b, pos // bs].long(), pos % bs
        k = k_cache[blk, off].float().repeat_interleave(group, dim=1)  # [n, H, D]: head h reads kv head h // group
        v = v_cache[blk, off].float().repeat_interleave(group, dim=1)
        p = torch.softmax(torch.einsum("hd,nhd->hn", q[b].float(), k) * scale, dim=-1)
        out[b] = torch.einsum("hn,nhd->hd", p, v)
    return out


@pytest.mark.parametrize("lens,heads,kv_heads,head_dim,block_size,window", [
    ([1, 5, 33, 200], 9, 3, 64, 16, 0),  # SmolLM2's heads; 1 key, a partial step, several steps
    ([7, 64, 3], 8, 1, 128, 4, 0),  # one kv head for all; small blocks
    ([1030, 17], 40, 2, 128, 16, 0),  # 20 heads a group: two tiles; a context past one softmax chunk
    ([2049, 1], 8, 8, 32, 5, 0),  # one head a group; three chunks; blocks that do not divide 16
    ([300, 2500, 90], 4, 1, 256, 16, 128),  # Gemma 3's local layers: a window shorter than the context
    ([300, 40], 9, 3, 64, 16, 1500),  # a window wider than every context: all keys
])
def test_kernel_equals_attention_over_the_cache(ops, lens, heads, kv_heads, head_dim, block_size, window):
    q, k_cache, v_cache, tables, seq_lens = paged_case(lens, heads, kv_heads, head_dim, block_size)
    out = torch.full(q.shape, float("nan")).bfloat16()
    ops.gqa_decode(out, q, k_cache, v_cache, tables, seq_lens, head_dim ** -0.5, window)
    want = reference(q, k_cache, v_cache, tables, seq_lens, head_dim ** -0.5, window)
    # Probabilities are rounded to bfloat16 before P V (as the streaming kernel and FlashAttention do).
    torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)


def test_a_padding_row_without_context_is_zero(ops):
    q, k_cache, v_cache, tables, _ = paged_case([3, 3], 8, 1, 64, 4)
    out = torch.full(q.shape, float("nan")).bfloat16()
    ops.gqa_decode(out, q, k_cache, v_cache, tables, torch.tensor([3, 0], dtype=torch.int32), 0.1, 0)
    assert torch.isfinite(out[0].float()).all() and (out[1] == 0).all()


def test_bad_shapes_are_refused_by_name(ops):
    q, k_cache, v_cache, tables, seq_lens = paged_case([5], 6, 4, 64, 4)  # 6 heads do not group over 4 kv heads
    with pytest.raises(RuntimeError, match="H a multiple of KVH"):
        ops.gqa_decode(torch.empty_like(q), q, k_cache, v_cache, tables, seq_lens, 0.1, 0)
    q, k_cache, v_cache, tables, seq_lens = paged_case([5], 8, 4, 48, 4)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        ops.gqa_decode(torch.empty_like(q), q, k_cache, v_cache, tables, seq_lens, 0.1, 0)


def decode_meta(seq_lens, tables, decode_only=True):
    n = len(seq_lens)
    return AttentionMetadata(
        slot_mapping=torch.zeros(n, dtype=torch.int64), query_start_loc=torch.arange(n + 1, dtype=torch.int32),
        seq_lens=seq_lens, block_tables=tables, max_query_len=1, max_seq_len=int(seq_lens.max()),
        query_lens_list=[1] * n, seq_lens_list=seq_lens.tolist(), is_decode_only=decode_only)


@pytest.mark.parametrize("heads,kv_heads,window,taken", [
    (16, 2, None, True),  # a group of 8
    (8, 2, None, True),  # a group of 4
    (9, 3, None, False),  # a group of 3: the streaming kernel is as fast there
    (9, 3, 16, True),  # a sliding window: the streaming kernel's bf16 fast path has none
])
def test_backend_routes_decode_steps_by_group_and_window(ops, monkeypatch, heads, kv_heads, window, taken):
    q, k_cache, v_cache, tables, seq_lens = paged_case([40, 7], heads, kv_heads, 64, 16)
    calls = []
    real = ops.gqa_decode
    monkeypatch.setattr(cpu_paged, "amx_decode_ops", lambda: type("Ops", (), {
        "gqa_decode": staticmethod(lambda *a: (calls.append(1), real(*a)))})())
    out = cpu_paged.CpuPagedAttentionBackend().forward(q, k_cache, v_cache, decode_meta(seq_lens, tables), 0.125,
                                                       sliding_window=window)
    assert bool(calls) == taken
    want = reference(q, k_cache, v_cache, tables, seq_lens, 0.125, window or 0)
    torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("arch,overrides", [
    ("gemma3", dict(head_dim=32)),  # sliding layers (window 8) beside global ones
    ("llama", dict(head_dim=32, num_attention_heads=16, num_key_value_heads=2)),  # 8 query heads a kv head
])
def test_bfloat16_models_decode_through_the_kernel(ops, model_factory, monkeypatch, arch, overrides):
    model = model_factory(arch, **overrides)
    prompts = ["the cat sat on the mat and looked out", "Kubernetes runs pods on nodes", "one two three four"]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    calls = []

    def counting():
        calls.append(1)
        return ops

    runs = {}
    for name, found in (("kernel", counting), ("streaming", lambda: None)):
        monkeypatch.setattr(cpu_paged, "amx_decode_ops", found)
        with LLM(model=model, dtype="bfloat16", block_size=16, max_model_len=128) as llm:
            runs[name] = llm.generate(prompts, params, use_tqdm=False)
    assert calls, "the decode steps never reached the kernel"
    for a, b in zip(runs["kernel"], runs["streaming"]):
        x, y = a.outputs[0], b.outputs[0]
        assert x.token_ids[:3] == y.token_ids[:3]  # random weights: a later near-tie may go either way in bf16
        for t, la, lb in zip(x.token_ids[:3], x.logprobs[:3], y.logprobs[:3]):
            assert la[t].logprob == pytest.approx(lb[t].logprob, abs=0.1)
