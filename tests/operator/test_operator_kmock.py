"""kopf runs shoal's handlers for real against the emulated API (conftest.Cluster) over HTTP.

The tests play the cluster's controllers: they patch a Deployment's status as the deployment controller
would, create a StatefulSet's pods, mark a pod failed, delete children, and make the API fail for a while.
"""

from __future__ import annotations

import copy
import hashlib
import json
import time

import requests

from kubekit import condition, isvc_body, wait_for
from prockit import EVENT_BOUND
from webkit import QuietHandler

from shoal.operator.render import L_GROUP, L_ISVC, L_MANAGED_BY, L_POD_INDEX

ISVC = "inferenceservices"


def gateway_children(name: str) -> set[tuple[str, str]]:
    """What spec.gateway (on by default) adds to an InferenceService's children."""
    gw = f"{name}-gateway"
    return {("deployments", gw), ("services", f"{name}-engines"), ("serviceaccounts", gw), ("roles", gw),
            ("rolebindings", gw), ("poddisruptionbudgets", gw), ("networkpolicies", gw)}


def children(env, ns: str) -> dict[tuple[str, str], dict]:
    found = {}
    for plural in ("deployments", "statefulsets", "services", "networkpolicies", "poddisruptionbudgets",
                   "configmaps", "persistentvolumeclaims", "serviceaccounts", "roles", "rolebindings"):
        for obj in env.cluster.find(plural, ns):
            found[(plural, obj["metadata"]["name"])] = obj
    return found


def ready_deployment(env, ns: str, name: str, n: int, generation: int | None = None) -> None:
    dep = env.client.get("deployments", ns, name)
    gen = generation or dep["metadata"]["generation"]
    env.client.patch("deployments", ns, name, {"status": {
        "observedGeneration": gen, "replicas": n, "readyReplicas": n, "updatedReplicas": n, "availableReplicas": n,
    }}, sub="status")


def get_isvc(env, ns: str, name: str) -> dict:
    return env.client.get(ISVC, ns, name)


def ready_is(env, ns, name, status: str, reason: str | None = None, timeout: float = 10):
    def check():
        c = condition(get_isvc(env, ns, name), "Ready")
        return c if c and c["status"] == status and (reason is None or c["reason"] == reason) else None
    return wait_for(check, timeout, f"Ready={status} {reason or ''} on {ns}/{name}")


def settled(env, ns: str, name: str) -> None:
    """Wait until the reconciler has no pass running or pending for ns/name: everything it was told so far has
    been acted on, so an assertion that nothing happened is meaningful (instead of sleeping and hoping)."""
    reconciler = env.operator.memo.reconciler
    wait_for(lambda: not reconciler.queue.busy((ns, name)), 10, f"the reconciler to settle on {ns}/{name}")


def test_create_makes_children_with_owner_references(env, ns):
    isvc = env.client.create(ISVC, ns, isvc_body("chat", {"replicas": 2, "model": {"uri": "hf://org/model"}}))
    uid = isvc["metadata"]["uid"]
    expected = {("deployments", "chat"), ("services", "chat"), ("networkpolicies", "chat"),
                ("poddisruptionbudgets", "chat")} | gateway_children("chat")
    wait_for(lambda: set(children(env, ns)) == expected, EVENT_BOUND, "children")
    kids = children(env, ns)
    for obj in kids.values():
        refs = obj["metadata"]["ownerReferences"]
        assert refs == [{"apiVersion": "serving.shoal.dev/v1alpha1", "kind": "InferenceService", "name": "chat",
                         "uid": uid, "controller": True, "blockOwnerDeletion": True}]
        assert obj["metadata"]["labels"][L_MANAGED_BY] == "shoal-operator"
    dep = kids[("deployments", "chat")]
    assert dep["spec"]["replicas"] == 2
    assert dep["spec"]["template"]["spec"]["containers"][0]["image"] == "registry.test/shoal-engine:test"
    # status before any pod is ready: honest, not Ready
    status = wait_for(lambda: get_isvc(env, ns, "chat").get("status"), EVENT_BOUND, "status")
    assert status["observedGeneration"] == 1 and status["readyReplicas"] == 0
    assert condition({"status": status}, "Ready")["status"] == "False"
    # Events about what was created
    events = wait_for(lambda: [e for e in env.cluster.find("events", ns) if e["reason"] == "Created"], EVENT_BOUND, "events")
    assert all(e["involvedObject"]["uid"] == uid for e in events)


def test_deployment_status_makes_isvc_ready(env, ns):
    env.client.create(ISVC, ns, isvc_body("qa", {"replicas": 2}))
    wait_for(lambda: env.client.get("deployments", ns, "qa"), EVENT_BOUND, "deployment")
    ready_deployment(env, ns, "qa", 2)
    cond = ready_is(env, ns, "qa", "True", "AllReplicasReady")
    status = get_isvc(env, ns, "qa")["status"]
    assert status["phase"] == "Ready"
    assert (status["replicas"], status["readyReplicas"], status["updatedReplicas"]) == (2, 2, 2)
    assert status["url"] == f"http://qa.{ns}.svc.cluster.local:8000"
    assert status["selector"] == f"app.kubernetes.io/component=engine,{L_ISVC}=qa"
    assert "2/2 replicas ready" in cond["message"]
    assert condition(get_isvc(env, ns, "qa"), "Degraded")["status"] == "False"
    assert condition(get_isvc(env, ns, "qa"), "Progressing")["status"] == "False"
    # one replica lost -> Degraded phase, Ready False
    env.client.patch("deployments", ns, "qa", {"status": {"readyReplicas": 1}}, sub="status")
    ready_is(env, ns, "qa", "False")
    assert get_isvc(env, ns, "qa")["status"]["phase"] == "Degraded"


def test_scale_via_spec_children_follow(env, ns):
    env.client.create(ISVC, ns, isvc_body("sc", {"replicas": 1}))
    wait_for(lambda: env.client.get("deployments", ns, "sc"), EVENT_BOUND, "deployment")
    assert env.client.get("poddisruptionbudgets", ns, "sc") is None
    env.client.patch(ISVC, ns, "sc", {"spec": {"replicas": 3}})
    wait_for(lambda: env.client.get("deployments", ns, "sc")["spec"]["replicas"] == 3, EVENT_BOUND, "scaled up")
    wait_for(lambda: env.client.get("poddisruptionbudgets", ns, "sc"), EVENT_BOUND, "PDB for replicas > 1")
    ready_deployment(env, ns, "sc", 3)
    ready_is(env, ns, "sc", "True")
    assert get_isvc(env, ns, "sc")["status"]["observedGeneration"] == 2
    env.client.patch(ISVC, ns, "sc", {"spec": {"replicas": 1}})
    wait_for(lambda: env.client.get("deployments", ns, "sc")["spec"]["replicas"] == 1, EVENT_BOUND, "scaled down")
    wait_for(lambda: env.client.get("poddisruptionbudgets", ns, "sc") is None, EVENT_BOUND, "PDB pruned")


def test_model_change_rolls_out_new_pod_template(env, ns):
    env.client.create(ISVC, ns, isvc_body("ro", {"model": {"uri": "hf://org/a"}}))
    wait_for(lambda: env.client.get("deployments", ns, "ro"), EVENT_BOUND, "deployment")
    ready_deployment(env, ns, "ro", 1)
    ready_is(env, ns, "ro", "True")
    old = env.client.get("deployments", ns, "ro")
    env.client.patch(ISVC, ns, "ro", {"spec": {"model": {"uri": "hf://org/b"}}})

    def new_template():
        dep = env.client.get("deployments", ns, "ro")
        args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
        return dep if args[args.index("--model") + 1] == "/cache/shoal/models/org--b@main" else None
    dep = wait_for(new_template, EVENT_BOUND, "new pod template")
    assert dep["metadata"]["generation"] == old["metadata"]["generation"] + 1
    assert dep["metadata"]["uid"] == old["metadata"]["uid"]  # patched in place: a rolling update, not a recreate
    # the deployment controller has not caught up yet -> Progressing
    wait_for(lambda: condition(get_isvc(env, ns, "ro"), "Progressing")["status"] == "True", EVENT_BOUND, "Progressing")
    ready_deployment(env, ns, "ro", 1)
    ready_is(env, ns, "ro", "True")
    assert get_isvc(env, ns, "ro")["status"]["servedModelName"] == "org/b"


def test_deleted_or_edited_child_comes_back(env, ns):
    env.client.create(ISVC, ns, isvc_body("dr", {"replicas": 2}))
    svc = wait_for(lambda: env.client.get("services", ns, "dr"), EVENT_BOUND, "service")
    wait_for(lambda: env.client.get("deployments", ns, "dr"), EVENT_BOUND, "deployment")
    env.client.delete("services", ns, "dr")
    back = wait_for(lambda: env.client.get("services", ns, "dr"), EVENT_BOUND, "service recreated")
    assert back["metadata"]["uid"] != svc["metadata"]["uid"]
    env.client.delete("deployments", ns, "dr")
    wait_for(lambda: env.client.get("deployments", ns, "dr"), EVENT_BOUND, "deployment recreated")
    # drift: someone edits the deployment by hand -> restored
    env.client.patch("deployments", ns, "dr", {"spec": {"replicas": 7}})
    wait_for(lambda: env.client.get("deployments", ns, "dr")["spec"]["replicas"] == 2, EVENT_BOUND, "drift repaired")
    env.client.patch("services", ns, "dr", {"spec": {"selector": {"app": "hijacked"}}})
    wait_for(lambda: env.client.get("services", ns, "dr")["spec"]["selector"].get(L_ISVC) == "dr", 10,
             "selector restored")


def test_invalid_spec_sets_invalidspec_and_touches_no_children(env, ns):
    # passes the schema of the emulator (no CEL there), caught by the operator's own checks
    env.client.create(ISVC, ns, isvc_body("bad", {"engine": {"tensorParallelSize": 4},
                                                  "resources": {"gpusPerPod": 3}}))
    cond = ready_is(env, ns, "bad", "False", "InvalidSpec")
    assert "spec.resources.gpusPerPod" in cond["message"]
    assert get_isvc(env, ns, "bad")["status"]["phase"] == "Failed"
    env.client.create(ISVC, ns, isvc_body("bad2", {"engine": {"extraArgs": ["--port", "9000"]}}))
    cond = ready_is(env, ns, "bad2", "False", "InvalidSpec")
    assert "spec.engine.extraArgs[0]" in cond["message"]
    settled(env, ns, "bad")
    settled(env, ns, "bad2")
    assert children(env, ns) == {}
    warnings = [e for e in env.cluster.find("events", ns) if e["reason"] == "InvalidSpec"]
    assert warnings and warnings[0]["type"] == "Warning"
    # fixing the spec recovers
    env.client.patch(ISVC, ns, "bad", {"spec": {"resources": {"gpusPerPod": 4}}})
    wait_for(lambda: env.client.get("deployments", ns, "bad"), EVENT_BOUND, "children after the fix")
    wait_for(lambda: condition(get_isvc(env, ns, "bad"), "Ready")["reason"] != "InvalidSpec", EVENT_BOUND, "reason cleared")


def test_invalid_update_leaves_existing_children_alone(env, ns):
    env.client.create(ISVC, ns, isvc_body("keep", {"replicas": 2}))
    dep = wait_for(lambda: env.client.get("deployments", ns, "keep"), EVENT_BOUND, "deployment")
    env.client.patch(ISVC, ns, "keep", {"spec": {"replicas": 1, "engine": {"extraArgs": ["--model=x"]}}})
    ready_is(env, ns, "keep", "False", "InvalidSpec")
    settled(env, ns, "keep")
    assert env.client.get("deployments", ns, "keep")["metadata"]["resourceVersion"] == \
        dep["metadata"]["resourceVersion"]
    assert env.client.get("poddisruptionbudgets", ns, "keep") is not None


def _group_pod(ns: str, isvc: str, group: int, ordinal: int, ready: bool = True) -> dict:
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": f"{isvc}-g{group}-{ordinal}", "labels": {
            L_ISVC: isvc, L_MANAGED_BY: "shoal-operator", "app.kubernetes.io/component": "engine",
            L_GROUP: str(group), L_POD_INDEX: str(ordinal)}},
        "spec": {"containers": [{"name": "engine", "image": "x"}]},
    }


def _pod_status(ready: bool, restarts: int = 0, phase: str = "Running") -> dict:
    return {"status": {
        "phase": phase,
        "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        "containerStatuses": [{"name": "engine", "ready": ready, "started": True, "restartCount": restarts,
                               "state": {"running": {}}}],
    }}


def test_multi_pod_group_restarts_together(env, ns):
    spec = {"replicas": 2, "engine": {"tensorParallelSize": 8, "pipelineParallelSize": 2},
            "resources": {"gpusPerPod": 8}}
    env.client.create(ISVC, ns, isvc_body("big", spec))
    wait_for(lambda: all(env.client.get("statefulsets", ns, f"big-g{r}") for r in (0, 1)), EVENT_BOUND, "statefulsets")
    assert env.client.get("services", ns, "big-g0")["spec"]["clusterIP"] == "None"
    assert env.client.get("services", ns, "big-engines")["spec"]["selector"][L_POD_INDEX] == "0"
    # play the StatefulSet controller: two pods per group, all ready
    for g in (0, 1):
        env.client.patch("statefulsets", ns, f"big-g{g}", {"status": {
            "observedGeneration": 1, "replicas": 2, "readyReplicas": 2, "updatedReplicas": 2}}, sub="status")
        for o in (0, 1):
            env.client.create("pods", ns, _group_pod(ns, "big", g, o))
            env.client.patch("pods", ns, f"big-g{g}-{o}", _pod_status(ready=o == 0), sub="status")
    # rank 1 not ready anywhere -> no group ready (a group is ready only when all its pods are)
    ready_is(env, ns, "big", "False", "ProbeFailing")  # the status has seen the running, unready rank 1 pods
    settled(env, ns, "big")
    assert get_isvc(env, ns, "big")["status"]["readyReplicas"] == 0
    for g in (0, 1):
        env.client.patch("pods", ns, f"big-g{g}-1", _pod_status(ready=True), sub="status")
    ready_is(env, ns, "big", "True")
    assert get_isvc(env, ns, "big")["status"]["readyReplicas"] == 2
    uids = {p["metadata"]["name"]: p["metadata"]["uid"] for p in env.cluster.find("pods", ns)}
    # the model download of rank 1 of group 1 failed twice (a hub 5xx) before it succeeded: init container
    # restarts are no rank failure, nothing restarts
    flaky_download = _pod_status(ready=True)
    flaky_download["status"]["initContainerStatuses"] = [{"name": "model-download", "ready": True, "restartCount": 2,
                                                          "state": {"terminated": {"exitCode": 0}}}]
    env.client.patch("pods", ns, "big-g1-1", flaky_download, sub="status")
    reconciler = env.operator.memo.reconciler
    wait_for(lambda: any((p.get("status") or {}).get("initContainerStatuses")
                         for p in reconciler.indexes["Pod"].get((ns, "big"), [])), 10, "the operator saw it")
    settled(env, ns, "big")
    assert not [e for e in env.cluster.find("events", ns) if e["reason"] == "GroupRestart"]
    assert {p["metadata"]["uid"] for p in env.cluster.find("pods", ns)} == set(uids.values())
    # its adapter-sync sidecar restarted (a liveness failure, an OOM): the engine and its rank kept running, so
    # nothing restarts either
    sidecar_restart = _pod_status(ready=True)
    sidecar_restart["status"]["containerStatuses"].append({"name": "adapter-sync", "ready": True, "started": True,
                                                           "restartCount": 3, "state": {"running": {}}})
    env.client.patch("pods", ns, "big-g1-1", sidecar_restart, sub="status")
    wait_for(lambda: any(len((p.get("status") or {}).get("containerStatuses") or []) == 2
                         for p in reconciler.indexes["Pod"].get((ns, "big"), [])), 10, "the operator saw it")
    settled(env, ns, "big")
    assert not [e for e in env.cluster.find("events", ns) if e["reason"] == "GroupRestart"]
    assert {p["metadata"]["uid"] for p in env.cluster.find("pods", ns)} == set(uids.values())
    # rank 1 of group 0 restarts (its container died): the whole group must restart, group 1 untouched
    env.client.patch("pods", ns, "big-g0-1", _pod_status(ready=False, restarts=1), sub="status")
    wait_for(lambda: env.client.get("pods", ns, "big-g0-0") is None and env.client.get("pods", ns, "big-g0-1")
             is None, 10, "group 0 pods deleted")
    assert {p["metadata"]["uid"] for p in env.cluster.find("pods", ns)} == {uids["big-g1-0"], uids["big-g1-1"]}
    restart_events = [e for e in env.cluster.find("events", ns) if e["reason"] == "GroupRestart"]
    assert restart_events and "big-g0-1" in restart_events[0]["message"]
    ready_is(env, ns, "big", "False")
    # the StatefulSet controller recreates the group; once all its ranks are ready, the service is whole again
    for o in (0, 1):
        env.client.create("pods", ns, _group_pod(ns, "big", 0, o))
        env.client.patch("pods", ns, f"big-g0-{o}", _pod_status(ready=True), sub="status")
    ready_is(env, ns, "big", "True")
    deletes = [w for w in env.cluster.writes if w[0] == "delete" and w[1] == "pods" and w[2] == ns]
    assert sorted(w[3] for w in deletes) == ["big-g0-0", "big-g0-1"]


def test_failed_pod_reasons_surface_in_status(env, ns):
    env.client.create(ISVC, ns, isvc_body("img", {"replicas": 1}))
    wait_for(lambda: env.client.get("deployments", ns, "img"), EVENT_BOUND, "deployment")
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "img-abc", "labels": {
        L_ISVC: "img", L_MANAGED_BY: "shoal-operator", "app.kubernetes.io/component": "engine"}},
        "spec": {"containers": [{"name": "engine", "image": "x"}]}}
    env.client.create("pods", ns, pod)
    env.client.patch("pods", ns, "img-abc", {"status": {"phase": "Pending", "containerStatuses": [{
        "name": "engine", "ready": False, "restartCount": 0, "state": {"waiting": {
            "reason": "ImagePullBackOff", "message": "Back-off pulling image \"x\""}}}]}}, sub="status")
    cond = ready_is(env, ns, "img", "False", "ImagePullBackOff")
    assert "img-abc" in cond["message"] and "Back-off pulling image" in cond["message"]
    isvc = get_isvc(env, ns, "img")
    assert isvc["status"]["phase"] == "Failed"
    assert condition(isvc, "Degraded")["status"] == "True"


def test_api_errors_are_retried_and_converge_without_duplicates(env, ns):
    cluster = env.cluster
    # children are created by server-side apply (a PATCH, "update" to the emulator's request classification)
    faults = [cluster.inject("update", "deployments", 500, 2, subresource=None),
              cluster.inject("update", "services", 409, 1, subresource=None),
              cluster.inject("update", ISVC, 500, 1, subresource="status")]
    try:
        env.client.create(ISVC, ns, isvc_body("flaky", {"replicas": 2}))
        wait_for(lambda: env.client.get("deployments", ns, "flaky") and env.client.get("services", ns, "flaky"),
                 15, "children despite errors")
        wait_for(lambda: get_isvc(env, ns, "flaky").get("status"), EVENT_BOUND, "status despite errors")
        ready_deployment(env, ns, "flaky", 2)
        ready_is(env, ns, "flaky", "True", timeout=15)
        faults.append(cluster.inject("update", "deployments", 503, 2, subresource=None))
        env.client.patch("deployments", ns, "flaky", {"spec": {"replicas": 5}})  # drift while patches fail
        wait_for(lambda: env.client.get("deployments", ns, "flaky")["spec"]["replicas"] == 2, EVENT_BOUND, "repaired")
    finally:
        for f in faults:
            f.remaining = 0
    creates = [w for w in cluster.writes if w[0] == "create" and w[2] == ns]
    kinds = sorted(w[1] for w in creates if w[1] != "events")
    assert kinds == sorted(["deployments", "inferenceservices", "networkpolicies", "poddisruptionbudgets", "services",
                            *(plural for plural, _ in gateway_children("flaky"))])
    # the engines' and the gateway's Deployment; the Service <name> and the gateway's <name>-engines
    assert len(cluster.find("deployments", ns)) == 2 and len(cluster.find("services", ns)) == 2


def test_operator_restart_resumes_without_duplicates(env, ns):
    env.client.create(ISVC, ns, isvc_body("res", {"replicas": 2}))
    wait_for(lambda: len(children(env, ns)) == 4 + len(gateway_children("res")), EVENT_BOUND, "children")
    env.operator.stop()
    env.operator = None
    env.client.delete("networkpolicies", ns, "res")  # changed while the operator was down
    env.client.patch(ISVC, ns, "res", {"spec": {"replicas": 3}})
    before = len([w for w in env.cluster.writes if w[0] == "create" and w[2] == ns and w[1] != "events"])
    env.restart_operator()
    wait_for(lambda: env.client.get("networkpolicies", ns, "res"), EVENT_BOUND, "netpol recreated on resume")
    wait_for(lambda: env.client.get("deployments", ns, "res")["spec"]["replicas"] == 3, EVENT_BOUND, "scaled on resume")
    settled(env, ns, "res")
    after = [w for w in env.cluster.writes if w[0] == "create" and w[2] == ns and w[1] != "events"]
    assert len(after) == before + 1  # only the missing NetworkPolicy


def test_deleting_the_isvc_collects_children(env, ns):
    env.client.create(ISVC, ns, isvc_body("gone", {"replicas": 2}))
    wait_for(lambda: len(children(env, ns)) == 4 + len(gateway_children("gone")), EVENT_BOUND, "children")
    env.client.delete(ISVC, ns, "gone")
    wait_for(lambda: children(env, ns) == {}, EVENT_BOUND, "children collected through ownerReferences")
    settled(env, ns, "gone")  # the deletions of the children were seen too
    assert children(env, ns) == {}  # and nothing resurrects them


def play_statefulsets(env, ns: str) -> None:
    """One pass of the StatefulSet controller and the kubelets: pods for every ordinal of every StatefulSet, on its
    template (OnDelete: existing pods keep theirs), labelled with its revision; a pod created in one pass becomes
    Ready in the next, so a rollout always has moments with unready new pods."""
    pods = {p["metadata"]["name"]: p for p in env.client.list("pods", ns)}
    for sts in env.client.list("statefulsets", ns):
        try:
            _play_statefulset(env, ns, sts, pods)
        except requests.HTTPError as e:  # the operator deleted it (or its pod) meanwhile: next pass
            if e.response is None or e.response.status_code not in (404, 409):
                raise


def _play_statefulset(env, ns: str, sts: dict, pods: dict) -> None:
    meta, template = sts["metadata"], sts["spec"]["template"]
    rev = meta["name"] + "-" + hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:8]
    ready = 0
    for ordinal in range(sts["spec"]["replicas"]):
        name = f"{meta['name']}-{ordinal}"
        pod = pods.get(name)
        if pod is None or pod["metadata"].get("deletionTimestamp"):
            env.client.create("pods", ns, {
                "apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": name, "labels": {**template["metadata"]["labels"], L_POD_INDEX: str(ordinal),
                                                      "controller-revision-hash": rev},
                             "ownerReferences": [{"apiVersion": "apps/v1", "kind": "StatefulSet",
                                                  "controller": True, "name": meta["name"],
                                                  "uid": meta["uid"]}]},
                "spec": template["spec"]})
            env.client.patch("pods", ns, name, _pod_status(ready=False), sub="status")
        elif not condition(pod, "Ready") or condition(pod, "Ready")["status"] != "True":
            env.client.patch("pods", ns, name, _pod_status(ready=True), sub="status")
        else:
            ready += 1
    env.client.patch("statefulsets", ns, meta["name"], {"status": {
        "observedGeneration": meta["generation"], "replicas": sts["spec"]["replicas"], "readyReplicas": ready,
        "updateRevision": rev}}, sub="status")


def ready_groups_timeline(env, ns: str, size: int, since_rv: int) -> list[int]:
    """Replaying the API's event log: the number of groups with all ranks Ready after every pod event."""
    pods: dict[str, dict] = {}
    timeline = []
    for rv, res, event in list(env.cluster.log):
        obj = event["object"]
        if res[2] != "pods" or obj["metadata"].get("namespace") != ns:
            continue
        if event["type"] == "DELETED":
            pods.pop(obj["metadata"]["name"], None)
        else:
            pods[obj["metadata"]["name"]] = obj
        if rv > since_rv:
            ready: dict[str, int] = {}
            for p in pods.values():
                if condition(p, "Ready") and condition(p, "Ready")["status"] == "True":
                    group = p["metadata"]["labels"][L_GROUP]
                    ready[group] = ready.get(group, 0) + 1
            timeline.append(sum(1 for n in ready.values() if n == size))
    return timeline


def roll(env, ns: str, name: str, done) -> None:
    """Play the StatefulSet controller until `done()` holds (bounded)."""
    deadline = time.monotonic() + 20
    while not done():
        assert time.monotonic() < deadline, "rollout did not finish: " + json.dumps({
            "statefulsets": [(s["metadata"]["name"], s["metadata"].get("annotations"), s.get("status"))
                             for s in env.client.list("statefulsets", ns)],
            "pods": [(p["metadata"]["name"], p["metadata"]["labels"].get("controller-revision-hash"),
                      condition(p, "Ready")) for p in env.client.list("pods", ns)],
            "status": get_isvc(env, ns, name).get("status")}, indent=1)
        play_statefulsets(env, ns)
        time.sleep(0.05)


def rolled_out(env, ns: str, name: str, model: str, groups: int):
    def check():
        isvc = get_isvc(env, ns, name)
        sets = env.client.list("statefulsets", ns)
        return (condition(isvc, "Ready") or {}).get("status") == "True" and len(sets) == groups and \
            all(model in str(s["spec"]["template"]) for s in sets) and \
            isvc["status"]["updatedReplicas"] == groups and isvc["status"]["replicas"] == groups
    return check


def test_multi_pod_rollout_surges_a_group_and_never_drops_to_zero(env, ns):
    spec = {"replicas": 1, "model": {"uri": "hf://org/old"},
            "engine": {"tensorParallelSize": 2, "pipelineParallelSize": 2},
            "resources": {"gpusPerPod": 2}}  # default rollout: maxSurge 1, maxUnavailable 0
    env.client.create(ISVC, ns, isvc_body("surge", spec))
    roll(env, ns, "surge", rolled_out(env, ns, "surge", "org/old", 1))
    assert [s["metadata"]["name"] for s in env.client.list("statefulsets", ns)] == ["surge-g0"]
    start = env.cluster.rv
    env.client.patch(ISVC, ns, "surge", {"spec": {"model": {"uri": "hf://org/new"}}})
    roll(env, ns, "surge", rolled_out(env, ns, "surge", "org/new", 1))
    timeline = ready_groups_timeline(env, ns, 2, start)
    assert timeline and min(timeline) >= 1, timeline  # never zero ready groups
    assert max(timeline) == 2  # the new group was Ready before the old one went
    assert [s["metadata"]["name"] for s in env.client.list("statefulsets", ns)] == ["surge-g1"]
    # the last pass of the test's StatefulSet controller may have raced the retirement and recreated an old rank;
    # the garbage collector removes such an orphan, as a cluster's would
    wait_for(lambda: sorted(p["metadata"]["name"] for p in env.client.list("pods", ns)) == ["surge-g1-0", "surge-g1-1"],
             timeout=5, what="only the new group's pods")
    assert env.client.get("services", ns, "surge-g0") is None and env.client.get("services", ns, "surge-g1")
    reasons = [e["reason"] for e in env.cluster.find("events", ns)]
    assert "GroupSurge" in reasons and "GroupRetire" in reasons


def test_multi_pod_rollout_in_place_with_max_surge_zero(env, ns):
    spec = {"replicas": 2, "model": {"uri": "hf://org/old"},
            "engine": {"tensorParallelSize": 2, "pipelineParallelSize": 2},
            "resources": {"gpusPerPod": 2}, "rollout": {"maxSurge": 0, "maxUnavailable": 1}}
    env.client.create(ISVC, ns, isvc_body("inplace", spec))
    roll(env, ns, "inplace", rolled_out(env, ns, "inplace", "org/old", 2))
    start = env.cluster.rv
    uids = {s["metadata"]["uid"] for s in env.client.list("statefulsets", ns)}
    env.client.patch(ISVC, ns, "inplace", {"spec": {"model": {"uri": "hf://org/new"}}})
    roll(env, ns, "inplace", rolled_out(env, ns, "inplace", "org/new", 2))
    timeline = ready_groups_timeline(env, ns, 2, start)
    assert min(timeline) == 1, timeline  # one group at a time (maxUnavailable 1), never both
    assert {s["metadata"]["uid"] for s in env.client.list("statefulsets", ns)} == uids  # same groups, in place
    created = [w for w in env.cluster.writes if w[0] == "create" and w[1] == "statefulsets" and w[2] == ns]
    assert len(created) == 2  # never a surge group


def test_in_place_group_update_of_an_immutable_field_recreates_the_group(env, ns):
    spec = {"replicas": 1, "model": {"uri": "hf://org/m"}, "engine": {"tensorParallelSize": 2,
            "pipelineParallelSize": 2}, "resources": {"gpusPerPod": 2}, "rollout": {"maxSurge": 0, "maxUnavailable": 1}}
    env.client.create(ISVC, ns, isvc_body("immut", spec))
    roll(env, ns, "immut", rolled_out(env, ns, "immut", "org/m", 1))
    uid = env.client.get("statefulsets", ns, "immut-g0")["metadata"]["uid"]
    # per-pod cache claims: volumeClaimTemplates cannot change on a StatefulSet (422)
    env.client.patch(ISVC, ns, "immut", {"spec": {"model": {"cache": {
        "persistent": True, "size": "100Gi", "accessMode": "ReadWriteOnce"}}}})

    def recreated():
        sts = env.client.get("statefulsets", ns, "immut-g0")
        return sts and sts["metadata"]["uid"] != uid and sts["spec"].get("volumeClaimTemplates")
    roll(env, ns, "immut", recreated)
    assert [e for e in env.cluster.find("events", ns) if e["reason"] == "GroupRecreate"]


def test_quota_exceeded_shows_on_conditions_and_events(env, ns):
    env.client.create(ISVC, ns, isvc_body("quota", {"replicas": 1}))
    wait_for(lambda: env.client.get("deployments", ns, "quota"), EVENT_BOUND, "deployment")
    message = ('pods "quota-7d9f-x2" is forbidden: exceeded quota: gpus, requested: requests.nvidia.com/gpu=1, '
               'used: requests.nvidia.com/gpu=8, limited: requests.nvidia.com/gpu=8')
    env.client.patch("deployments", ns, "quota", {"status": {"observedGeneration": 1, "replicas": 0, "conditions": [
        {"type": "ReplicaFailure", "status": "True", "reason": "FailedCreate", "message": message}]}}, sub="status")
    cond = ready_is(env, ns, "quota", "False", "FailedCreate")
    assert message in cond["message"]
    isvc = get_isvc(env, ns, "quota")
    assert condition(isvc, "Degraded")["status"] == "True" and condition(isvc, "Degraded")["reason"] == "FailedCreate"
    assert isvc["status"]["phase"] == "Failed"
    events = wait_for(lambda: [e for e in env.cluster.find("events", ns) if e["reason"] == "FailedCreate"], EVENT_BOUND, "event")
    assert events[0]["type"] == "Warning" and "exceeded quota" in events[0]["message"]


def test_statefulset_failed_create_events_show_on_conditions(env, ns):
    spec = {"replicas": 1, "engine": {"tensorParallelSize": 2, "pipelineParallelSize": 2},
            "resources": {"gpusPerPod": 2}}
    env.client.create(ISVC, ns, isvc_body("stsq", spec))
    sts = wait_for(lambda: env.client.get("statefulsets", ns, "stsq-g0"), EVENT_BOUND, "statefulset")
    message = ('create Pod stsq-g0-0 in StatefulSet stsq-g0 failed error: pods "stsq-g0-0" is forbidden: '
               'violates PodSecurity "restricted:latest": hostPath volumes')
    # the StatefulSet controller reports it only as an Event (no condition, no status change to watch)
    env.client.create("events", ns, {"apiVersion": "v1", "kind": "Event", "metadata": {"name": "stsq-g0.1"},
                                     "type": "Warning", "reason": "FailedCreate", "message": message,
                                     "lastTimestamp": "2026-01-01T00:00:00Z",
                                     "involvedObject": {"kind": "StatefulSet", "name": "stsq-g0", "namespace": ns,
                                                        "uid": sts["metadata"]["uid"]}})
    cond = ready_is(env, ns, "stsq", "False", "FailedCreate", timeout=15)
    assert "violates PodSecurity" in cond["message"] and "stsq-g0" in cond["message"]


def test_rejected_child_shows_on_conditions_and_recovers(env, ns):
    message = 'admission webhook "policy.example.com" denied the request: GPU pods need a team label'
    fault = env.cluster.inject("update", "deployments", 422, 1000, subresource=None, message=message)
    try:
        env.client.create(ISVC, ns, isvc_body("denied", {"replicas": 1}))
        cond = ready_is(env, ns, "denied", "False", "ChildRejected")
        assert "Deployment denied" in cond["message"] and message in cond["message"]
        assert get_isvc(env, ns, "denied")["status"]["phase"] == "Failed"
        wait_for(lambda: [e for e in env.cluster.find("events", ns) if e["reason"] == "ChildRejected"], EVENT_BOUND, "event")
        assert env.client.get("services", ns, "denied")  # the other children were still created
    finally:
        fault.remaining = 0
    wait_for(lambda: env.client.get("deployments", ns, "denied"), EVENT_BOUND, "deployment once the API accepts it")
    wait_for(lambda: condition(get_isvc(env, ns, "denied"), "Ready")["reason"] != "ChildRejected", EVENT_BOUND, "cleared")


def test_child_watches_are_filtered_server_side(env, ns):
    watches = [r for r in env.cluster._requests if r.action is not None and r.action.value == "WATCH"]
    by_plural = {r.resource.plural: r.params.get("labelSelector") for r in watches}
    for plural in ("deployments", "statefulsets", "services", "configmaps", "pods", "networkpolicies",
                   "poddisruptionbudgets", "persistentvolumeclaims"):
        assert by_plural[plural] == "app.kubernetes.io/managed-by=shoal-operator", plural


EVERY_OPTIONAL_FIELD = {
    "model": {"uri": "hf://org/model", "revision": "v2", "servedName": "m", "chatTemplate": "{{ messages }}",
              "cache": {"persistent": True, "size": "500Gi", "storageClassName": "cephfs"}},
    "replicas": 3, "image": "my.registry/engine:2", "imagePullPolicy": "Always", "imagePullSecrets": ["pull"],
    "engine": {"tensorParallelSize": 2, "dtype": "bfloat16", "maxModelLen": 8192, "maxNumSeqs": 64,
               "maxNumBatchedTokens": 4096, "gpuMemoryUtilization": 0.85, "enablePrefixCaching": False,
               "attentionBackend": "triton", "enforceEager": True, "shutdownTimeoutSeconds": 120,
               "extraArgs": ["--seed", "7"]},
    "resources": {"gpusPerPod": 2, "gpuResource": "amd.com/gpu", "cpu": "16", "memory": "128Gi",
                  "shmSize": "16Gi", "cacheSize": "200Gi", "extra": {"rdma/hca": 1}},
    "scheduling": {"nodeSelector": {"gpu": "a100"},
                   "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                   "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                       "nodeSelectorTerms": [{"matchExpressions": [{"key": "zone", "operator": "In",
                                                                    "values": ["a"]}]}]}}},
                   "priorityClassName": "inference",
                   "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "zone",
                                                  "whenUnsatisfiable": "ScheduleAnyway"}],
                   "schedulerName": "volcano", "runtimeClassName": "nvidia"},
    "env": [{"name": "NCCL_DEBUG", "value": "INFO"}],
    "security": {"apiKeySecretRef": {"name": "llm-key", "key": "token"}, "capabilities": ["IPC_LOCK"],
                 "networkPolicy": {"allowFrom": [{"namespaceSelector": {"matchLabels": {"team": "b"}}}],
                                   "metricsFrom": [{"namespaceSelector": {"matchLabels": {"prom": "yes"}}}]}},
    "probes": {"startupTimeoutSeconds": 3600, "downloadTimeoutSeconds": 7200},
    "rollout": {"maxUnavailable": 1, "maxSurge": 0},
    "pod": {"labels": {"kueue.x-k8s.io/queue-name": "q"}, "annotations": {"a": "b"}, "serviceAccountName": "sa",
            "automountServiceAccountToken": True,
            "template": {"spec": {"hostIPC": True, "containers": [{"name": "side", "image": "busybox"}]}}},
}


def converged(env, ns: str, name: str) -> bool:
    """Does every child hold exactly what the operator renders for the stored spec (nothing more)?"""
    from shoal.operator import handlers, render

    want = {(c["kind"], c["metadata"]["name"]): c
            for c in render.render(get_isvc(env, ns, name), handlers.settings_from_env())}
    plural = {"Deployment": "deployments", "StatefulSet": "statefulsets", "Service": "services",
              "NetworkPolicy": "networkpolicies", "PodDisruptionBudget": "poddisruptionbudgets",
              "ConfigMap": "configmaps", "PersistentVolumeClaim": "persistentvolumeclaims",
              "ServiceAccount": "serviceaccounts", "Role": "roles", "RoleBinding": "rolebindings"}
    have = children(env, ns)
    if set(have) != {(plural[k], n) for k, n in want}:
        return False
    for (kind, n), desired in want.items():
        actual = have[(plural[kind], n)]
        if any(actual.get(k) != desired.get(k) for k in ("spec", "data", "rules", "roleRef", "subjects")):
            return False
        if any(actual["metadata"].get(k) != desired["metadata"].get(k) for k in ("labels", "annotations")):
            return False
    return True


def test_removing_every_optional_field_converges_to_the_rendered_children(env, ns):
    env.client.create(ISVC, ns, isvc_body("opt", EVERY_OPTIONAL_FIELD))
    wait_for(lambda: converged(env, ns, "opt"), EVENT_BOUND, "children with every option")
    assert env.client.get("persistentvolumeclaims", ns, "opt-model-cache")
    pod = env.client.get("deployments", ns, "opt")["spec"]["template"]["spec"]
    assert pod["nodeSelector"] and pod["tolerations"] and pod["initContainers"] and pod["imagePullSecrets"]
    for c in pod["containers"] + pod["initContainers"]:  # the API key is never in args, nor in init containers
        assert not any("SHOAL_API_KEY" in a or a == "--api-key" for a in c.get("command", []) + c.get("args", []))
    assert not any(e["name"] == "SHOAL_API_KEY" for e in pod["initContainers"][0]["env"])
    # back to the defaults: every optional field removed (JSON merge patch: null deletes)
    env.client.patch(ISVC, ns, "opt", {"spec": {k: None for k in EVERY_OPTIONAL_FIELD}})
    wait_for(lambda: converged(env, ns, "opt"), EVENT_BOUND, "children without any option")
    pod = env.client.get("deployments", ns, "opt")["spec"]["template"]["spec"]
    for gone in ("nodeSelector", "tolerations", "affinity", "priorityClassName", "imagePullSecrets",
                 "initContainers", "topologySpreadConstraints", "schedulerName", "runtimeClassName",
                 "serviceAccountName", "hostIPC"):
        assert gone not in pod, gone
    assert [c["name"] for c in pod["containers"]] == ["engine"] and pod["automountServiceAccountToken"] is False
    assert "add" not in pod["containers"][0]["securityContext"]["capabilities"]
    assert env.client.get("configmaps", ns, "opt-chat-template") is None
    assert env.client.get("persistentvolumeclaims", ns, "opt-model-cache") is None
    assert not any(e["name"] in ("NCCL_DEBUG", "SHOAL_API_KEY") for e in pod["containers"][0]["env"])


def test_multi_pod_to_single_pod_converges(env, ns):
    env.client.create(ISVC, ns, isvc_body("shrink", {"engine": {"tensorParallelSize": 2, "pipelineParallelSize": 2},
                                                     "resources": {"gpusPerPod": 2}}))
    wait_for(lambda: converged(env, ns, "shrink"), EVENT_BOUND, "multi-pod children")
    assert env.client.get("services", ns, "shrink-engines")["spec"]["selector"][L_POD_INDEX] == "0"
    env.client.patch(ISVC, ns, "shrink", {"spec": {"engine": None, "resources": None}})
    wait_for(lambda: converged(env, ns, "shrink"), EVENT_BOUND, "single-pod children")
    assert L_POD_INDEX not in env.client.get("services", ns, "shrink-engines")["spec"]["selector"]
    assert env.client.get("statefulsets", ns, "shrink-g0") is None


# ---- the gateway the operator deploys ---------------------------------------------------------------------------
def _get(env, path: str) -> dict | None:
    r = env.client.http.get(env.server.url + path)
    if r.status_code == 404:
        return None
    r.raise_for_status()
    return r.json()


def test_operator_reconciles_the_gateway(env, ns):
    env.client.create("inferenceservices", ns, isvc_body("llm", {"replicas": 2, "gateway": {"routing": "least-load"}}))
    paths = {
        "Deployment": f"/apis/apps/v1/namespaces/{ns}/deployments/llm-gateway",
        "ServiceAccount": f"/api/v1/namespaces/{ns}/serviceaccounts/llm-gateway",
        "Role": f"/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/roles/llm-gateway",
        "RoleBinding": f"/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/rolebindings/llm-gateway",
        "engines Service": f"/api/v1/namespaces/{ns}/services/llm-engines",
        "PodDisruptionBudget": f"/apis/policy/v1/namespaces/{ns}/poddisruptionbudgets/llm-gateway",
        "NetworkPolicy": f"/apis/networking.k8s.io/v1/namespaces/{ns}/networkpolicies/llm-gateway",
    }
    for what, path in paths.items():
        wait_for(lambda p=path: _get(env, p), 15, f"the gateway's {what}")
    dep = _get(env, paths["Deployment"])
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--routing") + 1] == "least-load" and dep["spec"]["replicas"] == 2
    assert dep["metadata"]["ownerReferences"][0]["kind"] == "InferenceService"
    service = f"/api/v1/namespaces/{ns}/services/llm"
    wait_for(lambda: _get(env, service)["spec"]["selector"]["app.kubernetes.io/component"] == "gateway", 15,
             "the Service to point at the gateway")

    # Turned off: the gateway's objects go, and the Service points at the engines again.
    env.client.patch("inferenceservices", ns, "llm", {"spec": {"gateway": {"enabled": False}}})
    for what, path in paths.items():
        wait_for(lambda p=path: _get(env, p) is None, 15, f"the gateway's {what} to be deleted")
    wait_for(lambda: _get(env, service)["spec"]["selector"]["app.kubernetes.io/component"] == "engine", 15,
             "the Service to point at the engines")



# ---- spec.adapters ----------------------------------------------------------------------------------------------
class FakeSidecar:
    """What a pod's adapter-sync sidecar answers on /status (the real one runs in test_adapters_e2e.py)."""

    def __init__(self):
        import http.server
        import threading

        self.report: dict = {"config": None, "engine": "ready", "adapters": []}
        fake = self

        class Handler(QuietHandler):
            def do_GET(self):  # noqa: N802 - http.server's naming
                self.reply(200 if self.path == "/status" else 404, json.dumps(fake.report).encode(),
                           "application/json")

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def serve(self, configmap: dict, states: dict[str, tuple[str, str | None]]) -> None:
        listed = json.loads(configmap["data"]["adapters.json"])["adapters"]
        self.report = {"config": hashlib.sha256(configmap["data"]["adapters.json"].encode()).hexdigest()[:16],
                       "engine": "ready", "adapters": [{"name": a["name"], "source": a["source"],
                                                        "state": states[a["name"]][0], "message": states[a["name"]][1]}
                                                       for a in listed if a["name"] in states]}


def test_adapters_reach_the_pods_list_without_touching_the_template_and_show_on_status(env, ns):
    from shoal.operator.render import labels

    lora = {"engine": {"enableLora": True}, "gateway": {"enabled": False},
            "adapters": [{"name": "good", "uri": "file:///loras/good"}, {"name": "bad", "uri": "file:///loras/bad"}]}
    env.client.create(ISVC, ns, isvc_body("lo", lora))
    cm = wait_for(lambda: env.client.get("configmaps", ns, "lo-adapters"), EVENT_BOUND, "the adapters ConfigMap")
    dep = wait_for(lambda: env.client.get("deployments", ns, "lo"), EVENT_BOUND, "deployment")
    template_hash = dep["metadata"]["annotations"]["serving.shoal.dev/spec-hash"]
    sidecar = FakeSidecar()
    try:
        sidecar.serve(cm, {"good": ("Loaded", None), "bad": ("Failed", "400: rank 32, above --max-lora-rank 16")})
        spec = copy.deepcopy(dep["spec"]["template"]["spec"])
        spec["containers"][1]["ports"][0]["containerPort"] = sidecar.port  # where this "pod" listens
        env.client.create("pods", ns, {"apiVersion": "v1", "kind": "Pod", "metadata": {
            "name": "lo-abc12", "labels": labels("lo", "engine")}, "spec": spec})
        env.client.patch("pods", ns, "lo-abc12", {"status": {"phase": "Running", "podIP": "127.0.0.1", "conditions": [
            {"type": "Ready", "status": "True"}]}}, sub="status")
        ready_deployment(env, ns, "lo", 1)

        cond = wait_for(lambda: (c := condition(get_isvc(env, ns, "lo"), "AdaptersReady")) and
                        c["reason"] == "AdapterLoadFailed" and c, 15, "AdaptersReady=False")
        assert cond["status"] == "False" and "bad on lo-abc12: 400: rank 32" in cond["message"]
        status = get_isvc(env, ns, "lo")["status"]
        assert [(a["name"], a["readyReplicas"], a["failedReplicas"]) for a in status["adapters"]] == [
            ("good", 1, 0), ("bad", 0, 1)]
        assert status["adapters"][1]["errors"][0]["pod"] == "lo-abc12"
        assert condition(get_isvc(env, ns, "lo"), "Ready")["status"] == "True"  # the engine keeps serving
        failed = wait_for(lambda: [e for e in env.cluster.find("events", ns) if e["reason"] == "AdapterLoadFailed"],
                          10, "an AdapterLoadFailed Event")
        assert "adapter bad on pod lo-abc12" in failed[0]["message"] and failed[0]["type"] == "Warning"

        # Replace the bad adapter: the list reaches the pods (ConfigMap), the template does not move (no restart)
        env.client.patch(ISVC, ns, "lo", {"spec": {"adapters": [lora["adapters"][0],
                                                                {"name": "new", "uri": "hf://org/new-lora"}]}})
        cm = wait_for(lambda: (c := env.client.get("configmaps", ns, "lo-adapters")) and "new-lora" in
                      c["data"]["adapters.json"] and c, 10, "the new list in the ConfigMap")
        wait_for(lambda: [(a["readyReplicas"], a["pendingReplicas"]) for a in
                          get_isvc(env, ns, "lo")["status"]["adapters"]] == [(1, 0), (0, 1)], 10, "new: Pending while the pod still has the old list")
        sidecar.serve(cm, {"good": ("Loaded", None), "new": ("Loaded", None)})
        wait_for(lambda: condition(get_isvc(env, ns, "lo"), "AdaptersReady")["status"] == "True", 15,
                 "AdaptersReady=True once the pod reports the new list loaded")
        assert [a["name"] for a in get_isvc(env, ns, "lo")["status"]["adapters"]] == ["good", "new"]
        wait_for(lambda: [e for e in env.cluster.find("events", ns) if e["reason"] == "AdaptersReady"], 10,
                 "an AdaptersReady Event")
        settled(env, ns, "lo")
        assert env.client.get("deployments", ns, "lo")["metadata"]["annotations"][
            "serving.shoal.dev/spec-hash"] == template_hash

        # No adapters left: status.adapters and the condition go
        env.client.patch(ISVC, ns, "lo", {"spec": {"adapters": None}})
        wait_for(lambda: "adapters" not in get_isvc(env, ns, "lo")["status"], EVENT_BOUND, "status.adapters removed")
        assert condition(get_isvc(env, ns, "lo"), "AdaptersReady") is None
    finally:
        sidecar.server.shutdown()


def test_a_cpu_service_is_applied_once_however_often_it_is_reconciled(env, ns):
    """The API server drops empty env values: a template rendered with one (CUDA_VISIBLE_DEVICES="") never equals
    the stored one, and every reconcile re-applied the Deployment. N reconciles -> one apply."""
    env.client.create(ISVC, ns, isvc_body("cpu", {"resources": {"gpusPerPod": 0, "cpu": "1", "memory": "2Gi"},
                                                  "env": [{"name": "EMPTY_ON_PURPOSE", "value": ""}]}))
    wait_for(lambda: env.client.get("deployments", ns, "cpu"), 10, "deployment")
    settled(env, ns, "cpu")
    applies = lambda: env.cluster.applies.count(("deployments", ns, "cpu"))  # noqa: E731
    first = applies()
    for n in range(5):  # each a child event: a reconcile of the service
        env.client.patch("deployments", ns, "cpu", {"status": {"observedGeneration": 1, "replicas": 1,
                                                               "readyReplicas": n % 2}}, sub="status")
        wait_for(lambda: env.client.get(ISVC, ns, "cpu").get("status", {}).get("readyReplicas") == n % 2, 10,
                 "the reconcile that saw the new Deployment status")
        settled(env, ns, "cpu")
    assert first == 1 and applies() == first
    stored = env.client.get("deployments", ns, "cpu")["spec"]["template"]["spec"]["containers"][0]["env"]
    assert {"name": "EMPTY_ON_PURPOSE"} in stored


def test_no_child_is_written_for_a_service_deleted_while_a_reconcile_runs(env, ns):
    """The operator's indexes lag the API (watch streams of different kinds are not ordered): a reconcile that still
    sees a deleted service and a child the garbage collector already removed must not re-create that child (owned
    by a uid that no longer exists). Deletion races a reconcile here: the spec change and the deletion reach the
    operator (every watch) 1 s late, 0.5 s apart."""
    isvc = env.client.create(ISVC, ns, isvc_body("gone", {"replicas": 2}))
    wait_for(lambda: env.client.get("deployments", ns, "gone"), 10, "deployment")
    settled(env, ns, "gone")
    env.cluster.lag(None, 1.0)  # every watch: the children the garbage collector removes stay in the indexes
    try:
        env.client.patch(ISVC, ns, "gone", {"spec": {"replicas": 3}})  # its reconcile applies, creating nothing new
        time.sleep(0.5)  # the race itself: delete while that reconcile is on its way
        env.client.delete(ISVC, ns, "gone")
        deleted_at = len(env.cluster.writes)
        wait_for(lambda: (ns, "gone") not in (env.operator.memo.reconciler.indexes.get("InferenceService") or {}),
                 10, "the operator to see the deletion")
        settled(env, ns, "gone")
    finally:
        env.cluster.lag(None, 0)
    written = [w for w in env.cluster.writes[deleted_at:] if w[0] in ("create", "patch") and w[2] == ns]
    assert written == [], f"children written for the deleted {isvc['metadata']['uid']}: {written}"
    assert env.client.get("deployments", ns, "gone") is None
