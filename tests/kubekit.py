"""An emulated Kubernetes API for the tests: kmock's KubernetesEmulator with the gaps of the plain emulator filled
here, a client playing the cluster's controllers, and the operator (kopf) in a thread. Used by the operator and
gateway tests (their conftest fixtures) and by tests/benches.

`Cluster` (a KubernetesEmulator subclass) adds what kopf and the operator rely on from a real API server:
uid / creationTimestamp / resourceVersion / generation, namespaces from the URL, generateName, 409 on an
existing name or a stale resourceVersion, 422 when a JSON-patch `test` fails, status isolation (/status
changes only status, the main endpoint never does), server-side apply (`Cluster._apply`: per field manager,
fields a manager applied before and no longer applies are removed; lists are atomic), no-op patches that change
nothing (no event), empty env values dropped (omitempty, as the real server stores them), uid
preconditions on delete, label and field selectors on lists and watches,
resourceVersion on lists, watches that replay only events newer than the requested resourceVersion (subscribing
before the replay, so nothing is lost in between), `timeoutSeconds`, ownerReference garbage collection, fault injection (`cluster.inject(...)`)
for the retry tests, RBAC (`cluster.authorize`: 403 for what a Role does not grant, recorded in
`cluster.denied`), watches that lag (`cluster.lag`), and a record of every write, apply request and LIST
(`cluster.writes`, `cluster.applies`, `cluster.lists`).

The emulator and the operator each run in their own thread with their own event loop; tests are plain
synchronous functions acting as the cluster's controllers through HTTP (`Client`).
"""

from __future__ import annotations

import asyncio
import datetime
import json
import importlib
import random
import string
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

import aiohttp.web
import attrs
import jsonpatch
import kmock
import requests
import yaml
from kmock._internal import enums
from prockit import wait_for  # noqa: F401  (re-exported: the one wait helper)

GROUP, VERSION, PLURAL = "serving.shoal.dev", "v1alpha1", "inferenceservices"
# the API server's validation of StatefulSet updates: everything else in spec is immutable
STATEFULSET_MUTABLE = {"replicas", "ordinals", "template", "updateStrategy", "persistentVolumeClaimRetentionPolicy",
                       "minReadySeconds", "revisionHistoryLimit"}
# resources whose CRD declares no status subresource: their status is written through the main endpoint
WITHOUT_STATUS_SUBRESOURCE = {"clusterkopfpeerings", "kopfpeerings"}


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _selector_matches(selector: str | None, labels: dict[str, str]) -> bool:
    """Equality-based label selectors (a=b, a!=b, a, !a), comma-joined: what kopf and the operator send."""
    for term in filter(None, (t.strip() for t in (selector or "").split(","))):
        if "!=" in term:
            k, v = term.split("!=", 1)
            if labels.get(k) == v:
                return False
        elif "==" in term or "=" in term:
            k, v = term.replace("==", "=").split("=", 1)
            if labels.get(k) != v:
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True


def _fields_match(selector: str | None, obj: dict[str, Any]) -> bool:
    """Field selectors (=, ==, !=) on a dotted path of the object: metadata.name and metadata.namespace, as every
    resource supports, and the fields a kind adds (an Event's involvedObject.kind, reason, ...)."""
    for term in filter(None, (t.strip() for t in (selector or "").split(","))):
        negate = "!=" in term
        key, value = term.replace("!=", "=").replace("==", "=").split("=", 1)
        field: Any = obj
        for part in key.strip().split("."):
            field = field.get(part) if isinstance(field, dict) else None
        if (("" if field is None else str(field)) == value.strip()) == negate:
            return False
    return True


@dataclass
class Fault:
    action: str | None  # "create", "update", "delete", "fetch", "list", "watch" or None for all
    plural: str | None
    status: int
    remaining: int
    subresource: str | None = "*"
    message: str = "injected by the test"


@attrs.define(kw_only=True)
class Cluster(kmock.KubernetesEmulator):
    store: dict[tuple, dict[str, Any]] = attrs.field(factory=dict, init=False)
    log: list[tuple[int, tuple, dict[str, Any]]] = attrs.field(factory=list, init=False)
    rv: int = attrs.field(default=1000, init=False)
    faults: list[Fault] = attrs.field(factory=list, init=False)
    writes: list[tuple[str, str, str | None, str | None]] = attrs.field(factory=list, init=False)
    lists: list[tuple[str, str | None]] = attrs.field(factory=list, init=False)  # (plural, namespace) of each LIST
    # (plural, namespace, name) of every server-side apply request, no-ops included (each one costs the API server)
    applies: list[tuple[str, str | None, str | None]] = attrs.field(factory=list, init=False)
    applied: dict[tuple, dict[str, dict[str, Any]]] = attrs.field(factory=dict, init=False)  # key -> manager -> cfg
    gc: bool = attrs.field(default=True)
    lags: dict[str | None, float] = attrs.field(factory=dict, init=False)  # plural (None: all) -> seconds late
    _lag_tail: dict[str, asyncio.Future] = attrs.field(factory=dict, init=False)
    # RBAC: (apiGroup, resource, verb, namespace or None for a cluster-scoped request) -> allowed?; None: all
    authorize: Any = attrs.field(default=None, init=False)
    denied: list[tuple[str, str, str, str | None]] = attrs.field(factory=list, init=False)
    _changed: asyncio.Condition | None = attrs.field(default=None, init=False)

    # ------------------------------------------------------------------------------------------ plumbing
    @property
    def changed(self) -> asyncio.Condition:
        if self._changed is None:
            self._changed = asyncio.Condition()
        return self._changed

    def inject(self, action: str | None, plural: str | None, status: int, times: int,
               subresource: str | None = "*", message: str = "injected by the test") -> Fault:
        fault = Fault(action, plural, status, times, subresource, message)
        self.faults.append(fault)
        return fault

    @staticmethod
    def _key(request: kmock.Request) -> tuple:
        r = request.resource
        return (r.group, r.version, r.plural)

    def _fault(self, request: kmock.Request) -> Fault | None:
        if request.headers.get("X-Test-Client"):
            return None  # faults hit the operator, not the test playing the controllers
        action = request.action.value.lower() if request.action else None
        for fault in self.faults:
            if fault.remaining > 0 and fault.action in (None, action) and \
                    fault.plural in (None, request.resource.plural) and \
                    (fault.subresource == "*" or fault.subresource == request.subresource):
                fault.remaining -= 1
                return fault
        return None

    @staticmethod
    def _error(status: int, reason: str, message: str) -> aiohttp.web.Response:
        return aiohttp.web.json_response({"apiVersion": "v1", "kind": "Status", "metadata": {}, "status": "Failure",
                                          "code": status, "reason": reason, "message": message}, status=status)

    def lag(self, plural: str | None, seconds: float) -> None:
        """Watch events of `plural` (None: of every resource) reach watchers `seconds` late, in order per resource
        (GETs stay current): on a real server a watch-fed cache often lags the writes, e.g. an operator reads an
        object before its own status write is visible, or sees a child the garbage collector already removed."""
        if seconds:
            self.lags[plural] = seconds
        else:
            self.lags.pop(plural, None)

    async def _emit(self, res: tuple, type_: str, obj: dict[str, Any]) -> None:
        lag = self.lags.get(res[2], self.lags.get(None))
        if lag:
            loop = asyncio.get_running_loop()
            before, done = self._lag_tail.get(res[2]), loop.create_future()
            self._lag_tail[res[2]] = done
            due, obj = loop.time() + lag, json.loads(json.dumps(obj))

            async def later() -> None:
                if before is not None:
                    await before
                await asyncio.sleep(max(0.0, due - loop.time()))
                await self._log(res, type_, obj)
                done.set_result(None)
            loop.create_task(later())
            return
        await self._log(res, type_, obj)

    async def _log(self, res: tuple, type_: str, obj: dict[str, Any]) -> None:
        async with self.changed:
            rv = int(obj["metadata"].get("resourceVersion") or self.rv)  # the object's own (a lagging event's too)
            self.log.append((rv, res, {"type": type_, "object": json.loads(json.dumps(obj))}))
            self.changed.notify_all()

    def _bump(self, obj: dict[str, Any]) -> None:
        self.rv += 1
        obj["metadata"]["resourceVersion"] = str(self.rv)

    # ------------------------------------------------------------------------------------------ requests
    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        if request.resource is None or request.resource.plural is None:
            return await super(kmock.KubernetesEmulator, self)._handle(request)  # discovery etc.
        if self.authorize is not None and not request.headers.get("X-Test-Client"):
            verb = {enums.action.CREATE: "create", enums.action.UPDATE: "patch", enums.action.DELETE: "delete",
                    enums.action.FETCH: "get", enums.action.LIST: "list", enums.action.WATCH: "watch"}.get(
                request.action, "get")
            plural = request.resource.plural + (f"/{request.subresource}" if request.subresource else "")
            asked = (request.resource.group or "", plural, verb, request.namespace)
            if not self.authorize(*asked):
                self.denied.append(asked)
                where = f"in namespace {request.namespace}" if request.namespace else "at the cluster scope"
                return self._error(403, "Forbidden", f"{plural}.{asked[0]} is forbidden: cannot {verb} {where}")
        fault = self._fault(request)
        if fault is not None:
            reason = {409: "Conflict", 500: "InternalError", 503: "ServiceUnavailable", 429: "TooManyRequests",
                      422: "Invalid", 403: "Forbidden"}
            return self._error(fault.status, reason.get(fault.status, "Injected"), fault.message)
        action = request.action
        if action == enums.action.CREATE:
            return await self._create(request)
        if action == enums.action.UPDATE:
            return await self._patch(request)
        if action == enums.action.DELETE:
            return await self._delete(request)
        # Served directly, not through kmock's reaction DSL: matching a request there scans the whole request
        # history, which grows quadratic with a few thousand requests (the scale benchmark).
        try:
            if action == enums.action.FETCH:
                return aiohttp.web.json_response(await self._serve_fetch(request))
            if action == enums.action.LIST:
                return aiohttp.web.json_response(await self._serve_list(request))
        except kmock.KubernetesObjectNotFoundError:
            return self._error(404, "NotFound", f"{request.resource.plural} \"{request.name}\" not found")
        if action == enums.action.WATCH and request._raw_request is not None:
            response = aiohttp.web.StreamResponse(headers={"Content-Type": "application/json"})
            await response.prepare(request._raw_request)
            try:
                async for event in self._serve_watch(request):
                    if isinstance(event, dict):
                        await response.write(json.dumps(event).encode() + b"\n")
                await response.write_eof()
            except (ConnectionResetError, ConnectionError, RuntimeError):
                pass
            return response
        return await super(kmock.KubernetesEmulator, self)._handle(request)

    async def _create(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        obj = json.loads(json.dumps(request.data or {}))
        meta = obj.setdefault("metadata", {})
        if request.namespace:
            meta["namespace"] = request.namespace
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + "".join(random.choices(string.ascii_lowercase, k=5))
        if not meta.get("name"):
            return self._error(422, "Invalid", "metadata.name: Required value")
        res = self._key(request)
        key = (res, meta.get("namespace"), meta["name"])
        if key in self.store:
            return self._error(409, "AlreadyExists", f"{res[2]} \"{meta['name']}\" already exists")
        return await self._insert(res, key, obj)

    async def _insert(self, res: tuple, key: tuple, obj: dict[str, Any]) -> aiohttp.web.StreamResponse:
        _drop_empty_env(obj)
        meta = obj["metadata"]
        meta.update(uid=str(uuid.uuid4()), creationTimestamp=_now(), generation=1)
        for field in ("resourceVersion", "deletionTimestamp"):
            meta.pop(field, None)
        self._bump(obj)
        self.store[key] = obj
        self.writes.append(("create", res[2], meta.get("namespace"), meta["name"]))
        await self._emit(res, "ADDED", obj)
        owners = {ref.get("uid") for ref in meta.get("ownerReferences") or []}
        if self.gc and owners and not any(o["metadata"].get("uid") in owners for o in self.store.values()):
            # the garbage collector deletes dependents whose owners are all gone (created in a race)
            asyncio.get_running_loop().call_later(0.05, lambda: asyncio.ensure_future(self._orphaned(key)))
        return aiohttp.web.json_response(obj, status=201)

    async def _orphaned(self, key: tuple) -> None:
        obj = self.store.pop(key, None)
        if obj is not None:
            self._bump(obj)
            await self._emit(key[0], "DELETED", obj)
            await self._collect(obj)

    async def _patch(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        res = self._key(request)
        key = (res, request.namespace, request.name)
        old = self.store.get(key)
        ctype = (request.headers.get("Content-Type") or "").split(";")[0]
        if old is None and ctype == "application/apply-patch+yaml":
            return await self._apply(request, res, key, None)
        if old is None:
            return self._error(404, "NotFound", f"{res[2]} \"{request.name}\" not found")
        patch = request.data
        try:
            if ctype == "application/json-patch+json" or isinstance(patch, list):
                new = jsonpatch.apply_patch(json.loads(json.dumps(old)), patch)
            elif ctype == "application/apply-patch+yaml":
                return await self._apply(request, res, key, old)
            else:  # merge patch (strategic merge is treated as a JSON merge patch, lists replaced)
                want_rv = (patch.get("metadata") or {}).get("resourceVersion")
                if want_rv and want_rv != old["metadata"]["resourceVersion"]:
                    return self._error(409, "Conflict", "the object has been modified; please apply your changes "
                                                        "to the latest version and try again")
                new = _merge(json.loads(json.dumps(old)), patch)
        except jsonpatch.JsonPatchTestFailed as e:
            return self._error(422, "Invalid", f"the server rejected our request: {e}")
        except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as e:
            return self._error(422, "Invalid", str(e))
        return await self._commit(request, res, key, old, new)

    async def _commit(self, request: kmock.Request, res: tuple, key: tuple, old: dict[str, Any],
                      new: dict[str, Any]) -> aiohttp.web.StreamResponse:
        """Store the result of a patch or apply, with status isolation, generation and resourceVersion."""
        # status isolation: /status changes only status, the main endpoint everything but status
        if request.subresource == "status":
            merged = json.loads(json.dumps(old))
            merged["status"] = new.get("status")
            if merged["status"] is None:
                merged.pop("status")
            new = merged
        elif request.subresource in (None, "") and res[2] not in WITHOUT_STATUS_SUBRESOURCE:
            if "status" in old:
                new["status"] = old["status"]
            else:
                new.pop("status", None)
        if res[2] == "statefulsets" and request.subresource in (None, ""):
            fixed = {k: v for k, v in (new.get("spec") or {}).items() if k not in STATEFULSET_MUTABLE}
            if fixed != {k: v for k, v in (old.get("spec") or {}).items() if k not in STATEFULSET_MUTABLE}:
                return self._error(422, "Invalid", f"StatefulSet.apps \"{request.name}\" is invalid: spec: "
                                                   "Forbidden: updates to statefulset spec for fields other than "
                                                   f"{sorted(STATEFULSET_MUTABLE)} are forbidden")
        for field in ("uid", "creationTimestamp", "namespace", "name"):
            if field in old["metadata"]:
                new["metadata"][field] = old["metadata"][field]
        new["metadata"]["resourceVersion"] = old["metadata"]["resourceVersion"]
        new["metadata"]["generation"] = old["metadata"].get("generation", 1)
        _drop_empty_env(new)
        if new == old:  # a no-op patch changes nothing, bumps nothing, and emits no event
            return aiohttp.web.json_response(old)
        if new.get("spec") != old.get("spec"):
            new["metadata"]["generation"] += 1
        self._bump(new)
        self.writes.append(("patch" if not request.subresource else f"patch/{request.subresource}",
                            res[2], request.namespace, request.name))
        if new["metadata"].get("deletionTimestamp") and not new["metadata"].get("finalizers"):
            del self.store[key]
            await self._emit(res, "DELETED", new)
            await self._collect(new)
        else:
            self.store[key] = new
            await self._emit(res, "MODIFIED", new)
        return aiohttp.web.json_response(new)

    async def _apply(self, request: kmock.Request, res: tuple, key: tuple,
                     old: dict[str, Any] | None) -> aiohttp.web.StreamResponse:
        """Server-side apply, reduced to what decides convergence: each field manager owns the leaves (lists are
        atomic leaves) of the configuration it applied last; a leaf it applied before and no longer applies is
        removed unless another manager applies it too; without force, changing another manager's leaf is a 409."""
        self.applies.append((res[2], request.namespace, request.name))
        manager = request.params.get("fieldManager")
        if not manager:
            return self._error(422, "Invalid", "PATCH /apply: fieldManager is required for apply requests")
        applied = request.data if isinstance(request.data, dict) else yaml.safe_load(request.text or "{}")
        if not isinstance(applied, dict) or not applied.get("apiVersion") or not applied.get("kind"):
            return self._error(400, "BadRequest", "apply needs a complete object with apiVersion and kind")
        if (applied.get("metadata") or {}).get("name") not in (None, request.name):
            return self._error(400, "BadRequest", "the name of the object does not match the name in the URL")
        applied = json.loads(json.dumps(applied))
        managers = self.applied.setdefault(key, {})
        others = {leaf for m, cfg in managers.items() if m != manager for leaf in _leaves(cfg)}
        if old is not None and request.params.get("force") != "true":
            clashes = [".".join(p) for p in _leaves(applied) & others
                       if _get_path(old, p) != _get_path(applied, p)]
            if clashes:
                return self._error(409, "Conflict", f"Apply failed with {len(clashes)} conflicts: {clashes}")
        before = managers.get(manager) or {}
        managers[manager] = applied
        if old is None:
            obj = json.loads(json.dumps(applied))
            obj.setdefault("metadata", {})["namespace"] = request.namespace
            obj["metadata"]["managedFields"] = [{"manager": manager, "operation": "Apply"}]
            return await self._insert(res, key, obj)
        new = json.loads(json.dumps(old))
        for leaf in _leaves(before) - _leaves(applied) - others:
            _remove_path(new, leaf)
        new = _merge_atomic(new, applied)
        new["metadata"]["managedFields"] = [{"manager": m, "operation": "Apply"} for m in sorted(managers)]
        return await self._commit(request, res, key, old, new)

    async def _delete(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        res = self._key(request)
        key = (res, request.namespace, request.name)
        obj = self.store.get(key)
        if obj is None:
            return self._error(404, "NotFound", f"{res[2]} \"{request.name}\" not found")
        want_uid = ((request.data or {}).get("preconditions") or {}).get("uid") if isinstance(request.data, dict) \
            else None
        if want_uid and want_uid != obj["metadata"]["uid"]:
            return self._error(409, "Conflict", "Precondition failed: UID in precondition does not match")
        self.writes.append(("delete", res[2], request.namespace, request.name))
        if obj["metadata"].get("finalizers"):
            if not obj["metadata"].get("deletionTimestamp"):
                obj = json.loads(json.dumps(obj))
                obj["metadata"]["deletionTimestamp"] = _now()
                self._bump(obj)
                self.store[key] = obj
                await self._emit(res, "MODIFIED", obj)
            return aiohttp.web.json_response(obj)
        del self.store[key]
        self.applied.pop(key, None)
        self._bump(obj)
        await self._emit(res, "DELETED", obj)
        await self._collect(obj)
        return aiohttp.web.json_response(obj)

    async def _collect(self, owner: dict[str, Any]) -> None:
        """ownerReference garbage collection (background propagation), recursively."""
        if not self.gc:
            return
        uid = owner["metadata"]["uid"]
        for key, obj in list(self.store.items()):
            if any(ref.get("uid") == uid for ref in obj["metadata"].get("ownerReferences") or []):
                if key in self.store:
                    del self.store[key]
                    self._bump(obj)
                    await self._emit(key[0], "DELETED", obj)
                    await self._collect(obj)

    def _matching(self, request: kmock.Request) -> list[dict[str, Any]]:
        res = self._key(request)
        selector = request.params.get("labelSelector")
        fields = request.params.get("fieldSelector")
        return [obj for (r, ns, name), obj in self.store.items()
                if r == res and (request.namespace is None or ns == request.namespace)
                and (request.name is None or name == request.name)
                and _selector_matches(selector, obj["metadata"].get("labels") or {})
                and _fields_match(fields, obj)]

    async def _serve_fetch(self, request: kmock.Request) -> Any:
        obj = self.store.get((self._key(request), request.namespace, request.name))
        if obj is None:
            raise kmock.KubernetesObjectNotFoundError()
        return obj

    async def _serve_list(self, request: kmock.Request) -> Any:
        r = request.resource
        self.lists.append((r.plural, request.namespace))
        return {"apiVersion": f"{r.group}/{r.version}".lstrip("/"), "kind": "List",
                "metadata": {"resourceVersion": str(self.rv)}, "items": self._matching(request)}

    async def _serve_watch(self, request: kmock.Request):
        yield b""
        res = self._key(request)
        selector = request.params.get("labelSelector")
        since = request.params.get("resourceVersion")
        timeout = float(request.params.get("timeoutSeconds") or 0) or None
        deadline = time.monotonic() + timeout if timeout else None

        def wanted(event: dict[str, Any]) -> bool:
            meta = event["object"]["metadata"]
            return (request.namespace is None or meta.get("namespace") == request.namespace) and \
                (request.name is None or meta.get("name") == request.name) and \
                _selector_matches(selector, meta.get("labels") or {}) and \
                _fields_match(request.params.get("fieldSelector"), event["object"])

        async with self.changed:  # subscribe (take the position) and snapshot atomically
            position = len(self.log)
            if since in (None, "", "0"):
                replay = [{"type": "ADDED", "object": json.loads(json.dumps(o))} for o in self._matching(request)]
            else:
                replay = [ev for rv, r, ev in self.log if r == res and rv > int(since)]
        for event in replay:
            if wanted(event):
                yield event
        while deadline is None or time.monotonic() < deadline:
            async with self.changed:
                if len(self.log) <= position:
                    try:
                        left = None if deadline is None else max(0.0, deadline - time.monotonic())
                        await asyncio.wait_for(self.changed.wait(), timeout=left)
                    except asyncio.TimeoutError:
                        return
                batch = self.log[position:]
                position = len(self.log)
            for _rv, r, event in batch:
                if r == res and wanted(event):
                    yield event

    # --------------------------------------------------------------------------- direct access (any thread)
    def _items(self) -> list:
        """The store's entries, copied from a thread other than the server's: the server may resize the dict
        while the copy runs (a collection inside it can switch threads), which raises; then copy again."""
        while True:
            try:
                return list(self.store.items())
            except RuntimeError:  # "dictionary changed size during iteration"
                continue

    def find(self, plural: str, namespace: str | None = None, selector: str | None = None) -> list[dict]:
        return [json.loads(json.dumps(o)) for (r, ns, _), o in self._items()
                if r[2] == plural and (namespace is None or ns == namespace)
                and _selector_matches(selector, o["metadata"].get("labels") or {})]

    def obj(self, plural: str, namespace: str, name: str) -> dict | None:
        for (r, ns, n), o in self._items():
            if r[2] == plural and ns == namespace and n == name:
                return json.loads(json.dumps(o))
        return None


def _drop_empty_env(obj: dict[str, Any]) -> None:
    """The API server serializes an env var's `value` with omitempty: `{"name": X, "value": ""}` is stored (and read
    back) as `{"name": X}`, in pods and in the pod templates of workloads."""
    spec = obj.get("spec") or {}
    pod_specs = [spec, ((spec.get("template") or {}).get("spec") or {})]
    for pod_spec in pod_specs:
        if not isinstance(pod_spec, dict):
            continue
        for group in ("containers", "initContainers"):
            for container in pod_spec.get(group) or []:
                for var in container.get("env") or []:
                    if var.get("value") == "":
                        del var["value"]


def _merge(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return patch
    if not isinstance(target, dict):
        target = {}
    for k, v in patch.items():
        if v is None:
            target.pop(k, None)
        else:
            target[k] = _merge(target.get(k), v)
    return target


def _leaves(obj: Any, prefix: tuple = ()) -> set[tuple]:
    """Paths of the leaves of an applied configuration (maps recurse; lists, scalars and empty maps are leaves)."""
    if isinstance(obj, dict) and obj:
        return {leaf for k, v in obj.items() for leaf in _leaves(v, prefix + (k,))}
    return {prefix} if prefix else set()


def _get_path(obj: Any, path: tuple) -> Any:
    for part in path:
        if not isinstance(obj, dict) or part not in obj:
            return None
        obj = obj[part]
    return obj


def _remove_path(obj: dict, path: tuple) -> None:
    """Remove a leaf and the maps it leaves empty."""
    parents = [obj]
    for part in path[:-1]:
        child = parents[-1].get(part)
        if not isinstance(child, dict):
            return
        parents.append(child)
    parents[-1].pop(path[-1], None)
    for depth in range(len(path) - 1, 0, -1):
        if parents[depth] == {}:
            parents[depth - 1].pop(path[depth - 1], None)


def _merge_atomic(target: Any, applied: Any) -> Any:
    """Apply's merge: maps merge key by key, everything else (lists included) is replaced."""
    if not isinstance(applied, dict) or not isinstance(target, dict):
        return applied
    for k, v in applied.items():
        target[k] = _merge_atomic(target.get(k), v)
    return target


def declare_resources(cluster: Cluster) -> None:
    cluster.resources.load_bundled()
    cluster.resources["kopf.dev/v1/clusterkopfpeerings"] = kmock.ResourceInfo(
        kind="ClusterKopfPeering", singular="clusterkopfpeering", namespaced=False,
        verbs={"get", "list", "watch", "create", "patch", "delete"})
    cluster.resources[f"{GROUP}/{VERSION}/{PLURAL}"] = kmock.ResourceInfo(
        kind="InferenceService", singular="inferenceservice", namespaced=True, shortnames={"isvc", "sisvc"},
        verbs={"get", "list", "watch", "create", "patch", "delete"}, subresources={"status", "scale"})


# ---------------------------------------------------------------------------------------------- the threads
class Background:
    """An event loop in a daemon thread."""

    def __init__(self, name: str):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 30) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


class EmulatorServer:
    def __init__(self):
        self.bg = Background("kmock")
        self.cluster: Cluster | None = None

        async def start():
            self.cluster = Cluster()
            declare_resources(self.cluster)
            self._cm1 = self.cluster
            await self._cm1.__aenter__()
            self._cm2 = kmock.Server(self.cluster)
            await self._cm2.__aenter__()

        self.bg.run(start())
        self.url = str(self.cluster.url).rstrip("/")

    def close(self) -> None:
        async def stop():
            await self._cm2.__aexit__(None, None, None)
            await self._cm1.__aexit__(None, None, None)

        try:
            self.bg.run(stop(), timeout=10)
        except Exception:
            pass
        self.bg.stop()


class OperatorThread:
    """kopf.operator() with shoal's handlers, in its own thread and loop, against the emulator."""

    def __init__(self, peering: tuple[str, int] | None = None, namespaces: list[str] | None = None):
        """`peering`: (peering name, priority) to run peered (as the chart's highAvailability), else standalone;
        `namespaces`: serve only these (`-n`), else every namespace (`-A`)."""
        import kopf

        from shoal.operator import HANDLER_MODULES

        for module in HANDLER_MODULES:  # importing registers their handlers in kopf's default registry
            importlib.import_module(module)

        self.stop_flag = threading.Event()
        self.ready_flag = threading.Event()
        self.memo = kopf.Memo()
        self.error: BaseException | None = None

        def target():
            try:
                mode = dict(peering_name=peering[0], priority=peering[1]) if peering else dict(standalone=True)
                scope = dict(namespaces=namespaces) if namespaces else dict(clusterwide=True)
                asyncio.run(kopf.operator(stop_flag=self.stop_flag, ready_flag=self.ready_flag, memo=self.memo,
                                          **scope, **mode))
            except BaseException as e:  # pragma: no cover - surfaced by the fixture
                self.error = e

        self.thread = threading.Thread(target=target, name="kopf", daemon=True)
        self.thread.start()
        if not self.ready_flag.wait(20):
            raise RuntimeError(f"kopf did not start: {self.error!r}")

    def stop(self) -> None:
        self.stop_flag.set()
        self.thread.join(20)


class Client:
    """What the tests do to the cluster, over HTTP, as the kubectl user and the built-in controllers."""

    def __init__(self, url: str):
        self.url = url
        self.http = requests.Session()
        self.http.headers["X-Test-Client"] = "1"

    @staticmethod
    def _path(plural: str, namespace: str, name: str | None = None, sub: str | None = None) -> str:
        prefix = {"inferenceservices": f"/apis/{GROUP}/{VERSION}", "deployments": "/apis/apps/v1",
                  "statefulsets": "/apis/apps/v1", "networkpolicies": "/apis/networking.k8s.io/v1",
                  "poddisruptionbudgets": "/apis/policy/v1", "endpointslices": "/apis/discovery.k8s.io/v1"}.get(plural, "/api/v1")
        path = f"{prefix}/namespaces/{namespace}/{plural}"
        return path + (f"/{name}" if name else "") + (f"/{sub}" if sub else "")

    def create(self, plural: str, namespace: str, body: dict) -> dict:
        r = self.http.post(self.url + self._path(plural, namespace), json=body)
        r.raise_for_status()
        return r.json()

    def patch(self, plural: str, namespace: str, name: str, body: dict, sub: str | None = None) -> dict:
        r = self.http.patch(self.url + self._path(plural, namespace, name, sub), data=json.dumps(body),
                            headers={"Content-Type": "application/merge-patch+json"})
        r.raise_for_status()
        return r.json()

    def delete(self, plural: str, namespace: str, name: str) -> None:
        r = self.http.delete(self.url + self._path(plural, namespace, name))
        r.raise_for_status()

    def get(self, plural: str, namespace: str, name: str) -> dict | None:
        r = self.http.get(self.url + self._path(plural, namespace, name))
        if r.status_code == 404:
            return None
        r.raise_for_status()
        return r.json()

    def list(self, plural: str, namespace: str, selector: str | None = None) -> list[dict]:
        r = self.http.get(self.url + self._path(plural, namespace),
                          params={"labelSelector": selector} if selector else None)
        r.raise_for_status()
        return r.json()["items"]


def slice_labels(client: "Client", namespace: str, service: str) -> dict[str, str]:
    """The labels the EndpointSlice controller gives a Service's slices: the Service's own (the operator's watch
    selects them by app.kubernetes.io/managed-by) and kubernetes.io/service-name. Waits for the Service."""
    svc = wait_for(lambda: client.get("services", namespace, service), 15, f"service {namespace}/{service}")
    reserved = {"kubernetes.io/service-name", "endpointslice.kubernetes.io/managed-by",
                "service.kubernetes.io/headless"}
    labels = {k: v for k, v in (svc["metadata"].get("labels") or {}).items() if k not in reserved}
    return {**labels, "kubernetes.io/service-name": service}


def write_kubeconfig(path, url: str) -> str:
    """A kubeconfig at `path` pointing at the emulator at `url` (for kopf, the operator and shoal-gateway)."""
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "emulator",
        "clusters": [{"name": "emulator", "cluster": {"server": url}}],
        "users": [{"name": "tester", "user": {"token": "test-token"}}],
        "contexts": [{"name": "emulator", "context": {"cluster": "emulator", "user": "tester"}}],
    }))
    return str(path)


def condition(isvc: dict | None, type_: str) -> dict | None:
    for c in ((isvc or {}).get("status") or {}).get("conditions") or []:
        if c["type"] == type_:
            return c
    return None


def isvc_body(name: str, spec: dict | None = None) -> dict:
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "InferenceService", "metadata": {"name": name},
            "spec": spec or {}}
