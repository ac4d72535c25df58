"""`shoal-engine serve` with the hybrid models (Qwen3-Next and Qwen3.5: Gated DeltaNet + gated attention, Qwen3.5 as
its vision-language checkpoint; Granite 4 and Nemotron-H: Mamba2 + attention without RoPE; Falcon-H1: both side by
side in every layer; Jamba: Mamba (v1) + attention): greedy completions through the openai client, streamed equal to non-streamed and to the
offline engine; a repeated prompt is a prefix-cache hit in the usual metrics; the cache is all free again
afterwards; an image sent to the vision-language checkpoint is refused (its text decoder alone is served)."""

from __future__ import annotations

import pytest
from openai import BadRequestError, OpenAI

from .conftest import assert_served_greedy, metric, offline_greedy

PROMPTS = ["Once upon a time there was a little shoal of fish that swam together in the warm",
           "def add(a, b):"]


@pytest.mark.parametrize("arch", ["qwen3_next", "granitemoehybrid", "nemotron_h", "falcon_h1", "qwen3_5", "jamba"])
def test_hybrid_server_streamed_equals_non_streamed_and_caches_prefixes(start_server, model_factory, arch):
    model = model_factory(arch)
    ref = offline_greedy(model, PROMPTS, 16, max_model_len=256, block_size=4)
    server = start_server(model, "--max-model-len", "256", "--block-size", "4", "--max-num-seqs", "8")
    client = OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=600)  # the first request may build CPU kernels
    assert_served_greedy(client, PROMPTS, ref, 16)
    if arch == "qwen3_5":
        image = [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": "data:,"}}]
        with pytest.raises(BadRequestError, match=r"content part 1 is an image, but this model takes text only"):
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": image}], max_tokens=4)
    m = server.metrics()
    assert metric(m, "shoal:prefix_cache_hits_total", model_name="tiny") > 0, "the repeated prompts were not cached"
    assert metric(m, "shoal:num_free_kv_blocks") == metric(m, "shoal:num_kv_blocks")
