"""Images through the real `shoal-engine serve` process and the official openai client: base64 data-URL image_url
parts in /v1/chat/completions, streamed and not, answer what the offline engine (itself equal to transformers'
LLaVA, tests/engine/test_images.py) answers for the same prompt and image; /v1/completions with the same images in
multi_modal_data and the chat template's rendering as its prompt answers as chat and transformers do; /v1/models
says the model takes images; bad images are a clear 400 (on both routes) that leaves nothing running and no KV
block held."""

from __future__ import annotations

import openai
import pytest
from openai import OpenAI

from imagekit import complete, data_url, encode, hf_llava_greedy, image_part, make_image, rendered
from shoal.engine.tools.tiny_model import IMAGE_TOKEN
from .conftest import metric
from .test_openai_server import wait_idle

pytest.importorskip("PIL")

MAX = 8
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def server(start_server, llava_model):
    return start_server(llava_model, "--max-model-len", "128", "--num-kv-blocks", "64", "--block-size", "4",
                        "--limit-mm-per-prompt", '{"image": 2}')


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=server.base + "/v1", api_key="none", max_retries=0)


def chat(client, content, stream=False):
    return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": content}],
                                          max_tokens=MAX, temperature=0, stream=stream,
                                          extra_body={"ignore_eos": True})


def content_image(data: bytes):
    """An encoded image as the server decodes it (RGB)."""
    import io

    from PIL import Image

    return Image.open(io.BytesIO(data)).convert("RGB")


def offline(model_dir, content_text: str, images: list):
    """The offline engine's (greedy text, prompt length) for a one-message chat."""
    from shoal.engine import LLM, SamplingParams

    prompt = rendered(content_text)
    with LLM(model=model_dir, dtype="float32", num_kv_blocks=64, max_model_len=128, block_size=4) as llm:
        out = llm.generate({"prompt": prompt, "multi_modal_data": {"image": images}},
                           SamplingParams(temperature=0, max_tokens=MAX, ignore_eos=True), use_tqdm=False)
    return out[0].outputs[0].text, len(out[0].prompt_token_ids)


def test_models_says_images(client):
    card = client.models.list().data[0]
    assert card.model_extra["input_modalities"] == ["text", "image"]


def test_chat_with_images_equals_the_offline_engine(client, server, llava_model):
    a, b = make_image(11), make_image(12, 50, 30)
    content = [{"type": "text", "text": QUESTION}, image_part(encode(a)),
               image_part(encode(b, "JPEG"), "image/jpeg")]
    # the text parts and each image's placeholder, joined by newlines as the server renders them; the JPEG as the
    # server decodes it (lossy)
    want, prompt_len = offline(llava_model, f"{QUESTION}\n{IMAGE_TOKEN}\n{IMAGE_TOKEN}", [a, encode(b, "JPEG")])
    r = chat(client, content)
    assert r.choices[0].message.content == want
    assert r.usage.prompt_tokens == prompt_len  # each image counts its tokens
    status, body, _ = server.post("/tokenize", {"model": "tiny", "messages": [{"role": "user", "content": content}]})
    assert status == 200 and body["count"] == prompt_len
    # and where each image sits, with the digest its KV blocks are keyed by (what precise-prefix routing hashes)
    from transformers import AutoProcessor

    from shoal.engine.core.images import _digest

    processor = AutoProcessor.from_pretrained(llava_model).image_processor
    digests = [_digest(processor(images=[im], return_tensors="pt")["pixel_values"]).hex()
               for im in (a, content_image(encode(b, "JPEG")))]
    assert [im["digest"] for im in body["images"]] == digests and digests[0] != digests[1]
    image_id = body["tokens"][body["images"][0]["offset"]]
    for im in body["images"]:
        assert body["tokens"][im["offset"]:im["offset"] + im["length"]] == [image_id] * im["length"]
    status, text_only, _ = server.post("/tokenize", {"model": "tiny", "messages": [{"role": "user",
                                                                                  "content": QUESTION}]})
    assert status == 200 and "images" not in text_only
    assert "".join(c.choices[0].delta.content or "" for c in chat(client, content, stream=True) if c.choices) == want
    # another image under the same text is another answer (no false prefix-cache hit)
    other = chat(client, [{"type": "text", "text": QUESTION}, image_part(encode(make_image(13))),
                          image_part(encode(b, "JPEG"), "image/jpeg")])
    assert other.choices[0].message.content != want


def test_completion_with_images_answers_as_chat_and_transformers(client, server, llava_model):
    from transformers import AutoTokenizer

    a, b = make_image(31), encode(make_image(32, 50, 30), "JPEG")
    content = [{"type": "text", "text": QUESTION}, image_part(encode(a)), image_part(b, "image/jpeg")]
    want = chat(client, content)
    prompt = rendered(f"{QUESTION}\n{IMAGE_TOKEN}\n{IMAGE_TOKEN}")
    images = [{"url": data_url(encode(a))}, data_url(b, "image/jpeg")]  # the {"url"} form, or the URL itself
    r = complete(client, prompt, images, MAX)
    assert r.choices[0].text == want.choices[0].message.content
    assert r.usage.prompt_tokens == want.usage.prompt_tokens  # each image counts its tokens
    hf_prompt, hf_ids = hf_llava_greedy(llava_model, prompt, [a, content_image(b)], MAX)
    assert r.usage.prompt_tokens == len(hf_prompt)
    assert r.choices[0].text == AutoTokenizer.from_pretrained(llava_model).decode(hf_ids)
    assert "".join(c.choices[0].text for c in complete(client, prompt, images, MAX, stream=True) if c.choices) == \
        r.choices[0].text
    # /tokenize counts the prompt with its images as the completion does
    status, body, _ = server.post("/tokenize", {"model": "tiny", "prompt": prompt, "add_special_tokens": False,
                                                "multi_modal_data": {"image": images}})
    assert status == 200 and body["count"] == r.usage.prompt_tokens and len(body["images"]) == 2
    # the prompt as token ids, its placeholders among them, is the same request
    status, ids, _ = server.post("/tokenize", {"model": "tiny", "prompt": prompt, "add_special_tokens": False})
    assert complete(client, ids["tokens"], images, MAX).choices[0].text == r.choices[0].text
    # the images in the other order are another answer: they go to the placeholders in order
    swapped = complete(client, prompt, images[::-1], MAX).choices[0].text
    assert swapped != r.choices[0].text


BAD_IMAGES = [
    (image_part(b"\x89PNG\r\n\x1a\n not really"), "corrupt"),
    (image_part(encode(make_image(1))[:120]), "corrupt or truncated"),
    (image_part(encode(make_image(1), "TIFF"), "image/tiff"), "supported formats"),
    ({"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}, "fetching image URLs is off"),
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}, "not valid base64"),
    ({"type": "image_url", "image_url": {}}, "needs"),
    ({"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}, "must be a base64 data URL"),
]


def assert_nothing_held(server) -> None:
    m = wait_idle(server)
    assert metric(m, "shoal:num_requests_running") + metric(m, "shoal:num_requests_waiting") == 0
    assert metric(m, "shoal:kv_cache_usage_perc") == 0


@pytest.mark.parametrize("part, message", BAD_IMAGES)
def test_bad_images_are_a_clear_400(client, server, part, message):
    with pytest.raises(openai.BadRequestError, match=message):
        chat(client, [{"type": "text", "text": QUESTION}, part])
    assert_nothing_held(server)


@pytest.mark.parametrize("part, message", BAD_IMAGES)
def test_bad_completion_images_are_chats_400(client, server, part, message):
    with pytest.raises(openai.BadRequestError, match=message) as e:
        complete(client, f"{IMAGE_TOKEN} {QUESTION}", [part["image_url"]], MAX)
    assert e.value.body["param"] == "multi_modal_data" and "multi_modal_data.image[0]: " in e.value.message
    assert_nothing_held(server)


PNG = data_url(encode(make_image(5)))


@pytest.mark.parametrize("prompt, data, message", [
    (f"{IMAGE_TOKEN} {QUESTION}", {"image": [PNG, PNG]}, r"1 image placeholder\(s\) '<image>' for 2 image\(s\)"),
    (QUESTION, {"image": [PNG]}, r"0 image placeholder\(s\) '<image>' for 1 image\(s\)"),
    (f"{IMAGE_TOKEN}{IMAGE_TOKEN} {QUESTION}", {"image": [PNG]}, r"2 image placeholder\(s\) '<image>' for 1 image"),
    (f"{IMAGE_TOKEN}" * 3, {"image": [PNG] * 3}, "more than the limit of 2"),
    ([f"{IMAGE_TOKEN} a", f"{IMAGE_TOKEN} b"], {"image": [PNG]}, "goes with one prompt, not a batch of 2"),
    (f"{IMAGE_TOKEN} {QUESTION}", {"video": [PNG]}, "only \"image\" is supported"),
    (f"{IMAGE_TOKEN} {QUESTION}", {"image": [{"url": 7}]}, "needs"),
])
def test_completion_images_that_do_not_fit_the_prompt_are_a_400(client, server, prompt, data, message):
    with pytest.raises(openai.BadRequestError, match=message):
        client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX, extra_body={"multi_modal_data": data})
    with pytest.raises(openai.BadRequestError, match=message):  # streamed: refused before the stream starts
        client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX, stream=True,
                                  extra_body={"multi_modal_data": data})
    assert_nothing_held(server)


def test_too_many_images_is_a_400_and_the_server_still_answers(client, server):
    png = image_part(encode(make_image(3)))
    with pytest.raises(openai.BadRequestError, match="more than the limit of 2"):
        chat(client, [png, png, png])
    assert chat(client, [{"type": "text", "text": QUESTION}, png]).choices[0].message.content


def test_text_only_model_refuses_images(start_server, llama_model):
    server = start_server(llama_model, "--max-model-len", "128", "--num-kv-blocks", "16")
    c = OpenAI(base_url=server.base + "/v1", api_key="none", max_retries=0)
    assert c.models.list().data[0].model_extra["input_modalities"] == ["text"]
    with pytest.raises(openai.BadRequestError, match="takes text only"):
        chat(c, [{"type": "text", "text": QUESTION}, image_part(encode(make_image(0)))])
    with pytest.raises(openai.BadRequestError, match="takes text only: it cannot be given images") as e:
        complete(c, QUESTION, [data_url(encode(make_image(0)))], MAX)
    assert e.value.body["code"] == "images_not_supported"
    assert c.completions.create(model="tiny", prompt=QUESTION, max_tokens=2).choices[0].text is not None


def test_anthropic_image_blocks_answer_as_chat(client, server):
    import base64

    import anthropic

    png = encode(make_image(21))
    want = chat(client, [{"type": "text", "text": QUESTION}, image_part(png)]).choices[0].message.content
    messages = anthropic.Anthropic(base_url=server.base, api_key="none", max_retries=0).messages
    source = {"type": "base64", "media_type": "image/png", "data": base64.b64encode(png).decode()}
    r = messages.create(model="tiny", max_tokens=MAX, extra_body={"temperature": 0.0, "ignore_eos": True},
                        messages=[{"role": "user", "content": [{"type": "text", "text": QUESTION},
                                                               {"type": "image", "source": source}]}])
    assert r.content[0].text == want
    with pytest.raises(anthropic.BadRequestError, match="fetching image URLs is off"):
        messages.create(model="tiny", max_tokens=MAX, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}]}])


def test_responses_input_image_answers_as_chat(client):
    png = encode(make_image(22))
    want = chat(client, [{"type": "text", "text": QUESTION}, image_part(png)]).choices[0].message.content
    r = client.responses.create(model="tiny", max_output_tokens=MAX, temperature=0, store=False,
                                extra_body={"ignore_eos": True},
                                input=[{"role": "user", "content": [
                                    {"type": "input_text", "text": QUESTION},
                                    {"type": "input_image", "image_url": image_part(png)["image_url"]["url"]}]}])
    assert r.output_text == want
