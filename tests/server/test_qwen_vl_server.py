"""Qwen2.5-VL, Qwen3-VL and Qwen3.5 (each test once per family) through the real `shoal-engine serve` process and the official openai client: image_url parts become
Qwen's <|vision_start|><|image_pad|><|vision_end|>, answered as the offline engine answers the same prompt and images
(itself equal to transformers', tests/engine/test_qwen_vl.py), streamed and not; usage and /tokenize count each
image's tokens as the processor expands them; /v1/models says the model takes images; --limit-mm-per-prompt holds;
/v1/completions with Qwen's placeholders written in the prompt and the images in multi_modal_data answers as chat."""

from __future__ import annotations

import openai
import pytest
from openai import OpenAI

from imagekit import complete, data_url, encode, hf_qwen_vl_inputs, image_part, make_image, rendered
from .conftest import metric
from .test_openai_server import wait_idle

pytest.importorskip("PIL")

MAX = 8
QUESTION = "What is the capital of France?"
V = "<|vision_start|><|image_pad|><|vision_end|>"


@pytest.fixture(scope="module", params=["qwen_vl_model", "qwen3_vl_model", "qwen3_5_vl_model"])
def model(request):
    """(the model directory, its patch side in pixels)."""
    return request.getfixturevalue(request.param), 14 if request.param == "qwen_vl_model" else 16


@pytest.fixture(scope="module")
def server(start_server, model):
    return start_server(model[0], "--max-model-len", "128", "--num-kv-blocks", "64", "--block-size", "4",
                        "--limit-mm-per-prompt", '{"image": 2}')


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=server.base + "/v1", api_key="none", max_retries=0)


def chat(client, content, stream=False):
    return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": content}],
                                          max_tokens=MAX, temperature=0, stream=stream,
                                          extra_body={"ignore_eos": True})


def offline(model_dir, prompt: str, images: list) -> str:
    from shoal.engine import LLM, SamplingParams

    with LLM(model=model_dir, dtype="float32", num_kv_blocks=64, max_model_len=128, block_size=4) as llm:
        out = llm.generate({"prompt": prompt, "multi_modal_data": {"image": images}},
                           SamplingParams(temperature=0, max_tokens=MAX, ignore_eos=True), use_tqdm=False)
    return out[0].outputs[0].text


def test_models_says_images(client):
    assert client.models.list().data[0].model_extra["input_modalities"] == ["text", "image"]


def test_chat_with_two_images_equals_the_offline_engine(client, server, model):
    model_dir, patch = model
    a, b = make_image(41, 8 * patch, 6 * patch), make_image(42, 4 * patch, 4 * patch)
    content = [{"type": "text", "text": QUESTION}, image_part(encode(a)), image_part(encode(b))]
    prompt = rendered(f"{QUESTION}\n{V}\n{V}")  # the parts joined by newlines, each image Qwen's placeholder
    want = offline(model_dir, prompt, [a, b])
    prompt_len = hf_qwen_vl_inputs(model_dir, prompt, [a, b])["input_ids"].shape[1]  # 12 + 4 image tokens
    r = chat(client, content)
    assert r.choices[0].message.content == want
    assert r.usage.prompt_tokens == prompt_len
    status, body, _ = server.post("/tokenize", {"model": "tiny", "messages": [{"role": "user", "content": content}]})
    assert status == 200 and body["count"] == prompt_len
    assert "".join(c.choices[0].delta.content or "" for c in chat(client, content, stream=True) if c.choices) == want
    # other images under the same text: another answer (no false prefix-cache hit)
    other = chat(client, [{"type": "text", "text": QUESTION}, image_part(encode(make_image(43, 8 * patch, 6 * patch))),
                          image_part(encode(b))])
    assert other.choices[0].message.content != want


def test_completion_with_images_answers_as_chat(client, server, model):
    patch = model[1]
    a, b = encode(make_image(45, 8 * patch, 6 * patch)), encode(make_image(46, 4 * patch, 4 * patch))
    want = chat(client, [{"type": "text", "text": QUESTION}, image_part(a), image_part(b)])
    prompt, images = rendered(f"{QUESTION}\n{V}\n{V}"), [{"url": data_url(a)}, {"url": data_url(b)}]
    r = complete(client, prompt, images, MAX)
    assert r.choices[0].text == want.choices[0].message.content
    assert r.usage.prompt_tokens == want.usage.prompt_tokens
    assert "".join(c.choices[0].text for c in complete(client, prompt, images, MAX, stream=True) if c.choices) == \
        r.choices[0].text
    # a placeholder short: the 400 says what to write
    with pytest.raises(openai.BadRequestError, match=r"1 image placeholder.*for 2 image.*<\|vision_start\|>"):
        complete(client, rendered(f"{QUESTION}\n{V}"), images, MAX)


def test_too_many_images_is_a_400_and_the_server_still_answers(client, server, model):
    png = image_part(encode(make_image(44, 4 * model[1], 4 * model[1])))
    with pytest.raises(openai.BadRequestError, match="more than the limit of 2"):
        chat(client, [png, png, png])
    m = wait_idle(server)
    assert metric(m, "shoal:num_requests_running") + metric(m, "shoal:num_requests_waiting") == 0
    assert metric(m, "shoal:kv_cache_usage_perc") == 0
    assert chat(client, [{"type": "text", "text": QUESTION}, png]).choices[0].message.content
