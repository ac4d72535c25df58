"""bf16 linear layers at decode and prompt batch sizes: each kernel the engine can choose on this CPU, side by side.

    python -m shoal.engine.tools.bench_gemm [--rows 1 2 4 8 16 32 64 128 512] [--shapes bench smollm2]

Per weight shape ([out, in] of the bench model's and SmolLM2-135M's layers, and a 32k-row LM head) and row count:
microseconds per matmul of the AMX tile kernel (layers/amx_gemm.py, AMX tiers only), the small-M vector kernel
(layers/small_gemm.py, up to its MAX_ROWS) and oneDNN's prepacked bf16 GEMM (where bf16 is native), best of a few
rounds on a weight already in cache (decode steps stream weights from DRAM; `bench throughput --profile` measures
that). Measured, never timed in tests; how the engine chooses between them is in layers/weight_format.py.
"""

from __future__ import annotations

import argparse
import time

import torch

SHAPES = {
    "bench": {"qkv": (1024, 512), "o": (512, 512), "gate_up": (3072, 512), "down": (512, 1536),
              "lm_head": (32000, 512)},
    "smollm2": {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)},
}


def best_us(fn, flops: float) -> float:
    fn()
    n = max(5, int(2e8 / (flops + 1e6)))
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n)
    return best * 1e6


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m shoal.engine.tools.bench_gemm", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 512])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    args = ap.parse_args(argv)

    from shoal.engine.execution.cpu_features import cpu_features
    from shoal.engine.execution.layers import amx_gemm, small_gemm

    amx, small = amx_gemm.load_kernel(), small_gemm.load_kernel()
    onednn = cpu_features().bf16_native and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    print(f"tier {cpu_features().tier}, {torch.get_num_threads()} threads; microseconds per bf16 matmul "
          f"(AMX tiles: {'yes' if amx else 'unavailable'}; small-M kernel: {'yes' if small else 'unavailable'}; "
          f"oneDNN prepacked: {'yes' if onednn else 'unavailable'})")
    print(f"{'shape':<16}{'rows':>6}{'AMX tiles':>12}{'small-M':>12}{'oneDNN':>12}")
    g = torch.Generator().manual_seed(0)
    for family in args.shapes:
        for name, (n, k) in SHAPES[family].items():
            w = (torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16)
            packed_amx = amx_gemm.pack(w) if amx is not None else None
            packed_dnn = torch.ops.mkldnn._reorder_linear_weight(w, 32) if onednn else None
            for m in args.rows:
                x = torch.randn(m, k, generator=g).to(torch.bfloat16)
                flops = 2.0 * m * n * k
                cols = []
                cols.append(best_us(lambda: amx.linear(x, packed_amx, None), flops) if amx is not None else None)
                cols.append(best_us(lambda: small(x, w, None), flops)
                            if small is not None and m <= small_gemm.MAX_ROWS else None)
                cols.append(best_us(lambda: torch.ops.mkldnn._linear_pointwise(x, packed_dnn, None, "none", [], ""),
                                    flops) if packed_dnn is not None else None)
                cells = "".join(f"{c:>12.1f}" if c is not None else f"{'-':>12}" for c in cols)
                print(f"{family + ' ' + name:<16}{m:>6}{cells}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
