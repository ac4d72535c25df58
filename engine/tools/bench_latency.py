"""`shoal-engine bench latency`: one user at a time. Batch-1 decode tokens/s and time to first token for Shoal and
llama.cpp side by side on the same model, and speculative decoding on a repetitive task against none.

Shoal runs offline (its LLMEngine stepped directly, no HTTP): one request of --prompt-len random prompt tokens and
--output-len greedy output tokens (EOS ignored). TTFT is the first step (prefill and the first token); decode
tokens/s is the remaining output tokens over the time from the first token to the last, so the decode rate is
measured at a context of prompt-len and beyond. The median of --repeat runs is reported (after one warm-up run);
runs of the engines compared in a row alternate, so a busy machine slows both alike.

llama.cpp runs `llama-bench` from --llama-cpp-bin (a build directory's bin/) with the same thread count: `-p P`
on an empty context gives the prompt-processing rate (its TTFT is P divided by it) and `-n N` the generation rate
at a context depth of P (`-d`, where this llama-bench has that option); the median of its --repeat runs is
reported. Without --llama-cpp-bin (or without a GGUF for it to run) that column is skipped, saying so.

Rows:
  --model DIR_OR_GGUF [--llama-cpp-model GGUF]   one row: Shoal on --model (an HF directory in --dtype, or a GGUF
                                                  file, kept packed), llama.cpp on the GGUF (default: --model).
  --suite DIR                                     the standard table, from a directory holding hf/ (float32 HF
                                                  weights), and GGUF files named *F32*, *Q8_0*, *Q4_1*: float32 vs
                                                  the F32 GGUF, then each GGUF in both engines.
Speculative decoding rows follow (skip them with --skip-speculative): Shoal with and without --speculative-config
(default n-gram, 4 tokens) on a repetitive task — an instruct model (one with a chat template) asked to add a
docstring to a short function and reply with the whole function, up to its EOS; for a model without a chat
template, prompts that quote a passage twice and begin it a third time — at each batch size of --spec-batch (default 1 and 32): decode tokens/s per request at batch 1,
output tokens/s of the whole batch above, and the acceptance rate.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import time
from pathlib import Path

from shoal.engine.execution.cpu_features import peer_environ

DEFAULT_SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'

# The repetitive task for an instruct model: return a function with a small addition (code editing), the case n-gram
# proposals are for. Procedural code, which a small model copies faithfully; several snippets, so that the
# requests of a batch differ.
_SNIPPETS = [
    "def merge_sorted(left, right):\n    result = []\n    i = j = 0\n    while i < len(left) and j < len(right):\n"
    "        if left[i] <= right[j]:\n            result.append(left[i])\n            i += 1\n        else:\n"
    "            result.append(right[j])\n            j += 1\n    return result + left[i:] + right[j:]\n",
    "def binary_search(values, target):\n    low = 0\n    high = len(values) - 1\n    while low <= high:\n"
    "        middle = (low + high) // 2\n        if values[middle] == target:\n            return middle\n"
    "        if values[middle] < target:\n            low = middle + 1\n        else:\n"
    "            high = middle - 1\n    return -1\n",
    "def moving_average(values, window):\n    averages = []\n    total = 0\n    for i in range(len(values)):\n"
    "        total += values[i]\n        if i >= window:\n            total -= values[i - window]\n"
    "        if i >= window - 1:\n            averages.append(total / window)\n    return averages\n",
]
_ASK = "Add a docstring to this Python function. Reply with the whole function.\n\n"


def repetitive_prompts(tokenizer, vocab_size: int, n: int, prompt_len: int, seed: int) -> list[list[int]]:
    """n prompts of the repetitive task as token ids (see the module docstring)."""
    template = getattr(tokenizer, "chat_template", None)
    if template:
        prompts = []
        for i in range(n):
            ask = _ASK + _SNIPPETS[i % len(_SNIPPETS)]
            text = tokenizer.apply_chat_template([{"role": "user", "content": ask}], add_generation_prompt=True,
                                                 tokenize=False)
            prompts.append(tokenizer.encode(text, add_special_tokens=False))
        return prompts
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        passage = [rng.randrange(10, vocab_size) for _ in range(max(1, prompt_len // 3))]
        out.append((passage * 3)[:prompt_len])
    return out


def random_prompt(vocab_size: int, length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, vocab_size) for _ in range(length)]


# ----------------------------------------------------------------------------------------------------- Shoal


def shoal_engine(model: str, args, **extra):
    from shoal.engine.llm import LLM

    from shoal.engine.core.engine import _model_max_len
    from shoal.engine.execution.model_loader import load_hf_config

    limit = _model_max_len(load_hf_config(Path(model)))
    options = dict(max_model_len=args.max_model_len or min(1024, limit or 1024),
                   max_num_seqs=max([32] + args.spec_batch))
    if not model.endswith(".gguf"):
        options["dtype"] = args.dtype
    return LLM(model=model, **options, **extra)


def _one_run(engine, prompts: list[list[int]], output_len: int, tag: str, ignore_eos: bool = True
             ) -> tuple[float, float, int]:
    """(seconds to the first token, seconds from the first token to the last, output tokens) of the prompts
    run together, greedy."""
    from shoal.engine.contracts import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=ignore_eos)
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", p, params)
    t0 = time.perf_counter()
    first = None
    tokens = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens += len(out.outputs[0].token_ids)
        if first is None:
            first = time.perf_counter()
    return first - t0, time.perf_counter() - first, tokens


class ShoalRuns:
    """Timed runs of one engine on one set of prompts (after a warm-up that also captures the decode graph), kept
    so that runs of several engines can be interleaved; summary() gives medians and the speculative counters."""

    def __init__(self, llm, prompts: list[list[int]], output_len: int, ignore_eos: bool = True):
        self.engine, self.prompts, self.output_len = llm.llm_engine, prompts, output_len
        self.ignore_eos = ignore_eos
        _one_run(self.engine, [p[:16] for p in prompts], 4, "warm-up")
        self.ttfts, self.rates, self.totals = [], [], []
        self.stats0 = self.engine.get_stats()

    def run(self) -> None:
        ttft, rest, tokens = _one_run(self.engine, self.prompts, self.output_len, f"run{len(self.ttfts)}",
                                      self.ignore_eos)
        self.ttfts.append(ttft)
        self.rates.append((tokens - len(self.prompts)) / len(self.prompts) / rest)  # per request, after its first
        self.totals.append(tokens / (ttft + rest))

    def summary(self) -> dict:
        stats, stats0 = self.engine.get_stats(), self.stats0
        drafted = stats.spec_decode_num_draft_tokens_total - stats0.spec_decode_num_draft_tokens_total
        accepted = stats.spec_decode_num_accepted_tokens_total - stats0.spec_decode_num_accepted_tokens_total
        return {"ttft_ms": 1e3 * statistics.median(self.ttfts), "decode_tok_s": statistics.median(self.rates),
                "output_tok_s": statistics.median(self.totals), "acceptance": accepted / drafted if drafted else None,
                "decode_tok_s_runs": [round(r, 2) for r in self.rates],
                "output_tok_s_runs": [round(r, 2) for r in self.totals]}


# ------------------------------------------------------------------------------------------------- llama.cpp


def llama_bench_path(bin_dir: str | None) -> tuple[Path | None, str]:
    """(llama-bench, "") or (None, why its column is skipped)."""
    if not bin_dir:
        return None, "no --llama-cpp-bin given"
    path = Path(bin_dir) / "llama-bench"
    if not path.is_file():
        return None, f"{path} does not exist"
    return path, ""


class LlamaCppRuns:
    """llama-bench, one repetition per run() (interleaved with Shoal's runs): the prompt-processing rate on an empty
    context and the generation rate at a context of prompt_len; summary() gives medians."""

    def __init__(self, bench: Path, gguf: str, prompt_len: int, output_len: int, threads: int):
        help_text = subprocess.run([str(bench), "--help"], capture_output=True, text=True).stdout
        self.at_depth = "--n-depth" in help_text
        self.prompt_len, self.output_len = prompt_len, output_len
        self.cmd = [str(bench), "-m", gguf, "-p", str(prompt_len), "-n", str(output_len), "-t", str(threads),
                    "-r", "1", "-o", "json", *(["-d", f"0,{prompt_len}"] if self.at_depth else [])]
        self.pp, self.tg = [], []

    def run(self) -> None:
        proc = subprocess.run(self.cmd, capture_output=True, text=True, env=peer_environ())
        if proc.returncode:
            raise RuntimeError(f"{' '.join(self.cmd)} failed (exit {proc.returncode}): {proc.stderr.strip()[-800:]}")
        rows = json.loads(proc.stdout)
        depth = self.prompt_len if self.at_depth else 0
        self.pp.append(next(r["avg_ts"] for r in rows
                            if r["n_prompt"] == self.prompt_len and r["n_gen"] == 0 and not r.get("n_depth")))
        self.tg.append(next(r["avg_ts"] for r in rows
                            if r["n_gen"] == self.output_len and r["n_prompt"] == 0 and r.get("n_depth", 0) == depth))

    def summary(self) -> dict:
        return {"ttft_ms": 1e3 * self.prompt_len / statistics.median(self.pp),
                "decode_tok_s": statistics.median(self.tg), "decode_tok_s_runs": [round(r, 2) for r in self.tg],
                "decode_at_depth": self.at_depth}


# --------------------------------------------------------------------------------------------------- driver


def suite_rows(directory: Path) -> list[tuple[str, str, str | None]]:
    """(label, Shoal's model, llama.cpp's GGUF) for the standard table of a --suite directory."""
    ggufs = sorted(directory.glob("*.gguf"))

    def find(tag: str) -> Path | None:
        return next((g for g in ggufs if tag.lower() in g.name.lower()), None)

    rows = []
    hf, f32 = directory / "hf", find("f32")
    if (hf / "config.json").is_file():
        rows.append(("float32 (HF) vs F32 GGUF", str(hf), str(f32) if f32 else None))
    for tag in ("Q8_0", "Q4_1"):
        g = find(tag)
        if g is not None:
            rows.append((f"{tag} GGUF, both engines", str(g), str(g)))
    if not rows:
        raise SystemExit(f"--suite {directory}: no hf/ directory and no *F32*, *Q8_0* or *Q4_1* GGUF in it")
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="shoal-engine bench latency", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a Hugging Face model directory or GGUF file (one row)")
    ap.add_argument("--preset", default=None, help="a bench throughput random-weight preset instead of --model "
                                                   "(Shoal only), e.g. smollm2-135m")
    ap.add_argument("--llama-cpp-model", default=None, metavar="GGUF",
                    help="the GGUF llama.cpp runs for the --model row (default: --model when it is a GGUF)")
    ap.add_argument("--suite", default=None, metavar="DIR",
                    help="the standard table from DIR (hf/, *F32*.gguf, *Q8_0*.gguf, *Q4_1*.gguf)")
    ap.add_argument("--llama-cpp-bin", default=None, metavar="DIR", help="llama.cpp's bin/ (holding llama-bench)")
    ap.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16"],
                    help="Shoal's dtype for an HF directory (default float32: the precision of an F32 GGUF)")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--max-model-len", type=int, default=None,
                    help="default: 1024, or the model's own limit when that is smaller")
    ap.add_argument("--repeat", type=int, default=3, help="timed runs per measurement (median reported)")
    ap.add_argument("--threads", type=int, default=None, help="llama.cpp threads (default: torch's, as Shoal's)")
    ap.add_argument("--speculative-config", default=DEFAULT_SPEC, metavar="JSON")
    ap.add_argument("--spec-batch", type=int, nargs="+", default=[1, 32], metavar="N")
    ap.add_argument("--skip-speculative", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = ap.parse_args(argv)
    if sum(x is not None for x in (args.model, args.preset, args.suite)) != 1:
        ap.error("give exactly one of --model, --preset, --suite")

    import torch

    threads = args.threads or torch.get_num_threads()
    bench, why = llama_bench_path(args.llama_cpp_bin)
    if args.suite:
        rows = suite_rows(Path(args.suite))
    else:
        if args.preset:
            from shoal.engine.tools.bench_throughput import bench_model_dir

            model = str(bench_model_dir(args.preset))
        else:
            model = args.model
        gguf = args.llama_cpp_model or (model if model.endswith(".gguf") else None)
        rows = [(Path(model).name, model, gguf)]

    load = open("/proc/loadavg").read().split()[0]
    results = []
    for label, model, gguf in rows:
        row = {"row": label, "shoal_model": model, "llama_cpp_model": gguf}
        with shoal_engine(model, args) as llm:
            shoal = ShoalRuns(llm, [random_prompt(llm.llm_engine.vocab_size, args.prompt_len, args.seed)],
                              args.output_len)
            peer = None
            if bench is None or gguf is None:
                row["llama_cpp_skipped"] = why or "no GGUF for this row"
            else:
                peer = LlamaCppRuns(bench, gguf, args.prompt_len, args.output_len, threads)
            for _ in range(args.repeat):  # interleaved: both see the same machine, round by round
                shoal.run()
                if peer is not None:
                    peer.run()
            row["shoal"] = shoal.summary()
            if peer is not None:
                row["llama_cpp"] = peer.summary()
        results.append(row)

    spec_rows = []
    if not args.skip_speculative:
        from shoal.engine.config import SpeculativeConfig, parse_speculative_config

        spec = SpeculativeConfig(**parse_speculative_config(args.speculative_config))
        model = rows[0][1]
        with shoal_engine(model, args) as off, shoal_engine(model, args, speculative_config=spec) as on:
            e = off.llm_engine
            for batch in args.spec_batch:
                prompts = repetitive_prompts(e.tokenizer, e.vocab_size, batch, args.prompt_len, args.seed)
                # An instruct model's answer ends at its EOS (what follows is not the task); greedy, so both runs
                # produce the same tokens.
                stop = not getattr(e.tokenizer, "chat_template", None)
                runs = {"off": ShoalRuns(off, prompts, args.output_len, ignore_eos=stop),
                        "speculative": ShoalRuns(on, prompts, args.output_len, ignore_eos=stop)}
                for _ in range(args.repeat):  # interleaved
                    for r in runs.values():
                        r.run()
                spec_rows += [{"run": name, "batch": batch, **r.summary()} for name, r in runs.items()]

    from shoal.engine.execution.cpu_features import thread_policy

    summary = {"threads": threads, "openmp_wait": thread_policy(), "prompt_len": args.prompt_len,
               "output_len": args.output_len, "repeat": args.repeat, "load_at_start": float(load),
               "load_at_end": float(open("/proc/loadavg").read().split()[0]), "rows": results,
               "speculative": spec_rows, "speculative_config": args.speculative_config}
    if args.json:
        print(json.dumps(summary))
        return 0
    print(f"batch-1 latency, {args.prompt_len}-token prompt, {args.output_len} output tokens, {threads} threads "
          f"(OpenMP wait: {summary['openmp_wait']}), median of {args.repeat} interleaved runs, load {load} -> "
          f"{summary['load_at_end']}")
    print(f"  {'row':<34}{'Shoal tok/s':>12}{'TTFT ms':>9}{'llama.cpp tok/s':>17}{'TTFT ms':>9}{'Shoal/llama':>13}")
    for r in results:
        s = r["shoal"]
        line = f"  {r['row']:<34}{s['decode_tok_s']:>12.1f}{s['ttft_ms']:>9.1f}"
        if "llama_cpp" in r:
            c = r["llama_cpp"]
            line += f"{c['decode_tok_s']:>17.1f}{c['ttft_ms']:>9.1f}{s['decode_tok_s'] / c['decode_tok_s']:>12.2f}x"
        else:
            line += f"   llama.cpp skipped: {r['llama_cpp_skipped']}"
        print(line)
    if spec_rows:
        print(f"speculative decoding {args.speculative_config} on a repetitive task ({rows[0][0]}):")
        for batch in args.spec_batch:
            off, on = (next(r for r in spec_rows if r["run"] == n and r["batch"] == batch)
                       for n in ("off", "speculative"))
            key, unit = ("decode_tok_s", "decode tok/s") if batch == 1 else ("output_tok_s", "output tok/s")
            rate = "" if on["acceptance"] is None else f", acceptance {on['acceptance']:.3f}"
            print(f"  batch {batch:>3}: off {off[key]:8.1f} {unit}, speculative {on[key]:8.1f} "
                  f"({on[key] / off[key]:.2f}x{rate})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
