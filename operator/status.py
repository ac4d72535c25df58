"""Status diagnosis: what the children and pods say about an InferenceService, as its status.

Pure functions of the objects kopf's indexes hold (no I/O): ``compute_status`` aggregates the children of a valid
spec into phase, replica counts and the Ready / Progressing / Degraded conditions, naming the worst problem seen
on a pod (``pod_problem``) with the API's own words; ``invalid_status`` is the status of a refused spec.
"""

from __future__ import annotations

import datetime
import json
from dataclasses import dataclass
from typing import Any

from shoal.operator import api, canary, render
from shoal.operator.contract import A_SLEEPING
from shoal.operator.render import A_REVISION, DOWNLOAD_CONTAINER, L_GROUP, Plan

# Pod problems worth a reason of their own (container waiting reasons seen on pods -> condition reason)
WAITING_REASONS = {
    "ImagePullBackOff": "ImagePullBackOff", "ErrImagePull": "ImagePullBackOff", "InvalidImageName": "ImagePullBackOff",
    "ErrImageNeverPull": "ImagePullBackOff",
    "CrashLoopBackOff": "CrashLoopBackOff", "CreateContainerConfigError": "CreateContainerConfigError",
    "CreateContainerError": "CreateContainerConfigError", "RunContainerError": "CrashLoopBackOff",
}
# the more serious first: the Ready condition reports the worst one seen
SEVERITY = ["InvalidSpec", "ChildRejected", "FailedCreate", "CreateContainerConfigError", "ModelImagePullBackOff",
            "ImagePullBackOff", "CrashLoopBackOff", "PodFailed", "ProgressDeadlineExceeded", "Unschedulable", "ProbeFailing",
            "GroupRestarting", "ModelDownloadTimeout", "ModelDownloading", "ModelLoading", "PodsPending"]
FATAL_WHEN_NOTHING_READY = {"ChildRejected", "FailedCreate", "ModelDownloadTimeout", "CreateContainerConfigError",
                            "ModelImagePullBackOff", "ImagePullBackOff", "CrashLoopBackOff", "ProgressDeadlineExceeded",
                            "PodFailed"}


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def pod_ready(pod: dict[str, Any]) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in (pod.get("status") or {}).get("conditions") or [])


def asleep(pod: dict[str, Any]) -> bool:
    """Parked asleep by the autoscaler (scaleToZero sleep): not Ready on purpose, not a problem."""
    return bool((pod["metadata"].get("annotations") or {}).get(A_SLEEPING)) and not pod_ready(pod)


def terminating(obj: dict[str, Any]) -> bool:
    return bool(obj["metadata"].get("deletionTimestamp"))


ENGINE_CONTAINER = "engine"


def restarts(pod: dict[str, Any]) -> int:
    """Restarts of the pod's engine container — not of its init containers (a model download that retried, a hub
    hiccup, never joined the torch.distributed group) nor of its sidecars (an adapter-sync restart leaves the
    engine and its rank running): only the engine's failure restarts a group."""
    status = pod.get("status") or {}
    return sum(int(c.get("restartCount") or 0) for c in status.get("containerStatuses") or []
               if c.get("name") == ENGINE_CONTAINER)


@dataclass(frozen=True)
class Group:
    """What is observed about one group."""

    index: int
    revision: str | None  # of its StatefulSet's template
    current: bool  # the StatefulSet carries the desired revision
    ready: bool  # every rank Ready, running the StatefulSet's template as observed by its controller
    updated: bool  # current, and every rank runs that template
    pods: tuple[dict[str, Any], ...] = ()



def _index(sts: dict[str, Any]) -> int | None:
    value = (sts["metadata"].get("labels") or {}).get(L_GROUP, "")
    return int(value) if value.isdigit() else None


def observe_groups(statefulsets: list[dict[str, Any]], pods: list[dict[str, Any]], size: int,
            revision: str) -> list[Group]:
    """Groups from the live (not terminating) StatefulSets and pods of one InferenceService."""
    groups = []
    for sts in statefulsets:
        index = _index(sts)
        if index is None or sts["metadata"].get("deletionTimestamp"):
            continue
        members = tuple(p for p in pods if (p["metadata"].get("labels") or {}).get(L_GROUP) == str(index)
                        and not p["metadata"].get("deletionTimestamp"))
        status = sts.get("status") or {}
        seen = (sts["metadata"].get("generation") or 0) <= (status.get("observedGeneration") or 0)
        update_rev = status.get("updateRevision")
        on_template = seen and all(
            (p["metadata"].get("labels") or {}).get("controller-revision-hash") in (None, update_rev)
            for p in members)
        ready = len(members) == size and all(pod_ready(p) for p in members) and on_template
        own = (sts["metadata"].get("annotations") or {}).get(A_REVISION)
        groups.append(Group(index=index, revision=own, current=own == revision, ready=ready, pods=members,
                            updated=own == revision and on_template and len(members) == size))
    return sorted(groups, key=lambda g: g.index)



def admission_failures(children: dict[tuple[str, str], dict]) -> list[tuple[str, str]]:
    """Pods a workload controller could not create (quota exceeded, Pod Security admission, a webhook): the
    Deployment controller reports them as the condition ReplicaFailure / FailedCreate with the API's message."""
    found = []
    for (kind, name), obj in sorted(children.items()):
        for cond in (obj.get("status") or {}).get("conditions") or []:
            if cond.get("type") == "ReplicaFailure" and cond.get("status") == "True":
                found.append(("FailedCreate", f"{kind.lower()} {name} cannot create pods: "
                                              f"{cond.get('message') or cond.get('reason')}"))
    return found


def _seconds_since(timestamp: str | None, now: datetime.datetime) -> int | None:
    try:
        started = datetime.datetime.fromisoformat((timestamp or "").replace("Z", "+00:00"))
    except ValueError:
        return None
    return max(0, int((now - started).total_seconds()))


def _download_problem(pod: dict[str, Any], now: datetime.datetime, budget: int | None) -> tuple[str, str] | None:
    """The model download (init container) has its own budget: a slow, healthy download is progress."""
    name = pod["metadata"]["name"]
    for cs in (pod.get("status") or {}).get("initContainerStatuses") or []:
        if cs.get("name") != DOWNLOAD_CONTAINER:
            continue
        running = (cs.get("state") or {}).get("running")
        if running is None:
            return None
        elapsed = _seconds_since(running.get("startedAt"), now)
        so_far = f"{elapsed // 60} min so far" if elapsed is not None else "started"
        if budget is not None and elapsed is not None and elapsed > budget:
            return "ModelDownloadTimeout", (f"pod {name} has downloaded the model for {so_far}, beyond its budget "
                                            f"of {budget} s (spec.probes.downloadTimeoutSeconds)")
        return "ModelDownloading", (f"pod {name} is downloading the model ({so_far}; progress: kubectl logs "
                                    f"{name} -c {DOWNLOAD_CONTAINER})")
    return None


def model_cache_status(pods: list[dict[str, Any]], location: str | None = None) -> dict[str, Any] | None:
    """status.modelCache: the summary the newest pod's download init container left as its termination message
    (podtools/download.py) — its entry and what the cache held then — with the number of live pods that reported
    the same entry, and `location`, where the cache is."""
    reports = []
    for pod in pods:
        for cs in (pod.get("status") or {}).get("initContainerStatuses") or []:
            done = (cs.get("state") or {}).get("terminated") or {}
            if cs.get("name") == DOWNLOAD_CONTAINER and done.get("exitCode") == 0:
                try:
                    summary = json.loads(done.get("message") or "")["modelCache"]
                except (ValueError, KeyError, TypeError):
                    continue
                if isinstance(summary, dict) and isinstance(summary.get("entry"), str):
                    reports.append((done.get("finishedAt") or "", summary))
    if not reports:
        return None
    _, newest = max(reports, key=lambda r: r[0])
    out = {k: newest[k] for k in ("entry", "commit", "sizeBytes", "verified", "fetched") if newest.get(k) is not None}
    out["pods"] = sum(1 for _, r in reports if r.get("entry") == newest["entry"])
    if isinstance(newest.get("evicted"), list) and newest["evicted"]:
        out["evicted"] = [str(e) for e in newest["evicted"][:5]]
    if location:
        out["volume"] = location
    inventory = newest.get("cache") if isinstance(newest.get("cache"), dict) else {}
    for theirs, ours in (("entries", "cachedEntries"), ("usedBytes", "usedBytes"), ("capBytes", "capBytes")):
        if isinstance(inventory.get(theirs), int):
            out[ours] = inventory[theirs]
    recent = [e for e in inventory.get("recent") or [] if isinstance(e, dict) and isinstance(e.get("entry"), str)]
    if recent:
        out["cached"] = [{k: e[k] for k in ("entry", "sizeBytes", "lastUsed", "leases") if e.get(k) is not None}
                         for e in recent[:10]]
    return out


def _probe_path(pod: dict[str, Any], probe: str) -> str:
    """' (/readyz)': the engine container's probe path, which depends on the runtime (vLLM's is /health)."""
    for c in (pod.get("spec") or {}).get("containers") or []:
        if c.get("name") == "engine":
            path = ((c.get(probe) or {}).get("httpGet") or {}).get("path")
            return f" ({path.partition('?')[0]})" if path else ""  # (not a held probe's ?wait=)
    return ""


def _model_image(pod: dict[str, Any], container: str, said: str) -> str | None:
    """The reference of the image volume (an oci:// model) a pull failure of `container` is about: the kubelet
    pulls image volumes before the containers mounting them start, and reports a failed pull on each of those
    containers with the volume's reference in the message ("Failed to pull image \"REF\": ...")."""
    spec = pod.get("spec") or {}
    refs = {v["name"]: v["image"]["reference"] for v in spec.get("volumes") or []
            if isinstance(v.get("image"), dict) and v["image"].get("reference")}
    for c in (spec.get("containers") or []) + (spec.get("initContainers") or []):
        if c.get("name") == container:
            for m in c.get("volumeMounts") or []:
                if m.get("name") in refs and refs[m["name"]] in said:
                    return refs[m["name"]]
    return None


def model_image_problem(pod: str, ref: str, reason: str | None, message: str | None) -> tuple[str, str]:
    return "ModelImagePullBackOff", (
        f"pod {pod} cannot pull the model image oci://{ref} (spec.model.uri): {reason}: {message or ''} (check the "
        "reference, spec.imagePullSecrets for a private registry, and that the cluster supports image volumes)")


def pending_on_volumes(pod: dict[str, Any]) -> bool:
    """Not started yet, no container reporting why (ContainerCreating): where Kubernetes 1.31's kubelet left a pod
    whose image volume it could not pull, saying so only in the pod's Events."""
    problem = pod_problem(pod)
    return ((pod.get("status") or {}).get("phase") in (None, "Pending") and not terminating(pod)
            and problem is not None and problem[0] == "PodsPending")


def pod_problem(pod: dict[str, Any], now: datetime.datetime | None = None,
                download_budget: int | None = None) -> tuple[str, str] | None:
    """(reason, message) for a pod that is not serving, or None when it is ready."""
    name = pod["metadata"]["name"]
    status = pod.get("status") or {}
    if status.get("phase") == "Failed":
        return "PodFailed", f"pod {name} failed: {status.get('reason') or ''} {status.get('message') or ''}".strip()
    for cs in (status.get("initContainerStatuses") or []) + (status.get("containerStatuses") or []):
        waiting = (cs.get("state") or {}).get("waiting") or {}
        reason = WAITING_REASONS.get(waiting.get("reason", ""))
        if reason:
            last = ((cs.get("lastState") or {}).get("terminated") or {})
            extra = f" (last exit: {last.get('reason')}, code {last.get('exitCode')})" if last else ""
            said = (last.get("message") or "").strip().splitlines()
            if said and cs.get("name") == DOWNLOAD_CONTAINER:  # its termination message: why (the cache is full...)
                extra += f": {said[-1][:300]}"
            ref = _model_image(pod, cs.get("name"), waiting.get("message") or "") if reason == "ImagePullBackOff" \
                else None
            if ref:  # not the engine's image: the model's, which only a right reference (or a pull secret) fixes
                return model_image_problem(name, ref, waiting.get("reason"), waiting.get("message"))
            return reason, (f"pod {name} container {cs.get('name')}: {waiting.get('reason')}: "
                            f"{waiting.get('message') or ''}{extra}").strip()
    for cond in status.get("conditions") or []:
        if cond.get("type") == "PodScheduled" and cond.get("status") == "False":
            return "Unschedulable", f"pod {name} cannot be scheduled: {cond.get('message') or cond.get('reason')}"
    if pod_ready(pod):
        return None
    downloading = _download_problem(pod, now or datetime.datetime.now(datetime.timezone.utc), download_budget)
    if downloading:
        return downloading
    statuses = status.get("containerStatuses") or []
    if statuses and all("running" in (cs.get("state") or {}) for cs in statuses):
        if all(cs.get("started") for cs in statuses):
            return "ProbeFailing", (f"pod {name} is running but fails its readiness probe"
                                    f"{_probe_path(pod, 'readinessProbe')}")
        return "ModelLoading", (f"pod {name} is loading the model (startup probe{_probe_path(pod, 'startupProbe')} "
                                "not passed yet)")
    return "PodsPending", f"pod {name} is {status.get('phase') or 'Pending'}"


# ------------------------------------------------------------------------------------------------------- status
def condition(type_: str, ok: bool, reason: str, message: str, previous: dict[str, dict], generation: int | None):
    status = "True" if ok else "False"
    prev = previous.get(type_)
    ltt = prev.get("lastTransitionTime") if prev and prev.get("status") == status else None
    return {"type": type_, "status": status, "reason": reason, "message": message[:32000],
            "lastTransitionTime": ltt or _now(), "observedGeneration": generation}


def invalid_status(isvc: dict[str, Any], error: api.SpecError) -> dict[str, Any]:
    previous = {c["type"]: c for c in (isvc.get("status") or {}).get("conditions") or []}
    gen = isvc["metadata"].get("generation")
    message = f"{error.field}: {error.message}"
    return {
        "phase": "Failed", "observedGeneration": gen,
        "conditions": [
            condition("Ready", False, "InvalidSpec", message, previous, gen),
            condition("Progressing", False, "InvalidSpec", "children are left as they are until the spec is fixed",
                       previous, gen),
            condition("Degraded", True, "InvalidSpec", message, previous, gen),
        ],
    }


def autoscaled_serving(plan: Plan, ready: int, desired: int, errors: list[tuple[str, str]],
                       worst: tuple[str, str] | None, sleeping: int = 0) -> tuple[bool, tuple[str, str] | None]:
    """Ready means "requests will be served". An autoscaled fleet that adds replicas keeps serving on those it
    has (a scale-up is not degradation), and one at zero — or coming back from it — whose gateway holds requests
    and wakes the autoscaler serves them once a replica is up. -> (serving, the Ready reason and message; None:
    the plain rules apply)."""
    spec = plan.spec
    if spec.autoscaling is None or ready >= desired > 0:
        return False, None
    where = f"serving {plan.served_model_name} at {plan.url}"
    if ready > 0:
        tail = f"; {worst[1]}" if worst else ""
        return True, ("ScalingUp", f"{ready}/{desired} replicas ready, the others starting; {where}{tail}")
    if not render.scales_from_zero(spec) or errors:
        return False, None
    if desired == 0 and sleeping:
        return True, ("ScaledToZero", f"idle at 0 replicas awake, {sleeping} parked asleep (pods kept): the gateway "
                                      f"holds a request and wakes one; {where}")
    if desired == 0:
        return True, ("ScaledToZero", f"idle at 0 replicas: the gateway holds requests and wakes the autoscaler, "
                                      f"the first answers wait for a replica to start; {where}")
    tail = f": {worst[1]}" if worst else ""
    return True, ("ScalingFromZero", f"0/{desired} replicas ready; the gateway holds requests until one is{tail}")


def _image_volume_hint(spec: api.InferenceServiceSpec, message: str) -> str:
    """An API server without the ImageVolume feature drops an oci:// model's `image` volume source ("must specify
    a volume type") or, older still, does not know the field: say what the volume is."""
    if spec.model.uri.startswith("oci://") and "volumes" in message:
        return (f"{message} (spec.model.uri {spec.model.uri} is mounted as an image volume: the cluster needs the "
                "ImageVolume feature, Kubernetes >= 1.31, on by default from 1.33)")
    return message


def compute_status(isvc: dict[str, Any], plan: Plan, children: dict[tuple[str, str], dict],
                   pods: list[dict[str, Any]], rejected: list[str] = (),
                   failed_creates: list[tuple[str, str]] = (),
                   now: datetime.datetime | None = None) -> dict[str, Any]:
    """`rejected`: the API's messages for children the API refused to create or change (422, admission);
    `failed_creates`: (reason, message) of workloads whose pods cannot be created, from Events."""
    spec = plan.spec
    desired = spec.replicas
    gen = isvc["metadata"].get("generation")
    previous = {c["type"]: c for c in (isvc.get("status") or {}).get("conditions") or []}
    canary_pods = [p for p in pods if canary.canary_pod(p)]
    # the canary's are judged apart (canary_status), the prefill role's too (prefill_status)
    pods = [p for p in pods if not canary.canary_pod(p) and not _prefill_pod(p)]
    live_pods = [p for p in pods if not terminating(p)]
    # scaleToZero sleep: parked pods are part of the count but not of what should be Ready
    sleeping = sum(1 for p in live_pods if asleep(p)) if plan.spec.autoscaling else 0
    problems: list[tuple[str, str]] = []
    deadline_exceeded = False

    if plan.multi_pod:
        groups = observe_groups([o for (kind, _), o in children.items() if kind == "StatefulSet"], live_pods,
                                plan.pods_per_replica, plan.revision)
        replicas, ready, updated = len(groups), sum(g.ready for g in groups), sum(g.updated for g in groups)
    else:
        dep = children.get(("Deployment", plan.name)) or {}
        dstatus = dep.get("status") or {}
        current = bool(dep) and (dep["metadata"].get("generation") or 0) <= (dstatus.get("observedGeneration") or 0)
        replicas = int(dstatus.get("replicas") or 0)
        ready = int(dstatus.get("readyReplicas") or 0) if current else min(int(dstatus.get("readyReplicas") or 0),
                                                                            desired)
        updated = int(dstatus.get("updatedReplicas") or 0) if current else 0
        for cond in dstatus.get("conditions") or []:
            if cond.get("type") == "Progressing" and cond.get("reason") == "ProgressDeadlineExceeded":
                deadline_exceeded = True
                problems.append(("ProgressDeadlineExceeded",
                                 f"deployment {plan.name}: {cond.get('message') or 'rollout stalled'}"))

    problems += [("ChildRejected", _image_volume_hint(spec, message)) for message in rejected]
    problems += admission_failures(children) + list(failed_creates)
    budget = spec.probes.download_timeout_seconds if spec.model.uri.startswith("hf://") else None
    for pod in live_pods:
        problem = None if asleep(pod) else pod_problem(pod, now, budget)
        if problem and plan.multi_pod and problem[0] in ("PodFailed", "CrashLoopBackOff") and (
                (pod.get("status") or {}).get("phase") == "Failed" or restarts(pod) > 0):
            # heals by itself: the reconciler restarts the whole group (restart_broken_groups), never Failed
            problem = ("GroupRestarting", f"{problem[1]}; restarting all ranks of its group together")
        if problem:
            problems.append(problem)
    if any(p[0] == "ModelDownloading" for p in problems):  # the rollout deadline does not count the download
        deadline_exceeded = False
        problems = [p for p in problems if p[0] != "ProgressDeadlineExceeded"]
    problems.sort(key=lambda p: SEVERITY.index(p[0]) if p[0] in SEVERITY else len(SEVERITY))
    worst = problems[0] if problems else None
    errors = [p for p in problems if p[0] not in ("ModelDownloading", "ModelLoading", "PodsPending")]

    awake = max(desired - sleeping, 0)  # replicas that should be Ready
    all_ready = awake > 0 and ready >= awake
    rolling = updated < desired or replicas > desired or (not all_ready and not (sleeping and awake == 0))
    serving, serving_cond = autoscaled_serving(plan, ready, awake, errors, worst, sleeping)
    if serving_cond is not None:
        ready_cond = serving_cond
    elif desired == 0:
        ready_cond = ("ScaledToZero", "spec.replicas is 0: nothing serves requests")
    elif all_ready:
        ready_cond = ("AllReplicasReady", f"{ready}/{desired} replicas ready; serving {plan.served_model_name} "
                                          f"at {plan.url}")
    elif worst:
        ready_cond = (worst[0], f"{ready}/{desired} replicas ready; {worst[1]}")
    else:
        ready_cond = ("ReplicasNotReady", f"{ready}/{desired} replicas ready")

    if deadline_exceeded:
        progressing = (False, "ProgressDeadlineExceeded", "the rollout made no progress within its deadline")
    elif rolling and desired > 0:
        what = "rolling out a new pod template" if updated < desired else "waiting for replicas to become ready"
        progressing = (True, "RollingOut" if updated < desired else "ReplicasStarting",
                       f"{what}: {updated}/{desired} updated, {ready}/{desired} ready")
    else:
        progressing = (False, "RolloutComplete", f"{updated}/{desired} replicas run the current spec")

    if errors:
        degraded = (True, errors[0][0], errors[0][1])
    elif 0 < ready < awake and not progressing[0]:
        degraded = (True, "ReplicasUnavailable", f"only {ready}/{awake} replicas ready")
    else:
        degraded = (False, "AsExpected", "no problem seen on the pods")

    if all_ready or serving:
        phase = "Ready"
    elif ready > 0:
        phase = "Degraded"
    elif desired > 0 and worst and worst[0] in FATAL_WHEN_NOTHING_READY:
        phase = "Failed"
    elif any(p[0] in ("ModelDownloading", "ModelLoading", "ProbeFailing") for p in problems):
        phase = "Loading"
    else:
        phase = "Pending"

    cache = model_cache_status(live_pods, render.cache_location(plan.name, spec))
    return {
        **({"modelCache": cache} if cache else {}),
        "phase": phase,
        "replicas": replicas,
        "readyReplicas": ready,
        "ready": f"{min(ready, desired)}/{desired}",
        "updatedReplicas": updated,
        "selector": plan.selector_str,
        "url": plan.url,
        "servedModelName": plan.served_model_name,
        "observedGeneration": gen,
        "conditions": [
            condition("Ready", all_ready or serving, ready_cond[0], ready_cond[1], previous, gen),
            condition("Progressing", progressing[0], progressing[1], progressing[2], previous, gen),
            condition("Degraded", degraded[0], degraded[1], degraded[2], previous, gen),
            # conditions owned by others (the autoscaler's; AdaptersReady, set by the reconciler) stay as they are
            *(c for t, c in previous.items() if t not in ("Ready", "Progressing", "Degraded", *CANARY_CONDITIONS)),
            *canary_conditions(isvc, plan, children, canary_pods, previous, now),
        ],
        "canary": canary_status(isvc, plan, children),
        "prefill": prefill_status(plan, children, (isvc.get("status") or {}).get("prefill")),
    }


def _prefill_pod(pod: dict[str, Any]) -> bool:
    return ((pod.get("metadata") or {}).get("labels") or {}).get(api.contract.L_COMPONENT) == "prefill"


# status.prefill's fields the autoscaler writes (spec.prefill.autoscaling): kept as they are while it autoscales,
# removed when prefill.autoscaling goes (the prefill count is spec.prefill.replicas again)
PREFILL_AUTOSCALER_FIELDS = ("desiredReplicas", "neededReplicas", "reason", "message", "lastDecisionTime",
                             "lastScaleTime", "inputs")


def prefill_status(plan: Plan, children: dict[tuple[str, str], dict],
                   old: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """status.prefill: the prefill role's pods and how many are Ready (its Deployment's count), next to the
    autoscaler's fields (`old`, the stored status.prefill). Not part of the service's Ready: without prefill
    engines the decode engines prefill themselves."""
    if plan.spec.prefill is None:
        return None
    dstatus = (children.get(("Deployment", render.prefill_name(plan.name))) or {}).get("status") or {}
    new: dict[str, Any] = {"replicas": int(dstatus.get("replicas") or 0),
                           "readyReplicas": int(dstatus.get("readyReplicas") or 0)}
    old = old or {}
    autoscaled = plan.spec.prefill.autoscaling is not None
    new.update({k: old[k] if autoscaled else None for k in PREFILL_AUTOSCALER_FIELDS if k in old})
    return new


CANARY_CONDITIONS = (canary.CONDITION_READY, canary.CONDITION_ROLLED_BACK)


def _canary_ready(plan: Plan, children: dict[tuple[str, str], dict]) -> tuple[int, int]:
    dep = children.get(("Deployment", render.canary_name(plan.name))) or {}
    dstatus = dep.get("status") or {}
    return int(dstatus.get("replicas") or 0), int(dstatus.get("readyReplicas") or 0)


def canary_status(isvc: dict[str, Any], plan: Plan, children: dict[tuple[str, str], dict]) -> dict | None:
    """status.canary: the reconciler's part (revision, share, replicas); the figures and the rollback record are
    the canary judge's (canary_judge.py) and are kept while the revision is the same."""
    if plan.canary is None:
        return None  # removed from the spec (or promoted): so is everything said about it
    old = (isvc.get("status") or {}).get("canary") or {}
    replicas, ready = _canary_ready(plan, children)
    new = {"revision": plan.canary_revision, "trafficPercent": plan.canary_percent,
           "split": canary.split(plan.canary_percent), "replicas": replicas, "readyReplicas": ready}
    if old.get("revision") == plan.canary_revision:
        new.update({k: old[k] for k in ("stable", "canary", "figuresTime", "rollback") if k in old})
    else:  # a new revision: the last one's figures say nothing of it (null removes them in the merge patch)
        new.update({"stable": None, "canary": None, "figuresTime": None})
        if (old.get("rollback") or {}).get("revision") != plan.canary_revision:
            new["rollback"] = None
    return new


def canary_conditions(isvc: dict[str, Any], plan: Plan, children: dict[tuple[str, str], dict],
                      pods: list[dict[str, Any]], previous: dict[str, dict],
                      now: datetime.datetime | None) -> list[dict]:
    """CanaryReady (the reconciler's) and CanaryRolledBack (the judge's, kept while it names this revision)."""
    if plan.canary is None:
        return []
    gen = isvc["metadata"].get("generation")
    rolled = previous.get(canary.CONDITION_ROLLED_BACK)
    if canary.rolled_back(plan.spec, isvc.get("status")):
        ready = condition(canary.CONDITION_READY, False, "RolledBack", "the canary broke its SLO and was rolled back "
                          "(status.canary.rollback); change its model, image or engine options, or remove "
                          "spec.canary, to try again", previous, gen)
        return [ready, *([rolled] if rolled else [])]
    want = plan.canary.replicas
    _, ready_n = _canary_ready(plan, children)
    problems = [p for p in (pod_problem(pod, now) for pod in pods if not terminating(pod)) if p]
    if ready_n >= want:
        ready = condition(canary.CONDITION_READY, True, "CanaryServing",
                          f"{ready_n}/{want} canary replicas ready, receiving {plan.canary_percent}% of the "
                          "conversations", previous, gen)
    else:
        reason, detail = problems[0] if problems else ("ReplicasNotReady", "")
        ready = condition(canary.CONDITION_READY, False, reason,
                          f"{ready_n}/{want} canary replicas ready" + (f"; {detail}" if detail else ""), previous, gen)
    return [ready]


def status_changed(old: dict[str, Any], new: dict[str, Any]) -> bool:
    """Would patching `new` change the stored status (a no-op patch still costs an API call)?"""
    return any(old.get(k) != v for k, v in new.items())
