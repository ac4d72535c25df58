"""spec.prefill (prefill/decode disaggregation) without a cluster: the prefill role's Deployment, its headless
Service and NetworkPolicy, the engines' --kv-transfer-config roles (read back by the engine's own parser), the
gateway's --prefill-service, and the spec's refusals."""

from __future__ import annotations

import kubernetes_validate
import pytest

from shoal.engine import cli
from shoal.operator import api, contract, render

K8S_VERSION = kubernetes_validate.latest_version()
SETTINGS = render.Settings(engine_image="registry.test/shoal-engine:1", fleet_image="registry.test/shoal-operator:1",
                           operator_namespace="shoal-system")
BASE = {"model": {"uri": "hf://org/chat"}, "replicas": 2, "resources": {"gpusPerPod": 0, "cpu": 2, "memory": "4Gi"}}


def isvc(spec: dict) -> dict:
    return {"apiVersion": api.API_VERSION, "kind": api.KIND,
            "metadata": {"name": "llm", "namespace": "team-a", "uid": "u-1", "generation": 1}, "spec": spec}


def by_name(children: list[dict]) -> dict[tuple[str, str], dict]:
    return {(c["kind"], c["metadata"]["name"]): c for c in children}


def engine_config(deployment: dict):
    """The EngineConfig the engine container's args give, through `shoal-engine serve`'s own parser."""
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    args = cli.build_parser().parse_args(container["args"][container["args"].index("serve"):])
    return cli.engine_config_from_args(args)


def test_the_prefill_role_is_its_own_deployment_reached_through_its_own_service():
    plan = render.plan(isvc({**BASE, "prefill": {"replicas": 3, "cpu": 4, "memory": "8Gi"}}), SETTINGS)
    children = by_name(plan.children)
    for obj in plan.children:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    decode, prefill = children[("Deployment", "llm")], children[("Deployment", "llm-prefill")]
    assert prefill["spec"]["replicas"] == 3 and decode["spec"]["replicas"] == 2
    selector = {contract.L_ISVC: "llm", contract.L_COMPONENT: "prefill"}
    assert prefill["spec"]["selector"]["matchLabels"] == selector
    assert prefill["spec"]["template"]["metadata"]["labels"][contract.L_COMPONENT] == "prefill"
    # the decode Deployment's selector does not take the prefill pods, nor the engines Service (the gateway's
    # decode engines), the engines' NetworkPolicy or their disruption budget
    assert decode["spec"]["selector"]["matchLabels"][contract.L_COMPONENT] == "engine"
    assert children[("Service", "llm-engines")]["spec"]["selector"][contract.L_COMPONENT] == "engine"
    assert children[("PodDisruptionBudget", "llm")]["spec"]["selector"]["matchLabels"][contract.L_COMPONENT] == "engine"
    # the prefill pods' size: theirs where given, the engines' else
    resources = prefill["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert resources["requests"]["cpu"] == "4" and resources["limits"]["memory"] == "8Gi"
    # the roles, read back by the engine's parser
    produce, consume = engine_config(prefill).kv_transfer_config, engine_config(decode).kv_transfer_config
    assert (produce.kv_role, consume.kv_role) == ("kv_producer", "kv_consumer")
    assert produce.kv_connector == consume.kv_connector == "ShoalConnector"
    # found by the gateway through the headless Service's EndpointSlices
    service = children[("Service", "llm-prefill")]
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["selector"] == selector
    gateway = children[("Deployment", "llm-gateway")]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert gateway[gateway.index("--prefill-service") + 1] == "llm-prefill"
    # reached by the gateway (prefills) and the decode engines (KV pulls) on the HTTP port; scraped by the operator
    policy = children[("NetworkPolicy", "llm-prefill")]["spec"]
    assert policy["podSelector"]["matchLabels"] == selector
    peers = [p["podSelector"]["matchLabels"] for p in policy["ingress"][0]["from"]]
    assert peers == [render.gateway_selector("llm"), render.pod_selector("llm")]
    assert policy["ingress"][0]["ports"] == [{"port": api.ENGINE_PORT, "protocol": "TCP"}]
    assert policy["ingress"][1]["from"][0]["namespaceSelector"]["matchLabels"] == {
        "kubernetes.io/metadata.name": "shoal-system"}
    assert ("PodDisruptionBudget", "llm-prefill") in children


def test_the_shared_gateway_reaches_the_prefill_engines_too():
    """With a shared gateway, it sends the service's prefills as well: its pods (in its own namespace) may reach
    the prefill engines' HTTP port; the decode engines and the service's own gateway still may."""
    import dataclasses

    shared = dataclasses.replace(SETTINGS, shared_gateway="shoal-system/shoal-gateway")
    plan = render.plan(isvc({**BASE, "prefill": {"replicas": 1}}), shared)
    policy = by_name(plan.children)[("NetworkPolicy", "llm-prefill")]["spec"]
    kubernetes_validate.validate(by_name(plan.children)[("NetworkPolicy", "llm-prefill")], K8S_VERSION, strict=True)
    peers = policy["ingress"][0]["from"]
    assert [p["podSelector"]["matchLabels"] for p in peers[:2]] == [render.gateway_selector("llm"),
                                                                   render.pod_selector("llm")]
    assert peers[2]["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "shoal-system"}
    assert peers[2]["podSelector"]["matchLabels"][contract.L_COMPONENT] == "shared-gateway"
    alone = by_name(render.plan(isvc({**BASE, "prefill": {"replicas": 1}}), SETTINGS).children)
    assert len(alone[("NetworkPolicy", "llm-prefill")]["spec"]["ingress"][0]["from"]) == 2


def test_without_prefill_nothing_of_it_is_rendered():
    plan = render.plan(isvc(BASE), SETTINGS)
    names = {c["metadata"]["name"] for c in plan.children}
    assert "llm-prefill" not in names
    assert engine_config(by_name(plan.children)[("Deployment", "llm")]).kv_transfer_config is None
    gateway = by_name(plan.children)[("Deployment", "llm-gateway")]["spec"]["template"]["spec"]["containers"][0]
    assert "--prefill-service" not in gateway["args"]
    one = by_name(render.plan(isvc({**BASE, "prefill": {}}), SETTINGS).children)
    assert ("PodDisruptionBudget", "llm-prefill") not in one  # one prefill pod: no budget to keep


@pytest.mark.parametrize("spec, field, message", [
    ({**BASE, "prefill": {}, "runtime": "vllm"}, "spec.runtime", "Shoal engines only"),
    ({**BASE, "prefill": {}, "gateway": {"enabled": False}}, "spec.prefill", "needs the gateway"),
    ({**BASE, "prefill": {}, "engine": {"enablePrefixCaching": False}}, "spec.engine.enablePrefixCaching",
     "prefix-cache hashes"),
    ({"prefill": {}, "engine": {"tensorParallelSize": 8, "pipelineParallelSize": 2}, "resources": {"gpusPerPod": 8}},
     "spec.prefill",
     "one pod each"),
    ({**BASE, "prefill": {"replicas": 0}}, "spec.prefill.replicas", "greater than or equal to 1"),
])
def test_specs_prefill_cannot_serve_are_refused_naming_the_field(spec, field, message):
    with pytest.raises(api.SpecError) as e:
        api.validate("llm", spec)
    assert e.value.field == field and message in str(e.value)


def test_a_long_name_is_refused_for_the_prefill_pods():
    with pytest.raises(api.SpecError, match="at most 39 characters with spec.prefill"):
        api.validate("x" * 40, {**BASE, "prefill": {}})


def test_status_reports_the_prefill_role_apart_from_the_service():
    from shoal.operator import status

    body = isvc({**BASE, "prefill": {"replicas": 2}})
    plan = render.plan(body, SETTINGS)
    children = {("Deployment", "llm"): {"metadata": {"generation": 1}, "status": {
                    "observedGeneration": 1, "replicas": 2, "readyReplicas": 2, "updatedReplicas": 2}},
                ("Deployment", "llm-prefill"): {"metadata": {"generation": 1}, "status": {
                    "observedGeneration": 1, "replicas": 2, "readyReplicas": 0}}}
    failing = {"metadata": {"name": "llm-prefill-x", "labels": {contract.L_ISVC: "llm",
                                                                contract.L_COMPONENT: "prefill"}},
               "status": {"phase": "Running", "containerStatuses": [{"name": "engine", "restartCount": 9, "state": {
                   "waiting": {"reason": "CrashLoopBackOff", "message": "boom"}}}]}}
    out = status.compute_status(body, plan, children, [failing])
    assert out["prefill"] == {"replicas": 2, "readyReplicas": 0}
    # the decode engines serve (and prefill themselves): the service is Ready whatever the prefill role does
    assert out["phase"] == "Ready" and out["readyReplicas"] == 2
    degraded = next(c for c in out["conditions"] if c["type"] == "Degraded")
    assert degraded["status"] == "False"  # a failing prefill pod is status.prefill's to show, not the service's
    assert render.plan(isvc(BASE), SETTINGS) and status.compute_status(
        isvc(BASE), render.plan(isvc(BASE), SETTINGS), children, [])["prefill"] is None


def test_an_autoscaled_prefill_role_runs_the_autoscalers_count_within_its_bounds():
    spec = {**BASE, "prefill": {"replicas": 2, "autoscaling": {"minReplicas": 0, "maxReplicas": 5}}}

    def prefill_replicas(status: dict | None) -> tuple[int, int]:
        children = by_name(render.plan({**isvc(spec), "status": status}, SETTINGS).children)
        return children[("Deployment", "llm-prefill")]["spec"]["replicas"], children[("Deployment", "llm")]["spec"]["replicas"]

    assert prefill_replicas(None) == (2, 2)  # spec.prefill.replicas: where the role starts
    assert prefill_replicas({"prefill": {"desiredReplicas": 4}}) == (4, 2)  # the autoscaler's; decode untouched
    assert prefill_replicas({"prefill": {"desiredReplicas": 0}}) == (0, 2)  # scaled to zero: decode prefills
    assert prefill_replicas({"prefill": {"desiredReplicas": 9}}) == (5, 2)  # within maxReplicas
    # the decode replicas' own autoscaler count is apart from it
    spec["autoscaling"] = {"minReplicas": 1, "maxReplicas": 8}
    assert prefill_replicas({"prefill": {"desiredReplicas": 1}, "autoscaling": {"desiredReplicas": 6}}) == (1, 6)
    # without prefill.autoscaling a stale decision is ignored
    fixed = {**BASE, "prefill": {"replicas": 2}}
    assert api.running_prefill_replicas(api.validate("llm", fixed), {"prefill": {"desiredReplicas": 4}}) == 2


def test_status_keeps_the_autoscalers_prefill_fields_and_drops_them_with_prefill_autoscaling():
    from shoal.operator import status

    children = {("Deployment", "llm-prefill"): {"status": {"replicas": 3, "readyReplicas": 3}}}
    old = {"replicas": 3, "readyReplicas": 2, "desiredReplicas": 3, "reason": "ScaleUp",
           "inputs": {"waitingPrefillTokens": 20000}}
    auto = render.plan(isvc({**BASE, "prefill": {"autoscaling": {"maxReplicas": 4}}}), SETTINGS)
    out = status.prefill_status(auto, children, old)
    assert out == {"replicas": 3, "readyReplicas": 3, "desiredReplicas": 3, "reason": "ScaleUp",
                   "inputs": {"waitingPrefillTokens": 20000}}
    assert not status.status_changed({"prefill": out}, {"prefill": status.prefill_status(auto, children, out)})
    fixed = render.plan(isvc({**BASE, "prefill": {"replicas": 3}}), SETTINGS)
    # null in the merge patch: the fields go, the count is spec.prefill.replicas again
    assert status.prefill_status(fixed, children, old) == {"replicas": 3, "readyReplicas": 3, "desiredReplicas": None,
                                                           "reason": None, "inputs": None}
