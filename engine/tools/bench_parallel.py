"""`python -m shoal.engine.tools.bench_parallel`: output tokens/s of TP=1 vs TP=2 vs PP=2 (and more) on one model in one
run, plus the pipeline bubble fraction.

The workload is bench_throughput's (seeded prompts and output lengths, ignore_eos, greedy) on its default
benchmark model (Llama-shaped, hidden 512, 8 layers, GQA 8/4, vocab 32000, bfloat16), smaller by default so the
whole comparison takes a few minutes on 2 CPU cores. Each layout starts its worker processes (gloo on CPU), warms
up, then times one `generate()` over the whole workload.

Bubble fraction, per rank: 1 - (time in its own layers) / (time from receiving the step's plan to the end of the
step), summed over the timed run; the figure printed is the mean over ranks (what the pipeline leaves idle, plus
communication). The ideal GPipe bubble for P stages and M micro-batches, (P - 1) / (M + P - 1), is printed beside it.
"""

from __future__ import annotations

import argparse
import json
import time


def run_layout(model_dir, reqs, tp: int, pp: int, args) -> dict:
    from shoal.engine.llm import LLM
    from shoal.engine.contracts import SamplingParams

    options = dict(dtype=args.dtype, max_model_len=args.max_model_len, block_size=args.block_size,
                   tensor_parallel_size=tp, pipeline_parallel_size=pp)
    if args.max_num_batched_tokens:
        options["max_num_batched_tokens"] = args.max_num_batched_tokens
    if pp > 1:
        options["distributed"] = {"micro_batches": args.micro_batches, "layer_partition": (
            [int(x) for x in args.layer_partition.split(",")] if args.layer_partition else None)}
    with LLM(model=str(model_dir), **options) as llm:
        llm.generate([{"prompt_token_ids": reqs[0][0][:16]}], SamplingParams(max_tokens=4, ignore_eos=True),
                     use_tqdm=False)
        executor = llm.llm_engine.executor
        if hasattr(executor, "pipeline_stats"):
            executor.pipeline_stats(reset=True)
        prompts = [{"prompt_token_ids": p} for p, _ in reqs]
        params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for _, m in reqs]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        row = {"tp": tp, "pp": pp, "seconds": round(elapsed, 2), "output_tokens": tokens,
               "output_tok_s": round(tokens / elapsed, 1), "first_tokens": outs[0].outputs[0].token_ids[:8]}
        if hasattr(executor, "pipeline_stats"):
            stats = executor.pipeline_stats()
            row["bubble"] = round(sum(s["bubble"] for s in stats) / len(stats), 3)
            row["bubble_per_rank"] = [round(s["bubble"], 3) for s in stats]
            row["steps"] = stats[0]["steps"]
            m = executor.shard.micro_batches
            row["micro_batches"] = m
            row["ideal_bubble"] = round((pp - 1) / (m + pp - 1), 3)
    return row


def main(argv: list[str] | None = None) -> int:
    from shoal.engine.tools.bench_throughput import bench_model_dir, workload

    ap = argparse.ArgumentParser(prog="python -m shoal.engine.tools.bench_parallel", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="model directory (default: bench_throughput's generated benchmark model)")
    ap.add_argument("--layouts", nargs="+", default=["1x1", "2x1", "1x2"], metavar="TPxPP",
                    help="tensor x pipeline parallel sizes to compare (default: 1x1 2x1 1x2)")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, nargs=2, default=(32, 128), metavar=("MIN", "MAX"))
    ap.add_argument("--output-len", type=int, nargs=2, default=(32, 64), metavar=("MIN", "MAX"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="bfloat16", choices=["auto", "float32", "float16", "bfloat16"])
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--micro-batches", type=int, default=None, help="pipeline micro-batches per step")
    ap.add_argument("--layer-partition", default=None, metavar="N,N",
                    help="decoder layers per pipeline stage for the PP layouts (default: even)")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = ap.parse_args(argv)
    import logging

    logging.basicConfig(level=logging.WARNING)
    from shoal.engine.execution.model_loader import load_hf_config

    model_dir = args.model or bench_model_dir()
    vocab = load_hf_config(model_dir).vocab_size
    reqs = workload(args.seed, args.num_prompts, vocab, args.prompt_len, args.output_len)
    rows = []
    for layout in args.layouts:
        tp, pp = (int(x) for x in layout.lower().split("x"))
        rows.append(run_layout(model_dir, reqs, tp, pp, args))
        if not args.json:
            r = rows[-1]
            extra = (f"  bubble {r['bubble']:.1%} (ideal {r['ideal_bubble']:.1%} with {r['micro_batches']} "
                     f"micro-batches; per rank {r['bubble_per_rank']})" if "bubble" in r else "")
            print(f"TP={tp} PP={pp}: {r['output_tok_s']:8.1f} output tok/s ({r['output_tokens']} tokens in "
                  f"{r['seconds']:.1f}s){extra}", flush=True)
    same = all(r["first_tokens"] == rows[0]["first_tokens"] for r in rows)
    if args.json:
        print(json.dumps({"model": str(model_dir), "layouts": rows, "same_tokens": same}))
    elif not same:
        print("note: greedy tokens differ between layouts (bfloat16 sums in a different order)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
