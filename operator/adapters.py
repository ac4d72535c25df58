"""spec.adapters: what the engine pods are told to serve, and what they report back.

How an adapter list reaches running engines (the design; docs/operator.md explains the choice)
-----------------------------------------------------------------------------------------------
* The operator renders the list into the ConfigMap ``<name>-adapters`` (``adapters.json``: each adapter's name
  and its source as the pod sees it: a local directory, or ``hf://org/name@revision`` to fetch). The pod template
  mounts that ConfigMap by name only, so the list is no part of the template (nor of its hash): editing
  spec.adapters never rolls a pod.
* Every engine pod of a service with ``engine.enableLora`` runs a small sidecar, ``shoal-podtools sync-adapters``
  (operator/podtools/adapter_sync.py). The kubelet refreshes the mounted ConfigMap in place; the sidecar fetches hub
  adapters into the pod's cache volume and loads and unloads adapters through the engine's own
  ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` on localhost, with the engine's API key from the pod's
  Secret reference: the operator never holds the key, and nothing outside the pod calls those endpoints. Its
  readiness passes once the adapters of the pod's first list are loaded (or failed), so a new pod (scale-up,
  restart, rollout) turns Ready with the current set.
* The sidecar reports each adapter's state on ``/status`` (port ``adapter-sync``, 8001). The operator reads it from
  every serving pod (the NetworkPolicy admits the operator's namespace on that port) into ``status.adapters``,
  the ``AdaptersReady`` condition and Events (``AdapterLoadFailed``); a failed adapter never makes a replica
  unready: the engine keeps serving its base model and other adapters.

Sources: ``hf://`` (fetched by the pod), ``pvc://claim/path`` (the claim is mounted read-only at
``/adapters/<claim>``, or is the model's own claim at /models: only a claim not mounted before changes the
template), ``file:///path`` (in the image).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from dataclasses import dataclass, field
from typing import Any, Callable

from shoal.operator import api, contract
from shoal.operator.contract import L_POD_INDEX, MODELS_DIR

logger = logging.getLogger("shoal.operator.adapters")

SIDECAR = "adapter-sync"
SIDECAR_PORT = 8001
CONFIG_DIR = "/etc/shoal/adapters"
CONFIG_KEY = "adapters.json"
CLAIMS_DIR = "/adapters"
CONDITION = "AdaptersReady"
STATUS_TIMEOUT = 2.0
REPOLL_UNSETTLED = 2.0  # seconds between reads while an adapter is pending, downloading or loading
REPOLL_FAILED = 30.0  # while one has failed (the sidecar retries what may succeed later)
# status.adapters is counts per adapter plus a few examples of what went wrong, whatever the fleet's size
MAX_EXAMPLES = 2
EXAMPLE_LENGTH = 256


def configmap_name(name: str) -> str:
    return contract.adapters_configmap_name(name)


def claims(spec: api.InferenceServiceSpec) -> list[str]:
    """The claims of pvc:// adapters that the pods mount for them (not the model's claim: it is at /models)."""
    model_claim = spec.model.uri[len("pvc://"):].split("/", 1)[0] if spec.model.uri.startswith("pvc://") else None
    found = {a.uri[len("pvc://"):].split("/", 1)[0] for a in spec.adapters if a.uri.startswith("pvc://")}
    return sorted(found - {model_claim})


def source(spec: api.InferenceServiceSpec, adapter: api.Adapter) -> str:
    """Where the pod finds the adapter: a directory it has, or the hub reference the sidecar fetches."""
    uri = adapter.uri
    if uri.startswith("hf://"):
        return uri + (f"@{adapter.revision}" if adapter.revision else "")
    if uri.startswith("pvc://"):
        claim, _, path = uri[len("pvc://"):].partition("/")
        if spec.model.uri.startswith("pvc://") and spec.model.uri[len("pvc://"):].split("/", 1)[0] == claim:
            return f"{MODELS_DIR}/{path}".rstrip("/")
        return f"{CLAIMS_DIR}/{claim}/{path}".rstrip("/")
    return uri[len("file://"):]


def base_model(spec: api.InferenceServiceSpec) -> str | None:
    """The hub id of the service's model (hf://), which an adapter's adapter_config.json names as its
    base_model_name_or_path; None when the model is a path, whose hub id the operator cannot know."""
    return spec.model.uri[len("hf://"):] if spec.model.uri.startswith("hf://") else None


def config(spec: api.InferenceServiceSpec) -> str:
    """The ConfigMap's adapters.json (deterministic: the sidecar's digest of it is compared with ours)."""
    body: dict[str, Any] = {"adapters": [{"name": a.name, "source": source(spec, a)} for a in spec.adapters]}
    if base_model(spec):
        body["baseModel"] = base_model(spec)  # the sidecar refuses adapters trained for another base model
    return json.dumps(body, sort_keys=True, separators=(",", ":"))


def digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# ------------------------------------------------------------------------------------------------- status
def serving_pods(pods: list[dict[str, Any]], multi: bool) -> list[dict[str, Any]]:
    """Pods whose sidecar drives an engine API: running, not terminating, rank 0 of a multi-pod group."""
    found = []
    for p in pods:
        labels = p["metadata"].get("labels") or {}
        if p["metadata"].get("deletionTimestamp") or (p.get("status") or {}).get("phase") != "Running":
            continue
        if multi and labels.get(L_POD_INDEX) != "0":
            continue
        found.append(p)
    return sorted(found, key=lambda p: p["metadata"]["name"])


def sidecar_url(pod: dict[str, Any]) -> str | None:
    ip = (pod.get("status") or {}).get("podIP")
    for c in (pod.get("spec") or {}).get("containers") or []:
        if c.get("name") == SIDECAR:
            port = next((p.get("containerPort") for p in c.get("ports") or [] if p.get("name") == SIDECAR), None)
            if ip and port:
                host = f"[{ip}]" if ":" in ip else ip
                return f"http://{host}:{port}"
    return None


def replica_states(spec: api.InferenceServiceSpec, report: dict[str, Any] | None,
                   unreachable: str | None) -> dict[str, tuple[str, str | None]]:
    """{adapter name: (state, message)} in one pod, from its sidecar's report."""
    expected = digest(config(spec))
    entries = {e.get("name"): e for e in (report or {}).get("adapters") or [] if isinstance(e, dict)}
    out = {}
    for a in spec.adapters:
        if report is None:
            out[a.name] = ("Unknown", unreachable)
            continue
        e = entries.get(a.name)
        if e is not None and e.get("source") == source(spec, a) and e.get("state") in (
                "Pending", "Downloading", "Loading", "Loaded", "Failed"):
            out[a.name] = (e["state"], e.get("message"))
        elif report.get("config") != expected:
            out[a.name] = ("Pending", "the pod has not seen this adapter list yet (the kubelet refreshes a mounted "
                                      "ConfigMap within about a minute)")
        else:
            out[a.name] = ("Pending", f"the engine is not reachable yet: {report.get('engine')}")
    return out


def summarize(spec: api.InferenceServiceSpec, per_pod: dict[str, dict[str, tuple[str, str | None]]]
              ) -> tuple[list[dict[str, Any]], tuple[bool, str, str]]:
    """status.adapters (per adapter: how many serving pods have it loaded, failed or pending, and a few examples of
    the failures) and the AdaptersReady condition (ok, reason, message) from each pod's states."""
    entries, failed, waiting = [], [], []
    for a in spec.adapters:
        counts = {"Loaded": 0, "Failed": 0, "Pending": 0}
        examples = []
        for pod, states in per_pod.items():
            state, message = states[a.name]
            counts[state if state in counts else "Pending"] += 1
            if state == "Failed":
                failed.append(f"{a.name} on {pod}: {message}")
            elif state != "Loaded":
                waiting.append(f"{a.name} on {pod}: {state}{f' ({message})' if message else ''}")
            if state in ("Failed", "Unknown") and len(examples) < MAX_EXAMPLES:
                examples.append({"pod": pod, "state": state,
                                 **({"message": message[:EXAMPLE_LENGTH]} if message else {})})
        entries.append({"name": a.name, "uri": a.uri, **({"revision": a.revision} if a.revision else {}),
                        "readyReplicas": counts["Loaded"], "failedReplicas": counts["Failed"],
                        "pendingReplicas": counts["Pending"], "errors": examples})
    total = len(spec.adapters) * len(per_pod)
    loaded = total - len(failed) - len(waiting)
    if failed:
        cond = (False, "AdapterLoadFailed", f"{loaded}/{total} adapter loads done; {len(failed)} failed: "
                + "; ".join(failed[:5]))
    elif waiting:
        cond = (False, "AdaptersLoading", f"{loaded}/{total} adapter loads done; " + "; ".join(waiting[:5]))
    elif not per_pod:
        cond = (False, "NoServingPods", "no serving pod to load the adapters into yet")
    else:
        cond = (True, "AllAdaptersLoaded", f"{len(spec.adapters)} adapters loaded on {len(per_pod)} serving pods")
    return entries, cond


@dataclass
class Observation:
    adapters: list[dict[str, Any]] | None  # status.adapters (None: no adapters declared)
    condition: tuple[bool, str, str] | None
    failures: list[tuple[str, str, str]]  # (adapter, pod, message) of failed loads
    repoll: float | None  # seconds until the pods should be asked again (None: only on the next event)


@dataclass
class AdapterReports:
    """Reads the sidecars' /status for the reconciler, and re-triggers it while adapters are settling."""

    trigger: Callable[[str, str], None]
    session: Any = None
    reported: dict[tuple[str, str], set[tuple[str, str, str]]] = field(default_factory=dict)  # failures evented
    timers: dict[tuple[str, str], asyncio.TimerHandle] = field(default_factory=dict)

    async def _read(self, url: str) -> tuple[dict[str, Any] | None, str | None]:
        import aiohttp

        if self.session is None:
            self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=STATUS_TIMEOUT))
        try:
            async with self.session.get(url + "/status") as r:
                if r.status != 200:
                    return None, f"its adapter-sync sidecar answered {r.status}"
                return await r.json(), None
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
            return None, f"its adapter-sync sidecar does not answer ({e.__class__.__name__})"

    async def observe(self, key: tuple[str, str], spec: api.InferenceServiceSpec, pods: list[dict[str, Any]],
                      multi: bool) -> Observation:
        if not spec.adapters:
            self.forget(key)
            return Observation(None, None, [], None)
        serving = serving_pods(pods, multi)
        urls = [sidecar_url(p) for p in serving]
        reads = await asyncio.gather(*(self._read(u) if u else _missing() for u in urls))
        per_pod = {p["metadata"]["name"]: replica_states(spec, report, why)
                   for p, (report, why) in zip(serving, reads)}
        entries, cond = summarize(spec, per_pod)
        failures = [(name, pod, msg or "") for pod, states in per_pod.items()
                    for name, (state, msg) in states.items() if state == "Failed"]
        states = [s for states in per_pod.values() for s, _ in states.values()]
        # no serving pod: their events (created, running) trigger the next look
        repoll = REPOLL_UNSETTLED if any(s not in ("Loaded", "Failed") for s in states) else \
            REPOLL_FAILED if failures else None
        self._schedule(key, repoll)
        return Observation(entries, cond, failures, repoll)

    def new_failures(self, key: tuple[str, str], failures: list[tuple[str, str, str]]) -> list[tuple[str, str, str]]:
        """Failures not reported by an Event yet: each (adapter, reason) once, naming the first pod it was seen on
        (one Event per pod would be adapters x pods Events on a big fleet)."""
        seen = self.reported.setdefault(key, set())
        fresh = []
        for adapter, pod, message in failures:
            if (adapter, "", message) not in seen:
                seen.add((adapter, "", message))
                fresh.append((adapter, pod, message))
        return fresh

    def _schedule(self, key: tuple[str, str], delay: float | None) -> None:
        timer = self.timers.pop(key, None)
        if timer is not None:
            timer.cancel()
        if delay is not None:
            self.timers[key] = asyncio.get_running_loop().call_later(delay, self.trigger, *key)

    def forget(self, key: tuple[str, str]) -> None:
        self._schedule(key, None)
        self.reported.pop(key, None)

    async def close(self) -> None:
        for timer in self.timers.values():
            timer.cancel()
        if self.session is not None:
            await self.session.close()
            self.session = None


async def _missing() -> tuple[None, str]:
    return None, "it has no adapter-sync sidecar yet (a pod of the template before engine.enableLora)"
