"""kopf handlers: InferenceService -> children, children -> InferenceService status.

How it fits together
--------------------
* kopf indexes (in-memory, fed by watch streams) hold every InferenceService and every child the operator
  manages (Deployments, StatefulSets, Services, ConfigMaps, NetworkPolicies, PodDisruptionBudgets, Pods),
  keyed by (namespace, InferenceService name). kopf fills them completely before any handler runs, so a
  restarted operator sees what exists and never duplicates it.
* Every trigger — the resource created, updated or resumed, or any event of one of its children — marks the
  InferenceService dirty and wakes one worker task per resource. The worker reconciles until it is clean:
  render the desired children (render.py), create the missing, merge-patch the drifted (a spec-hash
  annotation plus a subset comparison of the spec), delete the unwanted (uid preconditions), restart
  multi-pod groups that lost a rank, then compute status from the indexes and patch it when it changed.
  A failed pass (API errors, conflicts) is retried with exponential backoff (0.2 s .. 10 s).
* An invalid spec (see api.validate) sets Ready=False / reason InvalidSpec naming the field, phase Failed,
  and leaves the children alone.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import os
from dataclasses import dataclass, field
from typing import Any

import kopf

from shoal.operator import api, render
from shoal.operator.kube import CHILD_KINDS, ApiError, Kube, load_configuration
from shoal.operator.render import (A_SPEC_HASH, L_GROUP, L_ISVC, L_MANAGED_BY, MANAGED_BY,
                                   Plan, Settings)

logger = logging.getLogger("shoal.operator")

MANAGED_SELECTOR = f"{L_MANAGED_BY}={MANAGED_BY}"
# Pod problems worth a reason of their own (container waiting reasons seen on pods -> condition reason)
WAITING_REASONS = {
    "ImagePullBackOff": "ImagePullBackOff", "ErrImagePull": "ImagePullBackOff", "InvalidImageName": "ImagePullBackOff",
    "CrashLoopBackOff": "CrashLoopBackOff", "CreateContainerConfigError": "CreateContainerConfigError",
    "CreateContainerError": "CreateContainerConfigError", "RunContainerError": "CrashLoopBackOff",
}
# the more serious first: the Ready condition reports the worst one seen
SEVERITY = ["InvalidSpec", "CreateContainerConfigError", "ImagePullBackOff", "CrashLoopBackOff", "PodFailed",
            "ProgressDeadlineExceeded", "Unschedulable", "ProbeFailing", "GroupRestarting", "ModelLoading",
            "PodsPending"]
FATAL_WHEN_NOTHING_READY = {"CreateContainerConfigError", "ImagePullBackOff", "CrashLoopBackOff",
                            "ProgressDeadlineExceeded", "PodFailed"}


def settings_from_env() -> Settings:
    """shoal-operator's flags arrive as environment variables (kopf loads this module itself)."""
    return Settings(
        engine_image=os.environ.get("SHOAL_ENGINE_IMAGE") or render.DEFAULT_ENGINE_IMAGE,
        max_gpus_per_node=int(os.environ.get("SHOAL_MAX_GPUS_PER_NODE") or 8),
        cluster_domain=os.environ.get("SHOAL_CLUSTER_DOMAIN") or "cluster.local",
        operator_namespace=os.environ.get("SHOAL_OPERATOR_NAMESPACE") or os.environ.get("POD_NAMESPACE") or None,
    )


# ------------------------------------------------------------------------------------------------------ helpers
def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def _slim(body: Any) -> dict[str, Any]:
    """A plain copy of an object for the indexes (without managedFields, the bulk nobody reads)."""
    import copy

    obj = copy.deepcopy(dict(body))
    meta = dict(obj.get("metadata") or {})
    meta.pop("managedFields", None)
    obj["metadata"] = meta
    return obj


def _contains(actual: Any, desired: Any) -> bool:
    """Is `desired` a subset of `actual` (what the API server stores after defaulting)?"""
    if isinstance(desired, dict):
        return isinstance(actual, dict) and all(_contains(actual.get(k), v) for k, v in desired.items())
    if isinstance(desired, list):
        return isinstance(actual, list) and len(actual) == len(desired) and all(
            _contains(a, d) for a, d in zip(actual, desired))
    if isinstance(desired, (int, float)) and not isinstance(desired, bool) and isinstance(actual, str):
        return str(desired) == actual
    return actual == desired


def _drifted(actual: dict[str, Any], desired: dict[str, Any]) -> bool:
    a_meta, d_meta = actual.get("metadata", {}), desired["metadata"]
    if (a_meta.get("annotations") or {}).get(A_SPEC_HASH) != d_meta["annotations"][A_SPEC_HASH]:
        return True
    if not _contains(a_meta.get("labels") or {}, d_meta["labels"]):
        return True
    for key in ("spec", "data"):
        if key in desired and not _contains(actual.get(key), desired[key]):
            return True
    return False


def _owned_by(obj: dict[str, Any], uid: str) -> bool:
    return any(ref.get("uid") == uid and ref.get("controller") for ref in obj["metadata"].get("ownerReferences") or [])


def _ref(isvc: dict[str, Any]) -> dict[str, Any]:
    m = isvc["metadata"]
    return {"apiVersion": api.API_VERSION, "kind": api.KIND,
            "metadata": {"name": m["name"], "namespace": m["namespace"], "uid": m.get("uid")}}


def _event(isvc: dict[str, Any], type_: str, reason: str, message: str) -> None:
    """A Kubernetes Event on the InferenceService (kopf posts it in the background)."""
    kopf.event(_ref(isvc), type=type_, reason=reason, message=message)


def _pod_ready(pod: dict[str, Any]) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in (pod.get("status") or {}).get("conditions") or [])


def _terminating(obj: dict[str, Any]) -> bool:
    return bool(obj["metadata"].get("deletionTimestamp"))


def _restarts(pod: dict[str, Any]) -> int:
    status = pod.get("status") or {}
    return sum(int(c.get("restartCount") or 0)
               for c in (status.get("containerStatuses") or []) + (status.get("initContainerStatuses") or []))


def pod_problem(pod: dict[str, Any]) -> tuple[str, str] | None:
    """(reason, message) for a pod that is not serving, or None when it is ready."""
    name = pod["metadata"]["name"]
    status = pod.get("status") or {}
    if status.get("phase") == "Failed":
        return "PodFailed", f"pod {name} failed: {status.get('reason') or ''} {status.get('message') or ''}".strip()
    for cs in status.get("containerStatuses") or []:
        waiting = (cs.get("state") or {}).get("waiting") or {}
        reason = WAITING_REASONS.get(waiting.get("reason", ""))
        if reason:
            last = ((cs.get("lastState") or {}).get("terminated") or {})
            extra = f" (last exit: {last.get('reason')}, code {last.get('exitCode')})" if last else ""
            return reason, (f"pod {name} container {cs.get('name')}: {waiting.get('reason')}: "
                            f"{waiting.get('message') or ''}{extra}").strip()
    for cond in status.get("conditions") or []:
        if cond.get("type") == "PodScheduled" and cond.get("status") == "False":
            return "Unschedulable", f"pod {name} cannot be scheduled: {cond.get('message') or cond.get('reason')}"
    if _pod_ready(pod):
        return None
    statuses = status.get("containerStatuses") or []
    if statuses and all("running" in (cs.get("state") or {}) for cs in statuses):
        if all(cs.get("started") for cs in statuses):
            return "ProbeFailing", f"pod {name} is running but fails its readiness probe (/readyz)"
        return "ModelLoading", f"pod {name} is loading the model (startup probe /startupz not passed yet)"
    return "PodsPending", f"pod {name} is {status.get('phase') or 'Pending'}"


# ------------------------------------------------------------------------------------------------------- status
def _condition(type_: str, ok: bool, reason: str, message: str, previous: dict[str, dict], generation: int | None):
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
            _condition("Ready", False, "InvalidSpec", message, previous, gen),
            _condition("Progressing", False, "InvalidSpec", "children are left as they are until the spec is fixed",
                       previous, gen),
            _condition("Degraded", True, "InvalidSpec", message, previous, gen),
        ],
    }


def compute_status(isvc: dict[str, Any], plan: Plan, children: dict[tuple[str, str], dict],
                   pods: list[dict[str, Any]]) -> dict[str, Any]:
    spec = plan.spec
    desired = spec.replicas
    gen = isvc["metadata"].get("generation")
    previous = {c["type"]: c for c in (isvc.get("status") or {}).get("conditions") or []}
    live_pods = [p for p in pods if not _terminating(p)]
    problems: list[tuple[str, str]] = []
    deadline_exceeded = False

    if plan.multi_pod:
        n = plan.pods_per_replica
        replicas = ready = updated = 0
        for r in range(desired):
            sts = children.get(("StatefulSet", render.group_name(plan.name, r)))
            if sts is None:
                continue
            replicas += 1
            group = [p for p in live_pods if p["metadata"].get("labels", {}).get(L_GROUP) == str(r)]
            if len(group) == n and all(_pod_ready(p) for p in group):
                ready += 1
            sstatus = sts.get("status") or {}
            current = (sts["metadata"].get("generation") or 0) <= (sstatus.get("observedGeneration") or 0)
            if current and (sstatus.get("updatedReplicas") or 0) >= n:
                updated += 1
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

    for pod in live_pods:
        problem = pod_problem(pod)
        if problem:
            problems.append(problem)
    problems.sort(key=lambda p: SEVERITY.index(p[0]) if p[0] in SEVERITY else len(SEVERITY))
    worst = problems[0] if problems else None
    errors = [p for p in problems if p[0] not in ("ModelLoading", "PodsPending")]

    all_ready = desired > 0 and ready >= desired
    rolling = updated < desired or replicas > desired or not all_ready
    if desired == 0:
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
    elif 0 < ready < desired and not progressing[0]:
        degraded = (True, "ReplicasUnavailable", f"only {ready}/{desired} replicas ready")
    else:
        degraded = (False, "AsExpected", "no problem seen on the pods")

    if all_ready:
        phase = "Ready"
    elif ready > 0:
        phase = "Degraded"
    elif desired > 0 and worst and worst[0] in FATAL_WHEN_NOTHING_READY:
        phase = "Failed"
    elif any(p[0] in ("ModelLoading", "ProbeFailing") for p in problems):
        phase = "Loading"
    else:
        phase = "Pending"

    return {
        "phase": phase,
        "replicas": replicas,
        "readyReplicas": ready,
        "updatedReplicas": updated,
        "selector": plan.selector_str,
        "url": plan.url,
        "servedModelName": plan.served_model_name,
        "observedGeneration": gen,
        "conditions": [
            _condition("Ready", all_ready, ready_cond[0], ready_cond[1], previous, gen),
            _condition("Progressing", progressing[0], progressing[1], progressing[2], previous, gen),
            _condition("Degraded", degraded[0], degraded[1], degraded[2], previous, gen),
        ],
    }


def _status_changed(old: dict[str, Any], new: dict[str, Any]) -> bool:
    return any(old.get(k) != v for k, v in new.items())


# ---------------------------------------------------------------------------------------------------- reconciler
@dataclass
class Reconciler:
    kube: Kube
    settings: Settings
    indexes: dict[str, Any] = field(default_factory=dict)
    dirty: set[tuple[str, str]] = field(default_factory=set)
    tasks: dict[tuple[str, str], asyncio.Task] = field(default_factory=dict)
    max_backoff: float = 10.0
    plans: dict[tuple[str, str], tuple[tuple, Plan]] = field(default_factory=dict)

    def trigger(self, namespace: str, name: str) -> None:
        key = (namespace, name)
        self.dirty.add(key)
        task = self.tasks.get(key)
        if task is None or task.done():
            self.tasks[key] = asyncio.get_running_loop().create_task(self._worker(key), name=f"reconcile {key}")

    async def _worker(self, key: tuple[str, str]) -> None:
        failures = 0
        try:
            while key in self.dirty:
                self.dirty.discard(key)
                try:
                    await self.reconcile(*key)
                    failures = 0
                except asyncio.CancelledError:
                    raise
                except Exception as e:  # API errors, conflicts, timeouts: retry the whole pass
                    failures += 1
                    delay = min(0.2 * 2 ** (failures - 1), self.max_backoff)
                    level = logging.WARNING if failures > 2 else logging.INFO
                    logger.log(level, "reconcile %s/%s failed (%s); retrying in %.1fs", *key, e, delay)
                    self.dirty.add(key)
                    await asyncio.sleep(delay)
        finally:
            if self.tasks.get(key) is asyncio.current_task():
                del self.tasks[key]

    def _get(self, index: str, key: tuple[str, str]) -> list[dict[str, Any]]:
        idx = self.indexes.get(index)
        return list(idx.get(key, [])) if idx is not None else []

    def observed(self, key: tuple[str, str]) -> dict[tuple[str, str], dict[str, Any]]:
        found: dict[tuple[str, str], dict[str, Any]] = {}
        for kind in CHILD_KINDS:
            for obj in self._get(kind, key):
                found[(kind, obj["metadata"]["name"])] = obj
        return found

    async def reconcile(self, namespace: str, name: str) -> None:
        key = (namespace, name)
        isvcs = self._get(api.KIND, key)
        if not isvcs:
            self.plans.pop(key, None)
            return  # deleted: the garbage collector removes the children through their ownerReferences
        isvc = isvcs[0]
        if _terminating(isvc):
            return
        uid = isvc["metadata"].get("uid")
        old_status = isvc.get("status") or {}
        try:
            plan = self._plan(isvc)
        except api.SpecError as e:
            status = invalid_status(isvc, e)
            if _status_changed(old_status, status):
                await self.kube.merge_patch(api.KIND, namespace, name, {"status": status}, subresource="status")
                self._event_on_transition(isvc, old_status, status)
            return

        observed = self.observed(key)
        desired = {(o["kind"], o["metadata"]["name"]): o for o in plan.children}
        if any(ck not in observed for ck in desired) and not await self._still_exists(isvc):
            return  # deleted meanwhile (its DELETED event is still on its way): never resurrect its children
        created: list[str] = []
        for ck, obj in desired.items():
            actual = observed.get(ck)
            if actual is None:
                try:
                    await self.kube.create(obj)
                    created.append(f"{ck[0]} {ck[1]}")
                except ApiError as e:
                    if e.status != 409:  # 409: created by a previous pass whose watch event is still on its way
                        raise
            elif not _owned_by(actual, uid):
                _event(isvc, "Warning", "ChildConflict",
                          message=f"{ck[0]} {ck[1]} exists but is not owned by this InferenceService; not touching it")
            elif _drifted(actual, obj):
                patch = {k: v for k, v in obj.items() if k in ("spec", "data")}
                patch["metadata"] = {k: obj["metadata"][k] for k in ("labels", "annotations", "ownerReferences")}
                await self.kube.merge_patch(ck[0], namespace, ck[1], patch)
                logger.info("updated %s %s/%s", ck[0], namespace, ck[1])
        if created:
            _event(isvc, "Normal", "Created", message="created " + ", ".join(created))
        for ck, actual in observed.items():
            if ck not in desired and _owned_by(actual, uid) and not _terminating(actual):
                try:
                    await self.kube.delete(ck[0], namespace, ck[1], uid=actual["metadata"].get("uid"))
                    _event(isvc, "Normal", "Deleted", message=f"deleted {ck[0]} {ck[1]} (no longer wanted)")
                except ApiError as e:
                    if e.status not in (404, 409):
                        raise

        pods = [p for p in self._get("Pod", key)]
        if plan.multi_pod:
            await self.restart_broken_groups(isvc, plan, observed, pods)

        status = compute_status(isvc, plan, observed, pods)
        if _status_changed(old_status, status):
            try:
                await self.kube.merge_patch(api.KIND, namespace, name, {"status": status}, subresource="status")
            except ApiError as e:
                if e.status == 404:
                    return  # deleted while we worked
                raise
            self._event_on_transition(isvc, old_status, status)

    def _plan(self, isvc: dict[str, Any]) -> Plan:
        """render.plan, memoised per (uid, generation): every child event re-reconciles, the spec rarely changes."""
        meta = isvc["metadata"]
        key = (meta["namespace"], meta["name"])
        cache_key = (meta.get("uid"), meta.get("generation"))
        cached = self.plans.get(key)
        if cached is not None and cached[0] == cache_key and cache_key[1] is not None:
            return cached[1]
        plan = render.plan(isvc, self.settings)
        self.plans[key] = (cache_key, plan)
        return plan

    async def _still_exists(self, isvc: dict[str, Any]) -> bool:
        """Watch streams of different kinds are not ordered: children may vanish (garbage collection) before the
        owner's own DELETED event arrives. Creating children is the one step that asks the API first."""
        meta = isvc["metadata"]
        try:
            fresh = await self.kube.get(api.KIND, meta["namespace"], meta["name"])
        except ApiError as e:
            if e.status == 404:
                return False
            raise
        return fresh["metadata"].get("uid") == meta.get("uid") and not _terminating(fresh)

    async def restart_broken_groups(self, isvc: dict[str, Any], plan: Plan,
                                    observed: dict[tuple[str, str], dict], pods: list[dict[str, Any]]) -> None:
        """A torch.distributed job cannot lose a rank: when a member of a group failed, restarted or is gone,
        delete the whole group's pods so that the StatefulSet recreates them together. Groups whose pods run
        an outdated template (OnDelete updates) are restarted one at a time while all other groups are ready."""
        n = plan.pods_per_replica
        outdated: list[tuple[int, list[dict]]] = []
        unready_groups = 0
        for r in range(plan.spec.replicas):
            sts = observed.get(("StatefulSet", render.group_name(plan.name, r)))
            if sts is None:
                continue
            group = [p for p in pods if p["metadata"].get("labels", {}).get(L_GROUP) == str(r)]
            live = [p for p in group if not _terminating(p)]
            broken = [p for p in live if (p.get("status") or {}).get("phase") == "Failed" or _restarts(p) > 0]
            lost = bool(live) and len(live) < len(group)  # someone deleted or evicted a member
            if not all(_pod_ready(p) for p in live) or len(live) < n:
                unready_groups += 1
            if broken or lost:
                who = broken[0]["metadata"]["name"] if broken else "a member"
                why = "failed" if broken and (broken[0].get("status") or {}).get("phase") == "Failed" else \
                    "restarted" if broken else "was deleted"
                _event(isvc, "Warning", "GroupRestart",
                          message=f"{who} of group {r} {why}: restarting all {n} pods of the group together")
                await self._delete_pods(isvc, live)
                continue
            update_rev = (sts.get("status") or {}).get("updateRevision")
            if update_rev and live and any(p["metadata"].get("labels", {}).get("controller-revision-hash")
                                           not in (None, update_rev) for p in live):
                outdated.append((r, live))
        if outdated and unready_groups == 0:
            r, live = outdated[0]
            _event(isvc, "Normal", "GroupRollout", message=f"restarting group {r} on the new pod template")
            await self._delete_pods(isvc, live)

    async def _delete_pods(self, isvc: dict[str, Any], pods: list[dict[str, Any]]) -> None:
        ns = isvc["metadata"]["namespace"]
        for pod in pods:
            try:
                await self.kube.delete("Pod", ns, pod["metadata"]["name"], uid=pod["metadata"].get("uid"))
            except ApiError as e:
                if e.status not in (404, 409):
                    raise

    def _event_on_transition(self, isvc: dict[str, Any], old: dict[str, Any], new: dict[str, Any]) -> None:
        def ready(status: dict[str, Any]) -> tuple[str | None, str | None]:
            for c in status.get("conditions") or []:
                if c.get("type") == "Ready":
                    return c.get("status"), c.get("reason")
            return None, None

        before, after = ready(old), ready(new)
        if before == after:
            return
        cond = next(c for c in new["conditions"] if c["type"] == "Ready")
        if after[0] == "True":
            _event(isvc, "Normal", "Ready", message=cond["message"])
        elif after[1] in ("ModelLoading", "PodsPending", "ReplicasNotReady", "ScaledToZero"):
            _event(isvc, "Normal", after[1], message=cond["message"])
        else:
            _event(isvc, "Warning", after[1] or "NotReady", message=cond["message"])


# ------------------------------------------------------------------------------------------------ kopf handlers
@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=api.GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=api.GROUP, key="last-handled-configuration")
    settings.posting.level = logging.WARNING  # only explicit kopf.info/warn become Events, not every log line
    settings.watching.server_timeout = 600
    settings.watching.connect_timeout = 30
    settings.networking.request_timeout = 60
    settings.networking.error_backoffs = [0.5, 1, 2, 5, 10]
    for child in (("apps", "v1", "deployments"), ("apps", "v1", "statefulsets"), ("", "v1", "services"),
                  ("", "v1", "configmaps"), ("", "v1", "pods"), ("networking.k8s.io", "v1", "networkpolicies"),
                  ("policy", "v1", "poddisruptionbudgets")):
        settings.watching.label_selectors[child] = MANAGED_SELECTOR  # server-side filtering of the watches
    if "reconciler" not in memo:
        memo.reconciler = Reconciler(kube=Kube.from_environment(), settings=settings_from_env())
    logger.info("shoal-operator: engine image %s, %d GPUs per node", memo.reconciler.settings.engine_image,
                memo.reconciler.settings.max_gpus_per_node)


@kopf.on.login()
def login(**_: Any) -> kopf.ConnectionInfo:
    """kopf's own connection, from the same configuration as the operator's client (see kube.load_configuration):
    in-cluster service account, else $KUBECONFIG as it is when the operator starts."""
    try:
        cfg = load_configuration()
    except Exception as e:
        raise kopf.LoginError(f"cannot authenticate neither in-cluster nor via kubeconfig: {e}") from e
    header = cfg.get_api_key_with_prefix("BearerToken") or cfg.get_api_key_with_prefix("authorization")
    parts = header.split(" ", 1) if header else []
    scheme, token = (None, None) if not parts else (None, parts[0]) if len(parts) == 1 else (parts[0], parts[1])
    return kopf.ConnectionInfo(
        server=cfg.host, ca_path=cfg.ssl_ca_cert, insecure=not cfg.verify_ssl,
        username=cfg.username or None, password=cfg.password or None, scheme=scheme, token=token,
        certificate_path=cfg.cert_file, private_key_path=cfg.key_file,
    )


@kopf.on.cleanup()
async def cleanup(memo: kopf.Memo, **_: Any) -> None:
    reconciler: Reconciler | None = memo.get("reconciler")
    if reconciler is not None:
        for task in list(reconciler.tasks.values()):
            task.cancel()
        reconciler.kube.close()


# Indexes: (namespace, InferenceService name) -> objects. kopf passes them to handlers by these names.
@kopf.index(api.GROUP, api.VERSION, api.PLURAL)
def isvc_index(namespace: str, name: str, body: kopf.Body, **_: Any) -> dict:
    return {(namespace, name): _slim(body)}


def _child_index(namespace: str, labels: dict, body: kopf.Body) -> dict:
    owner = labels.get(L_ISVC)
    return {(namespace, owner): _slim(body)} if owner else {}


_MANAGED = {L_MANAGED_BY: MANAGED_BY}


@kopf.index("apps", "v1", "deployments", labels=_MANAGED)
def deployment_index(namespace: str, labels: dict, body: kopf.Body, **_: Any) -> dict:
    return _child_index(namespace, labels, body)


@kopf.index("apps", "v1", "statefulsets", labels=_MANAGED)
def statefulset_index(namespace: str, labels: dict, body: kopf.Body, **_: Any) -> dict:
    return _child_index(namespace, labels, body)


@kopf.index("", "v1", "services", labels=_MANAGED)
def service_index(namespace: str, labels: dict, body: kopf.Body, **_: Any) -> dict:
    return _child_index(namespace, labels, body)


@kopf.index("", "v1", "configmaps", labels=_MANAGED)
def configmap_index(namespace: str, labels: dict, body: kopf.Body, **_: Any) -> dict:
    return _child_index(namespace, labels, body)


@kopf.index("networking.k8s.io", "v1", "networkpolicies", labels=_MANAGED)
def networkpolicy_index(namespace: str, labels: dict, body: kopf.Body, **_: Any) -> dict:
    return _child_index(namespace, labels, body)


@kopf.index("policy", "v1", "poddisruptionbudgets", labels=_MANAGED)
def pdb_index(namespace: str, labels: dict, body: kopf.Body, **_: Any) -> dict:
    return _child_index(namespace, labels, body)


@kopf.index("", "v1", "pods", labels=_MANAGED)
def pod_index(namespace: str, labels: dict, body: kopf.Body, **_: Any) -> dict:
    return _child_index(namespace, labels, body)


INDEX_KWARGS = {
    api.KIND: "isvc_index", "Deployment": "deployment_index", "StatefulSet": "statefulset_index",
    "Service": "service_index", "ConfigMap": "configmap_index", "NetworkPolicy": "networkpolicy_index",
    "PodDisruptionBudget": "pdb_index", "Pod": "pod_index",
}


def _trigger(memo: kopf.Memo, kwargs: dict[str, Any], namespace: str | None, name: str | None) -> None:
    reconciler: Reconciler = memo.reconciler
    if not reconciler.indexes:
        reconciler.indexes = {kind: kwargs[arg] for kind, arg in INDEX_KWARGS.items()}
    if namespace and name:
        reconciler.trigger(namespace, name)


@kopf.on.resume(api.GROUP, api.VERSION, api.PLURAL)
@kopf.on.create(api.GROUP, api.VERSION, api.PLURAL)
@kopf.on.update(api.GROUP, api.VERSION, api.PLURAL)
async def isvc_changed(namespace: str, name: str, memo: kopf.Memo, **kwargs: Any) -> None:
    _trigger(memo, kwargs, namespace, name)


@kopf.on.event("apps", "v1", "deployments", labels=_MANAGED)
@kopf.on.event("apps", "v1", "statefulsets", labels=_MANAGED)
@kopf.on.event("", "v1", "services", labels=_MANAGED)
@kopf.on.event("", "v1", "configmaps", labels=_MANAGED)
@kopf.on.event("networking.k8s.io", "v1", "networkpolicies", labels=_MANAGED)
@kopf.on.event("policy", "v1", "poddisruptionbudgets", labels=_MANAGED)
@kopf.on.event("", "v1", "pods", labels=_MANAGED)
async def child_changed(namespace: str, labels: dict, memo: kopf.Memo, **kwargs: Any) -> None:
    """Drift repair and status: any change of a child (incl. its deletion) re-reconciles its owner."""
    _trigger(memo, kwargs, namespace, labels.get(L_ISVC))


__all__ = ["Reconciler", "compute_status", "invalid_status", "pod_problem", "settings_from_env"]
