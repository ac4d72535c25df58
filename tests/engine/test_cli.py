"""`shoal-engine` command line: flag parsing and its mapping onto EngineConfig, help text, config errors, API key
sources, and the bench subcommands' delegation."""

from __future__ import annotations

import argparse
import sys
import types

import pytest

from shoal.engine import cli


@pytest.mark.parametrize("text,value", [
    ("536870912", 536870912), ("512MiB", 512 * 2**20), ("2GiB", 2 * 2**30), ("512M", 512 * 2**20),
    ("1.5G", int(1.5 * 2**30)), ("2GB", 2 * 10**9), ("64kib", 64 * 1024), ("100 MB", 100 * 10**6),
])
def test_parse_bytes(text, value):
    assert cli.parse_bytes(text) == value


@pytest.mark.parametrize("text", ["lots", "-5", "0", "1XB", ""])
def test_parse_bytes_rejects(text):
    with pytest.raises(argparse.ArgumentTypeError):
        cli.parse_bytes(text)


def _serve_args(*argv):
    parser = cli.build_parser()
    return parser.parse_args(["serve", *argv])


def test_flags_map_to_engine_config():
    args = _serve_args(
        "--model", "/m", "--served-model-name", "svc", "--tensor-parallel-size", "2", "--pipeline-parallel-size", "2",
        "--dtype", "half", "--max-model-len", "4k", "--max-num-seqs", "8", "--max-num-batched-tokens", "512",
        "--block-size", "32", "--gpu-memory-utilization", "0.5", "--kv-cache-memory", "256MiB", "--num-kv-blocks", "99",
        "--no-enable-prefix-caching", "--no-enable-chunked-prefill", "--attention-backend", "sdpa", "--enforce-eager",
        "--seed", "7", "--max-queue-len", "3", "--scheduling-policy", "priority", "--trust-remote-code",
        "--revision", "main", "--tokenizer", "/t", "--device", "cpu", "--chat-template", "{{ x }}",
    )
    c = cli.engine_config_from_args(args)
    assert (c.model, c.served_model_name, c.model_name) == ("/m", "svc", "svc")
    assert (c.tensor_parallel_size, c.pipeline_parallel_size, c.dtype) == (2, 2, "float16")
    assert (c.max_model_len, c.max_num_seqs, c.max_num_batched_tokens, c.block_size) == (4000, 8, 512, 32)
    assert (c.gpu_memory_utilization, c.kv_cache_memory, c.num_kv_blocks) == (0.5, 256 * 2**20, 99)
    assert (c.enable_prefix_caching, c.enable_chunked_prefill, c.attention_backend, c.enforce_eager) == \
           (False, False, "sdpa", True)
    assert (c.seed, c.max_queue_len, c.scheduling_policy, c.trust_remote_code) == (7, 3, "priority", True)
    assert (c.revision, c.tokenizer, c.device, c.chat_template) == ("main", "/t", "cpu", "{{ x }}")


def test_unset_flags_keep_config_defaults():
    from shoal.engine.config import EngineConfig

    c = cli.engine_config_from_args(_serve_args("--model", "/m"))
    d = EngineConfig(model="/m")
    assert c == d
    args = _serve_args("--model", "/m", "--enable-prefix-caching", "--enable-chunked-prefill")
    c = cli.engine_config_from_args(args)
    assert c.enable_prefix_caching and c.enable_chunked_prefill


def test_without_model_serves_the_demo_model(monkeypatch, tmp_path):
    import shoal.engine.tools.tiny_model as demo
    from shoal.engine.tools import demo_model

    monkeypatch.setattr(demo, "ensure_demo_model", lambda: tmp_path / "demo-llama")
    monkeypatch.setenv("SHOAL_CACHE", str(tmp_path))  # no SmolLM2 GGUF there: the random tiny model
    monkeypatch.delenv("SHOAL_DEMO_GGUF", raising=False)
    c = cli.engine_config_from_args(_serve_args())
    assert c.model == str(tmp_path / "demo-llama") and c.model_name == demo_model.DEMO_SERVED_NAME


def test_help_says_kv_cache_is_sized_on_cpu_by_bytes(capsys):
    with pytest.raises(SystemExit) as ei:
        cli.main(["serve", "--help"])
    assert ei.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "--kv-cache-memory" in out and "sized on CPU" in out and "512MiB" in out
    for flag in ("--tensor-parallel-size", "--pipeline-parallel-size", "--enable-prefix-caching",
                 "--no-enable-prefix-caching", "--enable-chunked-prefill", "--attention-backend", "--api-key-file",
                 "--shutdown-timeout", "--max-queue-len", "--num-kv-blocks", "--served-model-name", "--log-level"):
        assert flag in out, flag


def test_config_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as ei:
        cli.main(["serve", "--model", "/m", "--block-size", "0"])
    assert ei.value.code == 2
    err = capsys.readouterr().err
    assert "--block-size" in err and "Traceback" not in err


def test_api_key_sources(tmp_path, monkeypatch):
    monkeypatch.setenv("SHOAL_API_KEY", "from-env")
    ns = argparse.Namespace(api_key=None, api_key_file=None)
    assert cli.resolve_api_key(ns) == "from-env"
    f = tmp_path / "key"
    f.write_text("from-file\nold-key\n")
    keys = cli.resolve_api_key(argparse.Namespace(api_key=None, api_key_file=str(f)))
    assert keys.accepts("from-file") and keys.accepts("old-key") and not keys.accepts("nope")
    assert cli.resolve_api_key(argparse.Namespace(api_key="flag", api_key_file=str(f))) == "flag"
    f.write_text("  \n")
    with pytest.raises(ValueError):
        cli.resolve_api_key(argparse.Namespace(api_key=None, api_key_file=str(f)))
    monkeypatch.delenv("SHOAL_API_KEY")
    assert cli.resolve_api_key(ns) is None


def test_bench_throughput_delegates(monkeypatch):
    seen = {}
    fake = types.ModuleType("shoal.engine.tools.bench_throughput")
    fake.main = lambda argv: seen.setdefault("argv", argv) and 0
    monkeypatch.setitem(sys.modules, "shoal.engine.tools.bench_throughput", fake)
    import shoal.engine.tools as tools

    # `from shoal.engine.tools import bench_throughput` reads the package attribute once the real one was imported
    monkeypatch.setattr(tools, "bench_throughput", fake, raising=False)
    assert cli.main(["bench", "throughput", "--model", "/m", "--num-prompts", "4"]) == 0
    assert seen["argv"] == ["--model", "/m", "--num-prompts", "4"]


@pytest.mark.parametrize("argv, flag", [(["--hf-batch-sizes", "8", "0"], "--hf-batch-sizes"),
                                        (["--num-prompts", "0"], "--num-prompts"),
                                        (["--max-num-seqs", "-1"], "--max-num-seqs"),
                                        (["--hf-sequential", "-2"], "--hf-sequential")])
def test_bench_throughput_refuses_counts_below_one(argv, flag, capsys):
    """A zero batch size used to reach range() inside the transformers baseline as a traceback, after the model
    was built: the flag is named before anything runs."""
    from shoal.engine.tools import bench_throughput

    with pytest.raises(SystemExit) as ei:
        bench_throughput.main(["--preset", "bench", *argv])
    assert ei.value.code == 2
    err = capsys.readouterr().err
    assert flag in err and ("at least" in err or "0 (skip)" in err)
    assert "Traceback" not in err
