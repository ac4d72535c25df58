"""Runs `shoal-engine bench throughput`'s workload through vLLM's offline API, inside vLLM's own environment.

vLLM pins its own torch build, so it lives in a separate virtualenv: bench_throughput starts this file with that
environment's interpreter (`--vllm-python`), writes the workload as JSON to its stdin and reads one JSON line back.
This file must therefore import nothing from Shoal.
"""

import json
import os
import sys
import time


def main() -> int:
    spec = json.load(sys.stdin)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")  # GiB of KV cache on CPU
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=spec["model"], dtype=spec["dtype"], max_model_len=spec["max_model_len"], seed=0,
              skip_tokenizer_init=True, max_num_seqs=spec["max_num_seqs"])
    prompts = [TokensPrompt(prompt_token_ids=p) for p, _ in spec["requests"]]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, detokenize=False)
              for _, m in spec["requests"]]
    llm.generate(prompts[:1], SamplingParams(max_tokens=4, ignore_eos=True, detokenize=False), use_tqdm=False)
    best = float("inf")
    for _ in range(spec["repeat"]):
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        best = min(best, time.perf_counter() - t0)
        got = sum(len(o.outputs[0].token_ids) for o in outs)
        assert got == sum(m for _, m in spec["requests"]), got
    print("SHOAL-BENCH " + json.dumps({"seconds": best}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
