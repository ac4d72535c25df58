"""One definition per engine option: spec.engine -> rendered args -> `shoal-engine serve` flags -> EngineConfig.

EngineConfig's fields are the source (shoal.engine.config); the CLI flags and the CRD's engine block derive from
them. These tests walk every option of spec.engine through the operator's rendering and the engine's own parser,
so an option that is renamed, retyped or dropped on one side fails here.
"""

from __future__ import annotations

from typing import Literal, get_args, get_origin

import pytest

from shoal.engine import cli, flags
from shoal.engine.config import DistributedConfig, EngineConfig, MultiModalLimits, PoolerConfig
from shoal.operator import api, render
from shoal.operator.render import Settings

# A valid non-default value of every numeric option (one spec: their cross-field rules must hold together).
# Enums and booleans need none: every value of theirs is tried.
NUMERIC_SAMPLES = {
    "tensor_parallel_size": 2,
    "pipeline_parallel_size": 4,
    "max_model_len": 8192,
    "max_num_seqs": 8,
    "max_num_batched_tokens": 4096,
    "gpu_memory_utilization": 0.55,
    "max_loras": 4,
    "max_lora_rank": 32,
    "max_cpu_loras": 8,
    "kv_offloading_size": 4.5,
    "kv_offloading_backend": "native",  # its only value
    "kv_offloading_disk_path": "/tmp/kv-offload",
    "kv_offloading_disk_size": 64.0,
    "allowed_media_domains": ["images.example.com", "minio.images.svc"],
    "media_fetch_timeout": 2.5,
    "media_fetch_max_bytes": 1048576,
    "max_image_pixels": 1000000,
}
# Options valid only with others set (the spec's cross-field rules): what each is tried with.
COMPANIONS = {
    "kv_offloading_disk_path": {"kvOffloadingSize": 1.0, "kvOffloadingDiskSize": 2.0},
    "kv_offloading_disk_size": {"kvOffloadingSize": 1.0, "kvOffloadingDiskPath": "/tmp/kv"},
}
# Object-valued options: (the spec's camelCase value, the EngineConfig value it must arrive as).
OBJECT_SAMPLES = {
    "pooler_config": ({"poolingType": "MEAN", "normalize": False}, PoolerConfig(pooling_type="MEAN", normalize=False)),
    "limit_mm_per_prompt": ({"image": 2}, MultiModalLimits(image=2)),
}


def _values(name: str) -> list:
    if name in OBJECT_SAMPLES:
        return []  # test_object_options_round_trip
    base = flags.base_type(api.EngineOptions.model_fields[name].annotation)
    if base is bool:
        return [True, False]
    if get_origin(base) is Literal:
        return list(get_args(base))
    return [NUMERIC_SAMPLES[name]]


CASES = [(name, value) for name in api.ENGINE_FLAG_FIELDS for value in _values(name)]


def _parsed_config(spec: dict) -> tuple[EngineConfig, list[str]]:
    isvc = {"apiVersion": api.API_VERSION, "kind": api.KIND,
            "metadata": {"name": "llm", "namespace": "ns", "uid": "u"}, "spec": spec}
    parsed = api.validate("llm", spec)
    args = render.engine_args("llm", "ns", parsed, Settings())
    rendered = render.pod_template(isvc, parsed, Settings())["spec"]["containers"][0]["args"]
    assert rendered[-len(args):] == args  # after shoal-engine serve, or the multi-pod group's wrapper
    ns = cli.build_parser().parse_args(["serve", *args])
    return cli.engine_config_from_args(ns), args


def test_every_engine_option_of_the_spec_is_an_engine_flag():
    spec_only = set(api.EngineOptions.model_fields) - set(api.ENGINE_FLAG_FIELDS)
    assert spec_only == {"shutdown_timeout_seconds", "extra_args"}  # a server flag and the pass-through
    for name in api.ENGINE_FLAG_FIELDS:
        assert flags.flag_of(EngineConfig.model_fields[name]) is not None, name
        assert name in NUMERIC_SAMPLES or name in OBJECT_SAMPLES or len(_values(name)) > 1, \
            f"no sample value for spec.engine.{name}"


@pytest.mark.parametrize("name,value", CASES, ids=[f"{n}={v}" for n, v in CASES])
def test_option_round_trips_spec_to_engine_config(name, value):
    camel = api.EngineOptions.model_fields[name].alias
    config, args = _parsed_config({"model": {"uri": "hf://org/m"},
                                   "engine": {**COMPANIONS.get(name, {}), camel: value}})
    assert getattr(config, name) == value, args


@pytest.mark.parametrize("name", sorted(OBJECT_SAMPLES))
def test_object_options_round_trip(name):
    spec_value, want = OBJECT_SAMPLES[name]
    camel = api.EngineOptions.model_fields[name].alias
    config, args = _parsed_config({"model": {"uri": "hf://org/m"}, "engine": {camel: spec_value}})
    assert getattr(config, name) == want, args


def test_all_options_together_round_trip():
    engine = {api.EngineOptions.model_fields[n].alias: v for n, v in NUMERIC_SAMPLES.items()}
    config, args = _parsed_config({"model": {"uri": "hf://org/m"}, "engine": engine})
    assert {n: getattr(config, n) for n in NUMERIC_SAMPLES} == NUMERIC_SAMPLES, args
    assert config.model == "/cache/shoal/models/org--m@main"  # the model cache entry the init container filled


def test_unset_options_keep_the_engine_defaults():
    config, args = _parsed_config({"model": {"uri": "hf://org/m"}})
    defaults = EngineConfig(model="org/m")
    for name in api.ENGINE_FLAG_FIELDS:
        assert getattr(config, name) == getattr(defaults, name), (name, args)
    assert flags.flag_name(EngineConfig, "max_num_seqs") not in args  # left to the engine, not repeated


def test_crd_descriptions_come_from_the_engine_flags():
    for name in api.ENGINE_FLAG_FIELDS:
        description = api.EngineOptions.model_fields[name].description
        assert flags.flag_of(EngineConfig.model_fields[name]).help in description
        assert flags.flag_name(EngineConfig, name) in description


def test_help_lists_every_flag_with_its_help(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["serve", "--help"])
    assert exit_.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    for model in (EngineConfig, DistributedConfig):
        for name, flag in flags.flag_fields(model).items():
            assert flags.flag_name(model, name) in out, name
            assert " ".join(flag.help.split()[:4]) in out, name
    assert "(default: 256)" in out and "(default: on)" in out  # defaults come from the fields


@pytest.mark.parametrize("model,name,value", [
    (EngineConfig, "enable_prefix_caching", False), (EngineConfig, "enforce_eager", True),
    (EngineConfig, "kv_cache_dtype", "fp8"), (EngineConfig, "gpu_memory_utilization", 0.25),
    (EngineConfig, "max_model_len", 4096), (DistributedConfig, "layer_partition", [5, 3]),
    (DistributedConfig, "backend", "gloo"),
    (EngineConfig, "lora_modules", ["a=/adapters/a", "b=/adapters/b"]), (EngineConfig, "max_cpu_loras", 4),
])
def test_to_args_is_the_inverse_of_parsing(model, name, value):
    ns = cli.build_parser().parse_args(["serve", *flags.to_args(model, name, value)])
    assert flags.values_from_args(ns, model)[name] == value


def test_image_fetching_renders_as_engine_flags():
    spec = {"model": {"uri": "hf://org/m"}, "engine": {
        "allowedMediaDomains": ["images.example.com", "minio.images.svc"], "mediaFetchTimeout": 2.5,
        "mediaFetchMaxBytes": 1048576, "mediaFetchAllowPrivateAddresses": True, "maxImagePixels": 1000000}}
    config, args = _parsed_config(spec)
    i = args.index("--allowed-media-domains")
    assert args[i:i + 3] == ["--allowed-media-domains", "images.example.com", "minio.images.svc"]
    assert "--media-fetch-allow-private-addresses" in args
    assert (config.allowed_media_domains, config.media_fetch_timeout, config.media_fetch_max_bytes,
            config.media_fetch_allow_private_addresses, config.max_image_pixels) == (
        ["images.example.com", "minio.images.svc"], 2.5, 1048576, True, 1000000)
    # unset: fetching stays off and no flag is rendered
    config, args = _parsed_config({"model": {"uri": "hf://org/m"}})
    assert config.allowed_media_domains is None and not any(a.startswith("--media") for a in args)
