"""Runs `bench_images`' workload through one engine's offline API: Shoal's (`shoal.engine.LLM`) or vLLM's, each
inside its own environment (vLLM pins its own torch build, so it lives in a separate virtualenv).

bench_images starts this file with the chosen environment's interpreter, writes the workload as JSON to its stdin
and reads one JSON line back. Both engines take the same input — a prompt with one `<image>` placeholder per image
and `multi_modal_data={"image": [PIL images]}` — so both sides run exactly the same requests. This file must
therefore import nothing from Shoal at the top (only inside the Shoal branch).

Measured (wall time of `generate`, each engine warmed up on an image of its own first):
  ttft: one one-image chat at a time, max_tokens=1, a new image each (no cache can help): its prefill, the image's
        encoding and preprocessing included;
  images_per_second: `burst` one-image chats at once, each a new image, `burst_tokens` tokens each;
  turns: a conversation about one new image, `turns` user turns, each sent as the whole conversation so far with
        max_tokens=1 after the first: the time to first token of each turn.
"""

import json
import os
import statistics
import sys
import time


def make_llm(spec: dict, prefix_caching: bool):
    kw = dict(model=spec["model"], dtype=spec["dtype"], max_model_len=spec["max_model_len"], seed=0,
              enable_prefix_caching=prefix_caching, max_num_seqs=spec["max_num_seqs"])
    if spec["runtime"] == "shoal":
        from shoal.engine import LLM, SamplingParams

        return LLM(**kw), SamplingParams
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")  # GiB of KV cache on CPU
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    from vllm import LLM, SamplingParams

    return LLM(**kw, limit_mm_per_prompt={"image": 1}), SamplingParams


def forget_encoder_outputs(llm) -> None:
    """Shoal's encoder-output cache emptied: the next request encodes its images again."""
    llm.llm_engine.executor.runner.encoder_cache.clear()


def main() -> int:
    spec = json.load(sys.stdin)
    from PIL import Image

    images = [Image.open(p).convert("RGB") for p in spec["images"]]
    fresh = iter(images)
    variant = spec.get("variant", "default")
    llm, SamplingParams = make_llm(spec, prefix_caching=variant == "default")

    def generate(prompts: list[str], pictures: list, max_tokens: int) -> float:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        requests = [{"prompt": p, "multi_modal_data": {"image": [img]}} for p, img in zip(prompts, pictures)]
        if variant == "no-encoder-cache":
            forget_encoder_outputs(llm)
        t0 = time.perf_counter()
        outs = llm.generate(requests, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        assert all(len(o.outputs[0].token_ids) == max_tokens for o in outs), "an answer came back short"
        return seconds

    chat = spec["template"]  # "{history}" and "{question}"; the image placeholder sits in the first turn
    question = spec["question"]
    generate([chat.format(history="", question=spec["image_token"] + question)], [next(fresh)], 4)  # warm-up
    result: dict = {"runtime": spec["runtime"], "variant": variant}
    if variant == "default":
        ttfts = [generate([chat.format(history="", question=spec["image_token"] + question)], [next(fresh)], 1)
                 for _ in range(spec["ttft_repeat"])]
        result["ttft_s"] = statistics.median(ttfts)
        burst = [next(fresh) for _ in range(spec["burst"])]
        prompt = chat.format(history="", question=spec["image_token"] + question)
        seconds = generate([prompt] * len(burst), burst, spec["burst_tokens"])
        result["images_per_second"] = len(burst) / seconds
    image, history, turn_ttfts = next(fresh), "", []
    for turn in range(spec["turns"]):
        ask = (spec["image_token"] if turn == 0 else "") + f"{question} (turn {turn + 1})"
        prompt = chat.format(history=history, question=ask)
        turn_ttfts.append(generate([prompt], [image], 1))
        history = prompt + spec["answer"]
    result["turn_ttft_s"] = turn_ttfts
    print("SHOAL-BENCH " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
