"""The engine's C++ CPU kernels: every source and header in one tree (csrc/), one registry of what each builds
(`KERNELS`) and one way to get a kernel's ops (`kernel_ops(name)`), built on first use for the CPU tier this
process runs at. Each caller keeps its own torch fallback for a NativeBuildError.

Each extension is compiled with torch.utils.cpp_extension (and ninja) under a name keyed by a hash of its
sources, the shared headers, the tier's compiler flags and torch's version, so
- a build made for one tier never runs at another (a cluster's nodes, or a `SHOAL_CPU_ISA` cap, differ), and two
  versions of the source never overwrite each other's build;
- processes building the same extension queue on an flock of their own (the kernel releases it when its holder
  dies), never on torch's lock file alone: a process killed mid-build leaves that file behind, and torch's waiters
  poll for it to vanish, forever. Whoever holds the flock is the only builder, so a torch lock file it finds is
  such a leftover and is removed.
Builds land in torch's extensions directory ($TORCH_EXTENSIONS_DIR, else ~/.cache/torch_extensions). A build
that loaded once leaves a marker beside its library, and a later process loads that library directly: torch's
`load` would import setuptools (~0.2 s) and run ninja to find nothing to do, on the way to the first token.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from shoal.engine import startup
from shoal.engine.execution.cpu_features import cpu_features

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"  # every C++ source, and the headers they share (fast_math.h, ...)
INCLUDE_DIR = CSRC
BASE_CFLAGS = ["-O3", "-fopenmp"]


@dataclass(frozen=True)
class Kernel:
    source: Path  # the extension's one translation unit
    library: str  # its TORCH_LIBRARY namespace: the ops are torch.ops.<library>
    probe: str  # an op resolved at load, so that a failed registration shows there and not mid-step
    what: str  # its name in messages

    @property
    def extension(self) -> str:
        return "shoal_" + self.source.stem


KERNELS = {
    "paged_attention": Kernel(CSRC / "cpu_paged_attention.cpp", "shoal_cpu_paged", "paged_attention",
                              "cpu attention kernel"),
    "fused_ops": Kernel(CSRC / "cpu_fused_ops.cpp", "shoal_cpu_fused", "add_rms_norm", "cpu fused-op kernels"),
    "small_gemm": Kernel(CSRC / "cpu_small_gemm.cpp", "shoal_cpu_gemm", "linear", "cpu small-M linear kernel"),
    "amx_gemm": Kernel(CSRC / "cpu_amx_gemm.cpp", "shoal_cpu_amx", "linear", "cpu AMX bf16 linear kernel"),
    "moe": Kernel(CSRC / "cpu_moe.cpp", "shoal_cpu_moe", "fused_experts", "cpu MoE kernel"),
    "amx_decode_attention": Kernel(CSRC / "cpu_amx_decode_attention.cpp", "shoal_cpu_amx_attn", "gqa_decode",
                                   "cpu AMX decode attention kernel"),
    "gguf": Kernel(CSRC / "cpu_gguf.cpp", "shoal_cpu_gguf", "kernel_isa", "cpu GGUF kernels"),
    "lora": Kernel(CSRC / "cpu_lora.cpp", "shoal_cpu_lora", "lora_apply_", "cpu LoRA kernel"),
    "ssm": Kernel(CSRC / "cpu_ssm.cpp", "shoal_cpu_ssm", "selective_scan", "cpu selective-scan kernel"),
}


@functools.cache
def kernel_ops(name: str):
    """torch.ops.<library> of KERNELS[name], built (or reused) for this process's CPU tier. Raises NativeBuildError
    with a one-line reason (then, as a failure is not cached, every later call tries again: callers cache)."""
    k = KERNELS[name]
    return load_cpu_extension(k.extension, [k.source], k.what, k.library, k.probe)


BUILT_MARKER = "shoal-built"  # written once the build's library has loaded: the library beside it is whole


class NativeBuildError(RuntimeError):
    """A kernel could not be built or loaded; the message is short and names the compiler's own error."""


def _put_ninja_on_path() -> None:
    """torch finds ninja on PATH; the `ninja` wheel (a dependency) installs it next to this interpreter, which is
    not on PATH when a virtualenv's python is run without activating it."""
    try:
        import ninja
    except ImportError:
        return
    path = os.environ.get("PATH", "")
    if ninja.BIN_DIR not in path.split(os.pathsep):
        os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, path]) if path else ninja.BIN_DIR


def summarise(err: BaseException, what: str) -> str:
    """The compiler's own error lines when there are some (not the command line), else the exception's first."""
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    errors = [ln for ln in lines if re.search(r"(^|: )(fatal )?error:", ln)]
    summary = "; ".join(errors[:3]) if errors else lines[0] if lines else repr(err)
    return f"the {what} could not be built: {summary[:600]}"


def build_key(sources: list[Path], cflags: list[str]) -> str:
    h = hashlib.sha256()
    for path in sorted(sources) + sorted(INCLUDE_DIR.glob("*.h")):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    h.update(" ".join(cflags).encode())
    h.update(torch.__version__.encode())
    return h.hexdigest()[:12]


@contextlib.contextmanager
def build_lock(build_dir: Path):
    """Hold the build directory alone: an flock, so a holder that dies releases it. Inside, torch's own lock file
    (`lock`), if present, was left by a process killed mid-build, and is removed before torch waits on it."""
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / "shoal.flock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            stale = build_dir / "lock"
            if stale.exists():
                logger.warning("removing a build lock left by a process that died mid-build: %s", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def build_directory(full_name: str) -> Path:
    """Where torch.utils.cpp_extension builds `full_name` (its _get_build_directory, without importing it)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or None  # set but empty: the default, not the cwd
    if root is None:
        import torch._appdirs

        accelerator = (f"rocm{torch.version.hip.replace('.', '')}" if torch.version.hip is not None
                       else f"cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda is not None else "cpu")
        python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
        root = os.path.join(os.path.realpath(torch._appdirs.user_cache_dir(appname="torch_extensions")),
                            f"{python}_{accelerator}")
    return Path(root) / full_name


def _load_built(build_dir: Path, full_name: str) -> bool:
    """Load a library an earlier process built and loaded under this key (its name): True if there was one."""
    library = build_dir / f"{full_name}.so"
    if not (build_dir / BUILT_MARKER).is_file() or not library.is_file():
        return False
    torch.ops.load_library(str(library))
    return True


def load_cpu_extension(name: str, sources: list[Path], what: str, library: str, probe: str):
    """Compile (or reuse) and load the extension `name` from `sources` for this process's CPU tier and return its
    op namespace torch.ops.<library>, with the op `probe` resolved now (a failed registration shows here, not
    mid-step). Raises NativeBuildError with a one-line reason; callers fall back to their torch path."""
    for src in sources:
        if not src.exists():
            raise NativeBuildError(f"the {what} could not be built: {src} is missing from this installation")
    features = cpu_features()
    cflags = BASE_CFLAGS + features.cflags
    full_name = f"{name}_{features.tier}_{build_key(sources, cflags)}"
    try:
        build_dir = build_directory(full_name)
        with build_lock(build_dir), startup.timed("kernel_build"):
            if not _load_built(build_dir, full_name):
                from torch.utils.cpp_extension import load

                _put_ninja_on_path()
                load(name=full_name, sources=[str(s) for s in sources], extra_cflags=cflags,
                     extra_ldflags=["-fopenmp"], extra_include_paths=[str(INCLUDE_DIR)],
                     build_directory=str(build_dir), is_python_module=False, verbose=False)
                (build_dir / BUILT_MARKER).write_text(full_name + "\n")
    except Exception as e:  # a missing compiler/ninja/header is reported, never fatal: callers fall back
        logger.debug("%s build failure", what, exc_info=True)
        raise NativeBuildError(summarise(e, what)) from None
    try:
        ops = getattr(torch.ops, library)
        getattr(ops, probe)
    except (AttributeError, RuntimeError) as e:
        raise NativeBuildError(f"the {what} loaded but torch.ops.{library}.{probe} is missing: {e}") from None
    logger.info("%s: %s build for tier %s", what, full_name, features.tier)
    return ops
