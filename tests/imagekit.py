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
