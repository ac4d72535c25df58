"""Multi-LoRA throughput: output tok/s of a batch mixing requests over N adapters against the base model alone,
and adapter load time (`python -m shoal.engine.tools.bench_lora`).

The model is a bench_throughput preset (default smollm2-135m: SmolLM2-135M's shape) or --model DIR; the adapters
are random PEFT adapters of --rank over every attention and MLP projection (tools/tiny_lora.py), made once into a
temporary directory. Three runs of the same seeded workload (ignore_eos, greedy): the base model on an engine
without LoRA, the base model on an engine with LoRA enabled (the cost of the hooks alone), and every request under
one of the N adapters in turn (all N resident, --max-loras N, so one batch holds them all). With --repeat the three
run in interleaved rounds and the best of each counts. Each figure is given twice: output tokens per wall-clock
second, and per CPU-second of this process (the steadier one on a machine other jobs share: time the process
spent waiting for a core does not count).
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
    ap.add_argument("--repeat", type=int, default=1, help="interleaved rounds of the three runs (the best counts)")
    args = ap.parse_args(argv)

    model_dir = Path(args.model) if args.model else bench_model_dir(args.preset)
    import json

    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    reqs = workload(0, args.num_requests, vocab, args.prompt_len, args.output_len)
    prompts = [{"prompt_token_ids": p} for p, _ in reqs]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for _, m in reqs]
    tokens = sum(m for _, m in reqs)
    common = dict(dtype=args.dtype, max_model_len=512, max_num_seqs=max(16, args.num_requests))

    def run(llm, loras) -> tuple[float, float]:
        t0, c0 = time.perf_counter(), time.process_time()
        outs = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
        assert sum(len(o.outputs[0].token_ids) for o in outs) == tokens
        return time.perf_counter() - t0, time.process_time() - c0

    print(f"model {model_dir.name}; {len(reqs)} requests, {tokens} output tokens; {args.adapters} adapters of rank "
          f"{args.rank} over q/k/v/o/gate/up/down; best of {args.repeat} interleaved rounds", flush=True)
    with tempfile.TemporaryDirectory(prefix="shoal-bench-lora-") as tmp:
        t0 = time.perf_counter()
        dirs = [make_lora_adapter(Path(tmp, f"a{i}"), model_dir, rank=args.rank, alpha=2 * args.rank, seed=i)
                for i in range(args.adapters)]
        made = time.perf_counter() - t0
        with LLM(model=str(model_dir), **common) as base, \
                LLM(model=str(model_dir), enable_lora=True, max_loras=args.adapters, max_lora_rank=args.rank,
                    max_cpu_loras=args.adapters, **common) as lora:
            load = []
            for i, d in enumerate(dirs):
                t0 = time.perf_counter()
                lora.llm_engine.add_lora(f"a{i}", str(d))
                load.append(time.perf_counter() - t0)
            print(f"  adapter load time: mean {sum(load) / len(load) * 1000:.1f} ms, max {max(load) * 1000:.1f} ms "
                  f"(validate + read + shard; {args.adapters} adapters made in {made:.1f}s)", flush=True)
            mixed = [f"a{i % args.adapters}" for i in range(len(reqs))]
            variants = {"base model, LoRA off": (base, [None] * len(reqs)),
                        "base model, LoRA on": (lora, [None] * len(reqs)),
                        f"{args.adapters} adapters mixed": (lora, mixed)}
            for llm, loras in variants.values():  # warm-up: kernels built, caches touched
                llm.generate(prompts[:1], params[0].clone(max_tokens=2), lora_request=loras[:1], use_tqdm=False)
            best = {name: (float("inf"), float("inf")) for name in variants}
            for _ in range(args.repeat):
                for name, (llm, loras) in variants.items():
                    wall, cpu = run(llm, loras)
                    best[name] = (min(best[name][0], wall), min(best[name][1], cpu))
    base_wall, base_cpu = best["base model, LoRA off"]
    for name, (wall, cpu) in best.items():
        print(f"  {name:<24} {tokens / wall:8.1f} output tok/s ({base_wall / wall * 100 - 100:+.1f}% vs base), "
              f"{tokens / cpu:8.1f} per CPU-second ({base_cpu / cpu * 100 - 100:+.1f}%)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
