"""The engine's own GGUF reader (gguf_reader.py) against gguf-py's GGUFReader, and the converted-tokenizer cache.

gguf-py is the oracle: every metadata value and every tensor (name, type, shape, bytes) must read the same;
truncated or foreign bytes must raise GGUFFormatError, never another exception or a wrong tensor."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from gguf_fixtures import write_gguf
from shoal.engine.execution import gguf_model
from shoal.engine.execution.gguf_reader import GGUFFile, GGUFFormatError

SHAPE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)
GGUF_PY_ONLY = {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"}  # gguf-py's own pseudo-fields


@pytest.fixture(scope="module")
def files(model_factory, tmp_path_factory):
    out = tmp_path_factory.mktemp("gguf-reader")
    llama = model_factory("llama", **SHAPE)
    qwen = model_factory("qwen2", **SHAPE)
    return [write_gguf(llama, out / "llama-q4_1.gguf", weight_type="Q4_1", embed_type="Q8_0"),
            write_gguf(llama, out / "llama-f16.gguf", weight_type="F16"),
            write_gguf(qwen, out / "qwen2-q4_k.gguf", weight_type="Q4_K")]


def test_every_field_and_tensor_reads_as_gguf_py_reads_it(files):
    from gguf import GGUFReader

    for path in files:
        ours, ref = GGUFFile(str(path)), GGUFReader(str(path))
        assert set(ours.fields) == set(ref.fields) - GGUF_PY_ONLY
        for key, field in ours.fields.items():
            got, want = field.contents(), ref.fields[key].contents()
            if isinstance(want, float):
                assert got == pytest.approx(want), key
            else:
                assert got == want, key
        assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
        for a, b in zip(ours.tensors, ref.tensors):
            assert a.tensor_type == b.tensor_type and list(a.shape) == list(b.shape), a.name
            assert (a.n_elements, a.n_bytes, a.data_offset) == (b.n_elements, b.n_bytes, b.data_offset), a.name
            assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
            assert np.array_equal(a.data, b.data), a.name
        assert len(ours.metadata_digest()) == 64


def test_truncated_and_foreign_bytes_raise_a_format_error(files, tmp_path):
    good = files[0].read_bytes()
    bad = tmp_path / "bad.gguf"
    # cut inside the header, inside the vocabulary, inside the tensor table and inside the last tensor's data
    for cut in (3, 10, 30, 200, 5000, len(good) // 2, len(good) - 7):
        bad.write_bytes(good[:cut])
        with pytest.raises(GGUFFormatError):
            GGUFFile(str(bad))
    for data, why in ((b"", "empty"), (b"GGUF" + (7).to_bytes(4, "little") + bytes(16), "version 7"),
                      (b"GGUF" + (3).to_bytes(4, "big") + bytes(16), "big-endian"), (b"GGML" + bytes(60), "magic")):
        bad.write_bytes(data)
        with pytest.raises(GGUFFormatError, match=why):
            GGUFFile(str(bad))


def test_the_converted_tokenizer_is_cached_and_loads_the_same(files, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("SHOAL_CACHE", str(tmp_path / "cache"))
    saves = []
    real_save = gguf_model._save_converted
    monkeypatch.setattr(gguf_model, "_save_converted", lambda tok, where: (saves.append(where), real_save(tok, where)))
    path = files[0]
    first = gguf_model.load_gguf_tokenizer(path)
    assert len(saves) == 1 and (saves[0] / "tokenizer.json").is_file()
    second = gguf_model.load_gguf_tokenizer(path)
    assert len(saves) == 1, "the second load converted again instead of reading the cache"
    texts = ["Hello world! The quick brown", "Ünïcödé 🐟 naïve café", "  two  spaces\nand a line"]
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "and now?"}]

    def same(a, b):
        assert [a.encode(t) for t in texts] == [b.encode(t) for t in texts]
        assert a.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
            b.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        assert (a.eos_token_id, a.bos_token_id, len(a)) == (b.eos_token_id, b.bos_token_id, len(b))

    same(first, second)
    (saves[0] / "tokenizer.json").write_text("{not json")  # a damaged entry: converted again and replaced
    with caplog.at_level(logging.WARNING, logger=gguf_model.__name__):
        third = gguf_model.load_gguf_tokenizer(path)
    assert "cannot be loaded" in caplog.text and len(saves) == 2
    same(first, third)
    same(first, gguf_model.load_gguf_tokenizer(path))
    assert len(saves) == 2


@pytest.mark.parametrize("arch", ["qwen2", "gemma2"])
def test_a_cached_tokenizer_is_always_the_converted_one(model_factory, arch, tmp_path, monkeypatch):
    """A conversion that does not survive save_pretrained (Gemma's vocabulary loses its unk token) is not cached;
    whatever is cached loads back as the same tokenizer."""
    monkeypatch.setenv("SHOAL_CACHE", str(tmp_path / "cache"))
    extra = {"gemma2": dict(query_pre_attn_scalar=16)}.get(arch, {})
    path = write_gguf(model_factory(arch, **SHAPE, **extra), tmp_path / f"{arch}.gguf", weight_type="F16")
    first, second = gguf_model.load_gguf_tokenizer(path), gguf_model.load_gguf_tokenizer(path)
    texts = ["Hello world! The quick brown", "Ünïcödé 🐟 naïve café <unk>"]
    assert [second.encode(t) for t in texts] == [first.encode(t) for t in texts]
    assert (len(second), second.all_special_tokens, second.chat_template) == \
        (len(first), first.all_special_tokens, first.chat_template)


def test_an_unwritable_cache_costs_only_time(files, tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("SHOAL_CACHE", str(blocker))  # mkdir under a regular file fails
    tok = gguf_model.load_gguf_tokenizer(files[1])
    assert tok.encode("Hello world")
