"""Multi-LoRA throughput: output tok/s of a batch mixing requests over N adapters against the base model alone,
and adapter load time (`python -m shoal.engine.tools.bench_lora`).

The model is a bench_throughput preset (default smollm2-135m: SmolLM2-135M's shape) or --model DIR; the adapters
are random PEFT adapters of --rank over every attention and MLP projection (tools/tiny_lora.py), made once into a
temporary directory. Three runs of the same seeded workload (ignore_eos, greedy): the base model on an engine
without LoRA, the base model on an engine with LoRA enabled (the cost of the hooks alone), and every request under
one of the N adapters in turn (all N resident, --max-loras N, so one batch holds them all).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    from shoal.engine.contracts import SamplingParams
    from shoal.engine.llm import LLM
    from shoal.engine.tools.bench_throughput import PRESETS, bench_model_dir, workload
    from shoal.engine.tools.tiny_lora import make_lora_adapter

    ap = argparse.ArgumentParser(prog="python -m shoal.engine.tools.bench_lora", description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="smollm2-135m", choices=sorted(PRESETS))
    ap.add_argument("--model", default=None, help="a local model directory instead of a preset")
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, nargs=2, default=(32, 96), metavar=("MIN", "MAX"))
    ap.add_argument("--output-len", type=int, nargs=2, default=(32, 48), metavar=("MIN", "MAX"))
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--repeat", type=int, default=1, help="timed runs per variant (the best counts)")
    args = ap.parse_args(argv)

    model_dir = Path(args.model) if args.model else bench_model_dir(args.preset)
    import json

    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    reqs = workload(0, args.num_requests, vocab, args.prompt_len, args.output_len)
    prompts = [{"prompt_token_ids": p} for p, _ in reqs]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for _, m in reqs]
    tokens = sum(m for _, m in reqs)
    common = dict(dtype=args.dtype, max_model_len=512, max_num_seqs=max(16, args.num_requests))

    def timed(llm, loras) -> float:
        llm.generate(prompts[:1], params[0].clone(max_tokens=2), lora_request=loras[:1], use_tqdm=False)  # warm
        best = float("inf")
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
            best = min(best, time.perf_counter() - t0)
            assert sum(len(o.outputs[0].token_ids) for o in outs) == tokens
        return best

    results = {}
    print(f"model {model_dir.name}; {len(reqs)} requests, {tokens} output tokens; {args.adapters} adapters of rank "
          f"{args.rank} over q/k/v/o/gate/up/down", flush=True)

    def report(name: str, seconds: float) -> None:
        results[name] = seconds
        rate, base = tokens / seconds, tokens / results["base model, LoRA off"]
        print(f"  {name:<24} {rate:8.1f} output tok/s  ({(rate / base - 1) * 100:+.1f}% vs base)", flush=True)

    with LLM(model=str(model_dir), **common) as llm:
        report("base model, LoRA off", timed(llm, [None] * len(reqs)))
    with tempfile.TemporaryDirectory(prefix="shoal-bench-lora-") as tmp:
        t0 = time.perf_counter()
        dirs = [make_lora_adapter(Path(tmp, f"a{i}"), model_dir, rank=args.rank, alpha=2 * args.rank, seed=i)
                for i in range(args.adapters)]
        made = time.perf_counter() - t0
        with LLM(model=str(model_dir), enable_lora=True, max_loras=args.adapters, max_lora_rank=args.rank,
                 max_cpu_loras=args.adapters, **common) as llm:
            engine = llm.llm_engine
            load = []
            for i, d in enumerate(dirs):
                t0 = time.perf_counter()
                engine.add_lora(f"a{i}", str(d))
                load.append(time.perf_counter() - t0)
            print(f"  adapter load time: mean {sum(load) / len(load) * 1000:.1f} ms, max {max(load) * 1000:.1f} ms "
                  f"(validate + read + shard; {args.adapters} adapters made in {made:.1f}s)", flush=True)
            report("base model, LoRA on", timed(llm, [None] * len(reqs)))
            mixed = [f"a{i % args.adapters}" for i in range(len(reqs))]
            report(f"{args.adapters} adapters mixed", timed(llm, mixed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
