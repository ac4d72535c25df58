"""The fused MoE layer (C++ on CPU, torch, Triton under the interpreter) against a loop over experts and tokens."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shoal.engine.execution.layers import moe
from shoal.engine.execution.layers.moe import fused_experts_torch, select_experts

pytestmark = pytest.mark.numerics


def loop_reference(x, w13, w2, topk_weights, topk_ids, expert_start=0, b13=None, b2=None, clamped=None):
    """One expert at a time, one token at a time: the definition the fused paths must meet. clamped: (alpha, limit)
    of gpt-oss's activation instead of SwiGLU."""
    E, inter = w13.shape[0], w2.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float64)
    for e in range(E):
        for t in range(x.shape[0]):
            for j in range(topk_ids.shape[1]):
                if int(topk_ids[t, j]) == expert_start + e:
                    gate_up = w13[e].double() @ x[t].double() + (0 if b13 is None else b13[e].double())
                    gate, up = gate_up[:inter], gate_up[inter:]
                    if clamped is None:
                        h = F.silu(gate) * up
                    else:
                        alpha, limit = clamped
                        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
                        h = (up + 1) * gate * torch.sigmoid(alpha * gate)
                    y = w2[e].double() @ h + (0 if b2 is None else b2[e].double())
                    out[t] += float(topk_weights[t, j]) * y
    return out.to(x.dtype)


def cpp_path(*args):
    ops, why, _ = moe.load_cpu_kernel()
    if ops is None:
        pytest.skip(f"no C++ toolchain: {why}")
    return ops.fused_experts(*args)


def cpp_gemm_path(*args):
    """The C++ kernel's GEMM-per-expert path, whatever the rows per expert (it streams weight rows for few)."""
    ops, why, _ = moe.load_cpu_kernel()
    if ops is None:
        pytest.skip(f"no C++ toolchain: {why}")
    previous = ops.set_stream_max_rows(0)
    try:
        return ops.fused_experts(*args)
    finally:
        ops.set_stream_max_rows(previous)


def triton_path(*args):
    from shoal.engine.execution.layers import moe_triton

    if moe_triton.triton is None:
        pytest.skip("triton is not installed")
    return moe_triton.fused_experts_triton(*args)


PATHS = {"cpp": cpp_path, "cpp-gemm": cpp_gemm_path, "torch": fused_experts_torch, "triton": triton_path}


def make_case(tokens, experts, hidden, inter, top_k, seed=0, ids=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g) * 0.2
    w2 = torch.randn(experts, hidden, inter, generator=g) * 0.2
    logits = torch.randn(tokens, experts, generator=g)
    weights, routed = select_experts(logits, top_k, renormalize=True)
    return x, w13, w2, weights, routed if ids is None else ids


@pytest.mark.parametrize("path", list(PATHS))
# cpp: up to 32 rows per expert stream weight rows (every case but the last), more run GEMMs; cpp-gemm: GEMMs always.
@pytest.mark.parametrize("tokens,experts,top_k", [(1, 4, 2), (7, 4, 2), (37, 8, 2), (20, 6, 3), (160, 4, 2)])
def test_fused_experts_match_loop(path, tokens, experts, top_k):
    x, w13, w2, weights, ids = make_case(tokens, experts, hidden=32, inter=24, top_k=top_k)
    got = PATHS[path](x, w13, w2, weights, ids, 0)
    torch.testing.assert_close(got, loop_reference(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("activation", ["silu", "swiglu_clamped"])
def test_bfloat16_streaming_and_gemm_paths_agree(activation):
    """bf16 (AVX512-BF16 dot products where the CPU tier has them, converted floats elsewhere): the streaming path and
    the GEMM path round the same intermediates, so they agree to float32 summation order, and both track the loop."""
    from shoal.engine.execution.layers.moe import ExpertActivation

    x, w13, w2, weights, ids = make_case(24, 8, hidden=64, inter=96, top_k=2, seed=7)
    g = torch.Generator().manual_seed(8)
    b13, b2 = torch.randn(8, 192, generator=g).bfloat16(), torch.randn(8, 64, generator=g).bfloat16()
    act = ExpertActivation(activation, limit=1.5)
    args = (x.bfloat16(), w13.bfloat16(), w2.bfloat16(), weights, ids, 0, b13, b2, act.kernel_id, act.alpha, act.limit)
    stream, gemm = cpp_path(*args), cpp_gemm_path(*args)
    assert stream.dtype == torch.bfloat16
    torch.testing.assert_close(stream.float(), gemm.float(), rtol=2e-2, atol=2e-2)
    ref = loop_reference(*(t.bfloat16().float() for t in (x, w13, w2)), weights, ids, 0, b13.float(), b2.float(),
                         None if activation == "silu" else (act.alpha, act.limit))
    assert (stream.float() - ref).abs().max() <= 0.03 * ref.abs().max()


@pytest.mark.parametrize("path", list(PATHS))
def test_biased_clamped_experts_match_loop(path):
    """gpt-oss's experts: biases on both projections and the clamped SwiGLU (a limit low enough that the clamps bite
    on both sides), on all experts and on a rank holding experts [2, 4) only."""
    from shoal.engine.execution.layers.moe import ExpertActivation

    x, w13, w2, weights, ids = make_case(11, 4, hidden=32, inter=24, top_k=2, seed=5)
    g = torch.Generator().manual_seed(6)
    b13, b2 = torch.randn(4, 48, generator=g), torch.randn(4, 32, generator=g)
    act = ExpertActivation("swiglu_clamped", alpha=1.702, limit=1.5)
    args = (1.702, 1.5)
    cpp_args = (act.kernel_id, act.alpha, act.limit) if path.startswith("cpp") else (act,)
    got = PATHS[path](x, w13, w2, weights, ids, 0, b13, b2, *cpp_args)
    gate_up = x @ w13[0].t()
    assert (gate_up > 1.5).any() and (gate_up[:, 24:] < -1.5).any()
    torch.testing.assert_close(got, loop_reference(x, w13, w2, weights, ids, 0, b13, b2, args), rtol=1e-5, atol=1e-5)
    upper = PATHS[path](x, w13[2:].contiguous(), w2[2:].contiguous(), weights, ids, 2, b13[2:].contiguous(),
                        b2[2:].contiguous(), *cpp_args)
    torch.testing.assert_close(upper, loop_reference(x, w13[2:], w2[2:], weights, ids, 2, b13[2:], b2[2:], args),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("path", list(PATHS))
def test_experts_without_tokens_and_other_ranks_experts(path):
    """8 experts, 3 tokens routed to experts 1, 5 and 6 only: the idle experts contribute nothing, and a rank holding
    experts [4, 8) (expert parallel) computes exactly the pairs routed to them."""
    x, w13, w2, weights, _ = make_case(3, 8, hidden=16, inter=16, top_k=2, seed=1)
    ids = torch.tensor([[5, 1], [1, 6], [6, 5]])
    full = PATHS[path](x, w13, w2, weights, ids, 0)
    torch.testing.assert_close(full, loop_reference(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)
    upper = PATHS[path](x, w13[4:].contiguous(), w2[4:].contiguous(), weights, ids, 4)
    torch.testing.assert_close(upper, loop_reference(x, w13[4:], w2[4:], weights, ids, 4), rtol=1e-5, atol=1e-5)
    lower = PATHS[path](x, w13[:4].contiguous(), w2[:4].contiguous(), weights, ids, 0)
    torch.testing.assert_close(lower + upper, full, rtol=1e-5, atol=1e-5)
    # No pair routed to this rank at all: zeros of the right shape.
    none = PATHS[path](x, w13[2:4].contiguous(), w2[2:4].contiguous(), weights, ids, 2)
    assert none.shape == x.shape and not none.any()


def test_routing_ties_pick_like_topk_and_split_weight_evenly():
    # Equal logits: softmax is uniform, torch.topk decides which experts (the same rule transformers uses).
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [1.0, 3.0, 3.0, -2.0]])
    weights, ids = select_experts(logits, 2, renormalize=True)
    ref_w, ref_ids = torch.topk(torch.softmax(logits, -1), 2, dim=-1)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, torch.full((2, 2), 0.5))
    x, w13, w2, _, _ = make_case(2, 4, hidden=16, inter=8, top_k=2, seed=2)
    for path in ("cpp", "cpp-gemm", "torch", "triton"):
        got = PATHS[path](x, w13, w2, weights, ids, 0)
        torch.testing.assert_close(got, loop_reference(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)


def test_select_experts_scoring_and_normalisation():
    logits = torch.randn(5, 6, generator=torch.Generator().manual_seed(3))
    w, ids = select_experts(logits, 2, renormalize=False)
    ref_w, ref_ids = torch.topk(torch.softmax(logits, -1), 2)
    assert torch.equal(ids, ref_ids) and torch.allclose(w, ref_w)
    w, ids = select_experts(logits, 3, renormalize=False, scoring_func="sigmoid")
    ref_w, ref_ids = torch.topk(torch.sigmoid(logits), 3)
    assert torch.equal(ids, ref_ids) and torch.allclose(w, ref_w)
    w, _ = select_experts(logits, 3, renormalize=True, scoring_func="sigmoid")
    torch.testing.assert_close(w.sum(-1), torch.ones(5))
    with pytest.raises(ValueError, match="scoring_func 'relu' is not supported"):
        select_experts(logits, 2, True, scoring_func="relu")


def test_align_by_expert_groups_and_pads_each_expert():
    from shoal.engine.execution.layers.moe_triton import align_by_expert

    expert_of_slot = torch.tensor([2, 0, 2, 3, 2, 0, 3, 2, 1, 2])  # 3 marks "another rank's expert"
    slots, block_expert = align_by_expert(expert_of_slot, num_experts=3, block_m=4)
    S = expert_of_slot.numel()
    assert slots.numel() == block_expert.numel() * 4 == 4 * -(-(S + 3 * 3) // 4)
    for b, e in enumerate(block_expert.tolist()):
        block = [s for s in slots[4 * b:4 * b + 4].tolist() if s < S]
        if e < 0:
            assert not block
        else:
            assert all(int(expert_of_slot[s]) == e for s in block)
    placed = sorted(s for s in slots.tolist() if s < S)
    assert placed == [i for i, e in enumerate(expert_of_slot.tolist()) if e < 3]  # every local slot exactly once


@pytest.mark.parametrize("method,tol", [("int4", 1e-4), ("int8", 0.05)])
def test_quantized_experts_equal_the_dense_math_on_their_weights(method, tol):
    """--quantization on a FusedMoE: each expert quantized once; int4 (weight-only) equals the dense path on the
    dequantized weights, int8 (W8A8: activations quantized per token too) within its activation rounding."""
    from shoal.engine.execution.layers.moe import FusedMoE
    from shoal.engine.execution.quantization import METHODS

    torch.manual_seed(4)
    layer = FusedMoE(num_experts=4, hidden=64, intermediate=64, dtype=torch.float32)
    layer.w13.data.normal_(0, 0.2)
    layer.w2.data.normal_(0, 0.2)
    x = torch.randn(9, 64)
    weights, ids = select_experts(torch.randn(9, 4), 2, renormalize=True)
    ids[0] = torch.tensor([3, 1])  # expert 0 and 2 still get tokens elsewhere or none: both are fine
    layer.quantize(METHODS[method])
    assert not layer.w13.numel() and len(layer.format.pairs) == 4
    w13 = torch.stack([q.dequantize() for q, _ in layer.format.pairs])
    w2 = torch.stack([q.dequantize() for _, q in layer.format.pairs])
    got = layer(x, weights, ids)
    want = loop_reference(x, w13, w2, weights, ids)
    assert (got - want).abs().max() <= tol * want.abs().max(), (got - want).abs().max()


# ------------------------------------------------------------------------- the AMX tile path (AmxBf16Experts)

def amx_ops():
    from shoal.engine.execution.layers import amx_gemm

    ops = moe.load_cpu_kernel()[0]
    if ops is None or amx_gemm.load_kernel() is None or not ops.amx_available():
        pytest.skip("no AMX tiles in this process (the tile path is chosen only at the AMX tier)")
    return ops


def amx_path(x, w13, w2, weights, ids, expert_start=0, b13=None, b2=None, activation=0, alpha=1.702, limit=7.0):
    from shoal.engine.execution.layers import amx_gemm

    return amx_ops().fused_experts_amx(x, amx_gemm.pack(w13), amx_gemm.pack(w2), weights, ids, expert_start, b13,
                                       b2, activation, alpha, limit)


# Rows per expert: a partial tile (1, 7 tokens), more than one tile pass (80 tokens: ~20 rows on each of 8 experts),
# many passes (300); hidden 96: the last down unit holds 32 features, not 64.
@pytest.mark.parametrize("tokens", [1, 7, 80, 300])
@pytest.mark.parametrize("activation", ["silu", "swiglu_clamped"])
def test_amx_experts_match_the_loop_and_the_streaming_path(tokens, activation):
    from shoal.engine.execution.layers.moe import ExpertActivation

    x, w13, w2, weights, ids = make_case(tokens, 8, hidden=96, inter=64, top_k=2, seed=tokens)
    g = torch.Generator().manual_seed(9)
    b13, b2 = torch.randn(8, 128, generator=g).bfloat16(), torch.randn(8, 96, generator=g).bfloat16()
    act = ExpertActivation(activation, limit=1.5)
    args = (x.bfloat16(), w13.bfloat16(), w2.bfloat16(), weights, ids, 0, b13, b2, act.kernel_id, act.alpha, act.limit)
    got = amx_path(*args)
    assert got.dtype == torch.bfloat16 and got.shape == (tokens, 96)
    ref = loop_reference(*(t.bfloat16().float() for t in (x, w13, w2)), weights, ids, 0, b13.float(), b2.float(),
                         None if activation == "silu" else (act.alpha, act.limit))
    assert (got.float() - ref).abs().max() <= 0.03 * ref.abs().max()
    torch.testing.assert_close(got.float(), cpp_path(*args).float(), rtol=2e-2, atol=2e-2)


def test_amx_experts_on_a_rank_holding_some_experts_and_idle_experts():
    x, w13, w2, weights, _ = make_case(3, 8, hidden=32, inter=32, top_k=2, seed=1)
    x, w13, w2 = x.bfloat16(), w13.bfloat16(), w2.bfloat16()
    ids = torch.tensor([[5, 1], [1, 6], [6, 5]])
    full = amx_path(x, w13, w2, weights, ids)
    upper = amx_path(x, w13[4:].contiguous(), w2[4:].contiguous(), weights, ids, 4)
    lower = amx_path(x, w13[:4].contiguous(), w2[:4].contiguous(), weights, ids, 0)
    torch.testing.assert_close((lower.float() + upper.float()), full.float(), rtol=1e-2, atol=1e-2)
    ref = loop_reference(x.float(), w13.float(), w2.float(), weights, ids)
    assert (full.float() - ref).abs().max() <= 0.03 * ref.abs().max()
    none = amx_path(x, w13[2:4].contiguous(), w2[2:4].contiguous(), weights, ids, 2)
    assert none.shape == x.shape and not none.any()
    assert amx_path(x[:0], w13, w2, weights[:0], ids[:0]).shape == (0, 32)


def test_amx_experts_give_a_token_the_same_bits_whatever_its_batch():
    """A decode step's token must not change with who else is in the batch: each row's sums run in one order."""
    x, w13, w2, weights, ids = make_case(40, 4, hidden=64, inter=32, top_k=2, seed=3)
    x, w13, w2 = x.bfloat16(), w13.bfloat16(), w2.bfloat16()
    batch = amx_path(x, w13, w2, weights, ids)
    for t in (0, 17, 39):
        alone = amx_path(x[t:t + 1], w13, w2, weights[t:t + 1], ids[t:t + 1])
        assert torch.equal(alone, batch[t:t + 1])


def test_amx_experts_refuse_mismatched_inputs():
    from shoal.engine.execution.layers import amx_gemm

    ops = amx_ops()
    x, w13, w2, weights, ids = make_case(2, 4, hidden=64, inter=32, top_k=2)
    p13, p2 = amx_gemm.pack(w13.bfloat16()), amx_gemm.pack(w2.bfloat16())
    with pytest.raises(RuntimeError, match="bfloat16"):
        ops.fused_experts_amx(x, p13, p2, weights, ids, 0)
    with pytest.raises(RuntimeError, match="do not match hidden size 32"):
        ops.fused_experts_amx(x[:, :32].bfloat16(), p13, p2, weights, ids, 0)
    with pytest.raises(RuntimeError, match="expert stacks must be"):
        ops.fused_experts_amx(x.bfloat16(), w13.bfloat16(), p2, weights, ids, 0)
    with pytest.raises(RuntimeError, match="b2 must be"):
        ops.fused_experts_amx(x.bfloat16(), p13, p2, weights, ids, 0, None, torch.zeros(4, 63, dtype=torch.bfloat16))


def test_layers_take_the_amx_experts_format_exactly_where_it_runs():
    """plain_experts_format: the tile layout for tile-shaped bf16 stacks where the kernel is available (the dense
    stacks freed, the layer's answer unchanged within bf16 rounding), the stacks as they are otherwise."""
    from shoal.engine.execution.layers import amx_gemm
    from shoal.engine.execution.layers.moe import DENSE_EXPERTS, AmxBf16Experts, FusedMoE, plain_experts_format

    torch.manual_seed(5)
    narrow = FusedMoE(num_experts=4, hidden=64, intermediate=24, dtype=torch.bfloat16)  # 24: not a tile width
    assert plain_experts_format(narrow) is DENSE_EXPERTS
    assert plain_experts_format(FusedMoE(num_experts=4, hidden=64, intermediate=32, dtype=torch.float32)) \
        is DENSE_EXPERTS
    layer = FusedMoE(num_experts=4, hidden=64, intermediate=32, dtype=torch.bfloat16)
    layer.w13.data.normal_(0, 0.2)
    layer.w2.data.normal_(0, 0.2)
    x = torch.randn(9, 64).bfloat16()
    weights, ids = select_experts(torch.randn(9, 4), 2, renormalize=True)
    before = layer(x, weights, ids)
    w13 = layer.w13.data.clone()
    fmt = plain_experts_format(layer)
    available = moe.load_cpu_kernel()[0] is not None and amx_gemm.load_kernel() is not None
    assert isinstance(fmt, AmxBf16Experts) == available
    if not available:
        pytest.skip("no AMX tiles here: the dense stacks stay")
    layer.use(fmt)
    assert not layer.w13.numel() and torch.equal(amx_gemm.unpack(fmt.w13), w13)
    assert fmt.nbytes() == 4 * 3 * 64 * 32 * 2
    torch.testing.assert_close(layer(x, weights, ids).float(), before.float(), rtol=2e-2, atol=2e-2)
