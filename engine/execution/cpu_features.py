"""What this CPU can do, and which fast path each part of the engine takes on it: the one place that decides.

CPU pods land on whatever nodes a cluster has, so every fast path is chosen here at run time from the CPU's
feature flags and has a portable fallback that is always correct:

| part                 | fast path (needs)                                   | fallback                            |
|----------------------|-----------------------------------------------------|-------------------------------------|
| bf16 linear layers   | AMX tiles on one pair-layout copy (AMX); else the small-M kernel and oneDNN prepacked bf16 GEMM (native bf16: AVX512-BF16, AVX-NE-CONVERT, ARM bf16) | plain F.linear |
| `--dtype auto`       | bfloat16 where bf16 arithmetic is native            | float32 (bf16 there is emulated: slower, not smaller in compute) |
| C++ kernels          | compiled for the tier (-mavx2 ... -mavx512bf16)     | the generic build; torch ops without a compiler |
| cpu attention (bf16) | vdpbf16ps dot products (AVX512-BF16)                | the portable float32 loop           |
| fp8 KV decode        | e4m3 -> bf16 in registers (AVX512-BF16)             | the portable decode                 |
| int8 W8A8 GEMM       | oneDNN u8s8 with 8-bit weights (VNNI: int32 sums)   | 7-bit weights (no VNNI: u8 x s8 pair sums saturate in int16 at 8 bits); torch._int_mm off x86 |
| packed GGUF matmul   | blocks unpacked in registers: AVX2 vpmaddwd, AVX512-VNNI vpdpwssd, NEON smlal | portable loops |

Tiers, lowest first: x86-64 `generic` < `avx2` < `avx512` < `avx512_bf16` < `amx`; ARM64 `neon` < `sve`.
`SHOAL_CPU_ISA=<tier>` caps the tier (so every tier's code runs on one machine). When capped it also caps torch's
own kernels (`ATEN_CPU_CAPABILITY`) and oneDNN's (`ONEDNN_MAX_CPU_ISA`) unless those are set already; both are read
once, on first use, so the cap must be in the environment before torch runs a kernel (set it when starting the
process; the engine applies it as early as it can and warns when it came too late).
"""

from __future__ import annotations

import functools
import logging
import os
import platform
import re
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

ENV_CAP = "SHOAL_CPU_ISA"

X86_TIERS = ("generic", "avx2", "avx512", "avx512_bf16", "amx")
ARM_TIERS = ("neon", "sve")

# The /proc/cpuinfo flags a tier needs (on top of the tier below it).
_TIER_FLAGS = {
    "avx2": {"avx2", "fma", "f16c"},
    "avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq"},
    "avx512_bf16": {"avx512_bf16", "avx512_vnni"},
    "amx": {"amx_tile", "amx_bf16", "amx_int8"},
    "sve": {"sve"},
}
# Compiler flags per tier. Explicit ISA extensions rather than -march=native: a build names exactly what it may
# use, so a capped build never emits a newer instruction and a cached build is valid for every CPU of its tier.
_TIER_CFLAGS = {
    "generic": ["-march=x86-64", "-mtune=generic"],
    "avx2": ["-march=x86-64", "-mavx2", "-mfma", "-mf16c", "-mbmi2", "-mtune=generic"],
    "avx512": ["-march=x86-64", "-mavx2", "-mfma", "-mf16c", "-mbmi2", "-mavx512f", "-mavx512bw", "-mavx512vl",
               "-mavx512dq", "-mtune=generic"],
    "neon": ["-march=armv8-a"],
    "sve": ["-march=armv8.2-a+sve"],
}
_TIER_CFLAGS["avx512_bf16"] = _TIER_CFLAGS["avx512"] + ["-mavx512bf16", "-mavx512vnni"]
_TIER_CFLAGS["amx"] = _TIER_CFLAGS["avx512_bf16"] + ["-mamx-tile", "-mamx-bf16", "-mamx-int8"]
# torch's and oneDNN's names for the same caps.
_ATEN_CAPABILITY = {"generic": "default", "avx2": "avx2", "avx512": "avx512", "avx512_bf16": "avx512",
                    "amx": "avx512", "neon": "default"}
_ONEDNN_ISA = {"generic": "SSE41", "avx2": "AVX2", "avx512": "AVX512_CORE", "avx512_bf16": "AVX512_CORE_BF16",
               "amx": "AVX512_CORE_AMX", "neon": "DEFAULT", "sve": "DEFAULT"}


class CpuIsaError(ValueError):
    """SHOAL_CPU_ISA names no tier of this CPU's architecture."""


def read_cpu_flags(cpuinfo: str | None = None) -> frozenset[str]:
    """The feature flags of the first CPU in /proc/cpuinfo (`flags` on x86, `Features` on ARM)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return frozenset()
    m = re.search(r"^(?:flags|Features)\s*:(.*)$", cpuinfo, re.M)
    return frozenset(m.group(1).split()) if m else frozenset()


def _native_tier(arch: str, flags: frozenset[str]) -> str:
    tiers = ARM_TIERS if arch == "arm64" else X86_TIERS
    best = tiers[0]
    for tier in tiers[1:]:
        if not _TIER_FLAGS[tier] <= flags:
            break
        best = tier
    return best


def _arch() -> str:
    machine = platform.machine().lower()
    return "arm64" if machine in ("aarch64", "arm64") else "x86_64" if machine in ("x86_64", "amd64") else machine


@dataclass(frozen=True)
class CpuFeatures:
    """The tier this process runs at and every fast-path decision that follows from it."""

    arch: str  # x86_64 | arm64 | other
    flags: frozenset[str] = field(repr=False)
    native_tier: str
    tier: str  # native_tier, or lower when SHOAL_CPU_ISA caps it
    capped: bool

    @property
    def tiers(self) -> tuple[str, ...]:
        return ARM_TIERS if self.arch == "arm64" else X86_TIERS

    def at_least(self, tier: str) -> bool:
        return tier in self.tiers and self.tiers.index(self.tier) >= self.tiers.index(tier)

    @property
    def bf16_native(self) -> bool:
        """bf16 arithmetic in hardware at this tier (where oneDNN's bf16 GEMM and prepack are fast and allowed)."""
        if self.arch == "arm64":
            return "bf16" in self.flags and not self.capped
        return self.at_least("avx512_bf16") or ("avx_ne_convert" in self.flags and not self.capped)

    @property
    def int8_vnni(self) -> bool:
        """oneDNN's u8 x s8 GEMM sums in int32 (VNNI) rather than through saturating int16 pairs."""
        if self.arch != "x86_64":
            return False
        if self.at_least("avx512_bf16"):
            return True
        return not self.capped and bool({"avx512_vnni", "avx_vnni"} & self.flags)

    @property
    def cflags(self) -> list[str]:
        """Compiler flags for this tier's C++ kernels (empty on an architecture we have no table for)."""
        return list(_TIER_CFLAGS.get(self.tier, []))

    def paths(self) -> dict[str, str]:
        """Which path each part takes, for the start-up log and `shoal-engine` diagnostics."""
        amx = self.tier == "amx" and os.environ.get("SHOAL_DISABLE_AMX") != "1"
        bf16 = ("AMX tiles, one pair-layout copy of each weight (SHOAL_DISABLE_AMX=1: off)" if amx
                else "oneDNN prepacked bf16 GEMM" if self.bf16_native
                else "plain F.linear (no native bf16: emulated and slow; --dtype auto picks float32)")
        if self.arch == "x86_64":
            int8 = ("AMX tiles (s8 x s8, int32 sums), per-token quantization fused; oneDNN for other shapes" if amx
                    else "oneDNN u8s8 GEMM, 8-bit weights (VNNI)" if self.int8_vnni
                    else "oneDNN u8s8 GEMM, 7-bit weights (no VNNI: 8-bit u8 x s8 pair sums would saturate int16)")
        else:
            int8 = "torch._int_mm (exact int32 sums)"
        simd = self.tier in ("avx512_bf16", "amx")
        gguf = {"generic": "portable loops", "avx2": "AVX2 (vpmaddwd)", "avx512": "AVX-512 (vpmaddwd)",
                "avx512_bf16": "AVX512-VNNI (vpdpwssd)", "amx": "AVX512-VNNI (vpdpwssd)", "neon": "NEON (smlal)",
                "sve": "NEON (smlal)"}.get(self.tier, "portable loops")
        return {
            "bf16 linear": bf16,
            "C++ kernels": f"built for {self.tier} ({' '.join(self.cflags) or 'compiler defaults'})",
            "cpu attention bf16": "vdpbf16ps dot products" if simd else "portable float32 accumulation",
            "fp8 KV decode": "e4m3 -> bf16 in registers" if simd else "portable decode",
            "int8 linear": int8,
            "packed GGUF matmul": f"{gguf}, blocks unpacked in registers",
        }

    def describe(self) -> str:
        shown = sorted(f for f in self.flags if re.match(r"avx|amx|fma|f16c|sve|asimd|bf16|i8mm|vnni", f))
        cap = f", capped by {ENV_CAP}" if self.capped else ""
        head = (f"CPU {self.arch}: tier {self.tier} (native {self.native_tier}{cap}); "
                f"features: {' '.join(shown) or 'none of note'}")
        return head + "".join(f"\n  {part}: {path}" for part, path in self.paths().items())


def detect(cap: str | None = None, flags: frozenset[str] | None = None, arch: str | None = None) -> CpuFeatures:
    """This CPU's tier, capped by `cap` (default: $SHOAL_CPU_ISA). Arguments other than cap are for tests."""
    arch = arch or _arch()
    flags = read_cpu_flags() if flags is None else flags
    native = _native_tier(arch, flags)
    tiers = ARM_TIERS if arch == "arm64" else X86_TIERS
    cap = (os.environ.get(ENV_CAP, "") if cap is None else cap).strip().lower() or None
    tier, capped = native, False
    if cap is not None:
        if cap not in tiers:
            raise CpuIsaError(f"{ENV_CAP}={cap!r} is not a CPU tier of {arch}; choose one of {', '.join(tiers)}")
        if tiers.index(cap) < tiers.index(native):
            tier, capped = cap, True
        elif cap != native:
            logger.warning("%s=%s is above this CPU's tier %s; running at %s", ENV_CAP, cap, native, native)
    return CpuFeatures(arch=arch, flags=flags, native_tier=native, tier=tier, capped=capped)


@functools.cache
def cpu_features() -> CpuFeatures:
    """This process's CPU tier (read once). The first call also caps torch's and oneDNN's dispatch to match."""
    features = detect()
    if features.capped:
        _cap_libraries(features.tier)
    return features


def _cap_libraries(tier: str) -> None:
    for var, value in (("ATEN_CPU_CAPABILITY", _ATEN_CAPABILITY.get(tier)), ("ONEDNN_MAX_CPU_ISA", _ONEDNN_ISA.get(tier))):
        if value and var not in os.environ:
            os.environ[var] = value
    import torch

    got = torch.backends.cpu.get_cpu_capability().lower()
    want = _ATEN_CAPABILITY.get(tier, "default")
    if want == "default" and got not in ("default", "no avx") or want != "default" and got != want:
        logger.warning("%s=%s came after torch chose its CPU kernels (%s): set it (or ATEN_CPU_CAPABILITY=%s) in "
                       "the environment before the process starts to cap torch too", ENV_CAP, tier, got, want)


# How many threads and which OpenMP wait policy: `cpu_budget.py` decides from the CPU quota, affinity and load.
WAIT_POLICY_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def peer_environ(environ=None) -> dict[str, str]:
    """The environment for a peer engine a benchmark runs (llama.cpp, vLLM): this process's, less the thread count
    and wait policy Shoal chose for itself, so that the peer runs as its users run it (llama.cpp built with OpenMP
    ran 3x slower with passive waits on an idle machine). What the user set stays, for both."""
    from shoal.engine.execution.cpu_budget import SET_BY_SHOAL

    env = dict(os.environ if environ is None else environ)
    for var in filter(None, env.pop(SET_BY_SHOAL, "").split(",")):
        env.pop(var, None)
    return env


def thread_policy() -> str:
    """The OpenMP wait policy this process runs with, for the start-up log."""
    from shoal.engine.execution.cpu_budget import SET_BY_SHOAL

    chosen = {v: os.environ[v] for v in WAIT_POLICY_VARS if v in os.environ}
    if not chosen:
        return "libgomp's default (up to 300,000 spins, then sleep)"
    ours = os.environ.get(SET_BY_SHOAL, "").split(",")
    return ", ".join(f"{k}={v}" + (" (Shoal's choice)" if k in ours else " (from the environment)")
                     for k, v in chosen.items())


def log_cpu_features() -> None:
    import torch

    from shoal.engine.execution.cpu_budget import decision

    logger.info("%s\n  threads: %d, OpenMP wait: %s\n  CPU budget: %s", cpu_features().describe(),
                torch.get_num_threads(), thread_policy(), decision())
