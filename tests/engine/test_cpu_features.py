"""CPU tiers: detection from /proc/cpuinfo flags, the SHOAL_CPU_ISA cap, and the fast-path decisions that follow
(every decision is made in engine/execution/cpu_features.py; these tests pin what each tier gets)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from shoal.engine.execution.cpu_features import CpuIsaError, detect, read_cpu_flags

AVX2 = frozenset("fpu sse sse2 ssse3 sse4_1 sse4_2 avx avx2 fma f16c bmi2".split())  # AMD EPYC (Zen 2/3)
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"}  # Skylake-SP
CASCADE = AVX512 | {"avx512_vnni"}  # VNNI without bf16
AVX512_BF16 = CASCADE | {"avx512_bf16"}  # Cooper Lake, Zen 4
AMX = AVX512_BF16 | {"amx_tile", "amx_bf16", "amx_int8", "avx_vnni"}  # Sapphire Rapids
ALDER = AVX2 | {"avx_vnni"}  # client parts: VNNI on 256-bit registers, no AVX-512
GRAVITON2 = frozenset("fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm".split())
GRAVITON3 = GRAVITON2 | {"sve", "bf16", "i8mm", "svebf16"}


@pytest.mark.parametrize("flags,tier", [
    (frozenset({"sse2"}), "generic"), (AVX2, "avx2"), (AVX512, "avx512"), (CASCADE, "avx512"),
    (AVX512_BF16, "avx512_bf16"), (AMX, "amx"), (ALDER, "avx2"),
])
def test_x86_tier_is_the_highest_whose_flags_are_all_present(flags, tier):
    assert detect(cap="", flags=flags, arch="x86_64").tier == tier


def test_arm_tiers():
    assert detect(cap="", flags=GRAVITON2, arch="arm64").tier == "neon"
    f = detect(cap="", flags=GRAVITON3, arch="arm64")
    assert f.tier == "sve" and f.bf16_native and "-march=armv8.2-a+sve" in f.cflags
    assert not f.int8_vnni and "torch._int_mm" in f.paths()["int8 linear"]


def test_fast_paths_per_tier():
    avx2 = detect(cap="", flags=AVX2, arch="x86_64")
    assert not avx2.bf16_native and not avx2.int8_vnni
    assert "-mavx2" in avx2.cflags and not any("avx512" in f for f in avx2.cflags)
    assert "7-bit" in avx2.paths()["int8 linear"] and "float32" in avx2.paths()["bf16 linear"]
    cascade = detect(cap="", flags=CASCADE, arch="x86_64")
    assert not cascade.bf16_native and cascade.int8_vnni  # VNNI is there even though bf16 is not
    bf16 = detect(cap="", flags=AVX512_BF16, arch="x86_64")
    assert bf16.bf16_native and bf16.int8_vnni and "-mavx512bf16" in bf16.cflags
    assert "vdpbf16ps" in bf16.paths()["cpu attention bf16"]
    assert detect(cap="", flags=ALDER, arch="x86_64").int8_vnni  # oneDNN uses AVX-VNNI when uncapped


def test_a_cap_lowers_every_decision_and_never_raises_the_tier():
    capped = detect(cap="avx2", flags=AMX, arch="x86_64")
    assert (capped.tier, capped.native_tier, capped.capped) == ("avx2", "amx", True)
    assert not capped.bf16_native and not capped.int8_vnni  # oneDNN is capped to AVX2 too: no VNNI
    assert capped.cflags == detect(cap="", flags=AVX2, arch="x86_64").cflags
    generic = detect(cap="generic", flags=AVX2, arch="x86_64")
    assert generic.tier == "generic" and not any(f.startswith("-mavx") for f in generic.cflags)
    above = detect(cap="amx", flags=AVX2, arch="x86_64")
    assert above.tier == "avx2" and not above.capped


def test_an_unknown_cap_is_refused_naming_the_tiers():
    with pytest.raises(CpuIsaError, match="generic, avx2, avx512, avx512_bf16, amx"):
        detect(cap="avx1024", flags=AVX2, arch="x86_64")
    with pytest.raises(CpuIsaError, match="neon, sve"):
        detect(cap="avx2", flags=GRAVITON2, arch="arm64")


def test_flags_are_read_from_cpuinfo_on_both_architectures():
    assert "avx2" in read_cpu_flags("processor : 0\nflags\t\t: fpu avx2 fma\n")
    assert "asimd" in read_cpu_flags("processor : 0\nFeatures\t: fp asimd evtstrm\n")
    assert read_cpu_flags("nothing here") == frozenset()


def test_the_cli_refuses_a_bad_cap_before_doing_anything():
    env = dict(os.environ, SHOAL_CPU_ISA="pentium")
    proc = subprocess.run([sys.executable, "-m", "shoal.engine.cli", "serve", "--help"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "SHOAL_CPU_ISA='pentium' is not a CPU tier" in proc.stderr


def test_a_capped_process_caps_torch_and_onednn_and_logs_the_paths():
    code = ("import logging, os, torch; logging.basicConfig(level=logging.INFO);"
            "from shoal.engine.execution.cpu_features import cpu_features, log_cpu_features;"
            "f = cpu_features(); log_cpu_features();"
            "print(f.tier, torch.backends.cpu.get_cpu_capability(), os.environ['ONEDNN_MAX_CPU_ISA'])")
    env = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")}
    env["SHOAL_CPU_ISA"] = "generic" if detect(cap="").arch == "x86_64" else "neon"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    if env["SHOAL_CPU_ISA"] == "generic":
        assert proc.stdout.split() == ["generic", "DEFAULT", "SSE41"]
    assert "int8 linear:" in proc.stderr and "C++ kernels: built for" in proc.stderr
    assert "OpenMP wait:" in proc.stderr and "CPU budget:" in proc.stderr


def test_builds_are_keyed_by_source_and_tier_flags(tmp_path):
    from shoal.engine.execution.native_build import build_key

    src = tmp_path / "k.cpp"
    src.write_text("int f() { return 1; }\n")
    avx2 = detect(cap="", flags=AVX2, arch="x86_64").cflags
    bf16 = detect(cap="", flags=AVX512_BF16, arch="x86_64").cflags
    key = build_key([src], avx2)
    assert key == build_key([src], avx2) and key != build_key([src], bf16)
    src.write_text("int f() { return 2; }\n")
    assert build_key([src], avx2) != key


def test_a_lock_left_by_a_killed_build_is_cleared_and_a_live_build_waited_for(tmp_path):
    """A process killed mid-build leaves torch's lock file behind: the next builder removes it (torch's waiters
    would poll for it forever). A live builder holds the flock, so nobody removes its lock file under it."""
    import subprocess
    import sys
    import threading

    from shoal.engine.execution import native_build

    (tmp_path / "lock").touch()  # left by a killed build
    with native_build.build_lock(tmp_path):
        assert not (tmp_path / "lock").exists()
        (tmp_path / "lock").touch()  # torch's own lock, while this process builds
    # another process holding the flock (a live build): this one waits for it, then finds its lock file stale
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, sys, time; f = open(sys.argv[1], 'a'); fcntl.flock(f, fcntl.LOCK_EX); print('held', flush=True);"
        " sys.stdin.readline()"), str(tmp_path / "shoal.flock")], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        entered = threading.Event()

        def build():
            with native_build.build_lock(tmp_path):
                entered.set()

        waiter = threading.Thread(target=build)
        waiter.start()
        assert not entered.wait(0.5) and (tmp_path / "lock").exists()  # the live build's lock is kept
        holder.kill()  # the builder dies mid-build: the kernel releases its flock
        waiter.join(60)
        assert entered.is_set() and not (tmp_path / "lock").exists()
    finally:
        holder.kill()
        holder.wait()


def test_a_missing_kernel_source_is_reported_not_raised_by_the_loaders(tmp_path, monkeypatch):
    from shoal.engine.execution.native_build import NativeBuildError, load_cpu_extension

    with pytest.raises(NativeBuildError, match="is missing from this installation"):
        load_cpu_extension("shoal_missing", [tmp_path / "gone.cpp"], "test kernel", "shoal_missing", "op")


def test_the_build_directory_is_torchs(tmp_path, monkeypatch):
    from torch.utils.cpp_extension import _get_build_directory

    from shoal.engine.execution.native_build import build_directory

    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    assert build_directory("shoal_x_1") == Path(_get_build_directory("shoal_x_1", verbose=False))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert build_directory("shoal_x_2") == Path(_get_build_directory("shoal_x_2", verbose=False))


def test_a_kernel_built_and_loaded_once_loads_without_torchs_builder():
    """Once a build has loaded, a later process loads its library directly: no setuptools import, no ninja run."""
    from shoal.engine.execution.layers import fused

    ops, why, _ = fused.load_kernels()  # built here if no earlier test did
    assert ops is not None, why
    code = ("import sys; from shoal.engine.execution.layers import fused; ops, why, _ = fused.load_kernels(); "
            "assert ops is not None, why; assert hasattr(ops, 'add_rms_norm'); "
            "print('torch.utils.cpp_extension' in sys.modules, 'setuptools' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout.split()
    assert out == ["False", "False"], out
