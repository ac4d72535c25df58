"""One InferenceService contract (operator/contract.py): the gateway and the autoscaler derive the same names, the
same served model name and the same defaults as the operator renders, and the gateway exports the metrics the
autoscaler reads."""

from __future__ import annotations

import pytest

from shoal.operator import api, autoscaler, contract, render
from shoal.operator.gateway import metrics
from shoal.operator.gateway.fleet import ServiceView
from shoal.operator.render import Settings


def isvc(name: str, spec: dict) -> dict:
    return {"apiVersion": api.API_VERSION, "kind": api.KIND,
            "metadata": {"name": name, "namespace": "team", "uid": "u"}, "spec": spec}


SAMPLES = [
    ("chat", {"model": {"uri": "hf://Qwen/Qwen2.5-0.5B-Instruct"}}),
    ("named", {"model": {"uri": "pvc://models/llama", "servedName": "llama-3"}, "gateway": {"enabled": False}}),
    ("plain", {"model": {"uri": "pvc://models/x"},
               "autoscaling": {"minReplicas": 0, "maxReplicas": 2}}),
    ("slow", {"model": {"uri": "hf://org/m"}, "probes": {"startupTimeoutSeconds": 600},
              "autoscaling": {"minReplicas": 0, "maxReplicas": 3}, "engine": {"enableLora": True}}),
]


@pytest.mark.parametrize("name, spec", SAMPLES, ids=[s[0] for s in SAMPLES])
def test_the_gateway_and_the_autoscaler_derive_what_the_operator_renders(name, spec):
    obj = isvc(name, spec)
    plan = render.plan(obj, Settings())
    children = {(c["kind"], c["metadata"]["name"]) for c in render.render(obj, Settings())}
    view = ServiceView.of(obj)  # before the operator's first status: from the spec alone
    parsed = api.validate(name, spec)

    assert view.served_name == plan.served_model_name
    assert ServiceView.of({**obj, "status": {"servedModelName": plan.served_model_name}}).served_name == \
        plan.served_model_name
    # the Service whose EndpointSlices list the serving engines: rendered, and found alike by both readers
    assert ("Service", view.engine_service) in children
    assert view.engine_service == autoscaler.engine_service(name, parsed)
    if parsed.gateway.enabled:
        assert ("Deployment", contract.gateway_name(name)) in children
    if parsed.autoscaling and parsed.autoscaling.min_replicas == 0:
        assert ("ConfigMap", contract.wake_configmap_name(name)) in children
        assert view.hold_timeout == parsed.probes.startup_timeout_seconds
    if parsed.engine.enable_lora:
        assert ("ConfigMap", contract.adapters_configmap_name(name)) in children
    for kind, child in children:
        labels = next(c for c in render.render(obj, Settings())
                      if (c["kind"], c["metadata"]["name"]) == (kind, child))["metadata"]["labels"]
        assert labels[contract.L_MANAGED_BY] == contract.MANAGED_BY and labels[contract.L_ISVC] == name


def test_the_defaults_are_the_contracts():
    assert api.Probes().startup_timeout_seconds == contract.DEFAULT_STARTUP_TIMEOUT_SECONDS
    assert (api.GROUP, api.VERSION, api.KIND, api.PLURAL) == (contract.GROUP, contract.VERSION, contract.KIND,
                                                              contract.PLURAL)


def test_the_gateway_exports_the_metrics_the_autoscaler_reads():
    exported = {metrics.P + name: field for name, field, _doc in metrics.ENGINE_GAUGES}
    assert contract.GATEWAY_ENGINE_GAUGES.items() <= exported.items()
    text = ("# TYPE shoal:gateway_held_requests gauge\nshoal:gateway_held_requests 3\n"
            "# TYPE shoal:gateway_inflight_requests gauge\n"
            'shoal:gateway_inflight_requests{backend="http://e:8000"} 2\n'
            "# TYPE shoal:gateway_backend_kv_cache_usage gauge\n"
            'shoal:gateway_backend_kv_cache_usage{backend="http://e:8000"} 0.5\n')
    view = autoscaler.gateway_view(text)
    assert view.held == 3 and view.in_flight == {"http://e:8000": 2} and view.engines["http://e:8000"]["kv_usage"] == 0.5
