"""`shoal-engine bench throughput`: offline output tokens/s of Shoal vs transformers generate() on one model.

A seeded workload (default: 32 requests, prompts 32-256 tokens, outputs 64-128 tokens, ignore_eos) runs through
Shoal's engine and through transformers: one request at a time, and in left-padded static batches. Every
figure counts only the tokens each request asked for, so padding work is not rewarded.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path


def bench_model_dir() -> Path:
    """The default benchmark model: Llama-shaped, hidden 512, 8 layers, GQA 8/4, vocab 32000, bfloat16."""
    import os

    from shoal.engine.tools.tiny_model import make_model

    root = Path(os.environ.get("SHOAL_CACHE", Path.home() / ".cache" / "shoal"))
    path = root / "bench-llama-512"
    if not (path / "config.json").exists():
        make_model(path, arch="llama", seed=0, dtype="bfloat16", vocab_size=32000, hidden_size=512,
                   intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                   max_position_embeddings=2048, tie_word_embeddings=False)
    return path


def workload(seed: int, n: int, vocab: int, prompt_range, output_range):
    rng = random.Random(seed)
    reqs = []
    for _ in range(n):
        plen = rng.randint(*prompt_range)
        reqs.append(([rng.randrange(10, vocab) for _ in range(plen)], rng.randint(*output_range)))
    return reqs


def run_shoal(model_dir, reqs, args) -> float:
    from shoal.engine.llm import LLM
    from shoal.engine.execution.sampling import SamplingParams

    options = dict(dtype=args.dtype, max_model_len=args.max_model_len, block_size=args.block_size,
                   max_num_seqs=args.max_num_seqs, tensor_parallel_size=args.tensor_parallel_size,
                   pipeline_parallel_size=args.pipeline_parallel_size)
    if args.max_num_batched_tokens:
        options["max_num_batched_tokens"] = args.max_num_batched_tokens
    with LLM(model=str(model_dir), **options) as llm:
        llm.generate([{"prompt_token_ids": reqs[0][0][:16]}], SamplingParams(max_tokens=4, ignore_eos=True),
                     use_tqdm=False)
        prompts = [{"prompt_token_ids": p} for p, _ in reqs]
        params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for _, m in reqs]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        assert sum(len(o.outputs[0].token_ids) for o in outs) == sum(m for _, m in reqs)
    return elapsed


def run_hf(model_dir, reqs, batch_size: int, dtype) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    with torch.inference_mode():
        model.generate(torch.tensor([reqs[0][0][:16]]), max_new_tokens=4, do_sample=False)
        t0 = time.perf_counter()
        for i in range(0, len(reqs), batch_size):
            batch = reqs[i:i + batch_size]
            width = max(len(p) for p, _ in batch)
            ids = torch.zeros(len(batch), width, dtype=torch.long)
            mask = torch.zeros(len(batch), width, dtype=torch.long)
            for row, (p, _) in enumerate(batch):  # left padding, as decoder-only generation needs
                ids[row, width - len(p):] = torch.tensor(p)
                mask[row, width - len(p):] = 1
            model.generate(ids, attention_mask=mask, max_new_tokens=max(m for _, m in batch), do_sample=False)
        return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="shoal-engine bench throughput", description=__doc__)
    ap.add_argument("--model", help="model directory (default: a generated Llama-shaped benchmark model)")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, nargs=2, default=(32, 256), metavar=("MIN", "MAX"))
    ap.add_argument("--output-len", type=int, nargs=2, default=(64, 128), metavar=("MIN", "MAX"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="bfloat16", choices=["auto", "float32", "float16", "bfloat16"])
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    ap.add_argument("--pipeline-parallel-size", type=int, default=1)
    ap.add_argument("--hf-batch-sizes", type=int, nargs="*", default=[8, 32],
                    help="static batch sizes for transformers generate() (default: 8 32)")
    ap.add_argument("--hf-sequential", type=int, default=8,
                    help="requests to run one at a time through transformers (0 to skip; default 8: it is slow)")
    ap.add_argument("--skip-hf", action="store_true", help="measure Shoal only")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = ap.parse_args(argv)

    import torch

    model_dir = Path(args.model) if args.model else bench_model_dir()
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(str(model_dir)).vocab_size
    reqs = workload(args.seed, args.num_prompts, vocab, args.prompt_len, args.output_len)
    tokens = sum(m for _, m in reqs)
    results: dict[str, float] = {}
    results["shoal"] = tokens / run_shoal(model_dir, reqs, args)
    if not args.skip_hf:
        dtype = {"auto": "auto", "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[args.dtype]
        if args.hf_sequential:
            sub = reqs[: args.hf_sequential]
            results["hf_sequential"] = sum(m for _, m in sub) / run_hf(model_dir, sub, 1, dtype)
        for bs in args.hf_batch_sizes:
            results[f"hf_static_batch_{bs}"] = tokens / run_hf(model_dir, reqs, bs, dtype)
    hf = {k: v for k, v in results.items() if k.startswith("hf_")}
    best = max(hf, key=hf.get) if hf else None
    summary = {
        "model": str(model_dir), "requests": len(reqs), "output_tokens": tokens, "dtype": args.dtype,
        "threads": torch.get_num_threads(), "output_tokens_per_s": {k: round(v, 1) for k, v in results.items()},
        "speedup_vs_best_hf": round(results["shoal"] / hf[best], 2) if best else None, "best_hf": best,
    }
    if args.json:
        print(json.dumps(summary))
        return 0
    print(f"model {model_dir}  dtype {args.dtype}  {len(reqs)} requests, {tokens} output tokens, "
          f"{torch.get_num_threads()} threads")
    for name, value in results.items():
        ratio = f"  ({results['shoal'] / value:.2f}x Shoal / this)" if name != "shoal" else ""
        print(f"  {name:<22} {value:9.1f} output tok/s{ratio}")
    if best:
        print(f"Shoal vs best transformers ({best}): {summary['speedup_vs_best_hf']}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
