"""Images made in the test (PIL, seeded), and transformers' LLaVA as the oracle for vision-language output."""

from __future__ import annotations

import base64
import functools
import io


def make_image(seed: int, width: int = 60, height: int = 40):
    """A seeded random RGB picture (PIL), not square so the processor's resize and crop both run."""
    import numpy as np
    from PIL import Image

    pixels = np.random.RandomState(seed).randint(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def encode(image, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return buf.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def image_part(data: bytes, mime: str = "image/png") -> dict:
    """An OpenAI chat content part carrying the image as a base64 data URL."""
    return {"type": "image_url", "image_url": {"url": data_url(data, mime)}}


def rendered(content_text: str) -> str:
    """The tiny models' chat template rendering a one-message chat (generation prompt added): chat's prompt as
    text, what a completions request sends to be answered as that chat."""
    from jinja2 import Template

    from shoal.engine.tools.tiny_model import CHAT_TEMPLATE

    return Template(CHAT_TEMPLATE).render(messages=[{"role": "user", "content": content_text}],
                                          add_generation_prompt=True)


def complete(client, prompt, images: list, max_tokens: int, stream: bool = False):
    """A greedy completion (openai client) with `images` as multi_modal_data's "image" list; no special tokens are
    added, as none are to chat's rendered prompt."""
    return client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                     stream=stream, extra_body={"ignore_eos": True, "add_special_tokens": False,
                                                                "multi_modal_data": {"image": images}})


@functools.lru_cache(maxsize=2)
def _hf_llava(model_dir: str):
    import transformers as tf

    model = tf.LlavaForConditionalGeneration.from_pretrained(model_dir).eval()
    model.generation_config.eos_token_id = None  # compared over a fixed length, as the engine runs with ignore_eos
    model.generation_config.pad_token_id = 0
    return tf.AutoProcessor.from_pretrained(model_dir), model


def hf_llava_greedy(model_dir, text: str, images: list, max_new_tokens: int) -> tuple[list[int], list[int]]:
    """(prompt ids as the processor expands them, greedy generated ids) from transformers' LLaVA."""
    import torch

    processor, model = _hf_llava(str(model_dir))
    inputs = processor(text=text, images=images or None, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    prompt = inputs["input_ids"][0].tolist()
    return prompt, out[0, len(prompt):].tolist()


@functools.lru_cache(maxsize=2)
def _hf_qwen_vl(model_dir: str):
    import transformers as tf

    arch = tf.AutoConfig.from_pretrained(model_dir).architectures[0]  # Qwen2_5_VL... or Qwen3VL...
    model = getattr(tf, arch).from_pretrained(model_dir).eval()
    model.generation_config.eos_token_id = None  # compared over a fixed length, as the engine runs with ignore_eos
    model.generation_config.pad_token_id = 0
    return tf.AutoImageProcessor.from_pretrained(model_dir), tf.AutoTokenizer.from_pretrained(model_dir), model


def hf_qwen_vl_inputs(model_dir, text: str, images: list) -> dict:
    """What Qwen2_5_VLProcessor / Qwen3VLProcessor(text=..., images=...) give (they cannot be built without
    torchvision here): the
    image processor's patches and grids, each <|image_pad|> expanded to grid.prod() // merge_size**2 tokens
    (Qwen2_5_VLProcessor.replace_image_token), and mm_token_type_ids marking the image tokens."""
    import torch

    image_processor, tok, _ = _hf_qwen_vl(str(model_dir))
    inputs = {}
    if images:
        inputs = dict(image_processor(images=images, return_tensors="pt"))
        pieces = text.split("<|image_pad|>")
        counts = (inputs["image_grid_thw"].prod(-1) // image_processor.merge_size ** 2).tolist()
        text = pieces[0] + "".join("<|image_pad|>" * n + rest for n, rest in zip(counts, pieces[1:]))
    ids = torch.tensor([tok.encode(text)])
    image_token = tok.convert_tokens_to_ids("<|image_pad|>")
    inputs.update(input_ids=ids, attention_mask=torch.ones_like(ids),
                  mm_token_type_ids=(ids == image_token).to(torch.int32))
    return inputs


def hf_qwen_vl_greedy(model_dir, text: str, images: list, max_new_tokens: int):
    """(prompt ids as the processor expands them, greedy generated ids, log_softmax of each step's logits
    [max_new_tokens, vocab]) from transformers' Qwen2.5-VL or Qwen3-VL (the checkpoint's architecture)."""
    import torch

    _, _, model = _hf_qwen_vl(str(model_dir))
    inputs = hf_qwen_vl_inputs(model_dir, text, images)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
    prompt = inputs["input_ids"][0].tolist()
    logprobs = torch.log_softmax(torch.stack([step[0] for step in out.logits]).float(), dim=-1)
    return prompt, out.sequences[0, len(prompt):].tolist(), logprobs


@functools.lru_cache(maxsize=2)
def _hf_gemma3(model_dir: str):
    import transformers as tf

    model = tf.Gemma3ForConditionalGeneration.from_pretrained(model_dir).eval()
    model.generation_config.eos_token_id = None  # compared over a fixed length, as the engine runs with ignore_eos
    model.generation_config.pad_token_id = 0
    return tf.AutoProcessor.from_pretrained(model_dir), model


def hf_gemma3_greedy(model_dir, text: str, images: list, max_new_tokens: int):
    """(prompt ids as Gemma3Processor expands them, greedy generated ids, log_softmax of each step's logits
    [max_new_tokens, vocab]) from transformers' Gemma3ForConditionalGeneration (token_type_ids given: the
    bidirectional image mask)."""
    import torch

    processor, model = _hf_gemma3(str(model_dir))
    inputs = processor(text=text, images=images or None, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
    prompt = inputs["input_ids"][0].tolist()
    logprobs = torch.log_softmax(torch.stack([step[0] for step in out.logits]).float(), dim=-1)
    return prompt, out.sequences[0, len(prompt):].tolist(), logprobs


def worst_logprob_diff(reference, model_dir, outputs, prompts, max_new_tokens: int) -> float:
    """Check each output's prompt ids and greedy tokens equal the oracle's (`reference`: hf_qwen_vl_greedy or
    hf_gemma3_greedy; prompts: (text, images) pairs) and return the largest difference of a reported logprob."""
    diff = 0.0
    for out, (text, images) in zip(outputs, prompts):
        prompt, ids, logprobs = reference(model_dir, text, images, max_new_tokens)
        assert out.prompt_token_ids == prompt, text
        assert out.outputs[0].token_ids == ids, text
        for step, entry in enumerate(out.outputs[0].logprobs):
            for tid, lp in entry.items():
                diff = max(diff, abs(lp.logprob - float(logprobs[step, tid])))
    return diff
