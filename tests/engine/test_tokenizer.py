"""Tokenizer loading, chat templates, and incremental detokenization (UTF-8 safety, stop strings, flush)."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shoal.engine.contracts import SamplingParams
from shoal.engine.core.tokenizer import (
    ChatTemplateError,
    IncrementalDetokenizer,
    TokenizerLoadError,
    get_eos_token_ids,
    load_chat_template,
    load_tokenizer,
    render_chat,
)
from shoal.engine.tools.tiny_model import _CORPUS, CHAT_TEMPLATE, make_tokenizer

TEXTS = _CORPUS + [
    "Привет, мир! Ελληνικά κείμενα. 한국어 텍스트. العربية",
    "🐟🐠🐡🦈🐙 émoji runs 👩‍👩‍👧‍👦 and ZWJ sequences ✓✓✓ ∑∑ ππ",
    "mixed: naïve→café ≈ 東京 STOP here 日本語STOP😀 end",
]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    make_tokenizer(d)
    return d


@pytest.fixture(scope="module")
def tok(tok_dir):
    return load_tokenizer(tok_dir)


@pytest.fixture(scope="module")
def bare_tok(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok-bare")
    make_tokenizer(d, chat_template=False)
    return load_tokenizer(d)


def stream(tok, prompt_ids, ids, chunks=None, flush=True, **kw):
    """Feed `ids` in chunks; return (deltas, detokenizer)."""
    d = IncrementalDetokenizer(tok, prompt_ids, **kw)
    deltas = []
    i = 0
    for n in chunks or [1] * len(ids):
        if d.stopped:
            break
        deltas.append(d.append(ids[i : i + n]))
        i += n
    if flush and not d.stopped:
        deltas.append(d.flush())
    return deltas, d


# ---------------------------------------------------------------------------------------------------------------
# Loading


def test_load_tokenizer_and_eos(tok, tok_dir):
    assert tok.eos_token_id == 0
    assert get_eos_token_ids(tok) == {0}
    (tok_dir / "generation_config.json").write_text('{"eos_token_id": [0, 2]}')
    try:
        assert get_eos_token_ids(tok, tok_dir) == {0, 2}
    finally:
        (tok_dir / "generation_config.json").unlink()


def test_load_tokenizer_errors_name_the_path(tmp_path):
    empty = tmp_path / "no-tokenizer"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    with pytest.raises(TokenizerLoadError, match="no tokenizer files in .*no-tokenizer"):
        load_tokenizer(empty)
    with pytest.raises(TokenizerLoadError, match="does not exist"):
        load_tokenizer(tmp_path / "missing")
    with pytest.raises(TokenizerLoadError, match="surely-not/cached-model-xyz.*local Hugging Face cache"):
        load_tokenizer("surely-not/cached-model-xyz")


# ---------------------------------------------------------------------------------------------------------------
# Incremental detokenization


def test_multibyte_chars_are_split_across_tokens(tok):
    # the premise of the UTF-8 tests: some single tokens decode to U+FFFD on their own
    ids = tok.encode("東京は日本の首都です 🐟🐠🐡")
    assert any("\ufffd" in tok.decode([i]) for i in ids)


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("skip", [True, False])
def test_stream_equals_decode_and_never_garbles(tok, text, skip):
    prompt = tok.encode("<|user|>Hello<|end|><|assistant|>")
    ids = tok.encode(text) + [tok.eos_token_id] + tok.encode(" ü")
    deltas, d = stream(tok, prompt, ids, skip_special_tokens=skip)
    full = tok.decode(ids, skip_special_tokens=skip)
    assert "".join(deltas) == full == d.text
    assert not any("\ufffd" in x for x in deltas)
    assert d.stop_string is None


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_token_sequences(tok, data):
    V = len(tok)
    ids = data.draw(st.lists(st.integers(0, V - 1), min_size=0, max_size=60))
    prompt = data.draw(st.lists(st.integers(0, V - 1), max_size=8))
    chunks = []
    left = len(ids)
    while left:
        n = data.draw(st.integers(1, min(4, left)))
        chunks.append(n)
        left -= n
    skip = data.draw(st.booleans())
    deltas, d = stream(tok, prompt, ids, chunks, skip_special_tokens=skip)
    full = tok.decode(ids, skip_special_tokens=skip)
    # random bytes may be invalid UTF-8 (U+FFFD in the full text); the prompt may end mid-character, which the
    # detokenizer handles by decoding the output on its own. Either way the streamed text is the full decode.
    assert "".join(deltas) == full
    if "\ufffd" not in full:
        assert not any("\ufffd" in x for x in deltas)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_substrings_stream_cleanly(tok, data):
    text = data.draw(st.sampled_from(TEXTS))
    a = data.draw(st.integers(0, len(text)))
    b = data.draw(st.integers(a, len(text)))
    ids = tok.encode(text[a:b])
    deltas, _ = stream(tok, tok.encode("Q: "), ids)
    assert "".join(deltas) == tok.decode(ids) == text[a:b]
    assert not any("\ufffd" in x for x in deltas)


def test_incomplete_char_at_end_is_released_by_flush(tok):
    ids = tok.encode("ok 🐟")
    # drop the last token: the fish is incomplete
    ids = ids[:-1]
    assert tok.decode(ids).endswith("\ufffd")
    d = IncrementalDetokenizer(tok, [])
    streamed = "".join(d.append([i]) for i in ids)
    assert "\ufffd" not in streamed
    assert streamed + d.flush() == tok.decode(ids)


def test_work_is_incremental(tok):
    """Each step decodes a window of a few tokens, not the whole output."""
    calls = []
    ids = tok.encode(" ".join(TEXTS) * 3)
    d = IncrementalDetokenizer(tok, [1, 2, 3])
    inner = d._decode
    d._decode = lambda x: (calls.append(len(x)), inner(x))[1]
    for i in ids:
        d.append([i])
    d.flush()
    assert d.text == tok.decode(ids)
    assert max(calls) <= 12, max(calls)
    assert len(d._ids) <= 1024 + 16  # the window buffer is compacted


# ---------------------------------------------------------------------------------------------------------------
# Stop strings


def ids_for(tok, text):
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    return ids


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_tokens(tok, include):
    text = "Hello world! How are you today? I am fine"
    ids = ids_for(tok, text)
    stop = "you tod"
    # the stop string is not a single token: it spans several
    assert not any(stop in tok.decode([i]) for i in ids)
    deltas, d = stream(tok, [], ids, stop=[stop], include_stop_str_in_output=include)
    assert d.stop_string == stop
    want = "Hello world! How are " + (stop if include else "")
    assert d.text == "".join(deltas) == want
    assert d.append(ids[:2]) == "" and d.flush() == "" and d.text == want  # nothing after a stop


def test_stop_string_mid_token_and_multibyte(tok):
    text = "mixed: naïve→café ≈ 東京 STOP here"
    ids = ids_for(tok, text)
    for stop, before in [("é ≈", "mixed: naïve→caf"), ("京 ST", "mixed: naïve→café ≈ 東"), ("→", "mixed: naïve")]:
        deltas, d = stream(tok, [], ids, stop=[stop])
        assert d.stop_string == stop and d.text == before, (stop, d.text)
        assert not any("\ufffd" in x for x in deltas)


def test_earliest_of_several_stop_strings_wins(tok):
    ids = ids_for(tok, "The quick brown fox jumps over the lazy dog.")
    _, d = stream(tok, [], ids, stop=["lazy", "fox", "quick brown fox jumps over the lazy dog and more"])
    assert d.stop_string == "fox" and d.text == "The quick brown "


def test_held_back_prefix_is_released_by_flush(tok):
    ids = ids_for(tok, "Paris is lovely. STO")
    deltas, d = stream(tok, [], ids, stop=["STOP"], flush=False)
    assert d.text == "Paris is lovely. "  # "STO" may still become "STOP": held back
    assert d.flush() == "STO"
    assert d.text == "Paris is lovely. STO" and d.stop_string is None


def test_held_back_text_released_when_it_diverges(tok):
    ids = ids_for(tok, "a STOne and a STOP")
    seen = []
    d = IncrementalDetokenizer(tok, [], stop=["STOP"])
    for i in ids:
        seen.append(d.append([i]))
        # never released: anything that is a proper prefix of "STOP" at the end of what has been shown
        assert not d.text.endswith(("S", "ST", "STO"))
    assert "".join(seen) == d.text
    assert d.stop_string == "STOP" and d.text == "a STOne and a "


def test_stop_strings_ignored_until_min_tokens(tok):
    ids = ids_for(tok, "fox fox fox jumps")
    _, d = stream(tok, [], ids, stop=["fox"], min_tokens=len(ids) - 1)
    assert d.stop_string is None and d.text == "fox fox fox jumps"
    p = SamplingParams(stop="jumps", include_stop_str_in_output=True)
    d = IncrementalDetokenizer.from_params(tok, [], p)
    out = "".join(d.append([i]) for i in ids)
    assert out == "fox fox fox jumps" and d.stop_string == "jumps"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_stop_strings_property(tok, data):
    text = data.draw(st.sampled_from(TEXTS))
    ids = tok.encode(text)
    full = tok.decode(ids)
    a = data.draw(st.integers(0, max(0, len(full) - 1)))
    stop = full[a : a + data.draw(st.integers(1, 6))] or "x"
    other = data.draw(st.sampled_from(["zzz", "Q", "🐟🐠", "the"]))
    include = data.draw(st.booleans())
    rng = random.Random(data.draw(st.integers(0, 1000)))
    chunks, left = [], len(ids)
    while left:
        n = min(left, rng.randint(1, 3))
        chunks.append(n)
        left -= n
    deltas, d = stream(tok, [], ids, chunks, stop=[stop, other], include_stop_str_in_output=include)
    hits = [(full.find(s), s) for s in (stop, other) if full.find(s) != -1]
    assert "".join(deltas) == d.text
    assert not any("\ufffd" in x for x in deltas)
    if hits:
        i, s = min(hits, key=lambda h: h[0])
        assert d.stop_string is not None
        assert d.text == full[: i + (len(d.stop_string) if include else 0)]
        assert full[i:].startswith(d.stop_string)
    else:
        assert d.stop_string is None and d.text == full


# ---------------------------------------------------------------------------------------------------------------
# Chat templates

MSGS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 🐟"}]


def test_render_with_tokenizer_template(tok):
    out = render_chat(tok, MSGS)
    assert out == "<|system|>Be brief.<|end|><|user|>Hi 🐟<|end|><|assistant|>"
    assert render_chat(tok, MSGS, add_generation_prompt=False).endswith("<|end|>")
    # OpenAI content parts are joined
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert render_chat(tok, parts) == "<|user|>a\nb<|end|><|assistant|>"


def test_missing_template_raises_with_hint(bare_tok):
    with pytest.raises(ChatTemplateError, match="--chat-template FILE"):
        render_chat(bare_tok, MSGS)
    # a template passed explicitly is used
    assert render_chat(bare_tok, MSGS, chat_template=CHAT_TEMPLATE).startswith("<|system|>Be brief.")


def test_chat_template_from_file_and_inline(tmp_path, bare_tok):
    f = tmp_path / "t.jinja"
    f.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}[assistant] {% endif %}")
    t = load_chat_template(str(f))
    assert render_chat(bare_tok, MSGS, chat_template=t) == "[system] Be brief.\n[user] Hi 🐟\n[assistant] "
    assert load_chat_template(f) == f.read_text()  # a Path works too
    inline = "{% for m in messages %}{{ m['content'] }}|{% endfor %}"
    assert load_chat_template(inline) == inline
    assert render_chat(bare_tok, MSGS, chat_template=load_chat_template(inline)) == "Be brief.|Hi 🐟|"
    # escapes typed on a command line
    assert load_chat_template("{{ messages[0]['content'] }}\\n") == "{{ messages[0]['content'] }}\n"
    # a tokenizer_config.json-style file
    j = tmp_path / "tc.json"
    j.write_text('{"chat_template": "{{ messages[-1][\'content\'] }}"}')
    assert render_chat(bare_tok, MSGS, chat_template=load_chat_template(j)) == "Hi 🐟"
    assert load_chat_template(None) is None


def test_chat_template_errors(tmp_path, tok):
    with pytest.raises(ChatTemplateError, match="nope.jinja.*looks like a file path"):
        load_chat_template(str(tmp_path / "nope.jinja"))
    with pytest.raises(ChatTemplateError, match="not a valid Jinja template"):
        load_chat_template("{% for m in messages %}{{ m }}")
    empty = tmp_path / "empty.jinja"
    empty.write_text("  \n")
    with pytest.raises(ChatTemplateError, match="empty"):
        load_chat_template(str(empty))
    strict = (
        "{% for m in messages %}{% if m['role'] not in ['user', 'assistant'] %}"
        "{{ raise_exception('Only user and assistant roles are supported') }}{% endif %}"
        "{{ m['content'] }}{% endfor %}"
    )
    with pytest.raises(ChatTemplateError, match="Only user and assistant roles"):
        render_chat(tok, MSGS, chat_template=strict)
    with pytest.raises(ChatTemplateError, match="role"):
        render_chat(tok, [{"content": "no role"}])
    with pytest.raises(ChatTemplateError, match="non-empty list"):
        render_chat(tok, [])
    with pytest.raises(ChatTemplateError, match="only text content"):
        render_chat(tok, [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])


# ---------------------------------------------------------------------------------------------------------------
# A SentencePiece-style tokenizer (Llama's decoder: "▁" for spaces, byte fallback, leading space stripped)


@pytest.fixture(scope="module")
def sp_tok():
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for ch in "▁abcdefghijklmnopqrstuvwxyzHTé.,!?":
        vocab.setdefault(ch, len(vocab))
    merges = [("▁", "t"), ("▁t", "h"), ("▁th", "e"), ("▁", "a"), ("▁", "c")]
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    t = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    t.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    t.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                   decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


@pytest.mark.parametrize("text", ["the cat ate 東京 🐟 café!", "a cat, the end. 🐟🐠 é"])
def test_sentencepiece_style_keeps_the_leading_space(sp_tok, text):
    prompt = sp_tok.encode("the", add_special_tokens=False)
    full = sp_tok.encode("the " + text, add_special_tokens=False)
    assert full[: len(prompt)] == prompt
    out = full[len(prompt):]
    assert any("\ufffd" in sp_tok.decode([i]) for i in out)  # bytes split across tokens
    deltas, d = stream(sp_tok, prompt, out)
    # like vLLM: the text continues the prompt, so the first word keeps its space (decode(out) would strip it)
    assert d.text == "".join(deltas) == " " + text
    assert not any("\ufffd" in x for x in deltas)
    deltas, d = stream(sp_tok, prompt, out, stop=["te 東", ", the e", "🐠 é"])
    assert d.stop_string is not None
    assert d.text == (" " + text)[: (" " + text).find(d.stop_string)]
