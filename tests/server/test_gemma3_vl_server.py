"""Gemma 3 vision-language through the real `shoal-engine serve` process and the official openai client: an
image_url part becomes Gemma's <start_of_image>, and the answer's tokens and logprobs equal transformers'
Gemma3ForConditionalGeneration (bidirectional image attention) on the rendered prompt and the same image; usage
counts the image's expansion; another image gives other logprobs (no false prefix-cache hit)."""

from __future__ import annotations

import pytest
from openai import OpenAI

from imagekit import encode, hf_gemma3_greedy, image_part, make_image
from shoal.engine.tools.tiny_model import CHAT_TEMPLATE

pytest.importorskip("PIL")

MAX = 5
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def server(start_server, gemma3_vl_model):
    return start_server(gemma3_vl_model, "--max-model-len", "128", "--num-kv-blocks", "64", "--block-size", "4",
                        "--max-num-batched-tokens", "24")


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=server.base + "/v1", api_key="none", max_retries=0)


def chat(client, content):
    return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": content}],
                                          max_tokens=MAX, temperature=0, logprobs=True, top_logprobs=2,
                                          extra_body={"ignore_eos": True})


def rendered(content_text: str) -> str:
    from jinja2 import Template

    return Template(CHAT_TEMPLATE).render(messages=[{"role": "user", "content": content_text}],
                                          add_generation_prompt=True)


def test_chat_with_an_image_equals_transformers(client, gemma3_vl_model):
    import transformers as tf

    image = make_image(51)
    prompt = rendered(f"{QUESTION}\n<start_of_image>")  # the parts joined by newlines, the image Gemma's placeholder
    ids, want, logprobs = hf_gemma3_greedy(gemma3_vl_model, prompt, [image], MAX)
    r = chat(client, [{"type": "text", "text": QUESTION}, image_part(encode(image))])
    assert r.usage.prompt_tokens == len(ids) > 24  # above the step budget: prefilled in chunks, the image whole
    tok = tf.AutoTokenizer.from_pretrained(str(gemma3_vl_model))
    got = r.choices[0].logprobs.content
    assert r.choices[0].message.content == tok.decode(want, skip_special_tokens=True)
    for step, entry in enumerate(got):
        assert entry.logprob == pytest.approx(float(logprobs[step, want[step]]), abs=2e-4)
    # another image under the same text: transformers' other logprobs, not the first image's cached blocks
    other_image = make_image(52)
    _, other_ids, other_lp = hf_gemma3_greedy(gemma3_vl_model, prompt, [other_image], MAX)
    other = chat(client, [{"type": "text", "text": QUESTION}, image_part(encode(other_image))]).choices[0]
    assert other.logprobs.content[0].logprob == pytest.approx(float(other_lp[0, other_ids[0]]), abs=2e-4)
    assert abs(other.logprobs.content[0].logprob - got[0].logprob) > 1e-3
