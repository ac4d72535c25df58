"""The CPU demo on a real cluster: the chart's operator turns manifests/examples/cpu-demo.yaml into a serving
engine, the InferenceService reports Ready, and the gateway Service answers an OpenAI client.

Run through e2e/run.sh (kind + images built from the Dockerfiles); skipped when no cluster is reachable."""

from __future__ import annotations

import copy
import os
import re
import socket
import subprocess
import time
import urllib.request

import pytest
import yaml

from e2ekit import (EXAMPLES, GROUP_PLURAL, READY_TIMEOUT, diagnostics, kubectl, kubectl_json, ready_condition,
                    wait_for)

NAME = "shoal-demo"  # manifests/examples/cpu-demo.yaml


def _isvc(namespace: str, name: str = NAME) -> dict:
    return kubectl_json("get", f"{GROUP_PLURAL}/{name}", "-n", namespace)


def _wait_ready(namespace: str, name: str = NAME, replicas: int = 1) -> dict:
    def ready():
        isvc = _isvc(namespace, name)
        cond = ready_condition(isvc) or {}
        status = isvc.get("status", {})
        if cond.get("status") == "True" and status.get("readyReplicas") == replicas \
                and status.get("observedGeneration") == isvc["metadata"]["generation"]:
            return isvc
        return None

    try:
        return wait_for(ready, READY_TIMEOUT, what=f"{name} Ready with {replicas} replica(s)")
    except TimeoutError as e:
        pytest.fail(f"{e}\n{diagnostics(namespace, name)}")


@pytest.fixture(scope="module")
def demo(namespace):
    kubectl("apply", "-n", namespace, "-f", str(EXAMPLES / "cpu-demo.yaml"))
    return _wait_ready(namespace)


@pytest.fixture(scope="module")
def gateway(demo, namespace):
    """`kubectl port-forward` to the gateway Service; yields its base URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(["kubectl", "port-forward", "-n", namespace, f"svc/{NAME}", f"{port}:8000",
                             "--address=127.0.0.1"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = proc.stdout.readline()  # "Forwarding from 127.0.0.1:PORT -> 8000"
        assert "Forwarding from" in line, line + (proc.stdout.read() if proc.poll() is not None else "")
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _get(url: str, timeout: float = 10) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.status, resp.read().decode()


def test_demo_becomes_ready_with_an_honest_status(demo, namespace):
    status = demo["status"]
    assert status["phase"] == "Ready"
    assert status["replicas"] == 1 and status["readyReplicas"] == 1 and status["updatedReplicas"] == 1
    assert status["url"] == f"http://{NAME}.{namespace}.svc.cluster.local:8000"
    assert status["selector"]
    cond = ready_condition(demo)
    assert cond["reason"] and cond["lastTransitionTime"]
    # the printer columns a person sees with `kubectl get sisvc`
    table = kubectl("get", "sisvc", NAME, "-n", namespace).stdout
    assert re.search(rf"^{NAME}\s+True\s+1\s+demo://\s+http://", table.splitlines()[1]), table


def test_children_are_owned_by_the_inferenceservice(demo, namespace):
    uid = demo["metadata"]["uid"]
    for kind in ("deployment", "service", "networkpolicy"):
        child = kubectl_json("get", kind, NAME, "-n", namespace)
        owners = child["metadata"]["ownerReferences"]
        assert [(o["kind"], o["uid"], o.get("controller")) for o in owners] == [("InferenceService", uid, True)]
    pod = kubectl_json("get", "pods", "-n", namespace, "-l", f"serving.shoal.dev/inferenceservice={NAME}")["items"][0]
    sc = pod["spec"]["containers"][0]["securityContext"]
    assert sc["runAsNonRoot"] and not sc["allowPrivilegeEscalation"] and sc["capabilities"]["drop"] == ["ALL"]
    assert pod["spec"]["automountServiceAccountToken"] is False


def test_health_and_metrics_endpoints(gateway):
    for path in ("/startupz", "/readyz", "/livez", "/health"):
        assert _get(gateway + path)[0] == 200, path
    status, text = _get(gateway + "/metrics")
    assert status == 200
    assert f'shoal:num_requests_running{{model_name="{NAME}"}}' in text


def test_openai_client_through_the_gateway(gateway):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=gateway + "/v1", api_key="unused", timeout=120, max_retries=2)
    assert [m.id for m in client.models.list().data] == [NAME]

    chat = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hello!"}],
                                          max_tokens=8, temperature=0)
    assert isinstance(chat.choices[0].message.content, str)
    assert chat.choices[0].finish_reason in ("stop", "length")
    assert 0 < chat.usage.completion_tokens <= 8

    stream = client.completions.create(model=NAME, prompt="Once upon a time", max_tokens=8, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert isinstance(text, str) and len(chunks) > 2
    usage = chunks[-1].usage  # include_usage: a last chunk with no choices carries the totals
    assert usage is not None and 0 < usage.completion_tokens <= 8 and usage.prompt_tokens > 0

    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x", max_tokens=1)


def test_scale_subresource(demo, namespace):
    kubectl("scale", "sisvc", NAME, "-n", namespace, "--replicas=2")
    _wait_ready(namespace, replicas=2)
    assert kubectl_json("get", "deployment", NAME, "-n", namespace)["spec"]["replicas"] == 2
    kubectl("get", "poddisruptionbudget", NAME, "-n", namespace)  # replicas > 1 -> a PDB
    kubectl("scale", "sisvc", NAME, "-n", namespace, "--replicas=1")
    _wait_ready(namespace, replicas=1)
    wait_for(lambda: kubectl("get", "pdb", NAME, "-n", namespace, check=False).returncode != 0, 120,
             what="the PodDisruptionBudget to be pruned")


def test_a_deleted_child_comes_back(demo, namespace):
    before = kubectl_json("get", "service", NAME, "-n", namespace)["metadata"]["uid"]
    kubectl("delete", "service", NAME, "-n", namespace, "--wait=true")

    def recreated():
        out = kubectl("get", "service", NAME, "-n", namespace, "-o", "jsonpath={.metadata.uid}", check=False)
        return out.returncode == 0 and out.stdout and out.stdout != before

    wait_for(recreated, 120, what="the gateway Service to be recreated")


def test_invalid_spec_is_reported_and_creates_nothing(namespace):
    """A rule the schema cannot express (a flag the operator owns in extraArgs): Ready=False, InvalidSpec."""
    doc = yaml.safe_load((EXAMPLES / "cpu-demo.yaml").read_text())
    bad = copy.deepcopy(doc)
    bad["metadata"]["name"] = "shoal-invalid"
    bad["spec"]["engine"]["extraArgs"] = ["--port=9000"]
    kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(bad))

    def reported():
        cond = ready_condition(_isvc(namespace, "shoal-invalid")) or {}
        return cond if cond.get("reason") == "InvalidSpec" else None

    cond = wait_for(reported, 120, what="InvalidSpec")
    assert cond["status"] == "False" and "spec.engine.extraArgs[0]" in cond["message"]
    time.sleep(3)
    children = kubectl("get", "deployments,statefulsets,services", "-n", namespace, "-l",
                       "serving.shoal.dev/inferenceservice=shoal-invalid", "-o", "name").stdout
    assert children.strip() == ""
    kubectl("delete", f"{GROUP_PLURAL}/shoal-invalid", "-n", namespace)


def test_deleting_the_inferenceservice_deletes_its_children(demo, namespace):
    if os.environ.get("SHOAL_E2E_KEEP") == "1":
        pytest.skip("SHOAL_E2E_KEEP=1 keeps the demo running")
    kubectl("delete", f"{GROUP_PLURAL}/{NAME}", "-n", namespace, "--wait=true", timeout=180)
    wait_for(lambda: not kubectl("get", "deployments,services,networkpolicies", "-n", namespace, "-l",
                                 f"serving.shoal.dev/inferenceservice={NAME}", "-o", "name").stdout.strip(),
             180, what="garbage collection of the children")
