"""values.schema.json: every value is declared and checked, and Helm refuses values that break it, naming the
field."""

from __future__ import annotations

import json

import helm_python as helm
import jsonschema
import pytest
import yaml

from chartkit import CHART_DIR, NAMESPACE

SCHEMA = json.loads((CHART_DIR / "values.schema.json").read_text())
DEFAULTS = yaml.safe_load((CHART_DIR / "values.yaml").read_text())


def test_schema_is_valid_draft7_and_accepts_the_defaults():
    jsonschema.Draft7Validator.check_schema(SCHEMA)
    jsonschema.Draft7Validator(SCHEMA).validate(DEFAULTS)
    with helm.Chart.load(str(CHART_DIR)) as chart:
        assert chart.schema == SCHEMA
        chart.validate_schema(DEFAULTS)


def _walk(values, schema, path):
    """Every key of values.yaml is declared, and every object with fixed keys refuses unknown ones."""
    if isinstance(values, dict) and "properties" in schema:
        assert schema.get("additionalProperties") is False, f"{path or '/'} accepts unknown keys"
        for key, value in values.items():
            assert key in schema["properties"], f"{path}/{key} is not declared in values.schema.json"
            _walk(value, schema["properties"][key], f"{path}/{key}")
    elif isinstance(values, dict):
        assert "additionalProperties" in schema or schema.get("type") == "object", path


def test_every_value_is_declared():
    _walk(DEFAULTS, SCHEMA, "")


# (values, the field Helm must name)
INVALID = [
    ({"replicaCount": 2}, "'replicaCount' not allowed"),  # one kopf process; there is no replica knob
    ({"rbac": {"scope": "everything"}}, "/rbac/scope"),
    ({"rbac": {"create": "yes"}}, "/rbac/create"),
    ({"rbac": {"clusterWide": True}}, "'clusterWide' not allowed"),
    ({"image": {"pullPolicy": "Sometimes"}}, "/image/pullPolicy"),
    ({"image": {"digest": "md5:1234"}}, "/image/digest"),
    ({"image": {"tag": "has space"}}, "/image/tag"),
    ({"image": {"repository": ""}}, "/image/repository"),
    ({"engineImage": {"repository": "ghcr.io/x/y:tag"}}, "/engineImage/repository"),
    ({"operator": {"logFormat": "xml"}}, "/operator/logFormat"),
    ({"operator": {"healthPort": 80}}, "/operator/healthPort"),
    ({"operator": {"maxGpusPerNode": 0}}, "/operator/maxGpusPerNode"),
    ({"operator": {"clusterDomain": "Cluster Local"}}, "/operator/clusterDomain"),
    ({"operator": {"healthPort": "8080"}}, "/operator/healthPort"),
    ({"operator": {"watchNamespaces": ["Team_A"]}}, "/operator/watchNamespaces/0"),
    ({"operator": {"watchNamespaces": ["a", "a"]}}, "/operator/watchNamespaces"),
    ({"operator": {"extraArgs": [7]}}, "/operator/extraArgs/0"),
    ({"operator": {"extraEnv": [{"value": "x"}]}}, "/operator/extraEnv/0"),
    ({"serviceAccount": {"name": "Not A Name"}}, "/serviceAccount/name"),
    ({"resources": {"requests": {"cpu": "lots"}}}, "/resources/requests/cpu"),
    ({"resources": {"request": {"cpu": "1"}}}, "'request' not allowed"),
    ({"livenessProbe": {"periodSeconds": 0}}, "/livenessProbe/periodSeconds"),
    ({"tolerations": [{"key": "a", "operator": "Maybe"}]}, "/tolerations/0/operator"),
    ({"nodeSelector": {"disk": 1}}, "/nodeSelector/disk"),
    ({"metrics": {"scraperNamespace": "Monitoring"}}, "/metrics/scraperNamespace"),
    ({"metrics": {"serviceMonitor": {"enabled": "true"}}}, "/metrics/serviceMonitor/enabled"),
    ({"metrics": {"serviceMonitor": {"interval": "30 seconds"}}}, "/metrics/serviceMonitor/interval"),
    ({"metrics": {"serviceMonitor": {"interval": "1.5s"}}}, "/metrics/serviceMonitor/interval"),
    ({"metrics": {"serviceMonitor": {"scrapeTimeout": ""}}}, "/metrics/serviceMonitor/scrapeTimeout"),
    ({"metrics": {"serviceMonitor": {"namespace": "Monitoring"}}}, "/metrics/serviceMonitor/namespace"),
    ({"grafanaDashboard": {"labels": {"grafana_dashboard": 1}}}, "/grafanaDashboard/labels/grafana_dashboard"),
]


@pytest.mark.parametrize("values,field", INVALID, ids=[f for _, f in INVALID])
def test_invalid_values_are_refused_naming_the_field(values, field):
    with helm.Chart.load(str(CHART_DIR)) as chart:
        with pytest.raises(helm.HelmValuesError) as exc:
            chart.validate_schema(chart.merge_values(values))
        assert field in str(exc.value), str(exc.value)
        # `helm template` / `helm install` refuse them the same way
        with pytest.raises(helm.HelmValuesError) as exc:
            chart.render(values=values, name="shoal", namespace=NAMESPACE)
        assert field in str(exc.value), str(exc.value)


def test_lint_reports_schema_violations():
    report = helm.lint(str(CHART_DIR), {"rbac": {"scope": "everything"}}, namespace=NAMESPACE)
    assert any("/rbac/scope" in m["error"] for m in report["messages"] if m["severity"] == 3), report
