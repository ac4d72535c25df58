"""The namespace-scoped install (chart rbac.scope=namespace: Roles in the watched namespaces, no ClusterRole)
against an emulated API that enforces exactly the chart's Role: the operator never asks for anything the Role does
not grant (kopf's cluster-wide scans of CRDs and namespaces were refused at every start, logged and backed off
before anything was served), and it serves its namespace at once."""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

import kopf
import pytest

from kubekit import Client, EmulatorServer, OperatorThread, isvc_body, wait_for, write_kubeconfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "chart"))
from chartkit import by_kind, render  # noqa: E402

from shoal.operator import handlers  # noqa: E402

NS = "team-a"


def role_rules(namespace: str) -> dict[tuple[str, str], set[str]]:
    objects = render({"rbac": {"scope": "namespace"}, "operator": {"watchNamespaces": [namespace]}})
    (role,) = [r for r in by_kind(objects, "Role") if r["metadata"]["namespace"] == namespace]
    rules: dict[tuple[str, str], set[str]] = {}
    for rule in role["rules"]:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                rules.setdefault((group, resource), set()).update(rule["verbs"])
    return rules


def test_the_namespaced_mode_turns_kopfs_cluster_scans_off():
    settings = kopf.OperatorSettings()
    handlers.scope_settings(settings, "namespace")
    assert settings.scanning.disabled
    handlers.scope_settings(settings, "cluster")  # a ClusterRole: kopf follows CRDs as they are installed
    assert not settings.scanning.disabled


def test_the_charts_namespaced_role_suffices(tmp_path, monkeypatch):
    rules = role_rules(NS)
    chart = render({"rbac": {"scope": "namespace"}, "operator": {"watchNamespaces": [NS]}})
    (dep,) = [d for d in by_kind(chart, "Deployment") if d["metadata"]["name"] == "shoal"]
    assert "--rbac-scope=namespace" in dep["spec"]["template"]["spec"]["containers"][0]["args"]
    server = EmulatorServer()
    cluster = server.cluster
    cluster.authorize = lambda group, resource, verb, namespace: namespace == NS and verb in rules.get(
        (group, resource), ())
    monkeypatch.setenv("KUBECONFIG", write_kubeconfig(tmp_path / "config", server.url))
    monkeypatch.setenv("SHOAL_ENGINE_IMAGE", "registry.test/shoal-engine:test")
    monkeypatch.setenv("SHOAL_RBAC_SCOPE", "namespace")  # as the chart's --rbac-scope=namespace sets it
    monkeypatch.setenv("SHOAL_WATCH_NAMESPACES", NS)
    logging.getLogger("kopf").setLevel(logging.WARNING)
    client = Client(server.url)
    started = time.monotonic()
    operator = OperatorThread(namespaces=[NS])
    try:
        client.create("inferenceservices", NS, isvc_body("chat"))
        wait_for(lambda: client.get("deployments", NS, "chat"), 8, "the namespaced operator to reconcile")
        assert time.monotonic() - started < 8
        assert cluster.denied == [], f"asked for what the chart's Role does not grant: {sorted(set(cluster.denied))}"
    finally:
        operator.stop()
        client.http.close()
        server.close()
    if operator.error is not None:
        pytest.fail(f"kopf failed: {operator.error!r}")
