"""Helpers for the packaging tests: the Helm chart (rendered in-process by helm-python-sdk, which bundles Helm's
Go SDK), the kustomize base, the example InferenceServices and the generated CRD."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, Iterable

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART_DIR = ROOT / "charts" / "shoal"
MANIFESTS = ROOT / "manifests"
EXAMPLES = MANIFESTS / "examples"
CRD_FILE = ROOT / "crds" / "inferenceservices.serving.shoal.dev.yaml"
CHART_CRD_FILE = CHART_DIR / "crds" / CRD_FILE.name

RELEASE = "shoal"
NAMESPACE = "shoal-system"
# The most recent Kubernetes version kubernetes-validate ships schemas for.
KUBE_VERSION = "1.37.0"


def load_docs(text: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(text) if d]


def render(values: dict[str, Any] | None = None, *, namespace: str = NAMESPACE, name: str = RELEASE
           ) -> list[dict[str, Any]]:
    """Every object the chart renders with these values (templates only; CRDs come from crds/)."""
    import helm_python as helm

    with helm.Chart.load(str(CHART_DIR)) as chart:
        rendered = chart.render(values=values, name=name, namespace=namespace)
    objects = []
    for path, text in sorted(rendered.items()):
        if path.endswith(".txt"):  # NOTES.txt
            continue
        objects.extend(load_docs(text))
    return objects


def by_kind(objects: Iterable[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def one(objects: Iterable[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = by_kind(objects, kind)
    assert len(found) == 1, f"expected one {kind}, found {[o['metadata']['name'] for o in found]}"
    return found[0]


def kube_validate(obj: dict[str, Any]) -> None:
    """Validate against the official schemas of KUBE_VERSION, strictly (unknown fields are errors)."""
    import kubernetes_validate

    kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)


def crd_schema(strict: bool = True) -> dict[str, Any]:
    """The openAPIV3Schema of the generated CRD. strict=True adds `additionalProperties: false` wherever the
    API server would reject an unknown field under kubectl's default strict field validation (every object
    with declared properties and no x-kubernetes-preserve-unknown-fields)."""
    if not CRD_FILE.exists():
        pytest.skip(f"{CRD_FILE.relative_to(ROOT)} is not generated yet (python -m shoal.operator.crdgen)")
    crd = yaml.safe_load(CRD_FILE.read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v.get("storage")]
    schema = copy.deepcopy(version["schema"]["openAPIV3Schema"])
    if strict:
        _close_objects(schema)
    return schema


def _close_objects(node: Any) -> None:
    if isinstance(node, dict):
        if "properties" in node and not node.get("x-kubernetes-preserve-unknown-fields"):
            node.setdefault("additionalProperties", False)
        for value in node.values():
            _close_objects(value)
    elif isinstance(node, list):
        for value in node:
            _close_objects(value)


def crd_validator(strict: bool = True):
    """A JSON-schema validator for InferenceServices (OpenAPI v3.0 schemas are draft-4 shaped: boolean
    exclusiveMinimum/Maximum). CEL rules (x-kubernetes-validations) are not evaluated here; api.py carries
    their Python twins."""
    import jsonschema

    return jsonschema.Draft4Validator(crd_schema(strict))


def example_files() -> list[Path]:
    return sorted(EXAMPLES.glob("*.yaml"))


def pretty(obj: Any) -> str:
    return json.dumps(obj, indent=1, sort_keys=True)
