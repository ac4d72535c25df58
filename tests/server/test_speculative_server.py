"""`shoal-engine serve --speculative-config ...`: the OpenAI server with n-gram speculative decoding returns the
non-speculative engine's greedy completions (streamed and not) and reports vLLM's spec_decode_* counters."""

from __future__ import annotations

import json

from openai import OpenAI

from .conftest import assert_served_greedy, metric, offline_greedy

PROMPTS = ["one two three four five six one two three four five six one two three",
           "the cat sat on the mat, the cat sat on the mat, the cat",
           "A B C A B C A B C A B",
           "def f(x): return x + 1\ndef g(x): return x + 1\ndef h(x): return"]
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


def test_server_greedy_equals_non_speculative_and_counts(start_server, llama_model):
    ref = offline_greedy(llama_model, PROMPTS, 24, dtype="float32", max_model_len=256)
    server = start_server(llama_model, "--max-model-len", "256", "--num-kv-blocks", "64",
                          "--speculative-config", json.dumps(NGRAM))
    client = OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=120)
    assert_served_greedy(client, PROMPTS, ref, 24)
    m = server.metrics()
    drafted = metric(m, "shoal:spec_decode_num_draft_tokens_total", model_name="tiny")
    accepted = metric(m, "shoal:spec_decode_num_accepted_tokens_total", model_name="tiny")
    assert metric(m, "shoal:spec_decode_num_drafts_total", model_name="tiny") > 0
    assert 0 < accepted <= drafted
    assert metric(m, "shoal:num_free_kv_blocks") == metric(m, "shoal:num_kv_blocks")


def test_server_mtp_greedy_equals_non_speculative(start_server, model_factory, tmp_path):
    """`--speculative-config '{"method": "deepseek_mtp", ...}'` (vLLM's alias) on a DeepSeek V3 checkpoint with an MTP
    layer: the openai client's completions, streamed and not, are the non-speculative engine's."""
    from draftkit import mtp_checkpoint

    model = mtp_checkpoint(model_factory, tmp_path / "mtp")
    prompts = PROMPTS[:2]
    ref = offline_greedy(model, prompts, 12, dtype="float32", max_model_len=128, block_size=4)
    server = start_server(model, "--max-model-len", "128", "--block-size", "4", "--speculative-config",
                          json.dumps({"method": "deepseek_mtp", "num_speculative_tokens": 2}))
    client = OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=120)
    assert_served_greedy(client, prompts, ref, 12)
    m = server.metrics()
    assert metric(m, "shoal:spec_decode_num_drafts_total", model_name="tiny") > 0
    assert metric(m, "shoal:num_free_kv_blocks") == metric(m, "shoal:num_kv_blocks")


def test_server_mtp_on_a_hybrid_greedy_equals_non_speculative(start_server, model_factory, tmp_path):
    """Qwen3-Next's MTP layer (a hybrid: its recurrent state rolled back on every rejected proposal) behind the
    openai client: completions streamed and not are the non-speculative engine's, and nothing stays held."""
    from hybridkit import qwen_mtp_checkpoint

    model = qwen_mtp_checkpoint(model_factory, tmp_path / "qwen3-next-mtp")
    prompts = PROMPTS[:2]
    ref = offline_greedy(model, prompts, 12, dtype="float32", max_model_len=128, block_size=4)
    server = start_server(model, "--max-model-len", "128", "--block-size", "4", "--speculative-config",
                          json.dumps({"method": "mtp", "num_speculative_tokens": 2}))
    client = OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=120)
    assert_served_greedy(client, prompts, ref, 12)
    m = server.metrics()
    assert metric(m, "shoal:spec_decode_num_drafts_total", model_name="tiny") > 0
    assert metric(m, "shoal:num_free_kv_blocks") == metric(m, "shoal:num_kv_blocks")
