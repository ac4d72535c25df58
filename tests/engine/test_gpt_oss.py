"""gpt-oss beyond what test_moe_models.py runs for every MoE family: its MXFP4 checkpoint format, the SDPA attention
backend (sinks through explicit matmuls), and its harmony chat format rendered through transformers. Tiny random
model (tools/tiny_model.py: 3 layers alternating a window of 8 with full attention, 4 experts top-2, YaRN)."""

from __future__ import annotations

import json
import shutil

import pytest

from prequant_fixtures import write_mxfp4
from shoal.engine import LLM, SamplingParams
from test_engine_correctness import MAX_NEW, PROMPTS, check_against_hf

pytestmark = pytest.mark.numerics


@pytest.fixture(scope="module")
def gpt_oss(model_factory):
    return model_factory("gpt_oss")


def test_mxfp4_experts_load_like_transformers_reads_them(gpt_oss, tmp_path, caplog):
    """OpenAI's layout (experts as MXFP4 blocks and scales): dequantized expert by expert on load into the compute
    dtype, equal to transformers running the same file (which dequantizes it on CPU)."""
    model_dir = tmp_path / "mxfp4"
    write_mxfp4(gpt_oss, model_dir)
    caplog.set_level("INFO", logger="shoal.engine.execution.quantization.prequantized")
    with LLM(model=model_dir, block_size=4, max_model_len=128, max_num_batched_tokens=16) as llm:
        assert "MXFP4 4-bit checkpoint (group size 32): 6 packed expert tensors dequantized on load" in caplog.text
        outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True,
                                                       logprobs=3))
        check_against_hf(model_dir, llm.get_tokenizer(), outputs, PROMPTS)


def test_sdpa_backend(gpt_oss):
    with LLM(model=gpt_oss, block_size=4, max_model_len=128, max_num_batched_tokens=8,
             attention_backend="sdpa") as llm:
        outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True,
                                                       logprobs=3))
        check_against_hf(gpt_oss, llm.get_tokenizer(), outputs, PROMPTS)


# The harmony format (roles system/developer/user/assistant, channels analysis/final, reasoning effort in the system
# message), written for this test in the shape of the template gpt-oss checkpoints ship.
HARMONY = (
    "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
    "Reasoning: {{ reasoning_effort | default('medium') }}\n\n"
    "# Valid channels: analysis, commentary, final. Channel must be included for every message.<|end|>"
    "{%- for m in messages -%}"
    "{%- if m.role in ('system', 'developer') -%}<|start|>developer<|message|># Instructions\n\n{{ m.content }}<|end|>"
    "{%- elif m.role == 'user' -%}<|start|>user<|message|>{{ m.content }}<|end|>"
    "{%- elif m.role == 'assistant' -%}"
    "{%- if m.thinking is defined and loop.last -%}"
    "<|start|>assistant<|channel|>analysis<|message|>{{ m.thinking }}<|end|>{%- endif -%}"
    "<|start|>assistant<|channel|>final<|message|>{{ m.content }}{{ '<|return|>' if loop.last else '<|end|>' }}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}"
)
HARMONY_TOKENS = ["<|start|>", "<|message|>", "<|channel|>", "<|return|>", "<|call|>"]


def test_harmony_chat_template_renders_through_transformers_and_its_stop_tokens_end_generation(model_factory,
                                                                                               tmp_path):
    from transformers import AutoTokenizer

    from shoal.engine.core.tokenizer import get_eos_token_ids, load_tokenizer, render_chat
    from shoal.engine.server.protocol import ChatMessage

    model_dir = tmp_path / "harmony"
    shutil.copytree(model_factory("gpt_oss", vocab_size=400), model_dir)  # room for the harmony tokens
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    tok.add_special_tokens({"additional_special_tokens": HARMONY_TOKENS})
    tok.chat_template = HARMONY
    tok.save_pretrained(str(model_dir))
    stops = [tok.convert_tokens_to_ids(t) for t in ("<|return|>", "<|call|>")]
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": stops}))

    tok = load_tokenizer(model_dir)
    messages = [ChatMessage(role="developer", content="Answer briefly."), ChatMessage(role="user", content="Hello"),
                ChatMessage(role="assistant", content="Hi!", thinking="Greet back."),
                ChatMessage(role="user", content="Once upon a time")]
    text = render_chat(tok, [m.to_template() for m in messages], reasoning_effort="high")
    assert text.startswith("<|start|>system<|message|>You are ChatGPT") and "Reasoning: high" in text
    assert ("<|start|>developer<|message|># Instructions\n\nAnswer briefly.<|end|><|start|>user<|message|>Hello<|end|>"
            "<|start|>assistant<|channel|>final<|message|>Hi!<|end|>") in text  # earlier thinking is dropped
    assert text.endswith("<|start|>user<|message|>Once upon a time<|end|><|start|>assistant")
    ids = tok.encode(text, add_special_tokens=False)
    assert ids.count(tok.convert_tokens_to_ids("<|start|>")) == 6  # special tokens stay single tokens
    assert set(stops) <= get_eos_token_ids(tok, model_dir)
    with LLM(model=model_dir, block_size=4, max_model_len=256) as llm:
        out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        check_against_hf(model_dir, tok, out, [ids], max_new=4)
