"""render/: the per-InferenceService shoal-gateway (spec.gateway) and how it changes the engines' exposure."""

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


def test_the_gateway_watches_its_inferenceservice_for_declared_adapters_and_is_not_rolled_by_them():
    """The per-service gateway learns spec.adapters from the InferenceService itself (--inference-service), so
    adding an adapter changes nothing in its Deployment: no roll, and a request for the new adapter is held until
    an engine loads it (tests/gateway/test_gateway_declared_adapters.py)."""
    from shoal.operator.gateway.cli import build_parser, config_from_args

    lora = {"engine": {"enableLora": True}, "adapters": [{"name": "sql", "uri": "hf://org/sql-lora"}]}
    before = kids(lora)[("Deployment", "llm-gateway")]
    args = before["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--inference-service") + 1] == "llm"
    parsed = build_parser().parse_args(args)
    config_from_args(parsed)  # a combination the gateway accepts
    assert (parsed.service, parsed.namespace, parsed.inference_service) == ("llm-engines", "team-a", "llm")
    more = {**lora, "adapters": [*lora["adapters"], {"name": "chat-v2", "uri": "hf://org/chat-v2"}]}
    assert kids(more)[("Deployment", "llm-gateway")] == before


def test_service_points_at_the_gateway_and_the_gateway_at_ready_engines():
    k = kids()
    assert k[("Service", "llm")]["spec"]["selector"] == GATEWAY_PODS
    engines = k[("Service", "llm-engines")]["spec"]
    assert engines["clusterIP"] == "None" and not engines.get("publishNotReadyAddresses")  # Ready endpoints only
    assert engines["selector"] == {L_ISVC: "llm", L_COMPONENT: "engine"}
    assert engines["ports"][0]["name"] == "http"
    multi = kids({"engine": {"tensorParallelSize": 8, "pipelineParallelSize": 2}, "resources": {"gpusPerPod": 8}})
    assert multi[("Service", "llm-engines")]["spec"]["selector"][L_POD_INDEX] == "0"  # rank 0 serves the API


def test_gateway_may_read_endpointslices_and_its_own_inferenceservice_and_nothing_else():
    k = kids()
    assert k[("Role", "llm-gateway")]["rules"] == [
        {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["list", "watch"]},
        # spec.adapters, read by name (a field selector on metadata.name): no other InferenceService
        {"apiGroups": ["serving.shoal.dev"], "resources": ["inferenceservices"], "resourceNames": ["llm"],
         "verbs": ["get", "list", "watch"]}]
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
    assert k[("Role", "llm-gateway")]["rules"][2:] == [{"apiGroups": [""], "resources": ["configmaps"],
                                                        "resourceNames": ["llm-wake"], "verbs": ["patch"]}]
    wake = k[("ConfigMap", "llm-wake")]
    assert wake["metadata"]["ownerReferences"][0]["name"] == "llm"
    assert wake["metadata"]["labels"]["app.kubernetes.io/component"] == "wake"
    assert not any(r["apiGroups"] == ["serving.shoal.dev"] and set(r["verbs"]) - {"get", "list", "watch"}
                   for r in k[("Role", "llm-gateway")]["rules"])  # it reads its spec, never writes it
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


TRACING = {"endpoint": "http://otel-collector.observability:4318/", "samplingRatio": 0.25,
           "headersSecretRef": {"name": "otel-auth"}}


def otel(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", []) if e["name"].startswith("OTEL_")}


def test_tracing_renders_the_standard_otel_variables_into_engines_and_gateway():
    """spec.tracing (issue 34): the same OTEL_* variables in the engine and the gateway containers, so one trace
    spans both (a parent-based ratio follows the gateway's decision at the engine); nothing when unset."""
    k = kids({"tracing": TRACING, "env": [{"name": "OTEL_TRACES_SAMPLER_ARG", "value": "1.0"}]})
    engine = k[("Deployment", "llm")]["spec"]["template"]["spec"]["containers"][0]
    gateway = k[("Deployment", "llm-gateway")]["spec"]["template"]["spec"]["containers"][0]
    want = {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://otel-collector.observability:4318/v1/traces",
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
            "OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.25",
            "OTEL_RESOURCE_ATTRIBUTES": "k8s.namespace.name=team-a,shoal.inferenceservice=llm"}
    headers = {"secretKeyRef": {"name": "otel-auth", "key": "headers"}}
    assert {n: e.get("value") for n, e in otel(gateway).items() if "value" in e} == want
    assert otel(gateway)["OTEL_EXPORTER_OTLP_TRACES_HEADERS"]["valueFrom"] == headers
    # the engine: the same, except what the user's spec.env sets itself (given once, the user's value)
    assert [e["value"] for e in engine["env"] if e["name"] == "OTEL_TRACES_SAMPLER_ARG"] == ["1.0"]
    assert {n: e.get("value") for n, e in otel(engine).items() if "value" in e} == {
        **want, "OTEL_TRACES_SAMPLER_ARG": "1.0"}
    assert otel(engine)["OTEL_EXPORTER_OTLP_TRACES_HEADERS"]["valueFrom"] == headers
    assert "--otlp-traces-endpoint" not in engine["args"]  # Shoal's engine turns tracing on from the env
    version = kubernetes_validate.latest_version()
    for obj in (k[("Deployment", "llm")], k[("Deployment", "llm-gateway")]):
        kubernetes_validate.validate(obj, version, strict=True)
    # off: no OTEL_* anywhere
    k = kids()
    assert not otel(k[("Deployment", "llm")]["spec"]["template"]["spec"]["containers"][0])
    assert not otel(k[("Deployment", "llm-gateway")]["spec"]["template"]["spec"]["containers"][0])


def test_tracing_on_vllm_sets_its_flag_and_a_runtime_without_tracing_is_refused():
    k = kids({"runtime": "vllm", "model": {"uri": "hf://org/m"}, "tracing": {"endpoint": "https://otel:4318"}})
    engine = k[("Deployment", "llm")]["spec"]["template"]["spec"]["containers"][0]
    args = engine["args"] if "args" in engine else engine["command"]
    assert args[args.index("--otlp-traces-endpoint") + 1] == "https://otel:4318/v1/traces"
    assert otel(engine)["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"]["value"] == "http/protobuf"  # vLLM defaults to gRPC
    with pytest.raises(api.SpecError) as e:
        render.render(isvc({"runtime": "sglang", "model": {"uri": "hf://org/m"},
                            "tracing": {"endpoint": "http://otel:4318"}}), SETTINGS)
    assert e.value.field == "spec.tracing"


@pytest.mark.parametrize("tracing, field", [
    ({"endpoint": "otel:4318"}, "spec.tracing.endpoint"),
    ({"endpoint": "http://otel:4318", "samplingRatio": 1.5}, "spec.tracing.samplingRatio"),
    ({"samplingRatio": 0.5}, "spec.tracing.endpoint"),
])
def test_bad_tracing_names_the_field(tracing, field):
    with pytest.raises(api.SpecError) as e:
        render.render(isvc({"tracing": tracing}), SETTINGS)
    assert e.value.field == field


def test_gateway_batches_get_a_claim_of_the_service_mounted_at_the_batch_dir(tmp_path):
    from shoal.operator.gateway.cli import build_parser, config_from_args

    plain = kids()
    assert not any(kind == "PersistentVolumeClaim" for kind, _ in plain)
    k = kids({"gateway": {"batches": {"enabled": True, "size": "50Gi", "storageClassName": "nfs"}},
              "security": {"apiKeySecretRef": {"name": "keys"}}})
    claim = k[("PersistentVolumeClaim", "llm-gateway-batches")]
    assert claim["spec"] == {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "50Gi"}},
                             "storageClassName": "nfs"}
    # owned by the InferenceService (goes with it), not by the gateway's Deployment (survives its rolls)
    assert [(o["kind"], o["name"]) for o in claim["metadata"]["ownerReferences"]] == [("InferenceService", "llm")]
    pod = k[("Deployment", "llm-gateway")]["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert {"name": "batches", "persistentVolumeClaim": {"claimName": "llm-gateway-batches"}} in pod["volumes"]
    assert {"name": "batches", "mountPath": render.GATEWAY_BATCH_DIR} in c["volumeMounts"]
    assert any(m["name"] == "api-keys" for m in c["volumeMounts"])  # beside the engines' keys
    assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsGroup"]
    # memory for a running batch's requests (~3x its input file) and a file being checked, beyond the default 514Mi
    assert c["resources"]["limits"]["memory"] == "1314Mi"
    args = c["args"]
    assert args[args.index("--batch-dir") + 1] == render.GATEWAY_BATCH_DIR
    # the gateway's own CLI takes the rendered flags (the batch dir redirected to one this test can write)
    args[args.index("--batch-dir") + 1] = str(tmp_path)
    (tmp_path / "keys").write_text("k\n")
    args[args.index("--api-key-file") + 1] = str(tmp_path / "keys")
    config = config_from_args(build_parser().parse_args(args))
    assert config.batch_dir == str(tmp_path) and config.batch_share == "idle"
    # an existing claim is mounted, never created
    k = kids({"gateway": {"batches": {"enabled": True, "existingClaim": "shared-batches"}}})
    assert not any(kind == "PersistentVolumeClaim" for kind, _ in k)
    pod = k[("Deployment", "llm-gateway")]["spec"]["template"]["spec"]
    assert {"name": "batches", "persistentVolumeClaim": {"claimName": "shared-batches"}} in pod["volumes"]
    # turning batches on or off leaves the default Deployment as it was otherwise
    assert "fsGroup" not in plain[("Deployment", "llm-gateway")]["spec"]["template"]["spec"]["securityContext"]
    version = kubernetes_validate.latest_version()
    for obj in kids({"gateway": {"batches": {"enabled": True}}}).values():
        if obj["kind"] in ("PersistentVolumeClaim", "Deployment"):
            kubernetes_validate.validate(obj, version, strict=True)


@pytest.mark.parametrize("batches, field", [
    ({"enabled": True, "accessMode": "ReadWriteOnce"}, "spec.gateway.batches.accessMode"),
    ({"enabled": True, "accessMode": "ReadWriteOncePod"}, "spec.gateway.batches.accessMode"),
    ({"enabled": True, "size": "lots"}, "spec.gateway.batches.size"),
    ({"enabled": True, "existingClaim": "Not_A_Name"}, "spec.gateway.batches.existingClaim"),
    ({"enabled": "yes"}, "spec.gateway.batches.enabled"),
])
def test_bad_gateway_batches_name_the_field(batches, field):
    with pytest.raises(api.SpecError) as e:
        render.render(isvc({"gateway": {"batches": batches}}), SETTINGS)
    assert e.value.field == field
    if batches.get("accessMode") == "ReadWriteOnce":
        assert "gateway.replicas is 2" in e.value.message and "ReadWriteMany" in e.value.message
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
    assert [p["name"] for p in k[("Service", "llm-engines")]["spec"]["ports"]] == ["http", "kv-events", "kv-replay"]
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


@pytest.mark.parametrize("own_gateway", [True, False], ids=["own-gateway", "no-own-gateway"])
def test_a_precise_shared_gateway_has_every_services_engines_publish_and_may_subscribe(own_gateway):
    """shoal-operator --shared-gateway-routing precise-prefix (the chart's sharedGateway.routing): every service's
    engines publish KV events whatever its own gateway routes, the Service the shared gateway discovers them through
    names the ports (its EndpointSlices say which engines publish), and the NetworkPolicy lets the shared
    gateway's pods, not the service's own gateway, read them."""
    import dataclasses
    import json

    shared = dataclasses.replace(SETTINGS, shared_gateway="shoal-system/shoal-gateway",
                                 shared_gateway_routing="precise-prefix")
    spec = {"gateway": {"enabled": own_gateway}}
    k = {(c["kind"], c["metadata"]["name"]): c for c in render.render(isvc(spec), shared)}
    engine = k[("Deployment", "llm")]["spec"]["template"]["spec"]["containers"][0]
    config = json.loads(engine["args"][engine["args"].index("--kv-events-config") + 1])
    assert config["topic"] == "kv@team-a/llm"
    assert {"name": "kv-events", "containerPort": 5557, "protocol": "TCP"} in engine["ports"]
    discovered = k[("Service", "llm-engines" if own_gateway else "llm")]
    assert {"name": "kv-events", "port": 5557, "targetPort": "kv-events", "protocol": "TCP"} in \
        discovered["spec"]["ports"]
    assert {"name": "kv-replay", "port": 5558, "targetPort": "kv-replay", "protocol": "TCP"} in \
        discovered["spec"]["ports"]
    if own_gateway:  # the Service clients use selects the gateway pods: no engine port there
        assert [p["name"] for p in k[("Service", "llm")]["spec"]["ports"]] == ["http", "metrics"]
    (rule,) = [r for r in k[("NetworkPolicy", "llm")]["spec"]["ingress"]
               if {"port": 5557, "protocol": "TCP"} in r.get("ports", [])]
    assert rule["from"] == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "shoal-system"}},
                             "podSelector": {"matchLabels": {L_COMPONENT: "shared-gateway"}}}]
    if own_gateway:  # its own gateway routes prefix-load: it gets no KV-events flags
        args = k[("Deployment", "llm-gateway")]["spec"]["template"]["spec"]["containers"][0]["args"]
        assert "--kv-events-port" not in args and args[args.index("--routing") + 1] == "prefix-load"
    version = kubernetes_validate.latest_version()
    for obj in k.values():
        kubernetes_validate.validate(obj, version, strict=True)
    # a shared gateway that routes otherwise (or none) leaves the engines as they were
    for settings in (dataclasses.replace(shared, shared_gateway_routing="prefix-load"),
                     dataclasses.replace(SETTINGS, shared_gateway_routing="precise-prefix")):
        plain = {(c["kind"], c["metadata"]["name"]): c for c in render.render(isvc(spec), settings)}
        container = plain[("Deployment", "llm")]["spec"]["template"]["spec"]["containers"][0]
        assert "--kv-events-config" not in container["args"] and [p["name"] for p in container["ports"]] == ["http"]
        assert [p["name"] for p in plain[("Service", "llm-engines" if own_gateway else "llm")]["spec"]["ports"]] \
            in (["http"], ["http", "metrics"])
