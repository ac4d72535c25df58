"""int8 (W8A8) quality per CPU tier: perplexity of a fixed prompt set under the unquantized model and under int8,
in float32 and bfloat16 activations, at each CPU tier this machine can run (its own, and lower ones capped with
SHOAL_CPU_ISA, each in a fresh process so that torch and oneDNN are capped too).

Printed per tier and dtype: perplexity (none, int8), their ratio, the mean |logprob difference| of int8 against the
unquantized model over the prompt tokens, and how often its top-1 next token agrees. Use a real model for
language-quality figures (`--model DIR`, e.g. SmolLM2-135M-Instruct); without it a tiny random-weight model is
built, which shows arithmetic defects (a wrong sum is several nats) but not language quality. Measured, never timed
in tests.

    python -m shoal.engine.tools.bench_int8_quality --tiers native generic
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile

PROMPTS = [
    "What is the capital of France? The capital of France is Paris, a city on the Seine.",
    "The quick brown fox jumps over the lazy dog. A paged cache keeps keys and values in fixed-size blocks.",
    "Continuous batching lets requests join and leave the running batch at every step of the engine loop.",
    "Kubernetes runs pods on nodes; an operator reconciles custom resources into deployments and services.",
    "Once upon a time there was a little shoal of fish that swam together in the warm and quiet sea.",
    "def add(a, b):\n    return a + b\n\nfor i in range(10):\n    print(i * i)\n",
    "Water boils at one hundred degrees Celsius at sea level, and freezes at zero degrees.",
    "The first president of the United States was George Washington, who took office in 1789.",
]


def score(model: str, dtype: str, quantization: str | None) -> dict:
    """Per prompt token (after the first): the logprob of the actual token and whether it was the top-1."""
    from shoal.engine import LLM, SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
    with LLM(model=model, dtype=dtype, quantization=quantization, max_model_len=256, enforce_eager=True) as llm:
        outs = llm.generate(PROMPTS, params)
    logprobs, top1 = [], []
    for out in outs:
        for token, entry in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:]):
            logprobs.append(entry[token].logprob)
            top1.append(min(entry, key=lambda t: entry[t].rank or 10**9))
    return {"logprobs": logprobs, "top1": top1}


def worker(args) -> int:
    from shoal.engine.execution.cpu_features import cpu_features

    if args.emulate_vnni:
        # What a VNNI/AMX tier's GEMM computes: 8-bit weights, u8 x s8 products summed exactly in int32. Here the
        # exact torch._int_mm path with the VNNI tiers' weight range, on any CPU.
        from shoal.engine.execution.quantization import int8

        int8._cpu_kernel = lambda weight: (None, 127)

    rows = {}
    for dtype in args.dtypes:
        ref = score(args.model, dtype, None)
        got = score(args.model, dtype, "int8")
        n = len(ref["logprobs"])
        rows[dtype] = {
            "ppl_none": math.exp(-sum(ref["logprobs"]) / n), "ppl_int8": math.exp(-sum(got["logprobs"]) / n),
            "mean_abs_dlogprob": sum(abs(a - b) for a, b in zip(ref["logprobs"], got["logprobs"])) / n,
            "top1_agree": sum(a == b for a, b in zip(ref["top1"], got["top1"])) / n, "tokens": n,
        }
    f = cpu_features()
    path = "exact int32 sums, 8-bit weights (VNNI emulated)" if args.emulate_vnni else f.paths()["int8 linear"]
    tier = f"{f.tier}+vnni-emu" if args.emulate_vnni else f.tier
    print(json.dumps({"tier": tier, "native": f.native_tier, "int8": path, "rows": rows}))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m shoal.engine.tools.bench_int8_quality", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a local Hugging Face model directory (default: a tiny random one)")
    ap.add_argument("--tiers", nargs="+", default=["native", "generic"],
                    help="CPU tiers to run at (`native`: this CPU's own; lower ones are capped)")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    ap.add_argument("--emulate-vnni", action="store_true",
                    help="also run the arithmetic of a VNNI/AMX tier (8-bit weights, exact int32 sums) on this CPU")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)
    model = args.model
    if model is None:
        from shoal.engine.tools.tiny_model import make_model

        model = str(make_model(tempfile.mkdtemp(prefix="int8-quality-"), arch="llama", hidden_size=192,
                               intermediate_size=512))
    results = []
    runs = [(tier, False) for tier in args.tiers] + ([("native", True)] if args.emulate_vnni else [])
    for tier, emulate in runs:
        env = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")}
        env.pop("SHOAL_CPU_ISA", None)
        if tier != "native":
            env["SHOAL_CPU_ISA"] = tier
        if model.endswith(".gguf"):  # packed GGUF weights stay packed under --quantization: int8 would touch nothing
            env["SHOAL_GGUF_DEQUANTIZE"] = "1"
        proc = subprocess.run([sys.executable, "-m", "shoal.engine.tools.bench_int8_quality", "--worker",
                               "--model", model, "--dtypes", *args.dtypes, *(["--emulate-vnni"] if emulate else [])],
                              env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"tier {tier} failed:\n{proc.stderr[-3000:]}")
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    if args.json:
        print(json.dumps({"model": model, "results": results}))
        return 0
    print(f"model {model}; {len(PROMPTS)} prompts")
    print(f"{'tier':<17}{'dtype':<10}{'ppl none':>12}{'ppl int8':>12}{'ratio':>8}{'|dlogp|':>9}{'top1 =':>8}  int8 path")
    for r in results:
        for dtype, row in r["rows"].items():
            print(f"{r['tier']:<17}{dtype:<10}{row['ppl_none']:>12.2f}{row['ppl_int8']:>12.2f}"
                  f"{row['ppl_int8'] / row['ppl_none']:>8.3f}{row['mean_abs_dlogprob']:>9.3f}"
                  f"{row['top1_agree']:>8.1%}  {r['int8']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
