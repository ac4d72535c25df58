"""End-to-end helpers and fixtures (registered by e2e/conftest.py): a real cluster (kind via e2e/run.sh, or any
cluster KUBECONFIG points at), the chart installed with Helm, a namespace for InferenceServices.

Everything is skipped unless a cluster is reachable. To guard real clusters, a context not named `kind-*` is used
only with SHOAL_E2E=1 (e2e/run.sh sets it for the cluster it creates).

Environment:
  SHOAL_E2E_OPERATOR_IMAGE   operator image already present on the nodes   (default shoal-operator:e2e)
  SHOAL_E2E_ENGINE_IMAGE     engine image already present on the nodes     (default shoal-engine:e2e)
  SHOAL_E2E_READY_TIMEOUT    seconds to wait for an InferenceService Ready  (default 900)
  SHOAL_E2E_KEEP=1           leave the release and the test namespace behind for inspection
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "charts" / "shoal"
EXAMPLES = ROOT / "manifests" / "examples"
RELEASE = "shoal"
OPERATOR_NAMESPACE = "shoal-system"
GROUP_PLURAL = "inferenceservices.serving.shoal.dev"


def kubectl(*args: str, check: bool = True, timeout: float = 120, input: str | None = None
            ) -> subprocess.CompletedProcess:
    out = subprocess.run(["kubectl", *args], capture_output=True, text=True, timeout=timeout, input=input)
    if check and out.returncode != 0:
        raise AssertionError(f"kubectl {' '.join(args)} failed ({out.returncode}):\n{out.stderr}{out.stdout}")
    return out


def kubectl_json(*args: str) -> dict[str, Any]:
    return json.loads(kubectl(*args, "-o", "json").stdout)


def _cluster_problem() -> str | None:
    """Why the e2e suite cannot run here, or None when a cluster is reachable and allowed."""
    if shutil.which("kubectl") is None:
        return "no kubectl on PATH"
    if not os.environ.get("KUBECONFIG") and not (Path.home() / ".kube" / "config").exists():
        return "no cluster configured (no KUBECONFIG, no ~/.kube/config)"
    try:
        context = kubectl("config", "current-context", check=False, timeout=10).stdout.strip()
        if not context:
            return "kubeconfig has no current context"
        if not context.startswith("kind-") and os.environ.get("SHOAL_E2E") != "1":
            return f"context {context!r} is not a kind cluster; set SHOAL_E2E=1 to run against it anyway"
        ready = kubectl("get", "--raw=/readyz", "--request-timeout=5s", check=False, timeout=15)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"kubectl failed: {e}"
    if ready.returncode != 0:
        return f"cluster not reachable: {(ready.stderr or ready.stdout).strip()[:200]}"
    return None


@pytest.fixture(scope="session")
def cluster() -> None:
    problem = _cluster_problem()
    if problem:
        pytest.skip(f"e2e needs a Kubernetes cluster: {problem}")


def _image(env: str, default: str) -> dict[str, str]:
    ref = os.environ.get(env, default)
    repository, _, tag = ref.rpartition(":") if ":" in ref.rsplit("/", 1)[-1] else (ref, "", "latest")
    return {"repository": repository, "tag": tag}


def chart_values() -> dict[str, Any]:
    return {
        "image": {**_image("SHOAL_E2E_OPERATOR_IMAGE", "shoal-operator:e2e"), "pullPolicy": "IfNotPresent"},
        "engineImage": _image("SHOAL_E2E_ENGINE_IMAGE", "shoal-engine:e2e"),
        "operator": {"logFormat": "plain", "verbose": True},
    }


def _helm_install(values: dict[str, Any]) -> None:
    """`helm upgrade --install` with the helm binary when there is one, else the same through helm-python-sdk."""
    if shutil.which("helm"):
        values_file = Path(os.environ.get("TMPDIR", "/tmp")) / f"shoal-e2e-values-{uuid.uuid4().hex[:8]}.json"
        values_file.write_text(json.dumps(values))
        try:
            out = subprocess.run(
                ["helm", "upgrade", "--install", RELEASE, str(CHART), "--namespace", OPERATOR_NAMESPACE,
                 "--create-namespace", "--values", str(values_file), "--wait", "--timeout", "5m"],
                capture_output=True, text=True, timeout=420)
        finally:
            values_file.unlink(missing_ok=True)
        assert out.returncode == 0, out.stderr + out.stdout
        return
    import helm_python as helm

    with helm.Config(namespace=OPERATOR_NAMESPACE) as cfg:
        installed = {r["name"] for r in cfg.list(all_states=True)}
        if RELEASE in installed:
            cfg.upgrade(str(CHART), RELEASE, values, namespace=OPERATOR_NAMESPACE, wait="watcher", timeout=300)
        else:
            cfg.install(str(CHART), RELEASE, values, namespace=OPERATOR_NAMESPACE, create_namespace=True,
                        wait="watcher", timeout=300)


def _helm_uninstall() -> None:
    if shutil.which("helm"):
        subprocess.run(["helm", "uninstall", RELEASE, "--namespace", OPERATOR_NAMESPACE, "--wait"],
                       capture_output=True, text=True, timeout=300)
        return
    import helm_python as helm

    with helm.Config(namespace=OPERATOR_NAMESPACE) as cfg:
        cfg.uninstall(RELEASE, ignore_not_found=True, wait="watcher", timeout=300)


@pytest.fixture(scope="session")
def operator(cluster) -> dict[str, Any]:
    """The chart installed (CRD from charts/shoal/crds/, operator Deployment, RBAC) and the operator running."""
    values = chart_values()
    _helm_install(values)
    kubectl("rollout", "status", f"deployment/{RELEASE}", "-n", OPERATOR_NAMESPACE, "--timeout=300s", timeout=330)
    kubectl("wait", f"crd/{GROUP_PLURAL}", "--for=condition=Established", "--timeout=60s", timeout=90)
    yield values
    if os.environ.get("SHOAL_E2E_KEEP") != "1":
        _helm_uninstall()


@pytest.fixture(scope="session")
def namespace(operator) -> str:
    name = f"shoal-e2e-{uuid.uuid4().hex[:6]}"
    kubectl("create", "namespace", name)
    yield name
    if os.environ.get("SHOAL_E2E_KEEP") != "1":
        kubectl("delete", "namespace", name, "--wait=false", check=False)


def diagnostics(namespace: str, name: str) -> str:
    """What a person would look at when an InferenceService does not become Ready."""
    parts = []
    for args in (["get", f"{GROUP_PLURAL}/{name}", "-n", namespace, "-o", "yaml"],
                 ["get", "all,networkpolicies,poddisruptionbudgets", "-n", namespace, "-o", "wide"],
                 ["describe", "pods", "-n", namespace],
                 ["get", "events", "-n", namespace, "--sort-by=.lastTimestamp"],
                 ["logs", "-n", namespace, "-l", f"serving.shoal.dev/inferenceservice={name}", "--tail=80",
                  "--all-containers"],
                 ["logs", "-n", OPERATOR_NAMESPACE, f"deployment/{RELEASE}", "--tail=120"]):
        out = kubectl(*args, check=False, timeout=60)
        parts.append(f"$ kubectl {' '.join(args)}\n{out.stdout}{out.stderr}")
    return "\n".join(parts)


def wait_for(predicate, timeout: float, interval: float = 3.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what} (last: {last!r})")


def ready_condition(isvc: dict[str, Any]) -> dict[str, Any] | None:
    for cond in isvc.get("status", {}).get("conditions", []):
        if cond.get("type") == "Ready":
            return cond
    return None


READY_TIMEOUT = float(os.environ.get("SHOAL_E2E_READY_TIMEOUT", "900"))
