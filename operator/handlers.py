"""kopf handlers: the reconciler (InferenceService -> children) and its wiring into kopf.

How it fits together
--------------------
* kopf indexes (in-memory, fed by watch streams) hold every InferenceService and every child the operator
  manages (Deployments, StatefulSets, Services, ConfigMaps, NetworkPolicies, PodDisruptionBudgets, Pods),
  keyed by (namespace, InferenceService name). kopf fills them completely before any handler runs, so a
  restarted operator sees what exists and never duplicates it.
* Every trigger — the resource created, updated or resumed, or any event of one of its children — adds the
  InferenceService to a work queue (workqueue.py): one worker task per resource reconciles until it is clean:
  render the desired children (render/), server-side apply the missing and the drifted (a spec-hash
  annotation plus a subset comparison of the spec; apply removes what is no longer rendered, see kube.py),
  delete the unwanted (uid preconditions), restart
  multi-pod groups that lost a rank, then compute status from the indexes (status.py) and patch it when it
  changed.
  A failed pass (API errors, conflicts) is retried with exponential backoff (0.2 s .. 10 s). (kopf's own
  retries belong to its change handlers, which child events do not reach, and a kopf daemon per resource would
  put a finalizer on every InferenceService: hence this one small queue.)
* A pass is a short sequence of named steps (``Reconciler.reconcile``): desired children with the rollout's next
  step, apply, delete the unwanted, restart broken groups, write the status.
* The kopf wiring is one table (``CHILDREN``, ``OWNER``): per watched kind an index, a watch label selector
  and an event handler; kopf injects the indexes into the handlers, which hand them to the reconciler.
  The autoscaler (autoscaler.py) only starts and stops with the operator here and watches on its own;
  ``shoal.operator.HANDLER_MODULES`` lists the modules.
* An invalid spec (see api.validate) sets Ready=False / reason InvalidSpec naming the field, phase Failed,
  and leaves the children alone.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Callable

import kopf

from shoal.operator import adapters, api, canary, render, rollout, status, upgrade
from shoal.operator.kube import CHILD_KINDS, KINDS, OPTIONAL_KINDS, WATCHED_KINDS, ApiError, Kube, load_configuration
from shoal.operator.render import (A_SPEC_HASH, L_GROUP, L_ISVC, L_MANAGED_BY, MANAGED_BY,
                                   Plan, Settings)
from shoal.operator.workqueue import WorkQueue

logger = logging.getLogger("shoal.operator")

MANAGED_SELECTOR = f"{L_MANAGED_BY}={MANAGED_BY}"
# API answers that refuse a child for what it is (schema, admission webhooks, policies): shown on the status,
# not only logged; 403 too, since admission webhooks and missing RBAC both answer it
REJECTED = (400, 403, 422)
MODEL_IMAGE_PODS_CHECKED = 3  # pending pods whose Events one pass reads for an oci:// model's failed pull


class ChildrenRejected(Exception):
    """The API refused some children; the status says which and why."""


class OwnerGone(Exception):
    """The InferenceService was deleted (or replaced) while a pass was about to write its children."""
def settings_from_env() -> Settings:
    """shoal-operator's flags arrive as environment variables (kopf loads this module itself)."""
    return Settings(
        engine_image=os.environ.get("SHOAL_ENGINE_IMAGE") or render.DEFAULT_ENGINE_IMAGE,
        gateway_image=os.environ.get("SHOAL_GATEWAY_IMAGE") or render.DEFAULT_GATEWAY_IMAGE,
        fleet_image=os.environ.get("SHOAL_FLEET_IMAGE") or render.DEFAULT_FLEET_IMAGE,
        max_gpus_per_node=int(os.environ.get("SHOAL_MAX_GPUS_PER_NODE") or 8),
        max_concurrent_upgrades=int(os.environ.get("SHOAL_MAX_CONCURRENT_UPGRADES") or 1),
        cluster_domain=os.environ.get("SHOAL_CLUSTER_DOMAIN") or "cluster.local",
        operator_namespace=os.environ.get("SHOAL_OPERATOR_NAMESPACE") or os.environ.get("POD_NAMESPACE") or None,
        metrics_namespaces=tuple(ns.strip() for ns in (os.environ.get("SHOAL_METRICS_NAMESPACES") or "").split(",")
                                 if ns.strip()),
        shared_gateway=os.environ.get("SHOAL_SHARED_GATEWAY") or None,
        shared_gateway_routing=os.environ.get("SHOAL_SHARED_GATEWAY_ROUTING") or None,
    )


# ------------------------------------------------------------------------------------------------------ helpers
def _slim(body: Any) -> dict[str, Any]:
    """A plain copy of an object for the indexes (without managedFields, the bulk nobody reads)."""
    obj = copy.deepcopy(dict(body))
    meta = dict(obj.get("metadata") or {})
    meta.pop("managedFields", None)
    obj["metadata"] = meta
    return obj


def _same_quantity(actual: Any, desired: Any) -> bool:
    """The API server stores quantities canonically ("1024Mi" comes back as "1Gi", "2000m" as "2")."""
    from kubernetes.utils import parse_quantity

    try:
        return parse_quantity(actual) == parse_quantity(desired)
    except (ValueError, TypeError, ArithmeticError):
        return False


def _contains(actual: Any, desired: Any) -> bool:
    """Is `desired` a subset of `actual` (what the API server stores after defaulting and canonicalising)?"""
    if isinstance(desired, dict):
        return isinstance(actual, dict) and all(_contains(actual.get(k), v) for k, v in desired.items())
    if isinstance(desired, list):
        return isinstance(actual, list) and len(actual) == len(desired) and all(
            _contains(a, d) for a, d in zip(actual, desired))
    if actual == desired:
        return True
    if isinstance(desired, (int, float)) and not isinstance(desired, bool) and isinstance(actual, str):
        return str(desired) == actual or _same_quantity(actual, desired)
    return isinstance(desired, str) and isinstance(actual, (str, int)) and _same_quantity(actual, desired)


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


def _canary_rolled_back(isvc: dict[str, Any]) -> Any:
    """The canary revision the judge rolled back (status.canary.rollback.revision), which the plan follows."""
    return (((isvc.get("status") or {}).get("canary") or {}).get("rollback") or {}).get("revision")


def _autoscaled_replicas(isvc: dict[str, Any]) -> Any:
    """The autoscaler's replica counts (status.autoscaling.desiredReplicas, and the prefill role's
    status.prefill.desiredReplicas), which the plan follows: a status change, so it moves no generation."""
    status = isvc.get("status") or {}
    return ((status.get("autoscaling") or {}).get("desiredReplicas"),
            (status.get("prefill") or {}).get("desiredReplicas"))


# ---------------------------------------------------------------------------------------------------- reconciler
@dataclass
class Desired:
    """What one reconcile pass wants of the children."""

    children: dict[tuple[str, str], dict[str, Any]]  # (kind, name) -> manifest to apply
    keep: set[tuple[str, str]] = field(default_factory=set)  # outdated groups that still serve: left alone
    in_place: set[tuple[str, str]] = field(default_factory=set)  # groups replaced in place (maxSurge 0)


@dataclass
class Reconciler:
    kube: Kube
    settings: Settings
    indexes: dict[str, Any] = field(default_factory=dict)
    max_backoff: float = 10.0
    recheck_interval: float = 30.0
    # whether this replica leads (kopf's peering, as leadership.py reads it): a standby's indexes are stale, since
    # kopf closes its watches, so its recheck loop must not reconcile from them
    leading: Callable[[], bool] = lambda: True
    plans: dict[tuple[str, str], tuple[tuple, Plan]] = field(default_factory=dict)
    upgrades: upgrade.Upgrades = field(default_factory=upgrade.Upgrades)
    queue: WorkQueue = field(init=False)
    recheck_task: asyncio.Task | None = field(default=None, init=False)
    adapter_reports: adapters.AdapterReports = field(init=False)
    _events: set[asyncio.Task] = field(default_factory=set, init=False)  # Events being posted

    def __post_init__(self) -> None:
        self.queue = WorkQueue(lambda key: self.reconcile(*key), name="reconcile", max_backoff=self.max_backoff)
        self.adapter_reports = adapters.AdapterReports(trigger=self.trigger)

    def _event(self, isvc: dict[str, Any], type_: str, reason: str, message: str) -> None:
        """A Kubernetes Event on the InferenceService, posted in the background (k8s.events); best effort."""
        task = asyncio.get_running_loop().create_task(self.kube.event(isvc, type_, reason, message))
        self._events.add(task)
        task.add_done_callback(self._events.discard)

    def trigger(self, namespace: str, name: str, indexes: dict[str, Any] | None = None) -> None:
        """Queue a reconcile of the InferenceService. `indexes`: kopf's, as the calling handler got them (the same
        objects every time; the first call also starts the recheck loop)."""
        if indexes is not None and not self.indexes:
            self.indexes = indexes
            self.recheck_task = asyncio.get_running_loop().create_task(self.recheck_forever(), name="recheck")
        self.queue.add((namespace, name))

    def stop(self) -> None:
        self.queue.cancel()
        if self.recheck_task is not None:
            self.recheck_task.cancel()
        for timer in self.adapter_reports.timers.values():
            timer.cancel()

    async def recheck_forever(self) -> None:
        """What no watch reports — pods a StatefulSet keeps failing to create (Events only), a model download
        outliving its budget — is found by reconciling every InferenceService that is not Ready now and then.
        (A kopf timer would do it too, but timers put a finalizer on every object.)"""
        while True:
            await asyncio.sleep(self.recheck_interval)
            if not self.leading():
                continue
            for key in list(self.indexes.get(api.KIND) or {}):
                isvcs = self._get(api.KIND, key)
                conditions = ((isvcs[0] if isvcs else {}).get("status") or {}).get("conditions") or []
                if not any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions):
                    self.trigger(*key)

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
        """One pass, in the order of LeaderWorkerSet's Reconcile: desired state (rollout included), apply,
        delete, restart broken groups, status."""
        key = (namespace, name)
        isvc = self._current(key)
        if isvc is None:
            return
        isvc, pinned, started = self._pin_engine_image(key, isvc)
        if ((isvc.get("spec") or {}).get("canary") or {}).get("promote") is True and await self._promote(isvc):
            return  # the spec changed: its update event reconciles the promoted service
        try:
            plan = self._plan(isvc)
            await self._check_cache_claim(namespace, plan.spec)
        except api.SpecError as e:
            await self._write_status(isvc, status.invalid_status(isvc, e))
            return
        observed, pods = self.observed(key), self._get("Pod", key)
        want = self._desired(isvc, plan, observed, pods)
        try:
            rejected = await self._apply(isvc, want, observed)
        except OwnerGone:
            return  # deleted meanwhile (its DELETED event is still on its way): never resurrect its children
        await self._delete_unwanted(isvc, want, observed)
        if plan.multi_pod:
            await self.restart_broken_groups(isvc, plan, observed, pods)
        failed = await self._failed_creates(namespace, observed, pods, plan.pods_per_replica) if plan.multi_pod else []
        failed += await self._model_image_failures(namespace, plan.spec, pods)
        new_status = status.compute_status(isvc, plan, observed, pods, rejected, failed_creates=failed)
        if pinned:
            new_status["engineImage"] = pinned
        self._upgrade_condition(key, isvc, started, new_status)
        await self._adapter_status(isvc, plan, pods, new_status)
        await self._write_status(isvc, new_status)
        if self.upgrades.observe(key, new_status):  # an upgrade slot is free: the services waiting for one
            for other in list(self.indexes.get(api.KIND) or {}):
                found = self._get(api.KIND, other)
                if found and other != key and (found[0].get("status") or {}).get("engineImage") not in (
                        None, self.settings.engine_image):
                    self.trigger(*other)
        if rejected:  # an admission webhook or a policy may change its mind: retry, with the worker's backoff
            raise ChildrenRejected("; ".join(rejected))

    async def _adapter_status(self, isvc: dict[str, Any], plan: Plan, pods: list[dict[str, Any]],
                              new_status: dict[str, Any]) -> None:
        """status.adapters and the AdaptersReady condition from the pods' adapter-sync sidecars (adapters.py),
        and an Event for each failed load."""
        meta = isvc["metadata"]
        seen = await self.adapter_reports.observe((meta["namespace"], meta["name"]), plan.spec, pods, plan.multi_pod)
        previous = {c["type"]: c for c in (isvc.get("status") or {}).get("conditions") or []}
        conditions = [c for c in new_status["conditions"] if c["type"] != adapters.CONDITION]
        if seen.condition is not None:
            ok, reason, message = seen.condition
            conditions.append(status.condition(adapters.CONDITION, ok, reason, message, previous,
                                               meta.get("generation")))
        new_status["conditions"] = conditions
        new_status["adapters"] = seen.adapters
        for adapter, pod, message in self.adapter_reports.new_failures((meta["namespace"], meta["name"]),
                                                                       seen.failures):
            self._event(isvc, "Warning", "AdapterLoadFailed", message=f"adapter {adapter} on pod {pod}: {message}")

    async def _promote(self, isvc: dict[str, Any]) -> bool:
        """spec.canary.promote: write the canary's fields into the stable spec and remove spec.canary, in one patch
        on the version read (canary.promoted_spec). An invalid spec is not promoted (the pass reports it); ->
        whether the spec was patched."""
        meta = isvc["metadata"]
        namespace, name = meta["namespace"], meta["name"]
        for _attempt in range(5):
            spec = isvc.get("spec") or {}
            if (spec.get("canary") or {}).get("promote") is not True:
                return True  # promoted, or withdrawn, since the pass read it
            try:
                api.validate(name, spec, max_gpus_per_node=self.settings.max_gpus_per_node)
            except api.SpecError:
                return False
            patch = {"metadata": {"resourceVersion": isvc["metadata"].get("resourceVersion")},
                     "spec": canary.promoted_spec(spec)}
            try:
                await self.kube.merge_patch(api.KIND, namespace, name, patch)
                break
            except ApiError as e:
                if e.status == 404:
                    return True
                if e.status != 409:
                    raise
            # changed since read (often only its status, which triggers no pass): promote the version that is there
            try:
                isvc = await self.kube.get(api.KIND, namespace, name)
            except ApiError as e:
                if e.status == 404:
                    return True
                raise
        else:
            raise RuntimeError(f"{namespace}/{name}: spec.canary.promote kept conflicting (retried with backoff)")
        self._event(isvc, "Normal", "CanaryPromoted", "the canary is now the stable revision: spec.canary's model, "
                    "image and engine options were moved into the spec and spec.canary removed")
        return True

    def _upgrade_condition(self, key: tuple[str, str], isvc: dict[str, Any], started: bool,
                           new_status: dict[str, Any]) -> None:
        """upgrade.CONDITION: set when this pass starts a move to the default image, cleared once it rolled out."""
        old_status = isvc.get("status") or {}
        found = self.upgrades.condition(key, started, old_status, new_status, self.settings.engine_image)
        if found is not None:
            previous = {c["type"]: c for c in old_status.get("conditions") or []}
            new_status["conditions"] = [c for c in new_status["conditions"] if c["type"] != upgrade.CONDITION] + [
                status.condition(upgrade.CONDITION, *found, previous, isvc["metadata"].get("generation"))]

    def _pin_engine_image(self, key: tuple[str, str],
                          isvc: dict[str, Any]) -> tuple[dict[str, Any], str | None, bool]:
        """The default engine image this service runs, pinned in its status (upgrade.py): -> the InferenceService
        as the plan must see it, the image to write to its status (None with spec.image), and whether this pass
        starts moving it to the default image."""
        default = self.settings.engine_image
        everyone = [(k, found[0]) for k in list(self.indexes.get(api.KIND) or {}) if (found := self._get(api.KIND, k))]
        runtime = (isvc.get("spec") or {}).get("runtime") or "shoal"
        pinned, started = self.upgrades.pin(key, isvc, default, upgrade.workload_image(self.observed(key), runtime),
                                            self.settings.max_concurrent_upgrades, everyone)
        if started:
            self._event(isvc, "Normal", "EngineImageUpgrade",
                   message=f"moving to the operator's engine image {default} (was "
                           f"{(isvc.get('status') or {}).get('engineImage') or 'unpinned'})")
        if pinned and (isvc.get("status") or {}).get("engineImage") != pinned:
            isvc = {**isvc, "status": {**(isvc.get("status") or {}), "engineImage": pinned}}
        return isvc, pinned, started

    def _current(self, key: tuple[str, str]) -> dict[str, Any] | None:
        """The InferenceService to reconcile, or None when it is gone (the garbage collector removes its
        children through their ownerReferences) or terminating."""
        isvcs = self._get(api.KIND, key)
        if not isvcs:
            self.plans.pop(key, None)
            return None
        return None if status.terminating(isvcs[0]) else isvcs[0]

    def _desired(self, isvc: dict[str, Any], plan: Plan, observed: dict[tuple[str, str], dict],
                 pods: list[dict[str, Any]]) -> Desired:
        """The children this pass wants: the plan's, plus for multi-pod replicas the groups of the rollout's next
        step (rollout.step) — outdated groups that still serve are kept, not wanted, until they are retired."""
        want = Desired({(o["kind"], o["metadata"]["name"]): o for o in plan.children})
        # users' batch files and results: turning batches (or the gateway) off keeps them; they go with the service
        want.keep.add(("PersistentVolumeClaim", render.batches_claim_name(plan.name)))
        if not plan.multi_pod:
            return want
        uid = isvc["metadata"].get("uid")
        groups = status.observe_groups([o for (kind, _), o in observed.items() if kind == "StatefulSet"
                                        and _owned_by(o, uid)], pods, plan.pods_per_replica, plan.revision)
        move = rollout.step(groups, plan.spec.replicas, plan.spec.rollout.max_surge, plan.spec.rollout.max_unavailable)
        for g in groups:
            if g.index in move.retire:
                continue
            service, sts = plan.group(g.index)
            sts_key = ("StatefulSet", sts["metadata"]["name"])
            want.children[("Service", service["metadata"]["name"])] = service
            if g.current or g.index in move.update:
                want.children[sts_key] = sts
                if g.index in move.update:
                    want.in_place.add(sts_key)
            else:
                want.keep.add(sts_key)
        for index in move.create:
            want.children.update({(o["kind"], o["metadata"]["name"]): o for o in plan.group(index)})
        self._rollout_events(isvc, move, bool(groups))
        return want

    async def _apply(self, isvc: dict[str, Any], want: Desired, observed: dict[tuple[str, str], dict]) -> list[str]:
        """Server-side apply the missing and the drifted children; -> what the API refused, for the status."""
        namespace, uid = isvc["metadata"]["namespace"], isvc["metadata"].get("uid")
        created: list[str] = []
        rejected: list[str] = []
        made: list[tuple[str, str, str]] = []  # (kind, name, uid) of what this pass's applies created
        checked = False
        for ck, obj in want.children.items():
            actual = observed.get(ck)
            if actual is not None and not _owned_by(actual, uid):
                self._event(isvc, "Warning", "ChildConflict",
                       message=f"{ck[0]} {ck[1]} exists but is not owned by this InferenceService; not touching it")
                continue
            if actual is not None and not _drifted(actual, obj):
                continue
            # The indexes lag the API (watch streams of different kinds are not ordered): before the pass's first
            # write ask the API whether the owner still exists. An apply creates what is missing, even a child the
            # garbage collector just removed along with its deleted owner.
            if not checked:
                if not await self._still_exists(isvc):
                    raise OwnerGone(f"{namespace}/{isvc['metadata']['name']}")
                checked = True
            try:
                written = await self.kube.apply(obj)  # creates, updates and removes fields we no longer render
            except ApiError as e:
                if e.status == 422 and ck in want.in_place and actual is not None:
                    # a StatefulSet field that cannot change (volumeClaimTemplates, ...): the group goes down
                    # anyway, so replace the StatefulSet; the next pass creates it on the new spec
                    await self.kube.delete(ck[0], namespace, ck[1], uid=actual["metadata"].get("uid"))
                    self._event(isvc, "Normal", "GroupRecreate", message=f"recreating {ck[1]}: {e.message}")
                    continue
                if e.status == 404 and ck[0] in OPTIONAL_KINDS:  # its CRD is not installed
                    group = KINDS[ck[0]][0].split("/")[0]
                    rejected.append(f"{ck[0]} {ck[1]}: the cluster does not serve {KINDS[ck[0]][1]}.{group}; install "
                                    "the Gateway API and Gateway API Inference Extension CRDs, or remove "
                                    "spec.inferencePool")
                    continue
                if e.status not in REJECTED:
                    raise
                rejected.append(f"{ck[0]} {ck[1]} rejected by the API ({e.status} {e.reason}): {e.message}")
                continue
            if (written.get("metadata") or {}).get("uid") != ((actual or {}).get("metadata") or {}).get("uid"):
                made.append((ck[0], ck[1], written["metadata"]["uid"]))
            if actual is None:
                created.append(f"{ck[0]} {ck[1]}")
            else:
                logger.info("updated %s %s/%s", ck[0], namespace, ck[1])
        if made and not await self._still_exists(isvc):
            # deleted between the check and an apply that created a child: take back what this pass created (uid
            # preconditions: only those objects), instead of leaving it to the garbage collector
            for kind, name, child_uid in made:
                try:
                    await self.kube.delete(kind, namespace, name, uid=child_uid)
                except ApiError as e:
                    if e.status not in (404, 409):
                        raise
            raise OwnerGone(f"{namespace}/{isvc['metadata']['name']}")
        if created:
            self._event(isvc, "Normal", "Created", message="created " + ", ".join(created))
        return rejected

    async def _delete_unwanted(self, isvc: dict[str, Any], want: Desired,
                               observed: dict[tuple[str, str], dict]) -> None:
        """Delete owned children that are neither wanted nor kept (uid preconditions: never a successor)."""
        namespace, uid = isvc["metadata"]["namespace"], isvc["metadata"].get("uid")
        for ck, actual in observed.items():
            if ck in want.children or ck in want.keep or not _owned_by(actual, uid) or status.terminating(actual):
                continue
            try:
                await self.kube.delete(ck[0], namespace, ck[1], uid=actual["metadata"].get("uid"))
                self._event(isvc, "Normal", "Deleted", message=f"deleted {ck[0]} {ck[1]} (no longer wanted)")
            except ApiError as e:
                if e.status not in (404, 409):
                    raise

    async def _write_status(self, isvc: dict[str, Any], new_status: dict[str, Any]) -> None:
        """Patch the status when it changed, and post an Event when readiness did."""
        old_status = isvc.get("status") or {}
        if not status.status_changed(old_status, new_status):
            return
        meta = isvc["metadata"]
        # The conditions list is replaced whole (a merge patch): with the resourceVersion it was computed from, so
        # a newer condition of the autoscaler's is never overwritten by an older copy (409: the pass is retried
        # on the fresh object)
        patch = {"metadata": {"resourceVersion": meta.get("resourceVersion")}, "status": new_status}
        try:
            await self.kube.merge_patch(api.KIND, meta["namespace"], meta["name"], patch, subresource="status")
        except ApiError as e:
            if e.status == 404:
                return  # deleted while we worked
            raise
        self._event_on_transition(isvc, old_status, new_status)

    async def _check_cache_claim(self, namespace: str, spec: api.InferenceServiceSpec) -> None:
        """A model cache (model.cache.size: the eviction cap) larger than the existing claim it lives on would fill
        the volume before eviction starts: refused before anything is applied. A claim the operator cannot read
        (missing: the pods wait for it, as Kubernetes does) is not checked."""
        cache = spec.model.cache
        if not cache.claim_name or spec.cache_size() is None:
            return
        try:
            claim = await self.kube.get("PersistentVolumeClaim", namespace, cache.claim_name)
        except Exception:  # not found, or not readable: nothing to compare with
            return
        from kubernetes.utils import parse_quantity

        have = ((claim.get("status") or {}).get("capacity") or {}).get("storage") or (
            ((claim.get("spec") or {}).get("resources") or {}).get("requests") or {}).get("storage")
        if have and parse_quantity(str(spec.cache_size())) > parse_quantity(str(have)):
            raise api.SpecError("spec.model.cache.size", f"{spec.cache_size()} is larger than the claim "
                                f"{cache.claim_name} ({have}): the cache would fill the volume before evicting")

    def _plan(self, isvc: dict[str, Any]) -> Plan:
        """render.plan, memoised per (uid, generation, autoscaler's replica count): every child event
        re-reconciles, the spec rarely changes."""
        meta = isvc["metadata"]
        key = (meta["namespace"], meta["name"])
        cache_key = (meta.get("uid"), meta.get("generation"), _autoscaled_replicas(isvc),
                     (isvc.get("status") or {}).get("engineImage"), _canary_rolled_back(isvc))
        cached = self.plans.get(key)
        if cached is not None and cached[0] == cache_key and cache_key[1] is not None:
            return cached[1]
        plan = render.plan(isvc, self.settings)
        self.plans[key] = (cache_key, plan)
        return plan

    async def _still_exists(self, isvc: dict[str, Any]) -> bool:
        """Watch streams of different kinds are not ordered: children may vanish (garbage collection) before the
        owner's own DELETED event arrives. Writing children is the one step that asks the API first."""
        meta = isvc["metadata"]
        try:
            fresh = await self.kube.get(api.KIND, meta["namespace"], meta["name"])
        except ApiError as e:
            if e.status == 404:
                return False
            raise
        return fresh["metadata"].get("uid") == meta.get("uid") and not status.terminating(fresh)

    async def _failed_creates(self, namespace: str, observed: dict[tuple[str, str], dict],
                              pods: list[dict[str, Any]], size: int) -> list[tuple[str, str]]:
        """A StatefulSet reports pods it cannot create (quota, Pod Security admission) only as Events: read them
        for the groups that miss pods (a Deployment has the ReplicaFailure condition instead)."""
        found = []
        for (kind, name), sts in sorted(observed.items()):
            index = (sts["metadata"].get("labels") or {}).get(L_GROUP)
            if kind != "StatefulSet" or status.terminating(sts) or index is None:
                continue
            if sum(1 for p in pods if (p["metadata"].get("labels") or {}).get(L_GROUP) == index) >= size:
                continue
            events = await self.kube.list("Event", namespace, field_selector=(
                f"involvedObject.kind=StatefulSet,involvedObject.name={name},reason=FailedCreate"))
            events = [e for e in events if (e.get("involvedObject") or {}).get("name") == name
                      and (e.get("involvedObject") or {}).get("uid") in (None, sts["metadata"].get("uid"))
                      and e.get("reason") == "FailedCreate"]
            if events:
                latest = max(events, key=lambda e: e.get("lastTimestamp") or e.get("eventTime") or "")
                found.append(("FailedCreate", f"statefulset {name} cannot create pods: {latest.get('message')}"))
        return found

    async def _model_image_failures(self, namespace: str, spec: api.InferenceServiceSpec,
                                    pods: list[dict[str, Any]]) -> list[tuple[str, str]]:
        """An oci:// model's image volume the kubelet cannot pull, where only the pod's Events say so (Kubernetes
        1.31 leaves such a pod ContainerCreating; later kubelets report it on the container: status.pod_problem).
        Read for a few pending pods of the service at most."""
        if not spec.model.uri.startswith("oci://"):
            return []
        ref = spec.model.uri[len("oci://"):]
        for pod in [p for p in pods if status.pending_on_volumes(p)][:MODEL_IMAGE_PODS_CHECKED]:
            name = pod["metadata"]["name"]
            events = await self.kube.list("Event", namespace, field_selector=(
                f"involvedObject.kind=Pod,involvedObject.name={name},type=Warning"))
            said = [e for e in events if (e.get("involvedObject") or {}).get("name") == name
                    and (e.get("involvedObject") or {}).get("uid") in (None, pod["metadata"].get("uid"))
                    and f'"{ref}"' in (e.get("message") or "")]
            if said:
                latest = max(said, key=lambda e: e.get("lastTimestamp") or e.get("eventTime") or "")
                return [status.model_image_problem(name, ref, latest.get("reason"), latest.get("message"))]
        return []

    def _rollout_events(self, isvc: dict[str, Any], move: rollout.Step, had_groups: bool) -> None:
        for index in move.create:
            if had_groups:
                self._event(isvc, "Normal", "GroupSurge", message=f"starting group {index} on the current spec")
        for index in move.retire:
            self._event(isvc, "Normal", "GroupRetire", message=f"retiring group {index} (outdated or surplus)")
        for index in move.update:
            self._event(isvc, "Normal", "GroupRollout", message=f"replacing group {index} in place (maxSurge 0)")

    async def restart_broken_groups(self, isvc: dict[str, Any], plan: Plan,
                                    observed: dict[tuple[str, str], dict], pods: list[dict[str, Any]]) -> None:
        """A torch.distributed job cannot lose a rank: when a member of a group failed, restarted or is gone,
        delete the whole group's pods so that the StatefulSet recreates them together. A group updated in place
        (OnDelete) gets its pods restarted together once its controller has seen the new template."""
        n = plan.pods_per_replica
        for (kind, sts_name), sts in observed.items():
            index = (sts["metadata"].get("labels") or {}).get(L_GROUP)
            if kind != "StatefulSet" or index is None or status.terminating(sts):
                continue
            group = [p for p in pods if p["metadata"].get("labels", {}).get(L_GROUP) == index]
            live = [p for p in group if not status.terminating(p)]
            broken = [p for p in live if (p.get("status") or {}).get("phase") == "Failed" or status.restarts(p) > 0]
            lost = bool(live) and len(live) < len(group)  # someone deleted or evicted a member
            if broken or lost:
                who = broken[0]["metadata"]["name"] if broken else "a member"
                why = "failed" if broken and (broken[0].get("status") or {}).get("phase") == "Failed" else \
                    "restarted" if broken else "was deleted"
                self._event(isvc, "Warning", "GroupRestart",
                       message=f"{who} of group {index} {why}: restarting all {n} pods of the group together")
                await self._delete_pods(isvc, live)
                continue
            update_rev = (sts.get("status") or {}).get("updateRevision")
            if update_rev and live and any(p["metadata"].get("labels", {}).get("controller-revision-hash")
                                           not in (None, update_rev) for p in live):
                self._event(isvc, "Normal", "GroupRestart", message=f"restarting group {index} on its new pod template")
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
        def ready(status: dict[str, Any], type_: str = "Ready") -> tuple[str | None, str | None]:
            for c in status.get("conditions") or []:
                if c.get("type") == type_:
                    return c.get("status"), c.get("reason")
            return None, None

        if ready(new, adapters.CONDITION)[0] == "True" and ready(old, adapters.CONDITION)[0] != "True":
            cond = next(c for c in new["conditions"] if c["type"] == adapters.CONDITION)
            self._event(isvc, "Normal", "AdaptersReady", message=cond["message"])
        before, after = ready(old), ready(new)
        if before == after:
            return
        cond = next(c for c in new["conditions"] if c["type"] == "Ready")
        if after[0] == "True":
            self._event(isvc, "Normal", "Ready", message=cond["message"])
        elif after[1] in ("ModelDownloading", "ModelLoading", "PodsPending", "ReplicasNotReady", "ScaledToZero"):
            self._event(isvc, "Normal", after[1], message=cond["message"])
        else:
            self._event(isvc, "Warning", after[1] or "NotReady", message=cond["message"])


# ------------------------------------------------------------------------------------------------ kopf handlers
def scope_settings(settings: kopf.OperatorSettings, rbac_scope: str) -> None:
    """What kopf may ask the API for. A namespaced install (`--rbac-scope namespace`: Roles in the watched
    namespaces, no ClusterRole) turns kopf's scanning off: kopf otherwise lists and watches CRDs and namespaces
    cluster-wide at every start, is refused, logs the refusals and backs off before it serves anything. Off, it
    discovers the resources once at start (API discovery, which every authenticated user may read) and serves the
    -n namespaces by name."""
    settings.scanning.disabled = rbac_scope == "namespace"


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
    # how long a replica that died (no clean exit) keeps leading before a standby takes over (--peering-lifetime)
    settings.peering.lifetime = int(os.environ.get("SHOAL_PEERING_LIFETIME") or settings.peering.lifetime)
    scope_settings(settings, os.environ.get("SHOAL_RBAC_SCOPE") or "cluster")
    for w in CHILDREN:  # server-side filtering of the child watches
        settings.watching.label_selectors[(w.group, w.version, w.plural)] = MANAGED_SELECTOR
    if "reconciler" not in memo:
        memo.reconciler = Reconciler(kube=Kube.from_environment(), settings=settings_from_env(),
                                     recheck_interval=float(os.environ.get("SHOAL_RECHECK_SECONDS") or 30),
                                     leading=lambda: memo.autoscaler.leading() if "autoscaler" in memo else True)
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
        reconciler.stop()
        await reconciler.adapter_reports.close()
        await asyncio.gather(*reconciler._events, return_exceptions=True)
        await reconciler.kube.close()


# ------------------------------------------------------------------------------------------------ kopf wiring
# One table drives everything kopf watches: the index of each kind (kopf passes an index to handlers as the
# keyword argument named by its id), the label selector of its watch, and the handler that triggers a reconcile.
@dataclass(frozen=True)
class Watched:
    kind: str
    group: str
    version: str
    plural: str

    @property
    def index_id(self) -> str:
        return f"{self.kind.lower()}_index"


CHILDREN = tuple(Watched(kind, *KINDS[kind][0].rpartition("/")[::2], KINDS[kind][1]) for kind in WATCHED_KINDS)
OWNER = Watched(api.KIND, api.GROUP, api.VERSION, api.PLURAL)
_MANAGED = {L_MANAGED_BY: MANAGED_BY}


def _isvc_index(namespace: str, name: str, body: kopf.Body, **_: Any) -> dict:
    return {(namespace, name): _slim(body)}


def _child_index(namespace: str, labels: dict, body: kopf.Body, **_: Any) -> dict:
    owner = labels.get(L_ISVC)
    return {(namespace, owner): _slim(body)} if owner else {}


kopf.index(OWNER.group, OWNER.version, OWNER.plural, id=OWNER.index_id)(_isvc_index)
for _w in CHILDREN:
    kopf.index(_w.group, _w.version, _w.plural, labels=_MANAGED, id=_w.index_id)(_child_index)


def _indexes(kwargs: dict[str, Any]) -> dict[str, Any]:
    """kopf injects every index into every handler, as the keyword argument named by the index's id."""
    return {w.kind: kwargs[w.index_id] for w in (OWNER, *CHILDREN)}


@kopf.on.resume(OWNER.group, OWNER.version, OWNER.plural)
@kopf.on.create(OWNER.group, OWNER.version, OWNER.plural)
@kopf.on.update(OWNER.group, OWNER.version, OWNER.plural)
async def isvc_changed(namespace: str, name: str, memo: kopf.Memo, **kwargs: Any) -> None:
    memo.reconciler.trigger(namespace, name, _indexes(kwargs))


@kopf.on.event(OWNER.group, OWNER.version, OWNER.plural, id="autoscaled_replicas")
async def autoscaled_replicas_changed(namespace: str, name: str, type: str | None, body: kopf.Body,
                                      memo: kopf.Memo, **kwargs: Any) -> None:
    """The autoscaler scales by writing status.autoscaling.desiredReplicas (spec.replicas stays the user's), which
    kopf's change handlers never see: reconcile when it differs from what the last plan used."""
    spec = body.get("spec") or {}
    if type == "DELETED" or not (spec.get("autoscaling") or (spec.get("prefill") or {}).get("autoscaling")):
        return
    cached = memo.reconciler.plans.get((namespace, name))
    if cached is None or cached[0][2] != _autoscaled_replicas(dict(body)):
        memo.reconciler.trigger(namespace, name, _indexes(kwargs))


@kopf.on.event(OWNER.group, OWNER.version, OWNER.plural, id="canary_rollback")
async def canary_rollback_changed(namespace: str, name: str, type: str | None, body: kopf.Body,
                                  memo: kopf.Memo, **kwargs: Any) -> None:
    """The canary judge rolls a canary back by writing status.canary.rollback (canary_judge.py), which kopf's change
    handlers never see: reconcile when it differs from what the last plan used."""
    if type == "DELETED" or not (body.get("spec") or {}).get("canary"):
        return
    cached = memo.reconciler.plans.get((namespace, name))
    if cached is None or cached[0][4] != _canary_rolled_back(dict(body)):
        memo.reconciler.trigger(namespace, name, _indexes(kwargs))


async def child_changed(namespace: str, labels: dict, memo: kopf.Memo, **kwargs: Any) -> None:
    """Drift repair and status: any change of a child (incl. its deletion) re-reconciles its owner."""
    if labels.get(L_ISVC):
        memo.reconciler.trigger(namespace, labels[L_ISVC], _indexes(kwargs))


for _w in CHILDREN:
    kopf.on.event(_w.group, _w.version, _w.plural, labels=_MANAGED, id=f"{_w.kind.lower()}_changed")(child_changed)


__all__ = ["Reconciler", "settings_from_env"]
