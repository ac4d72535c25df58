"""manifests/examples/: every sample InferenceService validates against the generated CRD's openAPIV3Schema and
passes the operator's own validation; invalid ones are rejected with the field named."""

from __future__ import annotations

import importlib
import copy

import pytest
import yaml

from chartkit import EXAMPLES, ROOT, crd_schema, crd_validator, example_files, kube_validate, load_docs


def _isvcs():
    out = []
    for path in example_files():
        for doc in load_docs(path.read_text()):
            out.append((path.name, doc))
    return out


def _errors(doc):
    return sorted(crd_validator().iter_errors(doc), key=lambda e: list(e.absolute_path))


def test_the_required_examples_exist():
    names = {p.name for p in example_files()}
    assert {"cpu-demo.yaml", "single-gpu.yaml", "tp4.yaml", "tp8-pp2-multinode.yaml"} <= names


@pytest.mark.parametrize("filename,doc", _isvcs(), ids=[f"{f}:{d['metadata']['name']}" for f, d in _isvcs()])
def test_example_is_valid(filename, doc):
    if doc.get("kind") != "InferenceService":
        kube_validate(doc)  # any companion object (Secret, PVC, ...) is a valid Kubernetes object
        return
    assert doc["apiVersion"] == "serving.shoal.dev/v1alpha1"
    assert "namespace" not in doc["metadata"], "examples apply into the current namespace"
    errors = _errors(doc)
    assert not errors, "\n".join(f"{list(e.absolute_path)}: {e.message}" for e in errors)
    api = importlib.import_module("shoal.operator.api")
    api.validate(doc["metadata"]["name"], doc["spec"])  # CEL twins + semantic checks; raises SpecError


def _spec(filename):
    (doc,) = [d for d in load_docs((EXAMPLES / filename).read_text()) if d["kind"] == "InferenceService"]
    return doc


def test_examples_cover_the_topologies():
    api = importlib.import_module("shoal.operator.api")

    def parsed(filename):
        doc = _spec(filename)
        return api.validate(doc["metadata"]["name"], doc["spec"])

    cpu = parsed("cpu-demo.yaml")
    assert cpu.model.uri == api.DEMO_URI and cpu.gpus_per_pod() == 0 and cpu.pods_per_replica() == 1
    one_gpu = parsed("single-gpu.yaml")
    assert one_gpu.world_size == 1 and one_gpu.gpus_per_pod() == 1
    tp4 = parsed("tp4.yaml")
    assert tp4.engine.tensor_parallel_size == 4 and tp4.gpus_per_pod() == 4 and tp4.pods_per_replica() == 1
    big = parsed("tp8-pp2-multinode.yaml")
    assert (big.engine.tensor_parallel_size, big.engine.pipeline_parallel_size) == (8, 2)
    assert big.pods_per_replica() == 2


def test_examples_render_into_valid_children():
    render = importlib.import_module("shoal.operator.render")
    for filename, doc in _isvcs():
        if doc["kind"] != "InferenceService":
            continue
        isvc = copy.deepcopy(doc)
        isvc["metadata"].update(namespace="ml", uid="0000-1111", generation=1)
        for child in render.render(isvc):
            kube_validate(child)


def test_crd_is_served_under_the_documented_names():
    crd = yaml.safe_load((ROOT / "crds" / "inferenceservices.serving.shoal.dev.yaml").read_text()) \
        if (ROOT / "crds" / "inferenceservices.serving.shoal.dev.yaml").exists() else pytest.skip("no CRD yet")
    kube_validate(crd)
    names = crd["spec"]["names"]
    assert (crd["spec"]["group"], names["kind"], names["plural"]) == \
           ("serving.shoal.dev", "InferenceService", "inferenceservices")
    assert crd_schema()["properties"]["spec"]


# ------------------------------------------------------------------------------------------- invalid CRs
def _set(doc, dotted, value):
    node = doc
    *parents, leaf = dotted.split(".")
    for key in parents:
        node = node.setdefault(key, {})
    if value is _DELETE:
        node.pop(leaf, None)
    else:
        node[leaf] = value


_DELETE = object()
# (change to the CPU demo, the path the rejection must name)
INVALID = [
    ("spec.replicas", -1, "spec.replicas"),
    ("spec.replicas", "two", "spec.replicas"),
    ("spec.model.uri", "s3://bucket/model", "spec.model.uri"),
    ("spec.model.uri", "hf://", "spec.model.uri"),
    ("spec.model.servedName", "", "spec.model.servedName"),
    ("spec.engine.tensorParallelSize", 0, "spec.engine.tensorParallelSize"),
    ("spec.engine.pipelineParallelSize", 1.5, "spec.engine.pipelineParallelSize"),
    ("spec.engine.dtype", "float8", "spec.engine.dtype"),
    ("spec.engine.gpuMemoryUtilization", 1.5, "spec.engine.gpuMemoryUtilization"),
    ("spec.engine.gpuMemoryUtilization", 0, "spec.engine.gpuMemoryUtilization"),
    ("spec.engine.attentionBackend", "xformers", "spec.engine.attentionBackend"),
    ("spec.engine.enablePrefixCaching", "yes", "spec.engine.enablePrefixCaching"),
    ("spec.engine.extraArgs", "--seed 1", "spec.engine.extraArgs"),
    ("spec.engine.tensorParalelSize", 2, "spec.engine"),  # a typo: unknown field under strict validation
    ("spec.resources.gpusPerPod", -1, "spec.resources.gpusPerPod"),
    ("spec.resources.gpusPerPod", "one", "spec.resources.gpusPerPod"),
    ("spec.imagePullPolicy", "Sometimes", "spec.imagePullPolicy"),
    ("spec.probes.startupTimeoutSeconds", 5, "spec.probes.startupTimeoutSeconds"),
    ("spec.security.apiKeySecretRef", {"key": "k"}, "spec.security.apiKeySecretRef"),
    ("spec.security.networkPolicy.enabled", "false", "spec.security.networkPolicy.enabled"),
    ("spec.scheduling.nodeSelector", {"gpu": True}, "spec.scheduling.nodeSelector.gpu"),
    ("spec.replica", 2, "spec"),
]


@pytest.mark.parametrize("field,value,named", INVALID, ids=[f"{f}={v!r}" for f, v, _ in INVALID])
def test_invalid_cr_is_rejected_by_the_crd_naming_the_field(field, value, named):
    doc = copy.deepcopy(_spec("cpu-demo.yaml"))
    _set(doc, field, value)
    errors = _errors(doc)
    assert errors, f"{field}={value!r} was accepted"
    paths = [".".join(str(p) for p in e.absolute_path) for e in errors]
    messages = " | ".join(e.message for e in errors)
    assert named in paths, (paths, messages)
    if named in ("spec", "spec.engine"):  # unknown fields: the message names them
        assert repr(field.rsplit(".", 1)[1]) in messages, messages


@pytest.mark.parametrize("field,value,named", INVALID, ids=[f"{f}={v!r}" for f, v, _ in INVALID])
def test_invalid_cr_is_rejected_by_the_operator_naming_the_field(field, value, named):
    """The operator's own validation (api.validate: for objects the schema never saw) names the same field."""
    api = importlib.import_module("shoal.operator.api")
    doc = copy.deepcopy(_spec("cpu-demo.yaml"))
    _set(doc, field, value)
    with pytest.raises(api.SpecError) as exc:
        api.validate(doc["metadata"]["name"], doc["spec"])
    assert exc.value.field.startswith(named), (exc.value.field, str(exc.value))


# Rules that span fields: CEL in the CRD (x-kubernetes-validations, evaluated by the API server, not here) and
# their Python twins in api.py. Both must name the field.
CROSS_FIELD = [
    ({"resources": {"gpusPerPod": 3}, "engine": {"tensorParallelSize": 4}}, "spec.resources.gpusPerPod"),
    ({"engine": {"maxNumSeqs": 64, "maxNumBatchedTokens": 32}}, "spec.engine.maxNumBatchedTokens"),
    ({"rollout": {"maxUnavailable": 0, "maxSurge": 0}}, "spec.rollout.maxSurge"),
    ({"model": {"uri": "demo://", "revision": "main"}}, "spec.model.revision"),
]


@pytest.mark.parametrize("change,named", CROSS_FIELD, ids=[n for _, n in CROSS_FIELD])
def test_cross_field_rules_name_the_field(change, named):
    api = importlib.import_module("shoal.operator.api")
    doc = copy.deepcopy(_spec("cpu-demo.yaml"))
    for section, fields in change.items():
        doc["spec"].setdefault(section, {}).update(fields)
    assert not _errors(doc)  # each field alone is fine: only the rule catches it
    rules = crd_schema()["properties"]["spec"]["x-kubernetes-validations"]
    assert "spec" + named.removeprefix("spec") in {"spec" + r["fieldPath"] for r in rules}
    with pytest.raises(api.SpecError) as exc:
        api.validate(doc["metadata"]["name"], doc["spec"])
    assert exc.value.field == named


def test_every_priority_class_an_example_names_is_defined_beside_it():
    """An example whose pods name a PriorityClass that does not exist cannot create any pod (FailedCreate)."""
    for path in example_files():
        docs = load_docs(path.read_text())
        defined = {d["metadata"]["name"] for d in docs if d.get("kind") == "PriorityClass"}
        for doc in docs:
            if doc.get("kind") == "InferenceService":
                name = ((doc["spec"].get("scheduling") or {}).get("priorityClassName"))
                assert name is None or name in defined, f"{path.name} needs PriorityClass {name}: define it there"
