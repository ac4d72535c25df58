"""render.py: the per-InferenceService shoal-gateway (spec.gateway) and how it changes the engines' exposure."""

from __future__ import annotations

import kubernetes_validate
import pytest

from shoal.operator import api, render
from shoal.operator.render import L_COMPONENT, L_ISVC, L_POD_INDEX, Settings

SETTINGS = Settings(engine_image="registry.test/shoal-engine:1", gateway_image="registry.test/shoal-operator:1",
                    operator_namespace="shoal-system")
GATEWAY_PODS = {L_ISVC: "llm", L_COMPONENT: "gateway"}


def isvc(spec: dict | None = None) -> dict:
    return {"apiVersion": api.API_VERSION, "kind": api.KIND,
            "metadata": {"name": "llm", "namespace": "team-a", "uid": "uid-1", "generation": 1}, "spec": spec or {}}


def kids(spec: dict | None = None) -> dict[tuple[str, str], dict]:
    return {(c["kind"], c["metadata"]["name"]): c for c in render.render(isvc(spec), SETTINGS)}


def test_default_gateway_deployment():
    k = kids()
    dep = k[("Deployment", "llm-gateway")]
    assert dep["spec"]["replicas"] == 2
    assert dep["spec"]["selector"]["matchLabels"] == GATEWAY_PODS
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["image"] == "registry.test/shoal-operator:1" and c["command"] == ["shoal-gateway"]
    args = c["args"]
    assert args[args.index("--service") + 1] == "llm-engines" and args[args.index("--namespace") + 1] == "team-a"
    assert args[args.index("--routing") + 1] == "prefix-load" and args[args.index("--port-name") + 1] == "http"
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz" and c["livenessProbe"]["httpGet"]["path"] == "/livez"
    assert c["resources"] == {"requests": {"cpu": "250m", "memory": "514Mi"}, "limits": {"memory": "514Mi"}}
    assert c["securityContext"]["readOnlyRootFilesystem"] is True and pod["securityContext"]["runAsNonRoot"]
    assert pod["serviceAccountName"] == "llm-gateway" and pod["automountServiceAccountToken"] is True
    # streams may last as long as the engines' drain
    assert pod["terminationGracePeriodSeconds"] > int(args[args.index("--shutdown-timeout") + 1])
    assert pod["topologySpreadConstraints"][0]["labelSelector"]["matchLabels"] == GATEWAY_PODS


def test_service_points_at_the_gateway_and_the_gateway_at_ready_engines():
    k = kids()
    assert k[("Service", "llm")]["spec"]["selector"] == GATEWAY_PODS
    engines = k[("Service", "llm-engines")]["spec"]
    assert engines["clusterIP"] == "None" and not engines.get("publishNotReadyAddresses")  # Ready endpoints only
    assert engines["selector"] == {L_ISVC: "llm", L_COMPONENT: "engine"}
    assert engines["ports"][0]["name"] == "http"
    multi = kids({"engine": {"tensorParallelSize": 8, "pipelineParallelSize": 2}, "resources": {"gpusPerPod": 8}})
    assert multi[("Service", "llm-engines")]["spec"]["selector"][L_POD_INDEX] == "0"  # rank 0 serves the API


def test_gateway_may_read_endpointslices_and_nothing_else():
    k = kids()
    assert k[("Role", "llm-gateway")]["rules"] == [
        {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["list", "watch"]}]
    rb = k[("RoleBinding", "llm-gateway")]
    assert rb["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "llm-gateway"}
    assert rb["subjects"] == [{"kind": "ServiceAccount", "name": "llm-gateway", "namespace": "team-a"}]
    assert k[("ServiceAccount", "llm-gateway")]["automountServiceAccountToken"] is False


def test_network_policies_clients_to_gateway_to_engines():
    k = kids({"security": {"networkPolicy": {"allowFrom": [{"namespaceSelector": {"matchLabels": {"t": "x"}}}]}}})
    engines, gateway = k[("NetworkPolicy", "llm")], k[("NetworkPolicy", "llm-gateway")]
    assert engines["spec"]["ingress"][0]["from"] == [{"podSelector": {"matchLabels": GATEWAY_PODS}}]
    assert gateway["spec"]["podSelector"] == {"matchLabels": GATEWAY_PODS}
    assert gateway["spec"]["ingress"][0]["from"] == [{"namespaceSelector": {"matchLabels": {"t": "x"}}}]
    assert k[("PodDisruptionBudget", "llm-gateway")]["spec"]["maxUnavailable"] == 1


def test_the_gateway_admits_the_same_metrics_scrapers_as_the_engines():
    """A ServiceMonitor of the gateways (its Prometheus in a monitoring namespace or given as metricsFrom) must not
    find its targets down while the engines' are up."""
    settings = Settings(engine_image="e", gateway_image="g", operator_namespace="shoal-system",
                        metrics_namespaces=("monitoring",))
    scraper = {"podSelector": {"matchLabels": {"app": "vmagent"}}, "namespaceSelector": {}}
    k = {(c["kind"], c["metadata"]["name"]): c for c in render.render(
        isvc({"security": {"networkPolicy": {"metricsFrom": [scraper]}}}), settings)}
    engines, gateway = k[("NetworkPolicy", "llm")]["spec"]["ingress"], k[("NetworkPolicy", "llm-gateway")]["spec"]
    assert engines[1]["from"] == gateway["ingress"][1]["from"]
    assert gateway["ingress"][1]["ports"] == [{"port": 8000, "protocol": "TCP"}, {"port": 9090, "protocol": "TCP"}]
    froms = [peer for rule in gateway["ingress"] for peer in rule["from"]]
    for ns in ("shoal-system", "monitoring"):
        assert {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": ns}}} in froms
    assert scraper in froms


def test_gateway_options_reach_the_deployment():
    k = kids({"gateway": {"routing": "least-load", "replicas": 3, "image": "my/gw:2",
                          "resources": {"cpu": "1", "memory": "1Gi"}}})
    dep = k[("Deployment", "llm-gateway")]
    c = dep["spec"]["template"]["spec"]["containers"][0]
    assert dep["spec"]["replicas"] == 3 and c["image"] == "my/gw:2"
    assert c["args"][c["args"].index("--routing") + 1] == "least-load"
    assert c["resources"] == {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"memory": "1Gi"}}


def test_gateway_disabled_exposes_the_engines_directly():
    k = kids({"gateway": {"enabled": False}})
    assert not [key for key in k if key[1].startswith(("llm-gateway", "llm-engines"))]
    assert k[("Service", "llm")]["spec"]["selector"] == {L_ISVC: "llm", L_COMPONENT: "engine"}


@pytest.mark.parametrize("gateway, field", [
    ({"replicas": 1}, "spec.gateway.replicas"),
    ({"routing": "random"}, "spec.gateway.routing"),
    ({"resources": {"memory": "lots"}}, "spec.gateway.resources.memory"),
])
def test_bad_gateway_options_name_the_field(gateway, field):
    with pytest.raises(api.SpecError) as e:
        render.render(isvc({"gateway": gateway}), SETTINGS)
    assert e.value.field == field


def test_gateway_objects_are_valid_kubernetes():
    version = kubernetes_validate.latest_version()
    for (kind, name), obj in kids({"replicas": 3}).items():
        if name.startswith("llm-"):
            kubernetes_validate.validate(obj, version, strict=True)


def test_scale_from_zero_makes_the_gateway_hold_requests_and_wake_the_autoscaler():
    k = kids({"autoscaling": {"minReplicas": 0, "maxReplicas": 2}, "probes": {"startupTimeoutSeconds": 300}})
    args = k[("Deployment", "llm-gateway")]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--hold-timeout") + 1] == "300" and args[args.index("--wake-configmap") + 1] == "llm-wake"
    # the Waker annotates a ConfigMap of its own, and may write nothing else (never its InferenceService)
    assert k[("Role", "llm-gateway")]["rules"][1:] == [{"apiGroups": [""], "resources": ["configmaps"],
                                                        "resourceNames": ["llm-wake"], "verbs": ["patch"]}]
    wake = k[("ConfigMap", "llm-wake")]
    assert wake["metadata"]["ownerReferences"][0]["name"] == "llm"
    assert wake["metadata"]["labels"]["app.kubernetes.io/component"] == "wake"
    assert not any(r["apiGroups"] == ["serving.shoal.dev"] for r in k[("Role", "llm-gateway")]["rules"])
    assert ("ConfigMap", "llm-wake") not in kids({"autoscaling": {"minReplicas": 1, "maxReplicas": 2}})
    # by default the hold outlasts GPU node provisioning + image pull + model load (the startup budget), not 600 s
    args = kids({"autoscaling": {"minReplicas": 0, "maxReplicas": 2}})[("Deployment", "llm-gateway")]["spec"][
        "template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--hold-timeout") + 1] == "1800"
    assert "--hold-timeout" not in kids({"autoscaling": {"minReplicas": 1, "maxReplicas": 2}})[
        ("Deployment", "llm-gateway")]["spec"]["template"]["spec"]["containers"][0]["args"]


def test_the_gateway_checks_the_engines_api_key_itself():
    k = kids({"security": {"apiKeySecretRef": {"name": "llm-key", "key": "token"}},
              "autoscaling": {"minReplicas": 0, "maxReplicas": 2}})
    pod = k[("Deployment", "llm-gateway")]["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    # the Secret mounted (never an argument nor an env var), re-read when it is rotated, so unauthenticated
    # requests never hold or wake anything and a new key needs no restart
    assert "env" not in c and not any("llm-key" in a or "token" in a for a in c["args"])
    assert c["args"][c["args"].index("--api-key-file") + 1] == render.API_KEYS_FILE
    assert c["volumeMounts"] == [{"name": "api-keys", "mountPath": render.API_KEYS_DIR, "readOnly": True}]
    assert pod["volumes"] == [{"name": "api-keys", "secret": {"secretName": "llm-key",
                                                              "items": [{"key": "token", "path": "keys"}]}}]
    assert "env" not in kids()[("Deployment", "llm-gateway")]["spec"]["template"]["spec"]["containers"][0]


def test_gateway_timeouts_and_limits_are_spec_fields():
    def args(spec=None):
        return k_args(kids(spec))

    def k_args(k):
        return k[("Deployment", "llm-gateway")]["spec"]["template"]["spec"]["containers"][0]["args"]

    default = args()
    # a non-streaming generation may take an hour by default; silence between stream chunks ten minutes
    assert default[default.index("--response-timeout") + 1] == "3600"
    assert default[default.index("--read-timeout") + 1] == "600"
    a = args({"gateway": {"responseTimeoutSeconds": 7200, "readTimeoutSeconds": 120, "maxBodyBytes": 1048576,
                          "maxPending": 100}})
    assert [a[a.index(f) + 1] for f in ("--response-timeout", "--read-timeout", "--max-body-bytes", "--max-pending")
            ] == ["7200", "120", "1048576", "100"]
    with pytest.raises(api.SpecError) as e:
        kids({"gateway": {"responseTimeoutSeconds": 0}})
    assert e.value.field == "spec.gateway.responseTimeoutSeconds"


def test_gateway_memory_is_sized_from_its_bounds():
    """The old 256Mi limit could not hold the prefix index at its cap plus 4,096 pending requests' bodies: the
    gateway bounds the bodies it holds (maxBufferedBytes) and its memory is the sum of its bounds."""
    def memory(spec=None):
        c = kids(spec)[("Deployment", "llm-gateway")]["spec"]["template"]["spec"]["containers"][0]
        assert c["resources"]["requests"]["memory"] == c["resources"]["limits"]["memory"]
        return c["resources"]["limits"]["memory"], c["args"]

    limit, args = memory()
    mib = int(limit.removesuffix("Mi"))
    bodies = int(args[args.index("--max-buffered-bytes") + 1])
    pending = int(args[args.index("--max-pending") + 1])
    assert bodies == 128 * 2**20 and pending == 4096
    assert mib * 2**20 >= bodies + render.GATEWAY_INDEX_BYTES + render.GATEWAY_BASE_BYTES + pending * 16 * 1024
    bigger, _ = memory({"gateway": {"maxBufferedBytes": 1024 * 2**20}})
    assert int(bigger.removesuffix("Mi")) == mib + 1024 - 128
    assert memory({"gateway": {"resources": {"memory": "2Gi"}}})[0] == "2Gi"  # the user's word wins
    with pytest.raises(api.SpecError) as e:
        kids({"gateway": {"maxBodyBytes": 2**20, "maxBufferedBytes": 2**19}})
    assert e.value.field == "spec.gateway.maxBufferedBytes"


def test_the_gateways_metrics_listener_is_left_out_of_a_mesh():
    """The gateways serve /metrics on a listener of their own (and nothing else there), which Istio's sidecar
    leaves out of its mTLS, so the operator's autoscaler — outside the mesh — reads the load of mesh-only engines
    from them; the Service lists the port so that its EndpointSlices carry it."""
    k = kids()
    pod = k[("Deployment", "llm-gateway")]["spec"]["template"]
    (c,) = pod["spec"]["containers"]
    assert c["args"][c["args"].index("--metrics-port") + 1] == "9090"
    assert {"name": "metrics", "containerPort": 9090, "protocol": "TCP"} in c["ports"]
    assert pod["metadata"]["annotations"] == {"traffic.sidecar.istio.io/excludeInboundPorts": "9090"}
    assert {"name": "metrics", "port": 9090, "targetPort": "metrics", "protocol": "TCP"} in \
        k[("Service", "llm")]["spec"]["ports"]
    plain = kids({"gateway": {"enabled": False}})
    assert [p["name"] for p in plain[("Service", "llm")]["spec"]["ports"]] == ["http"]


def test_engines_that_schedule_by_priority_get_the_gateways_priority_never_a_clients():
    from shoal.operator.gateway.cli import build_parser

    def gateway_args(spec):
        return kids(spec)[("Deployment", "llm-gateway")]["spec"]["template"]["spec"]["containers"][0]["args"]

    assert "--engine-priority" not in gateway_args(None)
    args = gateway_args({"engine": {"schedulingPolicy": "priority"}})
    assert build_parser().parse_args(args).engine_priority


@pytest.mark.parametrize("runtime", ["shoal", "vllm"])
def test_precise_prefix_makes_engines_publish_kv_events_to_their_gateway(runtime):
    import json

    model = {"uri": "hf://org/model"}
    k = kids({"runtime": runtime, "model": model, "gateway": {"routing": "precise-prefix"}})
    engine = k[("Deployment", "llm")]["spec"]["template"]["spec"]["containers"][0]
    argv = engine.get("command", []) + engine["args"]
    config = json.loads(argv[argv.index("--kv-events-config") + 1])  # vLLM's flag and JSON for both runtimes
    assert config == {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:5557",
                      "replay_endpoint": "tcp://*:5558", "topic": "kv@team-a/llm"}
    assert {"name": "kv-events", "containerPort": 5557, "protocol": "TCP"} in engine["ports"]
    assert {"name": "kv-replay", "containerPort": 5558, "protocol": "TCP"} in engine["ports"]
    # only this service's gateway pods may subscribe
    rule = next(r for r in k[("NetworkPolicy", "llm")]["spec"]["ingress"] if {"port": 5557, "protocol": "TCP"}
                in r.get("ports", []))
    assert rule["from"] == [{"podSelector": {"matchLabels": GATEWAY_PODS}}]
    args = k[("Deployment", "llm-gateway")]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--routing") + 1] == "precise-prefix"
    assert args[args.index("--kv-events-port") + 1] == "5557" and args[args.index("--kv-events-topic") + 1] == \
        "kv@team-a/llm"
    version = kubernetes_validate.latest_version()
    for obj in k.values():
        kubernetes_validate.validate(obj, version, strict=True)
    # other routings leave the engines as they were
    plain = kids({"runtime": runtime, "model": model})[("Deployment", "llm")]["spec"]["template"]["spec"]["containers"][0]
    assert "--kv-events-config" not in plain.get("command", []) + plain["args"]
    assert [p["name"] for p in plain["ports"]] == ["http"]
