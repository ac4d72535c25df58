"""manifests/: the kustomize base for `kubectl apply -k manifests/` parses, validates, and matches the chart.

There is no kustomize binary on PyPI; the test reads kustomization.yaml and follows its resources itself (files
and kustomization directories, as kustomize does), and, where a kubectl with its built-in kustomize is on PATH,
also builds the base with it offline."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from chartkit import MANIFESTS, NAMESPACE, ROOT, kube_validate, load_docs, pretty

KUSTOMIZATION = MANIFESTS / "kustomization.yaml"
CLUSTER_SCOPED = {"Namespace", "CustomResourceDefinition", "ClusterRole", "ClusterRoleBinding"}


def _generate_module():
    spec = importlib.util.spec_from_file_location("manifests_generate", MANIFESTS / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _crd_base_missing() -> str | None:
    if not (MANIFESTS / "crds" / "kustomization.yaml").exists():
        return "manifests/crds/kustomization.yaml (owned by the CRD generator) does not exist yet"
    return None


def collect(directory: Path) -> list[dict]:
    """The objects a kustomization lists, following directories (bases) like kustomize, without transformers."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    objects: list[dict] = []
    for entry in kustomization.get("resources", []):
        target = (directory / entry).resolve()
        if target.is_dir():
            assert (target / "kustomization.yaml").exists(), f"{entry}: a directory resource needs a kustomization"
            objects += collect(target)
        else:
            # kustomize's default load restrictor: single files must lie inside the kustomization's root
            assert target.is_relative_to(directory.resolve()), f"{entry} is outside {directory}"
            objects += load_docs(target.read_text())
    return objects


def test_kustomization_shape():
    k = yaml.safe_load(KUSTOMIZATION.read_text())
    assert k["apiVersion"] == "kustomize.config.k8s.io/v1beta1" and k["kind"] == "Kustomization"
    assert k["namespace"] == NAMESPACE
    assert k["resources"] == ["namespace.yaml", "crds", "operator.yaml"]


def test_kubectl_apply_f_crds_applies_only_crds():
    """`kubectl apply -f crds/` reads every YAML file there: each must be a CRD (a kustomization.yaml is none)."""
    files = sorted((ROOT / "crds").iterdir())
    assert files
    for path in files:
        assert path.suffix in (".yaml", ".yml"), path
        docs = load_docs(path.read_text())
        assert docs and all(d["apiVersion"] == "apiextensions.k8s.io/v1" and d["kind"] == "CustomResourceDefinition"
                            for d in docs), f"{path.name} is not a CRD: `kubectl apply -f crds/` would fail on it"


def test_listed_resources_validate():
    if reason := _crd_base_missing():
        pytest.skip(reason)
    objects = collect(MANIFESTS)
    kinds = sorted(o["kind"] for o in objects)
    assert kinds == sorted(["Namespace", "CustomResourceDefinition", "ServiceAccount", "ClusterRole",
                            "ClusterRoleBinding", "Deployment"] + ["CustomResourceDefinition"] * 2)  # kopf peering
    for obj in objects:
        kube_validate(obj)
        if obj["kind"] not in CLUSTER_SCOPED:
            assert obj["metadata"].get("namespace") == NAMESPACE


def test_operator_yaml_validates_and_is_generated_from_the_chart():
    text = (MANIFESTS / "operator.yaml").read_text()
    for obj in load_docs(text):
        kube_validate(obj)
    gen = _generate_module()
    assert text == gen.render_text(), "manifests/operator.yaml is stale: run `python manifests/generate.py`"


def test_namespace_enforces_restricted_pod_security():
    (ns,) = load_docs((MANIFESTS / "namespace.yaml").read_text())
    kube_validate(ns)
    assert ns["metadata"]["name"] == NAMESPACE
    assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="no kubectl (with built-in kustomize) on PATH")
def test_kubectl_kustomize_builds_the_base():
    if reason := _crd_base_missing():
        pytest.skip(reason)
    out = subprocess.run(["kubectl", "kustomize", str(MANIFESTS)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    objects = load_docs(out.stdout)
    for obj in objects:
        kube_validate(obj)
    by_kind = {o["kind"]: o for o in objects}
    assert set(by_kind) == {"Namespace", "CustomResourceDefinition", "ServiceAccount", "ClusterRole",
                            "ClusterRoleBinding", "Deployment"}, pretty(sorted(by_kind))
    assert by_kind["ClusterRoleBinding"]["subjects"][0]["namespace"] == NAMESPACE
    (container,) = by_kind["Deployment"]["spec"]["template"]["spec"]["containers"]
    assert container["image"].startswith("ghcr.io/shoal-dev/shoal-operator:")
