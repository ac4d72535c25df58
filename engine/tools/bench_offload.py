"""KV offloading on a multi-turn workload: prefix hit rate by tier and time to first token, with the CPU (and disk)
tier against the pool alone. Prints numbers; not a test.

    python -m shoal.engine.tools.bench_offload [--model DIR] [--conversations 8] [--turns 4] [--disk]

The workload: --conversations conversations of --turns turns each, served turn by turn in rotation (every
conversation's turn 1, then every turn 2, ...), so between two turns of one conversation the others pass through
the pool. Each turn's prompt is the conversation so far plus --user-len new tokens, and --reply-len greedy tokens
are generated and appended. The pool is sized to a third of the workload's working set (the final conversations'
blocks), so without offloading most of a returning conversation's prefix has been evicted; the offload tier is
sized to hold the whole working set (with --disk, the CPU tier a tenth of it, the disk tier the rest).

Reported per configuration: the prompt tokens served from each tier (device: the pool) over the prompt tokens
looked up, and TTFT p50 / p90 over the turns after the first (the ones that can hit). Offline (LLMEngine stepped
directly), one request at a time, so TTFT is the prefill plus the first token. The configurations' engines run side
by side, each request on every one in turn (alternating which goes first), so a busy machine slows them alike; the
replies that differ from the first configuration's are counted.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from contextlib import ExitStack

from shoal.engine import LLM, SamplingParams


def workload(conversations: int, turns: int, user_len: int, vocab: int, seed: int) -> list[list[list[int]]]:
    """Per conversation, per turn, the user's new tokens."""
    rng = random.Random(seed)
    return [[[rng.randrange(5, vocab) for _ in range(user_len)] for _ in range(turns)] for _ in range(conversations)]


def one_request(engine, request_id: str, prompt: list[int], params: SamplingParams) -> tuple[float, list[int]]:
    """(TTFT seconds, the generated tokens) of one request run alone."""
    start, first, tokens = time.perf_counter(), None, []
    engine.add_request(request_id, prompt, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if first is None and out.outputs and out.outputs[0].token_ids:
                first = time.perf_counter() - start
            if out.finished:
                tokens = list(out.outputs[0].token_ids)
    return first, tokens


def run(model: str, turns_of: list[list[list[int]]], reply_len: int, block_size: int, pool_blocks: int,
        max_len: int, configs: dict[str, dict]) -> dict[str, dict]:
    """Every configuration's engine side by side, each request on each in turn (the order alternating), so a busy
    machine slows them alike. The conversations continue with the first configuration's replies; the others' replies
    that differ are counted (a prefix reused instead of recomputed runs other matmul shapes: on a quantized model a
    near-tie may then flip, as it does with the device pool's own prefix cache)."""
    params = SamplingParams(temperature=0, max_tokens=reply_len, ignore_eos=True)
    ttft: dict[str, list[float]] = {name: [] for name in configs}
    differing = dict.fromkeys(configs, 0)
    with ExitStack() as stack:
        engines = {name: stack.enter_context(LLM(model=model, block_size=block_size, num_kv_blocks=pool_blocks,
                                                 max_model_len=max_len, **offload)).llm_engine
                   for name, offload in configs.items()}
        history = [[] for _ in turns_of]
        order = list(engines)
        for turn in range(len(turns_of[0])):
            for c, turns in enumerate(turns_of):
                prompt = history[c] + turns[turn]
                replies = {}
                order.reverse()
                for name in order:
                    first, replies[name] = one_request(engines[name], f"c{c}-t{turn}", prompt, params)
                    if turn:
                        ttft[name].append(first)
                reference = replies[next(iter(engines))]
                for name, reply in replies.items():
                    differing[name] += reply != reference
                history[c] = prompt + reference  # every configuration sees the same conversations
        results = {}
        for name, engine in engines.items():
            stats = engine.get_stats()
            engine.pool.check_all_free()
            queried = max(1, stats.prefix_cache_queries_total)
            hits = stats.prefix_cache_tier_hits or {"device": stats.prefix_cache_hits_total}
            times = sorted(ttft[name])
            results[name] = {"hit_rate": {tier: n / queried for tier, n in hits.items()},
                             "total_hit_rate": sum(hits.values()) / queried,
                             "ttft_p50_ms": 1000 * statistics.median(times),
                             "ttft_p90_ms": 1000 * times[int(0.9 * (len(times) - 1))],
                             "differing": differing[name]}
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m shoal.engine.tools.bench_offload", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="an HF model directory or a GGUF file (default: the tiny random "
                                                 "demo model)")
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--user-len", type=int, default=96)
    p.add_argument("--reply-len", type=int, default=16)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--disk", action="store_true", help="also run a CPU tier of a tenth plus a disk tier")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    model = args.model
    if model is None:
        from shoal.engine.tools.tiny_model import ensure_demo_model

        model = str(ensure_demo_model())
    final_len = args.turns * (args.user_len + args.reply_len)
    working_set = args.conversations * -(-final_len // args.block_size)
    pool = max(working_set // 3, -(-final_len // args.block_size) + 2)  # one conversation always fits
    with LLM(model=model, block_size=args.block_size, num_kv_blocks=pool, max_model_len=final_len) as llm:
        per_block = llm.llm_engine.executor.bytes_per_block(args.block_size)
        vocab = llm.llm_engine.vocab_size
    turns_of = workload(args.conversations, args.turns, args.user_len, vocab, args.seed)
    gib = working_set * per_block / 2**30
    configs = {"pool only": {}, "pool + cpu tier": {"kv_offloading_size": gib}}
    disk_dir = tempfile.TemporaryDirectory(prefix="shoal-kv-bench-")
    if args.disk:
        configs["pool + cpu/10 + disk"] = {"kv_offloading_size": gib / 10, "kv_offloading_disk_path": disk_dir.name,
                                            "kv_offloading_disk_size": gib}
    print(f"{args.conversations} conversations x {args.turns} turns ({args.user_len} user + {args.reply_len} reply "
          f"tokens a turn); working set {working_set} blocks of {args.block_size}, pool {pool} blocks "
          f"({working_set / pool:.1f}x); {per_block} bytes a block")
    print(f"{'config':24} {'hit rate (device/cpu/disk)':34} {'total':>6} {'TTFT p50':>9} {'p90':>9}  replies differing")
    with disk_dir:
        for name, r in run(model, turns_of, args.reply_len, args.block_size, pool, final_len, configs).items():
            tiers = "/".join(f"{r['hit_rate'].get(t, 0.0):.2f}" for t in ("device", "cpu", "disk"))
            print(f"{name:24} {tiers:34} {r['total_hit_rate']:6.2f} {r['ttft_p50_ms']:7.1f}ms "
                  f"{r['ttft_p90_ms']:7.1f}ms  {r['differing']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
