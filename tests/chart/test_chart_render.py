"""The Helm chart rendered and linted by the real Helm engine (helm-python-sdk, in-process, offline), and every
rendered object validated against the official Kubernetes schemas."""

from __future__ import annotations

import importlib
import json

import helm_python as helm
import pytest
import yaml

from chartkit import (CHART_CRD_FILE, CHART_DIR, CRD_FILE, NAMESPACE, by_kind, kube_validate, one, pretty,
                      render)

DIGEST = "sha256:" + "ab" * 32

# name -> values: the defaults and the non-default shapes users pick.
CASES = {
    "defaults": None,
    "namespace-scope": {"rbac": {"scope": "namespace"}},
    "namespace-scope-many": {"rbac": {"scope": "namespace"},
                             "operator": {"watchNamespaces": ["team-a", "team-b"]}},
    "cluster-scope-some-namespaces": {"operator": {"watchNamespaces": ["team-a"]}},
    "service-monitor": {"metrics": {"scraperNamespace": "monitoring", "serviceMonitor": {
        "enabled": True, "namespace": "monitoring", "labels": {"release": "kube-prometheus-stack"},
        "interval": "15s", "scrapeTimeout": "5s"}}},
    "custom-image": {
        "image": {"repository": "registry.example.com/ml/shoal-operator", "digest": DIGEST, "pullPolicy": "Always"},
        "engineImage": {"repository": "registry.example.com/ml/shoal-engine", "tag": "0.1.0-cu13"},
        "imagePullSecrets": [{"name": "regcred"}],
        "operator": {"logFormat": "plain", "verbose": True, "extraArgs": ["--debug"], "maxGpusPerNode": 4,
                     "clusterDomain": "k8s.example.internal",
                     "extraEnv": [{"name": "TZ", "value": "UTC"}], "healthPort": 9090},
        "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"cpu": 1, "memory": "1Gi"}},
        "nodeSelector": {"kubernetes.io/os": "linux"},
        "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "ops", "effect": "NoSchedule"}],
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "kubernetes.io/arch", "operator": "In", "values": ["amd64"]}]}]}}},
        "priorityClassName": "system-cluster-critical",
        "podAnnotations": {"example.com/team": "ml"},
        "podLabels": {"team": "ml"},
        "serviceAccount": {"annotations": {"iam.example.com/role": "shoal"}},
    },
    "no-rbac-no-sa-no-dashboard": {"rbac": {"create": False}, "serviceAccount": {"create": False, "name": "ops"},
                                   "grafanaDashboard": {"enabled": False}},
    "full-name-override": {"fullnameOverride": "inference-operator"},
}


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request):
    values = CASES[request.param]
    return request.param, values, render(values)


def _container(objects):
    dep = one(objects, "Deployment")
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    return dep, container


# ---------------------------------------------------------------------------------------------- every case
def test_every_object_validates_against_kubernetes_schemas(case):
    name, _, objects = case
    assert objects
    for obj in objects:
        if obj["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # not a Kubernetes API: checked structurally in test_service_monitor
        if obj["apiVersion"] == "kopf.dev/v1":  # kopf's peering: a CRD of the chart's crds/ (test_high_avail...)
            assert obj["kind"] in PEERING_KINDS and set(obj) == {"apiVersion", "kind", "metadata"}
            continue
        kube_validate(obj)


def test_lint_is_clean(case):
    name, values, _ = case
    report = helm.lint(str(CHART_DIR), values, strict=True, namespace=NAMESPACE)
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert not report["errors"] and not problems, pretty(report)


def test_every_namespaced_object_has_a_namespace(case):
    _, _, objects = case
    cluster_scoped = {"ClusterRole", "ClusterRoleBinding", "Namespace", "CustomResourceDefinition",
                      "ClusterKopfPeering"}
    for obj in objects:
        if obj["kind"] not in cluster_scoped:
            assert obj["metadata"].get("namespace"), obj["metadata"]


def test_operator_pod_meets_the_restricted_pod_security_standard(case):
    _, _, objects = case
    dep, c = _container(objects)
    pod = dep["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] > 0
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    sc = c["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"] and not sc["capabilities"].get("add")
    assert sc["readOnlyRootFilesystem"] is True
    assert not sc.get("privileged")
    assert not pod.get("hostNetwork") and not pod.get("hostPID") and not pod.get("hostIPC")
    for vol in pod.get("volumes", []):
        assert set(vol) - {"name"} <= {"emptyDir", "configMap", "secret", "projected", "downwardAPI"}, vol
    # the read-only root filesystem leaves /tmp writable through an emptyDir
    assert {"name": "tmp", "mountPath": "/tmp"} in c["volumeMounts"]


def test_operator_runs_kopf_with_a_liveness_endpoint(case):
    _, values, objects = case
    dep, c = _container(objects)
    port = ((values or {}).get("operator") or {}).get("healthPort", 8080)
    if ((values or {}).get("highAvailability") or {}).get("enabled", True):
        assert dep["spec"]["replicas"] == 2 and "--standalone" not in c["args"]
        assert f"--peering={dep['metadata']['name']}" in c["args"] and "--peering-priority=auto" in c["args"]
    else:
        assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"] == {"type": "Recreate"}
        assert "--standalone" in c["args"]
    assert f"--liveness=http://0.0.0.0:{port}/healthz" in c["args"]
    assert c["ports"][0] == {"name": "health", "containerPort": port, "protocol": "TCP"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert "command" not in c  # the image's entrypoint is shoal-operator


def test_watched_namespaces_match_the_rbac(case):
    """The namespaces the operator watches (-n / -A) are exactly those its permissions cover."""
    _, values, objects = case
    values = values or {}
    _, c = _container(objects)
    watched = [a.split("=", 1)[1] for a in c["args"] if a.startswith("--namespace=")]
    scope = values.get("rbac", {}).get("scope", "cluster")
    if scope == "namespace":
        assert "--all-namespaces" not in c["args"]
        assert watched == (values.get("operator", {}).get("watchNamespaces") or [NAMESPACE])
    elif values.get("operator", {}).get("watchNamespaces"):
        assert watched == values["operator"]["watchNamespaces"] and "--all-namespaces" not in c["args"]
    else:
        assert watched == [] and "--all-namespaces" in c["args"]
    if not values.get("rbac", {}).get("create", True):
        assert not by_kind(objects, "ClusterRole") and not by_kind(objects, "Role")
        return
    if scope == "namespace":
        assert not by_kind(objects, "ClusterRole") and not by_kind(objects, "ClusterRoleBinding")
        assert sorted(r["metadata"]["namespace"] for r in by_kind(objects, "Role")) == sorted(watched)
        bindings = by_kind(objects, "RoleBinding")
        assert sorted(b["metadata"]["namespace"] for b in bindings) == sorted(watched)
    else:
        assert not by_kind(objects, "Role")
        bindings = [one(objects, "ClusterRoleBinding")]
    sa_name = c and one(objects, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"]
    for b in bindings:
        assert b["subjects"] == [{"kind": "ServiceAccount", "name": sa_name, "namespace": NAMESPACE}]
        assert b["roleRef"]["name"] == b["metadata"]["name"]


def test_shoal_operator_accepts_the_rendered_arguments(tmp_path):
    """The Deployment's arguments parse: shoal-operator's own flags, then kopf run's (click refuses unknown
    options before it looks at --help, so `ARGS --help` exits 0 only when every option is known)."""
    importlib.import_module("shoal.operator.handlers")
    import subprocess
    import sys

    for values in (None, CASES["custom-image"], CASES["namespace-scope-many"], CASES["service-monitor"]):
        _, c = _container(render(values))
        out = subprocess.run([sys.executable, "-m", "shoal.operator", *c["args"], "--help"], capture_output=True,
                             text=True, timeout=60, cwd=tmp_path, env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
        assert out.returncode == 0, out.stdout + out.stderr
        assert "Usage: shoal-operator run" in out.stdout, out.stdout


# ------------------------------------------------------------------------------------------------- RBAC
# What the operator may do, and nothing more: (apiGroup, resource) -> verbs.
EXPECTED_RULES = {
    ("serving.shoal.dev", "inferenceservices"): {"get", "list", "watch", "patch"},
    ("serving.shoal.dev", "inferenceservices/status"): {"patch"},
    ("serving.shoal.dev", "inferenceservices/finalizers"): {"update"},
    ("apps", "deployments"): {"list", "watch", "create", "patch", "delete"},
    ("apps", "statefulsets"): {"list", "watch", "create", "patch", "delete"},
    ("", "services"): {"list", "watch", "create", "patch", "delete"},
    ("", "configmaps"): {"list", "watch", "create", "patch", "delete"},
    ("", "persistentvolumeclaims"): {"list", "watch", "create", "patch", "delete"},
    ("networking.k8s.io", "networkpolicies"): {"list", "watch", "create", "patch", "delete"},
    ("policy", "poddisruptionbudgets"): {"list", "watch", "create", "patch", "delete"},
    ("", "pods"): {"list", "watch", "patch", "delete"},  # patch: the autoscaler's deletion costs
    ("discovery.k8s.io", "endpointslices"): {"list", "watch"},  # the autoscaler's scrape targets
    ("", "events"): {"list", "create", "patch"},
    # each InferenceService's gateway: its ServiceAccount + Role + RoleBinding, granting EndpointSlice reads
    ("", "serviceaccounts"): {"list", "watch", "create", "patch", "delete"},
    ("rbac.authorization.k8s.io", "roles"): {"list", "watch", "create", "patch", "delete"},
    ("rbac.authorization.k8s.io", "rolebindings"): {"list", "watch", "create", "patch", "delete"},
    # spec.inferencePool: the InferencePool and HTTPRoute for a Gateway running the inference extension
    ("inference.networking.k8s.io", "inferencepools"): {"list", "watch", "create", "patch", "delete"},
    ("gateway.networking.k8s.io", "httproutes"): {"list", "watch", "create", "patch", "delete"},
}
CLUSTER_ONLY_RULES = {
    ("apiextensions.k8s.io", "customresourcedefinitions"): {"list", "watch"},
}
NAMESPACE_RULES = {("", "namespaces"): {"list", "watch"}}  # only to resolve -n names cluster-wide
CLUSTER_PEERING_RULES = {("kopf.dev", "clusterkopfpeerings"): {"list", "watch", "patch"}}  # highAvailability
NAMESPACED_PEERING_RULES = {("kopf.dev", "kopfpeerings"): {"list", "watch", "patch"}}
PEERING_KINDS = {"ClusterKopfPeering", "KopfPeering"}


def flatten_rules(rules):
    out: dict[tuple[str, str], set[str]] = {}
    for rule in rules:
        assert not rule.get("resourceNames") and not rule.get("nonResourceURLs"), rule
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                out.setdefault((group, resource), set()).update(rule["verbs"])
    return out


@pytest.mark.parametrize("values", [None, {"operator": {"watchNamespaces": ["a"]}},
                                    {"highAvailability": {"enabled": False}}], ids=["all", "some", "single"])
def test_cluster_role_is_least_privilege(values):
    objects = render(values)
    rules = flatten_rules(one(objects, "ClusterRole")["rules"])
    ha = ((values or {}).get("highAvailability") or {}).get("enabled", True)
    some = bool(((values or {}).get("operator") or {}).get("watchNamespaces"))
    assert rules == {**EXPECTED_RULES, **CLUSTER_ONLY_RULES, **(NAMESPACE_RULES if some else {}),
                     **(CLUSTER_PEERING_RULES if ha else {})}
    for (group, resource), verbs in rules.items():
        assert "*" not in verbs and group != "*" and resource != "*"
        assert resource != "secrets"  # engine pods read API keys themselves; the operator never does


def test_rbac_matches_the_permissions_the_operator_declares():
    """operator/kube.py lists exactly what the handlers and kopf use; the chart grants exactly that."""
    kube = importlib.import_module("shoal.operator.kube")
    declared = {(group, resource): set(verbs) for group, resource, verbs in kube.PERMISSIONS}
    assert declared == {**EXPECTED_RULES, **CLUSTER_ONLY_RULES}
    for declared_rule, rules in ((kube.NAMESPACE_PERMISSIONS, NAMESPACE_RULES),
                                 (kube.CLUSTER_PEERING_PERMISSIONS, CLUSTER_PEERING_RULES),
                                 (kube.NAMESPACED_PEERING_PERMISSIONS, NAMESPACED_PEERING_RULES)):
        group, resource, verbs = declared_rule
        assert {(group, resource): set(verbs)} == rules
    assert {resource for _, resource in {**CLUSTER_ONLY_RULES, **NAMESPACE_RULES}} == set(kube.CLUSTER_SCOPED)


def test_namespaced_roles_grant_the_same_namespaced_rules():
    objects = render({"rbac": {"scope": "namespace"}, "operator": {"watchNamespaces": ["a", "b"]}})
    for role in by_kind(objects, "Role"):
        assert flatten_rules(role["rules"]) == {**EXPECTED_RULES, **NAMESPACED_PEERING_RULES}


def test_high_availability_peers_two_replicas():
    crdgen = importlib.import_module("shoal.operator.crdgen")
    peering_crds = {c["spec"]["names"]["kind"]: c for c in crdgen.build_peering_crds()}
    assert set(peering_crds) == PEERING_KINDS and all(
        (CHART_DIR / "crds" / crdgen.PEERING_FILENAME).read_text() == crdgen.render_peering_yaml() for _ in [0])
    objects = render()
    dep, _ = _container(objects)
    assert dep["spec"]["strategy"]["rollingUpdate"] == {"maxUnavailable": 0, "maxSurge": 1}
    (peering,) = by_kind(objects, "ClusterKopfPeering")
    assert peering["metadata"]["name"] == "shoal" and peering_crds["ClusterKopfPeering"]["spec"]["scope"] == "Cluster"
    pdb = one(objects, "PodDisruptionBudget")
    assert pdb["spec"]["minAvailable"] == 1 and pdb["spec"]["selector"] == dep["spec"]["selector"]
    # namespaced operators peer in every watched namespace
    objects = render({"rbac": {"scope": "namespace"}, "operator": {"watchNamespaces": ["a", "b"]}})
    assert sorted(p["metadata"]["namespace"] for p in by_kind(objects, "KopfPeering")) == ["a", "b"]
    assert not by_kind(objects, "ClusterKopfPeering")
    # off: one standalone process, no peering, no budget
    objects = render({"highAvailability": {"enabled": False}})
    assert not by_kind(objects, "ClusterKopfPeering") and not by_kind(objects, "PodDisruptionBudget")


# ------------------------------------------------------------------------------------------ specific values
def test_images_default_to_the_app_version():
    _, c = _container(render())
    app_version = yaml.safe_load((CHART_DIR / "Chart.yaml").read_text())["appVersion"]
    assert c["image"] == f"ghcr.io/shoal-dev/shoal-operator:{app_version}"
    assert f"--engine-image=ghcr.io/shoal-dev/shoal-engine:{app_version}" in c["args"]


def test_engine_image_default_matches_the_operators_own_default():
    render_mod = importlib.import_module("shoal.operator.render")
    _, c = _container(render())
    assert f"--engine-image={render_mod.DEFAULT_ENGINE_IMAGE}" in c["args"]


def test_custom_image_values_reach_the_deployment():
    objects = render(CASES["custom-image"])
    dep, c = _container(objects)
    pod = dep["spec"]["template"]["spec"]
    assert c["image"] == f"registry.example.com/ml/shoal-operator@{DIGEST}"
    assert c["imagePullPolicy"] == "Always"
    assert "--engine-image=registry.example.com/ml/shoal-engine:0.1.0-cu13" in c["args"]
    assert c["args"][-1] == "--debug" and "--verbose" in c["args"]
    assert "--max-gpus-per-node=4" in c["args"] and "--cluster-domain=k8s.example.internal" in c["args"]
    assert "--log-format=plain" in c["args"]
    assert {"name": "TZ", "value": "UTC"} in c["env"]
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]
    assert pod["nodeSelector"] == {"kubernetes.io/os": "linux"}
    assert pod["priorityClassName"] == "system-cluster-critical"
    assert pod["tolerations"][0]["key"] == "dedicated"
    assert c["resources"]["limits"] == {"cpu": 1, "memory": "1Gi"}
    assert dep["spec"]["template"]["metadata"]["labels"]["team"] == "ml"
    assert dep["spec"]["template"]["metadata"]["annotations"]["example.com/team"] == "ml"
    assert one(objects, "ServiceAccount")["metadata"]["annotations"] == {"iam.example.com/role": "shoal"}


def test_existing_service_account_is_used_when_not_created():
    objects = render(CASES["no-rbac-no-sa-no-dashboard"])
    assert not by_kind(objects, "ServiceAccount") and not by_kind(objects, "ConfigMap")
    assert one(objects, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"] == "ops"


def test_names_follow_the_release_and_overrides():
    assert one(render(), "Deployment")["metadata"]["name"] == "shoal"
    assert one(render(name="prod"), "Deployment")["metadata"]["name"] == "prod-shoal"
    objects = render(CASES["full-name-override"])
    assert {o["metadata"]["name"] for o in objects if o["kind"] != "ConfigMap"} == {"inference-operator"}


# ------------------------------------------------------------------------------------ monitoring & dashboard
def test_service_monitor_is_off_by_default():
    assert not [o for o in render() if o["kind"] == "ServiceMonitor"]


def test_service_monitor():
    values = CASES["service-monitor"]
    objects = render(values)
    sm = one(objects, "ServiceMonitor")
    # the engines' NetworkPolicies must let that Prometheus in
    assert "--metrics-namespace=monitoring" in _container(objects)[1]["args"]
    assert not [a for a in _container(render())[1]["args"] if a.startswith("--metrics-namespace")]
    # without an explicit scraper namespace, the ServiceMonitor's namespace is the scraper's
    sm_only = {"metrics": {"serviceMonitor": {"enabled": True, "namespace": "prom"}}}
    assert "--metrics-namespace=prom" in _container(render(sm_only))[1]["args"]
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert sm["metadata"]["namespace"] == "monitoring"
    assert sm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    spec = sm["spec"]
    assert set(spec) <= {"namespaceSelector", "selector", "endpoints", "targetLabels", "jobLabel"}
    assert spec["namespaceSelector"] == {"any": True}
    assert spec["selector"] == {"matchLabels": {"app.kubernetes.io/managed-by": "shoal-operator"},
                                "matchExpressions": [{"key": "app.kubernetes.io/component", "operator": "In",
                                                      "values": ["gateway", "engines"]}]}
    (ep,) = spec["endpoints"]
    assert ep == {"port": "http", "path": "/metrics", "scheme": "http", "interval": "15s",
                  "scrapeTimeout": "5s", "honorLabels": True}
    # namespaced operators: only their namespaces are scraped
    sm = one(render({**values, "rbac": {"scope": "namespace"}, "operator": {"watchNamespaces": ["a", "b"]}}),
             "ServiceMonitor")
    assert sm["spec"]["namespaceSelector"] == {"matchNames": ["a", "b"]}


def test_the_operators_autoscaler_metrics_are_served_and_scraped():
    """shoal-operator serves shoal:autoscaler_* on operator.metricsPort (what an HPA or KEDA reads with
    autoscalerClass external), and with the ServiceMonitor a PodMonitor scrapes exactly the operator's pods there."""
    dep, container = _container(render())
    assert "--metrics-port=9090" in container["args"]
    assert {"name": "metrics", "containerPort": 9090, "protocol": "TCP"} in container["ports"]
    assert not [o for o in render() if o["kind"] == "PodMonitor"]
    objects = render({**CASES["service-monitor"], "operator": {"metricsPort": 9191}})
    pm = one(objects, "PodMonitor")
    dep, container = _container(objects)
    assert pm["metadata"]["namespace"] == "monitoring" and pm["spec"]["namespaceSelector"] == {
        "matchNames": [NAMESPACE]}
    assert _selects(pm["spec"]["selector"], dep["spec"]["template"]["metadata"]["labels"])
    (ep,) = pm["spec"]["podMetricsEndpoints"]
    assert ep["port"] == "metrics" and ep["path"] == "/metrics"
    assert {"name": "metrics", "containerPort": 9191, "protocol": "TCP"} in container["ports"]
    assert "--metrics-port=9191" in container["args"]


def _selects(selector: dict, labels: dict) -> bool:
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for e in selector.get("matchExpressions", []):
        assert e["operator"] == "In", e
        if labels.get(e["key"]) not in e["values"]:
            return False
    return True


@pytest.mark.parametrize("gateway", [True, False])
def test_service_monitor_selects_the_metrics_services_the_operator_renders(gateway):
    """The ServiceMonitor's selector and port name must match what operator/render/ puts on the Services whose
    pods serve /metrics (the gateway's, the rank-0 engines'), and must not select the headless rank Services of
    multi-pod groups (workers serve no metrics)."""
    render_mod = importlib.import_module("shoal.operator.render")
    sm = one(render({"metrics": {"serviceMonitor": {"enabled": True}}}), "ServiceMonitor")
    port = sm["spec"]["endpoints"][0]["port"]
    isvc = {"apiVersion": "serving.shoal.dev/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": "big", "namespace": "ml", "uid": "u-1", "generation": 1},
            "spec": {"engine": {"tensorParallelSize": 8, "pipelineParallelSize": 2},
                     "resources": {"gpusPerPod": 8}, "replicas": 2, "gateway": {"enabled": gateway}}}
    services = [o for o in render_mod.render(isvc) if o["kind"] == "Service"]
    selected = [s for s in services if _selects(sm["spec"]["selector"], s["metadata"]["labels"])]
    assert sorted(s["metadata"]["name"] for s in selected) == (["big", "big-engines"] if gateway else ["big"])
    for s in selected:
        assert port in {p["name"] for p in s["spec"]["ports"]}


def test_grafana_dashboard_configmap():
    cm = one(render(), "ConfigMap")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["annotations"] == {"grafana_folder": "Shoal"}
    dashboard = json.loads(cm["data"]["shoal-engine.json"])
    assert dashboard["uid"] == "shoal-engine"
    assert json.loads((CHART_DIR / "dashboards" / "shoal-engine.json").read_text()) == dashboard
    cm = one(render({"grafanaDashboard": {"namespace": "grafana", "labels": {"dash": "yes"}, "folder": ""}}),
             "ConfigMap")
    assert cm["metadata"]["namespace"] == "grafana" and cm["metadata"]["labels"]["dash"] == "yes"
    assert "annotations" not in cm["metadata"]


# ------------------------------------------------------------------------------------------------------ CRD
def test_chart_ships_the_generated_crd():
    if not CHART_CRD_FILE.exists():
        pytest.skip("charts/shoal/crds/ is not generated yet (python -m shoal.operator.crdgen)")
    with helm.Chart.load(str(CHART_DIR)) as chart:
        crds = chart.crds
    assert sorted(c["filename"] for c in crds) == [f"shoal/crds/{CHART_CRD_FILE.name}",
                                                    "shoal/crds/kopfpeerings.kopf.dev.yaml"]
    crds = [c for c in crds if c["filename"].endswith(CHART_CRD_FILE.name)]
    assert CHART_CRD_FILE.read_text() == CRD_FILE.read_text()
    (doc,) = [d for d in yaml.safe_load_all(crds[0]["data"]) if d]
    kube_validate(doc)
    assert doc["metadata"]["name"] == "inferenceservices.serving.shoal.dev"
