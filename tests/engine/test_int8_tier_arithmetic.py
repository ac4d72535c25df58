"""The int8 (W8A8) GEMM's integer arithmetic per CPU tier, emulated in torch, against the quantization the kernel
chooses for that tier.

oneDNN's u8 x s8 GEMM runs one of two instruction sequences: with VNNI (`vpdpbusd`, AMX `tdpbusd`) four u8*s8
products are summed straight into int32, exact; without it `vpmaddubsw` adds each *pair* of products into a
saturating int16 and `vpmaddwd` widens the pairs. Shoal's activations are u8 with zero point 128 (1..255), so a pair
reaches 2 * 255 * 127 = 64770 with 8-bit weights and is clipped at 32767; the kernel keeps weights within +-63
wherever the tier's GEMM has no VNNI. These tests run both instruction sequences as the hardware does, on the
operands the kernel produces for each tier (every tier can be emulated on any machine), and check that the tier's
choice of weight range makes the tier's arithmetic exact."""

from __future__ import annotations

import pytest
import torch

from shoal.engine.execution.cpu_features import X86_TIERS, _ONEDNN_ISA, detect
from shoal.engine.execution.quantization.int8 import NO_VNNI_WEIGHT_LIMIT, quantize_rows_int8

pytestmark = pytest.mark.numerics

ZERO_POINT = 128
# Flag sets of real CPUs: (flags, what oneDNN's own dispatch has there when uncapped)
AVX2 = {"avx2", "fma", "f16c"}
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}
CPUS = {
    "haswell / zen2 (AVX2)": AVX2,
    "alder lake (AVX2 + AVX-VNNI)": AVX2 | {"avx_vnni"},
    "skylake-sp (AVX-512, no VNNI)": AVX512,
    "cascade lake (AVX-512 + VNNI)": AVX512 | {"avx512_vnni"},
    "zen4 / cooper lake (AVX512-BF16 + VNNI)": AVX512 | {"avx512_bf16", "avx512_vnni"},
    "sapphire rapids (AMX)": AVX512 | {"avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8"},
}


def quantize_activations_u8(x: torch.Tensor) -> torch.Tensor:
    """The C++ kernel's per-token quantization (quantize_rows_u8): symmetric to +-127, stored as u8 + 128."""
    q, _ = quantize_rows_int8(x)
    return q.to(torch.int32) + ZERO_POINT


def gemm_vnni(xu8: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """vpdpbusd / tdpbusd: groups of four u8*s8 products summed into int32 (no intermediate narrowing)."""
    return xu8.long() @ w.long().t()


def gemm_pairs_int16(xu8: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """vpmaddubsw then vpmaddwd: each adjacent pair of u8*s8 products saturates to int16, pairs sum in int32."""
    k = xu8.shape[1]
    assert k % 2 == 0
    prod = xu8.long()[:, None, :] * w.long()[None, :, :]  # [M, N, K]
    pairs = (prod[..., 0::2] + prod[..., 1::2]).clamp(-32768, 32767)
    return pairs.sum(-1)


def onednn_isa_has_vnni(features) -> bool:
    """Whether oneDNN, under the cap Shoal gives it for this tier (none when uncapped), runs a VNNI int8 GEMM."""
    if features.capped:
        return _ONEDNN_ISA[features.tier] in ("AVX512_CORE_BF16", "AVX512_CORE_AMX")  # both include VNNI
    return bool({"avx512_vnni", "avx_vnni", "amx_int8"} & features.flags)


def tier_gemm(features):
    return gemm_vnni if onednn_isa_has_vnni(features) else gemm_pairs_int16


def shoal_weight_limit(features) -> int:
    return 127 if features.int8_vnni else NO_VNNI_WEIGHT_LIMIT  # as quantization/int8.py picks it


def worst_case_operands(limit: int, k: int = 64, n: int = 6):
    """Activations whose per-token quantization gives 255 (and 1) next to weights at +-limit: the largest pairs."""
    x = torch.ones(3, k)
    x[1] = -1.0
    x[2, ::2] = -1.0
    w = torch.full((n, k), float(limit))
    w[1::2] = -float(limit)
    w[4] = torch.linspace(-limit, limit, k).round()
    return quantize_activations_u8(x), w.to(torch.int8)


def test_the_emulation_sees_the_saturation_it_is_meant_to_catch():
    """8-bit weights through the non-VNNI sequence are wrong; 7-bit weights are exact; VNNI is exact for both."""
    xu8, w8 = worst_case_operands(127)
    assert not torch.equal(gemm_pairs_int16(xu8, w8), gemm_vnni(xu8, w8))
    xu8, w7 = worst_case_operands(NO_VNNI_WEIGHT_LIMIT)
    assert torch.equal(gemm_pairs_int16(xu8, w7), gemm_vnni(xu8, w7))
    # with the zero point taken out, the exact sum is the signed product the scales multiply
    xs8 = xu8 - ZERO_POINT
    assert torch.equal(gemm_vnni(xu8, w7) - ZERO_POINT * w7.long().sum(1), xs8.long() @ w7.long().t())


@pytest.mark.parametrize("cpu", sorted(CPUS))
@pytest.mark.parametrize("cap", [None, *X86_TIERS])
def test_every_tier_chooses_weights_its_int8_gemm_sums_exactly(cpu, cap):
    features = detect(cap=cap or "", flags=frozenset(CPUS[cpu]), arch="x86_64")
    limit = shoal_weight_limit(features)
    gemm = tier_gemm(features)
    xu8, w = worst_case_operands(limit)
    assert torch.equal(gemm(xu8, w), gemm_vnni(xu8, w)), (features.tier, limit)
    # and on the weights the kernel would really build from a layer, next to real-looking activations
    torch.manual_seed(0)
    wq, _ = quantize_rows_int8(torch.randn(16, 128) * 0.05, limit)
    x = torch.randn(5, 128)
    x[:, 3] = 40.0  # an outlier channel, as real residual streams have: the other entries quantize small
    xu8 = quantize_activations_u8(x)
    assert torch.equal(gemm(xu8, wq), gemm_vnni(xu8, wq))


def emulated_kernel(gemm, compensation_error: int = 0):
    """An int8_linear whose integer GEMM is `gemm` over u8 activations (zero point 128), as oneDNN's would be."""

    def kernel(x, w, w_scale, w_zero_point, bias):
        xu8 = quantize_activations_u8(x)
        scale = x.abs().amax(-1, keepdim=True).clamp(min=1e-8) / 127
        acc = gemm(xu8, w) - (ZERO_POINT + compensation_error) * w.long().sum(1)
        return acc.double() * scale.double() * w_scale.double()

    return kernel


def test_the_load_time_probe_catches_a_gemm_that_is_not_exact():
    """The probe that picks the weight range at load, on emulated GEMMs: the saturating pairs of a CPU without VNNI
    fail it at 8 bits and pass at 7; a wrong zero-point compensation fails at any width; VNNI passes at 8."""
    from shoal.engine.execution.quantization.int8 import gemm_is_exact

    same = lambda w: w  # noqa: E731 - the emulated kernels take the plain int8 weight
    assert not gemm_is_exact(emulated_kernel(gemm_pairs_int16), 127, pack=same)
    assert gemm_is_exact(emulated_kernel(gemm_pairs_int16), NO_VNNI_WEIGHT_LIMIT, pack=same)
    assert gemm_is_exact(emulated_kernel(gemm_vnni), 127, pack=same)
    assert not gemm_is_exact(emulated_kernel(gemm_vnni, compensation_error=1), 127, pack=same)
    assert not gemm_is_exact(emulated_kernel(gemm_vnni, compensation_error=1), NO_VNNI_WEIGHT_LIMIT, pack=same)


def test_this_cpus_int8_gemm_is_exact_for_the_range_chosen_and_the_probe_sees_saturation():
    from shoal.engine.execution.cpu_features import cpu_features
    from shoal.engine.execution.quantization.int8 import Int8Weight, _cpu_kernel, gemm_is_exact

    kernel, limit = _cpu_kernel(torch.empty(0))
    if kernel is None:
        pytest.skip("no oneDNN int8 kernel here: torch._int_mm runs, exact by construction")
    assert limit == Int8Weight.weight_limit(torch.device("cpu"))
    assert gemm_is_exact(kernel, limit)
    if not cpu_features().int8_vnni:  # vpmaddubsw here: 8-bit weights saturate, and the probe must say so
        assert not gemm_is_exact(kernel, 127) and limit == NO_VNNI_WEIGHT_LIMIT
