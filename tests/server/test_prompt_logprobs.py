"""Prompt logprobs, what evaluation clients rely on, against transformers (float32) — with prefix caching and
chunked prefill on — and lm-evaluation-harness's local-completions model against a real `serve` process."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from openai import OpenAI

CHUNK = 32  # --max-num-batched-tokens: prompts below are prefilled in several chunks


@pytest.fixture(scope="module")
def server(start_server, llama_model):
    return start_server(llama_model, "--dtype", "float32", "--max-model-len", "256", "--num-kv-blocks", "256",
                        "--block-size", "16", "--enable-prefix-caching", "--enable-chunked-prefill",
                        "--max-num-batched-tokens", str(CHUNK))


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def hf(llama_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(llama_model, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(llama_model)


def hf_token_logprobs(model, ids: list[int]) -> list[float]:
    """log P(ids[i] | ids[:i]) for i >= 1, in float32."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    return [lp[i - 1, ids[i]].item() for i in range(1, len(ids))]


PROMPT = ("A paged cache keeps keys and values in fixed-size blocks, so sequences of any length share one pool "
          "and a prefix computed once is reused by every request that starts with it.")


def test_echo_logprobs_equal_transformers_with_prefix_cache_and_chunked_prefill(server, client, hf):
    model, tok = hf
    ids = tok(PROMPT)["input_ids"]
    assert len(ids) > 2 * CHUNK  # several prefill chunks
    ref = hf_token_logprobs(model, ids)
    client.completions.create(model="tiny", prompt=PROMPT, max_tokens=1)  # the prompt's blocks are now cached
    for prompt in (PROMPT, ids):  # text and token ids
        # max_tokens 0 + echo: score the prompt without generating (the first token has no logprob).
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=0, echo=True, logprobs=1,
                                      temperature=0)
        c = r.choices[0]
        assert c.text == PROMPT and r.usage.completion_tokens == 0
        lp = c.logprobs
        assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert lp.token_logprobs[1:] == pytest.approx(ref, abs=2e-4)
        for val, top in zip(lp.token_logprobs[1:], lp.top_logprobs[1:]):
            assert max(top.values()) >= val - 1e-6 and 1 <= len(top) <= 2
        assert "".join(lp.tokens) == PROMPT and lp.text_offset[1] == len(lp.tokens[0])
    # echo + generation, streamed: the prompt's logprobs come first, then one per generated token.
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, echo=True, logprobs=0,
                                            temperature=0, stream=True))
    streamed = [v for ch in chunks if ch.choices and ch.choices[0].logprobs
                for v in ch.choices[0].logprobs.token_logprobs]
    assert len(streamed) == len(ids) + 3 and streamed[0] is None
    assert streamed[1:len(ids)] == pytest.approx(ref, abs=2e-4)
    # n > 1: every choice echoes the prompt with its logprobs.
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, n=2, echo=True, logprobs=0, seed=1)
    for c in r.choices:
        assert c.logprobs.token_logprobs[1:len(ids)] == pytest.approx(ref, abs=2e-4)


def test_vllm_prompt_logprobs_field(server, hf):
    model, tok = hf
    ids = tok(PROMPT)["input_ids"]
    ref = hf_token_logprobs(model, ids)
    status, r, _ = server.post("/v1/completions", {"model": "tiny", "prompt": ids, "max_tokens": 1,
                                                   "prompt_logprobs": 2})
    assert status == 200, r
    plp = r["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ids)
    for i, entry in enumerate(plp[1:], start=1):
        own = entry[str(ids[i])]
        assert own["logprob"] == pytest.approx(ref[i - 1], abs=2e-4) and len(entry) <= 3 and own["rank"] >= 1
    status, r, _ = server.post("/v1/chat/completions", {"model": "tiny", "max_tokens": 1, "prompt_logprobs": 0,
                                                        "messages": [{"role": "user", "content": PROMPT}]})
    assert status == 200 and r["prompt_logprobs"][0] is None
    assert len(r["prompt_logprobs"]) == r["usage"]["prompt_tokens"]


def test_tokenizer_info(server):
    status, raw = server.get("/tokenizer_info")
    info = json.loads(raw)
    assert status == 200 and info["tokenizer_class"] and info["model_max_length"] == 256 and info["vocab_size"] > 0


# ------------------------------------------------------------------------------------------ lm-evaluation-harness
def _lm_eval() -> list[str]:
    """How to run lm-evaluation-harness: $SHOAL_LM_EVAL (an `lm_eval` executable, e.g. in its own venv), else the
    one the test extra installs here."""
    exe = os.environ.get("SHOAL_LM_EVAL")
    return [exe] if exe else [sys.executable, "-m", "lm_eval"]


DOCS = [
    {"q": "The sky is", "choices": ["blue", "green", "loud"], "gold": 0},
    {"q": "Two plus two is", "choices": ["four", "seven"], "gold": 0},
    {"q": "A cat says", "choices": ["woof", "meow", "moo", "quack"], "gold": 1},
    {"q": "Water freezes at zero degrees", "choices": ["Celsius", "Kelvin"], "gold": 0},
    {"q": "The opposite of hot is", "choices": ["warm", "cold", "spicy"], "gold": 1},
    {"q": "for i in range(10): print", "choices": ["(i)", "[i]", "{i}"], "gold": 0},
    {"q": "Paged attention stores keys in", "choices": ["blocks", "files", "pages of a book"], "gold": 0},
    {"q": "def add(a, b): return", "choices": ["a + b", "a - b", "b"], "gold": 0},
]

TASK = """task: shoal_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{q}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: gold
metric_list:
  - metric: acc
"""


def _reference_accuracy(model, tok) -> float:
    """lm-eval's loglikelihood, computed with transformers: context "q", continuation " choice"."""
    hits = 0
    for d in DOCS:
        scores = []
        for choice in d["choices"]:
            ctx = tok(d["q"])["input_ids"]
            whole = tok(d["q"] + " " + choice)["input_ids"]
            lps = hf_token_logprobs(model, whole)
            scores.append(sum(lps[len(ctx) - 1:]))
        hits += int(max(range(len(scores)), key=scores.__getitem__) == d["gold"])
    return hits / len(DOCS)


def test_lm_eval_local_completions_matches_transformers(server, hf, llama_model, tmp_path):
    cmd = _lm_eval()
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (tmp_path / "task.yaml").write_text(TASK.format(data=data))
    out = tmp_path / "out"
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    args = ["--model", "local-completions", "--model_args",
            f"model=tiny,base_url={server.base}/v1/completions,tokenizer={llama_model},tokenized_requests=False,"
            "num_concurrent=2,max_retries=1",
            "--tasks", "shoal_tiny_mc", "--include_path", str(tmp_path), "--output_path", str(out), "--log_samples"]
    proc = subprocess.run(cmd + args, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0 and "run" not in cmd[-1]:  # newer lm-eval: `lm_eval run ...`
        proc = subprocess.run(cmd + ["run"] + args, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(next(Path(out).rglob("results_*.json")).read_text())
    acc = results["results"]["shoal_tiny_mc"]["acc,none"]
    model, tok = hf
    assert math.isclose(acc, _reference_accuracy(model, tok)), (acc, proc.stdout[-2000:])
