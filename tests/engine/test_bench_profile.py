"""`shoal-engine bench throughput --profile` on a local model directory: the step breakdown a user reads."""

from __future__ import annotations

import re

import pytest

from shoal.engine.cli import main


def test_profile_prints_where_a_decode_step_goes(model_factory, capsys):
    model_dir = model_factory("llama", num_hidden_layers=4)  # max_position_embeddings 512: below the 1024 default
    rc = main(["bench", "throughput", "--model", str(model_dir), "--skip-hf", "--profile", "--num-prompts", "4",
               "--prompt-len", "8", "16", "--output-len", "6", "8", "--dtype", "float32"])
    out = capsys.readouterr().out
    assert rc == 0
    assert re.search(r"shoal\s+[\d.]+ output tok/s", out)
    decode = out.split("decode-only steps:")[1].split("steps with prompt tokens")[0]
    for row in ("scheduler", "build inputs", "model forward", "embedding", "4 decoder layers", "linear",
                "attention", "other", "final norm", "lm head (logits)", "sampler", "detokenize", "engine other"):
        assert row in decode, row
    step_ms = float(re.search(r"step\s+([\d.]+) ms", decode).group(1))
    forward_ms = float(re.search(r"model forward\s+([\d.]+) ms", decode).group(1))
    assert 0 < forward_ms < step_ms
    floor = re.search(r"memory-traffic floor of a decode step: weights ([\d.]+) MB .* / ([\d.]+) GB/s measured = "
                      r"([\d.]+) ms; measured step ([\d.]+) ms = ([\d.]+)x the floor", out)
    assert floor and float(floor.group(1)) > 0 and float(floor.group(3)) > 0
    assert "compute floor of a decode step" in out


def test_bench_rejects_a_directory_without_a_model(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "throughput", "--model", str(tmp_path), "--skip-hf"])
    assert e.value.code == 2
    assert "not a Hugging Face model directory" in capsys.readouterr().err
