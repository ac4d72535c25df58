"""A DeepSeek V3 (MLA) model through the real `shoal-engine serve` process and the openai client: streamed output
equals non-streamed output, and both equal transformers' greedy tokens."""

from __future__ import annotations

import sys
from pathlib import Path

from openai import OpenAI

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))  # hf_reference
from hf_reference import hf_greedy  # noqa: E402


def test_mla_stream_equals_non_stream_and_transformers(start_server, model_factory):
    model_dir = model_factory("deepseek_v3")
    server = start_server(model_dir, "--max-model-len", "128", "--block-size", "4")
    client = OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=120)
    kw = dict(model="tiny", prompt="Once upon a time there was a little shoal of fish", max_tokens=12,
              temperature=0.0, logprobs=1, extra_body={"ignore_eos": True})
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, **kw))
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert streamed == full.choices[0].text and full.choices[0].finish_reason == "length"
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    ref_ids, _ = hf_greedy(model_dir, tok.encode(kw["prompt"]), 12)
    assert full.choices[0].text == tok.decode(ref_ids, skip_special_tokens=True)
