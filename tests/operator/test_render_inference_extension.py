"""render/ for platforms: an InferencePool and HTTPRoute (spec.inferencePool) validated against the Gateway API
Inference Extension's and the Gateway API's published schemas (gie_schemas.py), and the shared gateway's access to
every service (the operator's --shared-gateway)."""

from __future__ import annotations

import jsonschema
import kubernetes_validate
import pytest

from gie_schemas import HTTP_ROUTE, INFERENCE_POOL, cel_errors
from shoal.operator import api, render
from shoal.operator.render import L_COMPONENT, L_ISVC, L_POD_INDEX, Settings

SETTINGS = Settings(engine_image="registry.test/shoal-engine:1", operator_namespace="shoal-system")
POOL = {"endpointPicker": {"name": "llm-epp"}}
ROUTE = {"parentRefs": [{"name": "inference-gateway", "namespace": "gateways", "sectionName": "https"}],
         "hostnames": ["llm.example.com"]}


def isvc(spec: dict | None = None, name: str = "llm") -> dict:
    return {"apiVersion": api.API_VERSION, "kind": api.KIND,
            "metadata": {"name": name, "namespace": "team-a", "uid": "uid-1", "generation": 1}, "spec": spec or {}}


def kids(spec: dict | None = None, settings: Settings = SETTINGS) -> dict[tuple[str, str], dict]:
    return {(c["kind"], c["metadata"]["name"]): c for c in render.render(isvc(spec), settings)}


def valid(obj: dict, schema: dict) -> None:
    jsonschema.Draft7Validator(schema).validate(obj)
    assert cel_errors(obj) == []


def test_off_by_default():
    assert not [k for k in kids() if k[0] in ("InferencePool", "HTTPRoute")]


@pytest.mark.parametrize("spec", [
    {"inferencePool": POOL},
    {"inferencePool": {"endpointPicker": {"name": "epp", "port": 9003, "failureMode": "FailOpen"}, "httpRoute": ROUTE},
     "model": {"uri": "hf://Qwen/Qwen2.5-7B-Instruct"}},
    {"inferencePool": {**POOL, "httpRoute": {"parentRefs": [{"name": "gw"}], "matchModelHeader": False}},
     "engine": {"tensorParallelSize": 8, "pipelineParallelSize": 2}, "resources": {"gpusPerPod": 8}},
])
def test_the_pool_and_route_validate_against_the_published_schemas(spec):
    k = kids(spec)
    pool = k[("InferencePool", "llm")]
    valid(pool, INFERENCE_POOL)
    multi = "pipelineParallelSize" in spec.get("engine", {})
    # the pool is the engines that serve the API: every pod, or rank 0 of each multi-pod group
    assert pool["spec"]["selector"]["matchLabels"] == {L_ISVC: "llm", L_COMPONENT: "engine",
                                                       **({L_POD_INDEX: "0"} if multi else {})}
    assert pool["spec"]["targetPorts"] == [{"number": 8000}]
    picker = spec["inferencePool"]["endpointPicker"]
    assert pool["spec"]["endpointPickerRef"] == {"kind": "Service", "name": picker["name"],
                                                 "port": {"number": picker.get("port", 9002)},
                                                 "failureMode": picker.get("failureMode", "FailClose")}
    assert pool["metadata"]["ownerReferences"][0]["name"] == "llm"  # deleted with the InferenceService
    if "httpRoute" not in spec["inferencePool"]:
        assert ("HTTPRoute", "llm") not in k
        return
    route = k[("HTTPRoute", "llm")]
    valid(route, HTTP_ROUTE)
    (rule,) = route["spec"]["rules"]
    assert rule["backendRefs"] == [{"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "llm"}]
    (match,) = rule["matches"]
    if spec["inferencePool"]["httpRoute"].get("matchModelHeader", True):
        served = api.served_model_name("llm", api.parse_spec(spec))
        assert match["headers"] == [{"type": "Exact", "name": "X-Gateway-Model-Name", "value": served}]
    else:
        assert "headers" not in match
    assert rule["timeouts"] == {"request": "3600s"}  # a whole non-streaming generation, as spec.gateway allows


def test_the_schemas_catch_what_the_api_server_would_refuse():
    pool = kids({"inferencePool": POOL})[("InferencePool", "llm")]
    for broken in ({**pool["spec"], "targetPorts": []}, {**pool["spec"], "targetPortNumber": 8000},
                   {**pool["spec"], "selector": {"matchLabels": {}}}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.Draft7Validator(INFERENCE_POOL).validate({**pool, "spec": broken})
    no_port = {**pool, "spec": {**pool["spec"], "endpointPickerRef": {"name": "x"}}}
    assert cel_errors(no_port) == ["endpointPickerRef: port is required when kind is 'Service' or unspecified"]
    route = kids({"inferencePool": {**POOL, "httpRoute": ROUTE}})[("HTTPRoute", "llm")]
    twice = {**route, "spec": {**route["spec"], "parentRefs": route["spec"]["parentRefs"] * 2}}
    assert cel_errors(twice) and cel_errors({**route, "spec": {**route["spec"], "rules": [
        {"backendRefs": [{"name": "svc"}]}]}}) == ["backendRefs: Must have port for Service reference"]


@pytest.mark.parametrize("bad, field", [
    ({"endpointPicker": {"name": ""}}, "spec.inferencePool.endpointPicker.name"),
    ({"endpointPicker": {"name": "e", "port": 0}}, "spec.inferencePool.endpointPicker.port"),
    ({"endpointPicker": {"name": "e", "failureMode": "Open"}}, "spec.inferencePool.endpointPicker.failureMode"),
    ({"endpointPicker": {"name": "e"}, "httpRoute": {"parentRefs": []}}, "spec.inferencePool.httpRoute.parentRefs"),
    ({"endpointPicker": {"name": "e"}, "httpRoute": {"parentRefs": [{"name": "g", "namespace": "Bad_NS"}]}},
     "spec.inferencePool.httpRoute.parentRefs[0].namespace"),
    ({}, "spec.inferencePool.endpointPicker"),
])
def test_a_bad_inference_pool_spec_names_its_field(bad, field):
    with pytest.raises(api.SpecError) as e:
        api.validate("llm", {"inferencePool": bad})
    assert e.value.field == field, e.value


def test_the_extensions_gateway_may_reach_the_engines_directly():
    allow = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gateways"}}}]
    spec = {"security": {"networkPolicy": {"allowFrom": allow}}}
    peers = kids(spec)[("NetworkPolicy", "llm")]["spec"]["ingress"][0]["from"]
    assert peers == [{"podSelector": {"matchLabels": {L_ISVC: "llm", L_COMPONENT: "gateway"}}}]
    peers = kids({**spec, "inferencePool": POOL})[("NetworkPolicy", "llm")]["spec"]["ingress"][0]["from"]
    assert peers[1:] == allow  # Envoy (or Istio...) sends to the pod the endpoint picker chose


def test_the_shared_gateway_reaches_every_engine_and_may_wake_only_services_at_zero():
    settings = Settings(operator_namespace="shoal-system", shared_gateway="shoal-system/shoal-gateway")
    shared = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "shoal-system"}},
              "podSelector": {"matchLabels": {L_COMPONENT: "shared-gateway"}}}
    k = kids({}, settings)
    assert shared in k[("NetworkPolicy", "llm")]["spec"]["ingress"][0]["from"]
    assert ("RoleBinding", "llm-shared-gateway") not in k  # never at zero: nothing to wake
    k = kids({"autoscaling": {"minReplicas": 0, "maxReplicas": 2}}, settings)
    binding = k[("RoleBinding", "llm-shared-gateway")]
    assert binding["roleRef"]["name"] == "llm-gateway"  # patch llm-wake and read EndpointSlices, nothing else
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "shoal-gateway", "namespace": "shoal-system"}]
    kubernetes_validate.validate(binding, "1.37.0", strict=True)
    assert shared not in kids({})[("NetworkPolicy", "llm")]["spec"]["ingress"][0]["from"]  # only when named


def test_priority_and_scheduling_policy_reach_the_engines():
    k = kids({"priority": 5, "engine": {"schedulingPolicy": "priority"}})
    args = k[("Deployment", "llm")]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--scheduling-policy") + 1] == "priority"
    vllm = kids({"runtime": "vllm", "model": {"uri": "hf://a/b"}, "engine": {"schedulingPolicy": "priority"}})
    args = vllm[("Deployment", "llm")]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--scheduling-policy") + 1] == "priority"
    with pytest.raises(api.SpecError, match="runtime sglang"):
        api.validate("llm", {"runtime": "sglang", "model": {"uri": "hf://a/b"},
                             "engine": {"schedulingPolicy": "priority"}})
    with pytest.raises(api.SpecError) as e:
        api.validate("llm", {"priority": 2**31})
    assert e.value.field == "spec.priority"


@pytest.mark.parametrize("n_adapters, routes", [(63, [[64]]), (64, [[64, 1]]), (256, [[64, 64], [64, 64], [1]])])
def test_an_http_route_for_many_adapters_is_split_into_valid_rules_and_routes(n_adapters, routes):
    """One match per served name; the Gateway API allows 64 matches per rule and 128 per route: 64 adapters (65
    names) made one invalid rule. Rules of <= 64, routes of <= 128 (<name>, <name>-r2, ...), every name routed."""
    adapters = [{"name": f"a{i}", "uri": f"hf://org/adapter-{i}"} for i in range(n_adapters)]
    k = kids({"engine": {"enableLora": True}, "adapters": adapters,
              "inferencePool": {**POOL, "httpRoute": ROUTE}})
    found = sorted((name for kind, name in k if kind == "HTTPRoute"), key=lambda n: (len(n), n))
    assert found == ["llm", "llm-r2", "llm-r3"][:len(routes)]
    names = []
    for name, sizes in zip(found, routes):
        route = k[("HTTPRoute", name)]
        valid(route, HTTP_ROUTE)
        assert [len(rule["matches"]) for rule in route["spec"]["rules"]] == sizes
        names += [m["headers"][0]["value"] for rule in route["spec"]["rules"] for m in rule["matches"]]
    assert names == ["llm"] + [a["name"] for a in adapters]
