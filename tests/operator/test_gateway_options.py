"""Gateway options are declared once (GatewayConfig fields with an Option, gateway/options.py): every option that
spec.gateway exposes round-trips — a CRD field (in the generated CRD, with its bounds) -> the gateway container's
rendered arguments -> the shoal-gateway parser -> the GatewayConfig the gateway runs with."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from shoal.operator import api, render
from shoal.operator.gateway import cli, options
from shoal.operator.gateway.proxy import GatewayConfig
from shoal.operator.render import Settings

ROOT = Path(__file__).resolve().parents[2]
DECLARED = options.spec_fields(GatewayConfig)


def camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(w.title() for w in rest)


def crd_gateway_properties() -> dict:
    crd = yaml.safe_load((ROOT / "crds" / "inferenceservices.serving.shoal.dev.yaml").read_text())
    (version,) = crd["spec"]["versions"]
    return version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["gateway"]["properties"]


def other_value(declared: options.Declared, spec: options.SpecField):
    """A valid value that is not the default, so the round trip cannot pass by defaults alone."""
    if declared.option.choices:
        return next(c for c in declared.option.choices if c != declared.default)
    value = options.spec_default(declared) + 1
    assert spec.le is None or value <= spec.le
    return value


def test_options_are_declared():
    assert {spec.name for _, spec in DECLARED} >= {"routing", "response_timeout_seconds", "read_timeout_seconds",
                                                   "max_body_bytes", "max_pending", "max_buffered_bytes"}


@pytest.mark.parametrize("declared, spec", DECLARED, ids=[s.name for _, s in DECLARED])
def test_a_declared_option_round_trips_from_the_crd_to_the_running_gateway(declared, spec):
    prop = crd_gateway_properties()[camel(spec.name)]
    assert prop["description"] == spec.description and prop["default"] == options.spec_default(declared)
    if spec.ge is not None:
        assert (prop["minimum"], prop["maximum"]) == (spec.ge, spec.le)
    if declared.option.choices:
        assert prop["enum"] == list(declared.option.choices)

    value = other_value(declared, spec)
    gateway = {camel(spec.name): value}
    isvc = {"apiVersion": api.API_VERSION, "kind": api.KIND, "metadata": {"name": "llm", "namespace": "ns", "uid": "u"},
            "spec": {"model": {"uri": "hf://org/m"}, "gateway": gateway}}
    deployment = next(c for c in render.render(isvc, Settings())
                      if c["kind"] == "Deployment" and c["metadata"]["name"] == "llm-gateway")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["shoal-gateway"]
    args = container["args"]
    assert args.count(declared.flag) == 1, f"{declared.flag} rendered {args.count(declared.flag)} times"

    config = cli.config_from_args(cli.build_parser().parse_args(args))
    assert getattr(config, declared.field) == value, (declared.flag, args)


def test_an_undeclared_flag_is_refused_by_name():
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["--endpoint", "http://e:8000", "--max-pending", "0"])
