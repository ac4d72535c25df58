"""The chart's shared gateway (sharedGateway.enabled): one OpenAI endpoint for every InferenceService, rendered by
the real Helm engine, validated against the Kubernetes schemas, least privilege, and wired to the operator."""

from __future__ import annotations

import importlib
import subprocess
import sys

import helm_python as helm
import pytest

from chartkit import CHART_DIR, NAMESPACE, by_kind, kube_validate, pretty, render

SHARED = {"sharedGateway": {"enabled": True, "tenantKeysSecret": "tenants", "engineKeysSecret": "engine-keys",
                            "tenantHeader": "x-gateway-inference-fairness-id", "trustedProxies": ["10.8.0.0/16"],
                            "maxInflightPerEngine": 8, "namespaceMaxPriority": {"prod": 100},
                            "tenantQuotas": {"requestsPerMinute": 600, "tokensPerMinute": 100000,
                                             "maxConcurrent": 16}}}
ONE_NAMESPACE = {"sharedGateway": {"enabled": True, "namespace": "models", "service": {"type": "LoadBalancer"},
                                   "tenantKeysSecret": "tenants"}}


def gateway_objects(values):
    return [o for o in render(values) if o["metadata"].get("labels", {}).get("app.kubernetes.io/component")
            == "shared-gateway"]


def test_off_by_default():
    assert not gateway_objects(None)


@pytest.mark.parametrize("values", [SHARED, ONE_NAMESPACE], ids=["cluster", "namespace"])
def test_the_shared_gateway_renders_valid_least_privilege_objects(values):
    objects = gateway_objects(values)
    assert sorted(o["kind"] for o in objects) == sorted(
        ["ServiceAccount", "Deployment", "Service", "PodDisruptionBudget", "NetworkPolicy",
         *(["Role", "RoleBinding"] if values is ONE_NAMESPACE else ["ClusterRole", "ClusterRoleBinding"])])
    for obj in objects:
        kube_validate(obj)
    report = helm.lint(str(CHART_DIR), values, strict=True, namespace=NAMESPACE)
    assert not report["errors"] and not [m for m in report["messages"] if m["severity"] >= 2], pretty(report)
    (role,) = [o for o in objects if o["kind"].endswith("Role")]
    # it reads InferenceServices and EndpointSlices; waking a service is granted per service by the operator
    assert role["rules"] == [
        {"apiGroups": ["serving.shoal.dev"], "resources": ["inferenceservices"], "verbs": ["list", "watch"]},
        {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["list", "watch"]},
        {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]}]
    if values is ONE_NAMESPACE:
        assert role["metadata"]["namespace"] == "models"
    (dep,) = by_kind(objects, "Deployment")
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["command"] == ["shoal-gateway"] and c["securityContext"]["readOnlyRootFilesystem"] is True
    assert ("--namespace=models" if values is ONE_NAMESPACE else "--all-namespaces") in c["args"]
    (svc,) = by_kind(objects, "Service")
    assert svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]
    # the operator's --shared-gateway names this ServiceAccount, whose pods every engine NetworkPolicy admits
    operator = [o for o in render(values) if o["kind"] == "Deployment" and o is not dep
                and o["metadata"]["name"] != dep["metadata"]["name"]][0]
    (op,) = operator["spec"]["template"]["spec"]["containers"]
    assert f"--shared-gateway={NAMESPACE}/{pod['serviceAccountName']}" in op["args"]
    render_mod = importlib.import_module("shoal.operator.render")
    assert dep["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"] == \
        render_mod.SHARED_GATEWAY_COMPONENT


def test_tenant_and_engine_keys_are_mounted_secrets_and_the_arguments_parse():
    (dep,) = by_kind(gateway_objects(SHARED), "Deployment")
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert {v["name"]: v["secret"]["secretName"] for v in pod["volumes"]} == {"tenant-keys": "tenants",
                                                                             "engine-keys": "engine-keys"}
    assert "--tenant-keys=/etc/shoal/tenant-keys" in c["args"] and "--engine-keys=/etc/shoal/engine-keys" in c["args"]
    cli = importlib.import_module("shoal.operator.gateway.cli")
    args = cli.build_parser().parse_args(c["args"])
    assert cli.shared_mode(args) and args.all_namespaces and args.max_inflight_per_engine == 8
    assert args.tenant_header == "x-gateway-inference-fairness-id"
    config = cli.config_from_args(cli.build_parser().parse_args(
        [a for a in c["args"] if not a.startswith(("--tenant-keys", "--engine-keys"))]))  # no Secret mounted here
    assert config.max_priority == 0 and config.namespace_max_priority == {"prod": 100}  # bounded by default
    assert (config.quotas.requests_per_minute, config.quotas.tokens_per_minute, config.quotas.max_concurrent) == (
        600, 100000, 16)


def test_the_operator_accepts_the_shared_gateway_flag(tmp_path):
    importlib.import_module("shoal.operator.handlers")
    operator = [o for o in render(SHARED) if o["kind"] == "Deployment"
                and o["metadata"]["labels"]["app.kubernetes.io/component"] == "operator"][0]
    (c,) = operator["spec"]["template"]["spec"]["containers"]
    out = subprocess.run([sys.executable, "-m", "shoal.operator", *c["args"], "--help"], capture_output=True,
                         text=True, timeout=60, cwd=tmp_path, env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert out.returncode == 0, out.stdout + out.stderr
    bad = subprocess.run([sys.executable, "-m", "shoal.operator", "--shared-gateway", "nope", "--help"],
                         capture_output=True, text=True, timeout=60, cwd=tmp_path,
                         env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert bad.returncode != 0 and "NAMESPACE/SERVICEACCOUNT" in bad.stderr
    bad = subprocess.run([sys.executable, "-m", "shoal.operator", "--shared-gateway", "a/b",
                          "--shared-gateway-routing", "exact", "--help"], capture_output=True, text=True, timeout=60,
                         cwd=tmp_path, env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert bad.returncode != 0 and "--shared-gateway-routing takes prefix-load, precise-prefix" in bad.stderr


def test_a_precise_shared_gateway_tells_the_operator_so_and_its_arguments_parse(monkeypatch):
    """sharedGateway.routing: precise-prefix reaches both: the gateway's --routing, and the operator's
    --shared-gateway-routing, which has every service's engines publish KV events to it (docs/gateway.md)."""
    values = {"sharedGateway": {**SHARED["sharedGateway"], "routing": "precise-prefix"}}
    (dep,) = by_kind(gateway_objects(values), "Deployment")
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    cli = importlib.import_module("shoal.operator.gateway.cli")
    config = cli.config_from_args(cli.build_parser().parse_args(
        [a for a in c["args"] if not a.startswith(("--tenant-keys", "--engine-keys"))]))
    assert config.routing == "precise-prefix"
    operator = [o for o in render(values) if o["kind"] == "Deployment"
                and o["metadata"]["labels"]["app.kubernetes.io/component"] == "operator"][0]
    (op,) = operator["spec"]["template"]["spec"]["containers"]
    assert "--shared-gateway-routing=precise-prefix" in op["args"]
    main = importlib.import_module("shoal.operator.__main__")
    env, _ = main.parse(op["args"])
    assert env["SHOAL_SHARED_GATEWAY_ROUTING"] == "precise-prefix"
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    settings = importlib.import_module("shoal.operator.handlers").settings_from_env()
    containers = importlib.import_module("shoal.operator.render.containers")
    assert containers.shared_gateway_precise(settings)  # what the engines then render: tests/operator


@pytest.mark.parametrize("values, message", [
    ({}, "set tenantKeysSecret"),
    ({"engineKeysSecret": "engine-keys"}, "set tenantKeysSecret"),  # the engines' keys handed to anyone
    ({"tenantHeader": "x-tenant"}, "needs sharedGateway.trustedProxies"),
])
def test_the_default_is_safe_an_anonymous_gateway_is_refused(values, message):
    with pytest.raises(helm.HelmError) as exc:
        render({"sharedGateway": {"enabled": True, **values}})
    assert message in str(exc.value), str(exc.value)


def test_only_the_named_peers_reach_the_gateway_and_an_unsafe_opt_out_says_so():
    cli = importlib.import_module("shoal.operator.gateway.cli")
    objects = gateway_objects(SHARED)
    (policy,) = by_kind(objects, "NetworkPolicy")
    (dep,) = by_kind(objects, "Deployment")
    assert policy["spec"]["podSelector"]["matchLabels"] == dep["spec"]["selector"]["matchLabels"]
    # a tenant header is believed from the trusted proxies only: nobody else reaches the port
    assert policy["spec"]["ingress"] == [{"ports": [{"port": "http", "protocol": "TCP"}],
                                          "from": [{"ipBlock": {"cidr": "10.8.0.0/16"}}]}]
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    assert cli.build_parser().parse_args(c["args"]).trusted_proxies == "10.8.0.0/16"
    (policy,) = by_kind(gateway_objects(ONE_NAMESPACE), "NetworkPolicy")
    assert policy["spec"]["ingress"][0]["from"] == [{"namespaceSelector": {}}]  # the cluster's pods, not outside
    unsafe = gateway_objects({"sharedGateway": {"enabled": True, "allowUnauthenticated": True}})
    (dep,) = by_kind(unsafe, "Deployment")
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    args = cli.build_parser().parse_args(c["args"])
    assert args.allow_unauthenticated and cli.config_from_args(args).tenant_keys is None
    for obj in unsafe:
        kube_validate(obj)


def test_tracing_values_become_the_otel_variables_the_gateway_and_its_sdk_read(monkeypatch):
    """sharedGateway.tracing (issue 34): off (no OTEL_* at all) by default; set, the standard variables that turn the
    gateway's tracing on and that OpenTelemetry's SDK reads as a parent-based ratio sampler and the OTLP exporter."""
    tracing = importlib.import_module("shoal.operator.gateway.tracing")
    sampling = importlib.import_module("opentelemetry.sdk.trace.sampling")
    exporter = importlib.import_module("opentelemetry.exporter.otlp.proto.http.trace_exporter")
    (dep,) = by_kind(gateway_objects(SHARED), "Deployment")
    assert not dep["spec"]["template"]["spec"]["containers"][0].get("env")
    values = {"sharedGateway": {**SHARED["sharedGateway"], "tracing": {
        "endpoint": "http://otel-collector.observability:4318/", "samplingRatio": 0.25,
        "headersSecret": {"name": "otel-auth"}}}}
    objects = gateway_objects(values)
    for obj in objects:
        kube_validate(obj)
    (dep,) = by_kind(objects, "Deployment")
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert [e["valueFrom"] for e in c["env"] if e["name"] == "OTEL_EXPORTER_OTLP_TRACES_HEADERS"] == [
        {"secretKeyRef": {"name": "otel-auth", "key": "headers"}}]
    for name in list(__import__("os").environ):
        if name.startswith("OTEL_"):
            monkeypatch.delenv(name)
    for name, value in env.items():
        if value is not None:
            monkeypatch.setenv(name, value)
    assert tracing.tracing_configured()
    sampler = sampling._get_from_env_or_default()
    assert isinstance(sampler, sampling.ParentBased) and "TraceIdRatioBased{0.25}" in sampler.get_description()
    assert exporter.OTLPSpanExporter()._endpoint == "http://otel-collector.observability:4318/v1/traces"
    with pytest.raises(helm.HelmError):  # not a URL: the values schema refuses it
        render({"sharedGateway": {**SHARED["sharedGateway"], "tracing": {"endpoint": "otel:4318"}}})
def test_batches_get_a_kept_volume_every_replica_mounts_and_the_flags_parse():
    cli = importlib.import_module("shoal.operator.gateway.cli")
    values = {"sharedGateway": {**ONE_NAMESPACE["sharedGateway"],
                                "batches": {"enabled": True, "storageClassName": "nfs", "size": "50Gi",
                                            "maxInflightPerEngine": 3}}}
    objects = gateway_objects(values)
    for obj in objects:
        kube_validate(obj)
    report = helm.lint(str(CHART_DIR), values, strict=True, namespace=NAMESPACE)
    assert not report["errors"] and not [m for m in report["messages"] if m["severity"] >= 2], pretty(report)
    (pvc,) = by_kind(objects, "PersistentVolumeClaim")
    assert pvc["spec"] == {"accessModes": ["ReadWriteMany"], "storageClassName": "nfs",
                           "resources": {"requests": {"storage": "50Gi"}}}
    assert pvc["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"  # users' results outlive the release
    (dep,) = by_kind(objects, "Deployment")
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert {"name": "batches", "persistentVolumeClaim": {"claimName": pvc["metadata"]["name"]}} in pod["volumes"]
    assert {"name": "batches", "mountPath": "/var/lib/shoal/batches"} in c["volumeMounts"]
    assert pod["securityContext"]["fsGroup"] == 65532
    args = cli.build_parser().parse_args(c["args"])
    assert (args.batch_dir, args.batch_max_inflight_per_engine) == ("/var/lib/shoal/batches", 3)
    # an existing claim is mounted as it is; no volume without batches
    values["sharedGateway"]["batches"]["existingClaim"] = "mine"
    objects = gateway_objects(values)
    assert not by_kind(objects, "PersistentVolumeClaim")
    (dep,) = by_kind(objects, "Deployment")
    assert {"name": "batches", "persistentVolumeClaim": {"claimName": "mine"}} in dep["spec"]["template"]["spec"][
        "volumes"]
    (dep,) = by_kind(gateway_objects(ONE_NAMESPACE), "Deployment")
    assert not any(a.startswith("--batch") for a in dep["spec"]["template"]["spec"]["containers"][0]["args"])


def test_a_volume_only_one_pod_can_mount_needs_one_replica():
    values = {"sharedGateway": {**ONE_NAMESPACE["sharedGateway"],
                                "batches": {"enabled": True, "accessMode": "ReadWriteOnce"}}}
    with pytest.raises(helm.HelmError) as exc:
        render(values)
    assert "set sharedGateway.replicas: 1" in str(exc.value)
    values["sharedGateway"]["replicas"] = 1
    assert by_kind(gateway_objects(values), "PersistentVolumeClaim")[0]["spec"]["accessModes"] == ["ReadWriteOnce"]


# Where the chart's default differs from the flag's, and why; any other default must agree.
CHART_DEFAULTS = {
    # a pod's in-flight streams get ten minutes on a rollout, not the CLI's 30 s (terminationGracePeriodSeconds)
    "shutdown-timeout": (600, 30.0),
}


def test_the_charts_generated_gateway_flags_and_schema_are_fresh():
    """templates/_gateway_flags.tpl and values.schema.json's sharedGateway entries are generated from the gateway
    options' declarations (python -m shoal.operator.chartgen); the committed ones are what it writes now."""
    chartgen = importlib.import_module("shoal.operator.chartgen")
    assert chartgen.FLAGS_TEMPLATE.read_text() == chartgen.render_template(), "run python -m shoal.operator.chartgen"
    assert chartgen.SCHEMA.read_text() == chartgen.schema_text(), "run python -m shoal.operator.chartgen"
    assert chartgen.main(["--check"]) == 0


def test_every_value_the_chart_sets_reaches_the_running_gateway():
    """The chart's sharedGateway values, rendered by the real Helm engine into the container's args, parse into
    the GatewayConfig they name: not the defaults (so no value is dropped on the way), and every declared chart
    value among them."""
    chartgen = importlib.import_module("shoal.operator.chartgen")
    cli = importlib.import_module("shoal.operator.gateway.cli")
    values = {"sharedGateway": {**SHARED["sharedGateway"], "routing": "least-load", "maxQueued": 77,
                                "queueTimeoutSeconds": 9.5, "maxPending": 99, "maxPriority": 5,
                                "shutdownTimeoutSeconds": 45, "allowUnauthenticated": True,
                                "batches": {"enabled": True, "maxInflightPerEngine": 3}}}
    (dep,) = by_kind(gateway_objects(values), "Deployment")
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    rendered = {a.split("=", 1)[0] for a in args}
    assert {d.flag for d, _ in chartgen.chart_values()} <= rendered
    parsed = cli.build_parser().parse_args([a for a in args if not a.startswith(("--tenant-keys", "--engine-keys",
                                                                                   "--batch-dir"))])
    config = cli.config_from_args(parsed)
    assert (config.routing, config.max_queued, config.queue_timeout, config.max_pending) == ("least-load", 77, 9.5, 99)
    assert (config.max_priority, config.namespace_max_priority, config.max_inflight) == (5, {"prod": 100}, 8)
    assert (config.quotas.requests_per_minute, config.quotas.tokens_per_minute, config.quotas.max_concurrent) == \
        (600, 100000, 16)
    assert config.tenant_header == "x-gateway-inference-fairness-id" and config.allow_unauthenticated
    assert [str(n) for n in config.trusted_proxies] == ["10.8.0.0/16"] and config.batch_per_engine == 3
    assert parsed.shutdown_timeout == 45


def test_the_charts_gateway_values_agree_with_the_gateways_own_options():
    """Each chart value the shared gateway's template turns into a shoal-gateway flag: its default parses and is
    the flag's, its schema's choices are the flag's (or fewer, as declared), and its schema's bounds are what the
    flag accepts (a value the schema lets through is never one the gateway refuses at start, and the reverse)."""
    import argparse
    import json

    import yaml

    chartgen = importlib.import_module("shoal.operator.chartgen")
    cli = importlib.import_module("shoal.operator.gateway.cli")
    parser = cli.build_parser()
    actions = {o: a for a in parser._actions for o in a.option_strings}
    schema = json.loads((CHART_DIR / "values.schema.json").read_text())["properties"]["sharedGateway"]
    values = yaml.safe_load((CHART_DIR / "values.yaml").read_text())["sharedGateway"]

    def accepts(action, text: str) -> bool:
        try:
            value = action.type(text) if action.type else text
        except (argparse.ArgumentTypeError, ValueError):
            return False
        return action.choices is None or value in action.choices

    declared = chartgen.chart_values()
    assert {"--max-queued", "--queue-timeout", "--max-pending", "--tenant-tokens-per-minute"} <= \
        {d.flag for d, _ in declared}
    for d, chart in declared:
        entry, default = schema, values
        for key in chart.path.split("."):
            entry, default = entry["properties"][key], default[key]
        action = actions[d.flag]
        flag = d.flag[2:]
        if d.boolean:
            assert entry["type"] == "boolean" and default is False and action.default is False, flag
            continue
        if d.option.repeat or chart.join is not None:  # a map or a list: empty by default, each item the flag's
            assert not default and entry["type"] in ("object", "array"), flag
            continue
        if action.default is None:  # unset by default: no flag
            assert default in ("", None), flag
            continue
        assert accepts(action, str(default)), (flag, default)
        want = CHART_DEFAULTS.get(flag)
        if want:
            assert (default, action.default) == want, (flag, default, action.default)
        else:
            assert default == action.default, (flag, chart.path, default, action.default)
        if action.choices is not None:
            assert set(entry["enum"]) == set(chart.choices or action.choices) and \
                set(entry["enum"]) <= set(action.choices), flag
            continue
        low = entry.get("minimum", entry.get("exclusiveMinimum"))
        step = 1 if entry["type"] == "integer" else 0.5
        if low is None:  # unbounded below in the chart: so must the flag be
            assert accepts(action, "-5"), f"{chart.path}: the schema allows -5, --{flag} refuses it"
            continue
        inside = low if "minimum" in entry else low + step
        assert accepts(action, str(inside)), f"{chart.path}: the schema allows {inside}, --{flag} refuses it"
        below = low - step if "minimum" in entry else low
        assert not accepts(action, str(below)), f"{chart.path}: the schema refuses {below}, --{flag} accepts it"
        if "maximum" in entry:
            assert accepts(action, str(entry["maximum"])), (flag, entry["maximum"])
