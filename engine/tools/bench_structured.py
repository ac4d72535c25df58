"""`python -m shoal.engine.tools.bench_structured`: the cost of grammar-constrained decoding at batch 32.

32 requests constrained by a bounded JSON schema run as one batch; then the same 32 prompts run unconstrained
with each request's max_tokens set to the length its structured twin produced (ignore_eos), so both batches
generate exactly the same number of tokens per request. Printed: seconds, output tokens/s, and the ratio.

The model is the throughput benchmark's (Llama-shaped, hidden 512, 8 layers) with a real 32k-token byte-level
BPE trained on the Python standard library, so the grammar works over a realistic vocabulary.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["red", "green", "blue"]}, "maxItems": 3},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "active"],
    "additionalProperties": False,
}


def _train_tokenizer(path: Path, vocab_size: int = 32000) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    stdlib = Path(os.__file__).parent
    files = sorted(str(p) for p in stdlib.glob("*.py"))[:200]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train(files, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(str(path))


def model_dir() -> Path:
    from shoal.engine.tools.demo_model import cache_root
    from shoal.engine.tools.tiny_model import make_model

    path = cache_root() / "bench-llama-512-tok32k"
    if not (path / "tokenizer.json").exists():
        make_model(path, arch="llama", seed=0, dtype="bfloat16", vocab_size=32000, hidden_size=512,
                   intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                   max_position_embeddings=2048, tie_word_embeddings=False, tokenizer=False, eos_token_id=0)
        _train_tokenizer(path)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a model directory (default: the 32k-vocabulary bench model)")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--dtype", default="auto")
    args = p.parse_args(argv)

    from shoal.engine import LLM, SamplingParams
    from shoal.engine.core.structured_outputs import StructuredOutputsParams

    path = Path(args.model) if args.model else model_dir()
    prompts = [f"Record {i}: describe a person as JSON." for i in range(args.num_requests)]
    with LLM(str(path), dtype=args.dtype, max_num_seqs=args.num_requests, max_model_len=1024) as llm:
        spec = StructuredOutputsParams(json=SCHEMA)
        llm.generate(prompts[:2], SamplingParams(max_tokens=8, structured_outputs=spec))  # warm-up + compile
        structured = [SamplingParams(temperature=1.0, seed=i, max_tokens=args.max_tokens, structured_outputs=spec)
                      for i in range(len(prompts))]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, structured)
        t_struct = time.perf_counter() - t0
        lengths = [len(o.outputs[0].token_ids) for o in outs]
        valid = sum(o.outputs[0].finish_reason == "stop" and _valid(o.outputs[0].text) for o in outs)
        plain = [SamplingParams(temperature=1.0, seed=i, max_tokens=n, ignore_eos=True)
                 for i, n in enumerate(lengths)]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, plain)
        t_plain = time.perf_counter() - t0
        assert [len(o.outputs[0].token_ids) for o in outs] == lengths
    tokens = sum(lengths)
    result = {
        "requests": len(prompts), "output_tokens": tokens, "valid_json": valid,
        "structured_s": round(t_struct, 3), "unstructured_s": round(t_plain, 3),
        "structured_tok_s": round(tokens / t_struct, 1), "unstructured_tok_s": round(tokens / t_plain, 1),
        "slowdown": round(t_struct / t_plain, 3),
        "load": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }
    print(json.dumps(result))
    return 0


def _valid(text: str) -> bool:
    try:
        import jsonschema
    except ImportError:  # only the test extra has it
        return isinstance(json.loads(text), dict)
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


if __name__ == "__main__":
    sys.exit(main())
