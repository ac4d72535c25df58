"""Every CPU tier's code: the C++ kernels compile for tiers this machine lacks (x86 AVX-512/AVX512-BF16, and ARM64
NEON/SVE with Debian's cross compiler), and the engine's numerics tests pass again at the lowest tier of this
machine's architecture (SHOAL_CPU_ISA caps the C++ builds, torch's and oneDNN's dispatch), with the same greedy
tokens and logits as the native tier."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shoal.engine.execution.cpu_features import cpu_features, detect
from shoal.engine.execution.native_build import BASE_CFLAGS, INCLUDE_DIR, KERNELS

ATTENTION = KERNELS["paged_attention"].source
FUSED = KERNELS["fused_ops"].source
SMALL_GEMM = KERNELS["small_gemm"].source
SSM = KERNELS["ssm"].source
ARCH = cpu_features().arch
LOWEST = detect(cap="").tiers[0]


def _compile_only(compiler: str, source: Path, tier_flags: list[str], out: Path) -> None:
    from torch.utils.cpp_extension import include_paths

    cmd = [compiler, "-std=c++17", *BASE_CFLAGS, *tier_flags, f"-I{INCLUDE_DIR}",
           *(f"-I{p}" for p in include_paths()), "-c", str(source), "-o", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert out.stat().st_size > 0


@pytest.mark.skipif(ARCH != "x86_64", reason="x86 tiers are cross-checked on x86 machines")
@pytest.mark.parametrize("tier", ["avx512", "avx512_bf16"])
@pytest.mark.parametrize("source", [ATTENTION, SMALL_GEMM], ids=["attention", "small_gemm"])
def test_kernels_compile_for_x86_tiers_above_this_one(tier, source, tmp_path):
    if shutil.which("c++") is None:
        pytest.skip("no C++ compiler")
    if cpu_features().at_least(tier) and source == SMALL_GEMM:
        pytest.skip(f"this machine runs the {tier} build (test_small_gemm.py)")
    flags = detect(cap=tier, flags=frozenset().union(*_ALL_X86_FLAGS), arch="x86_64").cflags
    _compile_only("c++", source, flags, tmp_path / "kernel.o")


_ALL_X86_FLAGS = [{"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx512_vnni",
                   "amx_tile", "amx_bf16", "amx_int8"}]


@pytest.mark.parametrize("tier,source", [("neon", ATTENTION), ("neon", FUSED), ("sve", ATTENTION),
                                         ("neon", SMALL_GEMM), ("neon", SSM)])
def test_kernels_cross_compile_for_arm64(tier, source, tmp_path):
    """Debian's aarch64 cross compiler (apt-get install g++-aarch64-linux-gnu) builds both extensions with the
    flags the ARM tiers use; the object is ARM64 code."""
    compiler = shutil.which("aarch64-linux-gnu-g++")
    if compiler is None:
        pytest.skip("g++-aarch64-linux-gnu is not installed (apt-get install g++-aarch64-linux-gnu)")
    flags = detect(cap=tier, flags=frozenset({"asimd", "sve"}), arch="arm64").cflags
    out = tmp_path / "kernel.o"
    _compile_only(compiler, source, flags, out)
    assert out.read_bytes()[18:20] == (183).to_bytes(2, "little")  # ELF e_machine EM_AARCH64


_PROBE = r"""
import json, sys, torch
from shoal.engine import LLM, SamplingParams
from shoal.engine.execution.cpu_features import cpu_features
out = {"tier": cpu_features().tier, "runs": {}}
params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)
prompts = ["Hello world! The quick brown", "numbers 0 1 2 3 4 5 6 7 8 9 10 11 12"]
for name, kw in {"float32": dict(dtype="float32"), "bfloat16": dict(dtype="bfloat16"),
                 "int8": dict(dtype="float32", quantization="int8"),
                 "fp8kv": dict(dtype="float32", kv_cache_dtype="fp8")}.items():
    with LLM(model=sys.argv[1], max_model_len=128, block_size=4, attention_backend="cpu", **kw) as llm:
        res = llm.generate(prompts, params, use_tqdm=False)
    out["runs"][name] = [{"ids": list(c.token_ids), "lp": [d[t].logprob for t, d in zip(c.token_ids, c.logprobs)]}
                         for c in (r.outputs[0] for r in res)]
print("RESULT" + json.dumps(out))
"""


def _probe(model_dir: Path, env: dict) -> dict:
    proc = subprocess.run([sys.executable, "-c", _PROBE, str(model_dir)], env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT"))
    return json.loads(line[len("RESULT"):])


def _capped_env(tier: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("SHOAL_CPU_ISA", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")}
    if tier:
        env["SHOAL_CPU_ISA"] = tier
    return env


@pytest.mark.slow
def test_lowest_tier_gives_the_native_tiers_tokens_and_logprobs(model_factory):
    """The same model through the C++ attention kernel, fused ops, bf16, int8 and an fp8 KV cache, once at this
    machine's tier and once capped to its architecture's lowest: greedy tokens equal, logprobs within 1e-3 (float32)
    or the tolerance of the reduced-precision path."""
    model = model_factory("llama")
    native = _probe(model, _capped_env(None))
    lowest = _probe(model, _capped_env(LOWEST))
    assert lowest["tier"] == LOWEST and native["tier"] == cpu_features().tier
    tolerance = {"float32": 1e-3, "bfloat16": 0.05, "int8": 0.05, "fp8kv": 0.05}
    for name, tol in tolerance.items():
        for a, b in zip(native["runs"][name], lowest["runs"][name]):
            if name == "float32":
                assert a["ids"] == b["ids"], name
            diff = max(abs(x - y) for x, y in zip(a["lp"], b["lp"]))
            if a["ids"] == b["ids"]:
                assert diff < tol, (name, diff)


_BF16_PROBE = r"""
import json, logging, sys
logging.basicConfig(level=logging.INFO)  # the dtype decision is logged: the test reads why
from shoal.engine import LLM, SamplingParams
from shoal.engine.execution.cpu_features import cpu_features
prompts = [{"prompt_token_ids": ids} for ids in json.loads(sys.argv[2])]
params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
out = {"tier": cpu_features().tier, "bf16_native": cpu_features().bf16_native}
for choice in ("auto", "bfloat16"):
    with LLM(model=sys.argv[1], dtype=choice, max_model_len=128, block_size=4) as llm:
        out[choice] = {"dtype": str(llm.llm_engine.dtype),
                       "ids": [list(r.outputs[0].token_ids) for r in llm.generate(prompts, params, use_tqdm=False)]}
print("RESULT" + json.dumps(out))
"""


@pytest.mark.slow
def test_a_bf16_checkpoint_loads_with_dtype_auto_and_bfloat16_at_the_lowest_tier(tmp_path):
    """What most Hugging Face models ship (bf16 weights, `dtype: bfloat16` in config.json) on a CPU without native
    bf16: `--dtype auto` runs float32 (the bf16 weights are exact in it, so greedy equals transformers in float32),
    and an explicit bfloat16 runs too, never crashing in oneDNN's prepack."""
    from hf_reference import hf_greedy

    from shoal.engine.tools.tiny_model import make_model

    model = make_model(tmp_path / "bf16", arch="llama", dtype="bfloat16")
    prompts = [[1, 5, 9, 200, 33, 7], [1, 100, 101, 102, 103, 104, 105, 106, 107, 108, 109]]
    proc = subprocess.run([sys.executable, "-c", _BF16_PROBE, str(model), json.dumps(prompts)],
                          env=_capped_env(LOWEST), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT"))[len("RESULT"):])
    assert got["tier"] == LOWEST
    if not got["bf16_native"]:
        assert got["auto"]["dtype"] == "torch.float32"
        assert "no native bf16" in proc.stderr  # the log says why
        for ids, out in zip(prompts, got["auto"]["ids"]):
            assert out == hf_greedy(model, ids, 8)[0]
    assert got["bfloat16"]["dtype"] == "torch.bfloat16"
    assert all(len(ids) == 8 for ids in got["bfloat16"]["ids"])
    assert got["bfloat16"]["ids"][0][0] == got["auto"]["ids"][0][0]  # bf16 rounding may drift later, not at once


@pytest.mark.slow
def test_numerics_suite_passes_at_the_lowest_tier():
    """The numerics tests (marked `numerics`) again, in a process capped to the lowest tier: what a node without
    AVX2 (or an ARM64 node without SVE) runs, on this machine."""
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "numerics", "-p", "no:cacheprovider",
                           "-x", str(root / "tests")], env=_capped_env(LOWEST), cwd=root, capture_output=True,
                          text=True, timeout=1800)
    tail = proc.stdout[-3000:]
    assert proc.returncode == 0, tail + proc.stderr[-2000:]
    assert " passed" in tail
