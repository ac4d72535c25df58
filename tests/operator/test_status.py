"""Status diagnosis (status.py, pure functions) and the shoal-operator command line."""

from __future__ import annotations

import copy
import datetime
import subprocess
import sys

import pytest

from shoal.operator import __main__ as cli
from shoal.operator import api, handlers, kube, render, status
from shoal.operator.render import L_GROUP, Settings


def isvc(spec=None, status=None):
    return {"metadata": {"name": "m", "namespace": "ns", "uid": "u", "generation": 3}, "spec": spec or {},
            "status": status or {}}


def pod(name, *, ready=False, waiting=None, running=True, started=True, phase="Running", group=None,
        unschedulable=False, restarts=0):
    cs = {"name": "engine", "ready": ready, "started": started, "restartCount": restarts,
          "state": {"waiting": waiting} if waiting else {"running": {}} if running else {}}
    conds = [{"type": "Ready", "status": "True" if ready else "False"}]
    if unschedulable:
        conds.append({"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                      "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."})
        cs = None
    labels = {L_GROUP: str(group)} if group is not None else {}
    return {"metadata": {"name": name, "labels": labels},
            "status": {"phase": phase, "conditions": conds, "containerStatuses": [cs] if cs else []}}


def deployment(ready, replicas=2, updated=None, gen=1, observed=1, conditions=None):
    return {("Deployment", "m"): {"metadata": {"name": "m", "generation": gen}, "status": {
        "replicas": replicas, "readyReplicas": ready, "updatedReplicas": replicas if updated is None else updated,
        "observedGeneration": observed, "conditions": conditions or []}}}


def status_for(spec, children, pods, old=None):
    obj = isvc(spec, old)
    return status.compute_status(obj, render.plan(obj, Settings()), children, pods)


def cond(status, type_):
    return next(c for c in status["conditions"] if c["type"] == type_)


def test_all_ready():
    s = status_for({"replicas": 2}, deployment(2), [pod("a", ready=True), pod("b", ready=True)])
    assert s["phase"] == "Ready" and s["readyReplicas"] == 2 and s["observedGeneration"] == 3
    assert s["ready"] == "2/2"
    assert cond(s, "Ready")["status"] == "True" and cond(s, "Ready")["reason"] == "AllReplicasReady"
    assert cond(s, "Progressing")["status"] == "False" and cond(s, "Degraded")["status"] == "False"
    assert all(c["observedGeneration"] == 3 for c in s["conditions"])


@pytest.mark.parametrize("waiting,reason", [
    ({"reason": "ImagePullBackOff", "message": "Back-off pulling image"}, "ImagePullBackOff"),
    ({"reason": "ErrImagePull", "message": "not found"}, "ImagePullBackOff"),
    ({"reason": "CrashLoopBackOff", "message": "back-off 5m0s restarting failed container"}, "CrashLoopBackOff"),
    ({"reason": "CreateContainerConfigError", "message": "secret \"k\" not found"}, "CreateContainerConfigError"),
])
def test_container_waiting_reasons(waiting, reason):
    s = status_for({"replicas": 1}, deployment(0, replicas=1), [pod("p1", waiting=waiting, running=False)])
    ready = cond(s, "Ready")
    assert ready["status"] == "False" and ready["reason"] == reason
    assert "p1" in ready["message"] and waiting["message"] in ready["message"]
    assert s["phase"] == "Failed" and cond(s, "Degraded")["reason"] == reason


def test_probe_failing_loading_unschedulable():
    s = status_for({"replicas": 1}, deployment(0, replicas=1), [pod("p", started=True, ready=False)])
    assert cond(s, "Ready")["reason"] == "ProbeFailing" and s["phase"] == "Loading"
    assert cond(s, "Degraded")["status"] == "True"
    s = status_for({"replicas": 1}, deployment(0, replicas=1), [pod("p", started=False)])
    assert cond(s, "Ready")["reason"] == "ModelLoading" and s["phase"] == "Loading"
    assert cond(s, "Degraded")["status"] == "False"
    s = status_for({"replicas": 1}, deployment(0, replicas=1), [pod("p", unschedulable=True, phase="Pending")])
    assert cond(s, "Ready")["reason"] == "Unschedulable" and "Insufficient nvidia.com/gpu" in cond(s, "Ready")[
        "message"]


def test_partial_and_rollout_and_deadline():
    s = status_for({"replicas": 2}, deployment(1), [pod("a", ready=True)])
    assert s["phase"] == "Degraded" and cond(s, "Ready")["status"] == "False"
    s = status_for({"replicas": 2}, deployment(2, gen=2, observed=1), [])
    assert cond(s, "Progressing")["status"] == "True" and s["updatedReplicas"] == 0
    dl = [{"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded",
           "message": "ReplicaSet \"m-1\" has timed out progressing."}]
    s = status_for({"replicas": 2}, deployment(0, conditions=dl), [])
    assert cond(s, "Progressing")["reason"] == "ProgressDeadlineExceeded" and s["phase"] == "Failed"


def test_scaled_to_zero():
    s = status_for({"replicas": 0}, deployment(0, replicas=0), [])
    assert cond(s, "Ready")["reason"] == "ScaledToZero" and s["phase"] == "Pending"


AUTOSCALED = {"autoscaling": {"minReplicas": 0, "maxReplicas": 4}}


def test_an_idle_autoscaled_fleet_at_zero_is_ready_the_gateway_holds_and_wakes():
    """`kubectl wait --for=condition=Ready` must not hang on a fleet idle at zero: requests will be served."""
    s = status_for({**AUTOSCALED, "replicas": 0}, deployment(0, replicas=0), [])
    assert cond(s, "Ready")["status"] == "True" and cond(s, "Ready")["reason"] == "ScaledToZero"
    assert "the gateway holds requests" in cond(s, "Ready")["message"] and s["phase"] == "Ready"
    assert cond(s, "Degraded")["status"] == "False"
    # woken: the first replica loads while the gateway holds the requests
    s = status_for(AUTOSCALED, deployment(0, replicas=1), [pod("p", started=False)],
                   old={"autoscaling": {"desiredReplicas": 1}})
    assert cond(s, "Ready")["status"] == "True" and cond(s, "Ready")["reason"] == "ScalingFromZero"
    # but not when the replica cannot start: that is an error, whatever the gateway holds
    s = status_for(AUTOSCALED, deployment(0, replicas=1), [pod("p", waiting={
        "reason": "CrashLoopBackOff", "message": "back-off"}, running=False)],
        old={"autoscaling": {"desiredReplicas": 1}})
    assert cond(s, "Ready")["status"] == "False" and cond(s, "Ready")["reason"] == "CrashLoopBackOff"
    # without the gateway nothing holds requests: spec.replicas 0 is still not ready
    s = status_for({"replicas": 0}, deployment(0, replicas=0), [])
    assert cond(s, "Ready")["status"] == "False"


def test_a_scale_up_is_not_degradation():
    s = status_for({**AUTOSCALED, "replicas": 1}, deployment(1, replicas=3),
                   [pod("a", ready=True), pod("b", started=False), pod("c", started=False)],
                   old={"autoscaling": {"desiredReplicas": 3}})
    assert s["ready"] == "1/3" and s["phase"] == "Ready"
    assert cond(s, "Ready")["status"] == "True" and cond(s, "Ready")["reason"] == "ScalingUp"
    assert cond(s, "Degraded")["status"] == "False"
    assert cond(s, "Progressing")["status"] == "True"
    # the same numbers without autoscaling (replicas the user asked for are missing) stay not Ready
    s = status_for({"replicas": 3}, deployment(1, replicas=3), [pod("a", ready=True)])
    assert cond(s, "Ready")["status"] == "False" and s["phase"] == "Degraded"


def test_last_transition_time_kept_while_status_unchanged():
    first = status_for({"replicas": 1}, deployment(1, replicas=1), [])
    old = dict(first)
    old["conditions"] = [dict(c, lastTransitionTime="2020-01-01T00:00:00Z") for c in first["conditions"]]
    again = status_for({"replicas": 1}, deployment(1, replicas=1), [], old=old)
    assert cond(again, "Ready")["lastTransitionTime"] == "2020-01-01T00:00:00Z"
    flipped = status_for({"replicas": 1}, deployment(0, replicas=1), [], old=old)
    assert cond(flipped, "Ready")["lastTransitionTime"] != "2020-01-01T00:00:00Z"


def test_multi_pod_group_ready_only_when_all_ranks_are():
    spec = {"replicas": 2, "engine": {"tensorParallelSize": 8, "pipelineParallelSize": 2},
            "resources": {"gpusPerPod": 8}}
    revision = render.plan(isvc(spec), Settings()).revision
    sts = {("StatefulSet", f"m-g{r}"): {"metadata": {
        "name": f"m-g{r}", "generation": 1, "labels": {L_GROUP: str(r)},
        "annotations": {render.A_REVISION: revision}}, "status": {
        "observedGeneration": 1, "updatedReplicas": 2, "replicas": 2}} for r in (0, 1)}
    pods = [pod("m-g0-0", ready=True, group=0), pod("m-g0-1", ready=True, group=0),
            pod("m-g1-0", ready=True, group=1), pod("m-g1-1", ready=False, group=1)]
    s = status_for(spec, sts, pods)
    assert (s["replicas"], s["readyReplicas"], s["updatedReplicas"]) == (2, 1, 2)
    assert s["phase"] == "Degraded" and "1/2 replicas ready" in cond(s, "Ready")["message"]


def test_invalid_status_names_the_field():
    s = status.invalid_status(isvc(), api.SpecError("spec.engine.dtype", "bad"))
    assert s["phase"] == "Failed" and cond(s, "Ready")["reason"] == "InvalidSpec"
    assert cond(s, "Ready")["message"] == "spec.engine.dtype: bad"


def test_drift_detection():
    desired = render.render(isvc({"replicas": 2}) | {"metadata": {"name": "m", "namespace": "ns", "uid": "u"}})[0]
    actual = {**desired, "metadata": {**desired["metadata"], "resourceVersion": "5"},
              "spec": {**desired["spec"], "progressDeadlineSeconds": desired["spec"]["progressDeadlineSeconds"],
                       "paused": False}}
    assert not handlers._drifted(actual, desired)  # server-side defaults are not drift
    edited = {**actual, "spec": {**actual["spec"], "replicas": 7}}
    assert handlers._drifted(edited, desired)


def test_drift_compares_quantities_canonically():
    desired = render.render(isvc({"resources": {"gpusPerPod": 0, "cpu": "2000m", "memory": "1024Mi"}}) |
                            {"metadata": {"name": "m", "namespace": "ns", "uid": "u"}})[0]
    actual = copy.deepcopy(desired)
    res = actual["spec"]["template"]["spec"]["containers"][0]["resources"]
    res["requests"].update(cpu="2", memory="1Gi")  # as the API server stores them
    res["limits"].update(memory="1Gi")
    assert not handlers._drifted(actual, desired)
    res["requests"]["memory"] = "2Gi"
    assert handlers._drifted(actual, desired)


# ------------------------------------------------------------------------------------------------------- CLI
def test_cli_splits_own_flags_from_kopf_flags():
    env, rest = cli.parse(["--standalone", "--engine-image=r/e:1", "-A", "--max-gpus-per-node", "4",
                           "--liveness=http://0.0.0.0:8080/healthz", "--log-format=json", "--verbose"])
    assert env == {"SHOAL_ENGINE_IMAGE": "r/e:1", "SHOAL_MAX_GPUS_PER_NODE": "4"}
    assert rest == ["--standalone", "-A", "--liveness=http://0.0.0.0:8080/healthz", "--log-format=json",
                    "--verbose"]
    with pytest.raises(SystemExit):
        cli.parse(["--max-gpus-per-node=0"])
    env, rest = cli.parse(["--metrics-namespace", "monitoring", "--metrics-namespace=prom", "-A"])
    assert env == {"SHOAL_METRICS_NAMESPACES": "monitoring,prom"} and rest == ["-A"]


def test_peering_priority_auto_is_random_and_distinct():
    a = cli.peering_priority(["--peering=shoal", "--peering-priority", "auto", "-A"])
    b = cli.peering_priority(["--peering=shoal", "--peering-priority=auto", "-A"])
    assert a[0] == "--peering=shoal" and a[1] == "--priority" and a[3:] == ["-A"] and b[3:] == ["-A"]
    assert 0 < int(a[2]) < 2**31 and a[2] != b[2]
    with pytest.raises(SystemExit):
        cli.peering_priority(["--peering-priority", "7"])


def test_settings_from_env(monkeypatch):
    monkeypatch.setenv("SHOAL_ENGINE_IMAGE", "x/y:z")
    monkeypatch.setenv("SHOAL_MAX_GPUS_PER_NODE", "4")
    monkeypatch.delenv("SHOAL_OPERATOR_NAMESPACE", raising=False)
    monkeypatch.setenv("POD_NAMESPACE", "ops")
    monkeypatch.setenv("SHOAL_METRICS_NAMESPACES", "monitoring, prom")
    s = handlers.settings_from_env()
    assert (s.engine_image, s.max_gpus_per_node, s.operator_namespace) == ("x/y:z", 4, "ops")
    assert s.metrics_namespaces == ("monitoring", "prom")


def test_cli_accepts_kopf_run_flags():
    out = subprocess.run([sys.executable, "-m", "shoal.operator", "--engine-image", "a/b:c", "--standalone",
                          "-n", "team-a", "--liveness=http://0.0.0.0:8080/healthz", "--verbose", "--help"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "--all-namespaces" in out.stdout and "--liveness" in out.stdout and "--log-format" in out.stdout


def test_permissions_cover_every_kind_the_operator_writes():
    granted = {(g, r): set(v) for g, r, v in kube.PERMISSIONS}
    for kind, (api_version, plural) in kube.KINDS.items():
        group = api_version.rpartition("/")[0]
        verbs = granted[(group, plural)]
        assert {"list", "watch"} <= verbs if kind != "Event" else "list" in verbs, kind
        if kind in kube.CHILD_KINDS:
            assert {"create", "patch", "delete"} <= verbs, kind
    assert granted[("", "pods")] >= {"delete"} and granted[(api.GROUP, "inferenceservices/status")] >= {"patch"}
    assert "get" in granted[(api.GROUP, "inferenceservices")]  # read before children are created
    assert all("update" not in v or r.endswith("/finalizers") for (g, r), v in granted.items())  # no PUT


def downloading_pod(started: str, waiting: dict | None = None) -> dict:
    state = {"waiting": waiting} if waiting else {"running": {"startedAt": started}}
    return {"metadata": {"name": "dl", "labels": {}}, "status": {
        "phase": "Pending", "conditions": [{"type": "Ready", "status": "False"}],
        "initContainerStatuses": [{"name": "model-download", "ready": False, "restartCount": 0, "state": state}],
        "containerStatuses": [{"name": "engine", "ready": False, "restartCount": 0,
                               "state": {"waiting": {"reason": "PodInitializing"}}}]}}


DEADLINE = [{"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded",
             "message": "ReplicaSet \"m-1\" has timed out progressing."}]
NOW = datetime.datetime(2026, 1, 1, 12, 0, tzinfo=datetime.timezone.utc)


def test_a_slow_healthy_download_is_progress_not_a_failure():
    obj = isvc({"model": {"uri": "hf://org/big"}})
    s = status.compute_status(obj, render.plan(obj, Settings()), deployment(0, replicas=1, conditions=DEADLINE),
                              [downloading_pod("2026-01-01T10:00:00Z")], now=NOW)
    assert cond(s, "Ready")["reason"] == "ModelDownloading" and "120 min so far" in cond(s, "Ready")["message"]
    assert "kubectl logs dl -c model-download" in cond(s, "Ready")["message"]
    assert s["phase"] == "Loading" and cond(s, "Degraded")["status"] == "False"
    assert cond(s, "Progressing")["status"] == "True"


def test_a_download_beyond_its_budget_fails():
    obj = isvc({"model": {"uri": "hf://org/big"}, "probes": {"downloadTimeoutSeconds": 3600}})
    s = status.compute_status(obj, render.plan(obj, Settings()), deployment(0, replicas=1),
                              [downloading_pod("2026-01-01T10:00:00Z")], now=NOW)
    assert cond(s, "Ready")["reason"] == "ModelDownloadTimeout" and "3600 s" in cond(s, "Ready")["message"]
    assert s["phase"] == "Failed"


def test_a_failing_download_reports_the_init_container():
    obj = isvc({"model": {"uri": "hf://org/big"}})
    pod = downloading_pod("", waiting={"reason": "CrashLoopBackOff", "message": "back-off 40s"})
    s = status.compute_status(obj, render.plan(obj, Settings()), deployment(0, replicas=1), [pod], now=NOW)
    assert cond(s, "Ready")["reason"] == "CrashLoopBackOff" and "model-download" in cond(s, "Ready")["message"]


async def test_the_status_patch_carries_the_resource_version_it_was_computed_from():
    """The conditions list is replaced whole: without the resourceVersion an older copy of the autoscaler's
    condition could be written back over a newer one."""
    class RecordingKube:
        def __init__(self):
            self.patches = []

        async def merge_patch(self, kind, namespace, name, patch, subresource=None):
            self.patches.append((subresource, patch))
            return {}

    kube = RecordingKube()
    reconciler = handlers.Reconciler(kube=kube, settings=Settings())
    obj = isvc()
    obj["metadata"]["resourceVersion"] = "41"
    await reconciler._write_status(obj, {"phase": "Pending", "conditions": []})
    ((subresource, patch),) = kube.patches
    assert subresource == "status" and patch["metadata"]["resourceVersion"] == "41"
    assert patch["status"]["phase"] == "Pending"


def test_a_rank_that_failed_is_a_group_restart_not_a_failed_service():
    """A failed or restarted rank makes the reconciler restart its whole group, which heals by itself: the status
    says GroupRestarting, and the phase is never Failed for it."""
    spec = {"replicas": 1, "engine": {"tensorParallelSize": 8, "pipelineParallelSize": 2},
            "resources": {"gpusPerPod": 8}}
    revision = render.plan(isvc(spec), Settings()).revision
    sts = {("StatefulSet", "m-g0"): {"metadata": {
        "name": "m-g0", "generation": 1, "labels": {L_GROUP: "0"}, "annotations": {render.A_REVISION: revision}},
        "status": {"observedGeneration": 1, "updatedReplicas": 2, "replicas": 2}}}
    for broken in (pod("m-g0-1", phase="Failed", group=0),
                   pod("m-g0-1", group=0, restarts=1, waiting={"reason": "CrashLoopBackOff", "message": "back-off"})):
        s = status_for(spec, sts, [pod("m-g0-0", ready=True, group=0), broken])
        assert s["phase"] != "Failed"
        assert cond(s, "Ready")["reason"] == "GroupRestarting" and "m-g0-1" in cond(s, "Ready")["message"]
    # a single-pod replica's failure stays what it is
    s = status_for({"replicas": 1}, deployment(0, replicas=1), [pod("m-1", phase="Failed")])
    assert s["phase"] == "Failed" and cond(s, "Ready")["reason"] == "PodFailed"


def test_an_engine_image_pull_failure_is_not_blamed_on_the_model_image():
    pod = {"metadata": {"name": "p"}, "spec": {
        "volumes": [{"name": "model", "image": {"reference": "registry.example.com/models/m:1"}}],
        "containers": [{"name": "engine", "image": "registry.example.com/engine:2",
                        "volumeMounts": [{"name": "model", "mountPath": "/models"}]}]},
        "status": {"containerStatuses": [{"name": "engine", "state": {"waiting": {
            "reason": "ErrImagePull", "message": 'Failed to pull image "registry.example.com/engine:2": denied'}}}]}}
    assert status.pod_problem(pod)[0] == "ImagePullBackOff"
    pod["status"]["containerStatuses"][0]["state"]["waiting"]["message"] = (
        'Failed to pull image "registry.example.com/models/m:1": not found')
    reason, message = status.pod_problem(pod)
    assert reason == "ModelImagePullBackOff" and "oci://registry.example.com/models/m:1" in message


def test_a_cluster_without_image_volumes_is_named_in_the_rejection():
    obj = isvc({"model": {"uri": "oci://registry.example.com/models/m:1"}})
    refused = ('Deployment.apps "m" is invalid: spec.template.spec.volumes[3]: Required value: must specify a '
               'volume type')
    s = status.compute_status(obj, render.plan(obj, Settings()), {}, [], rejected=[refused])
    ready = cond(s, "Ready")
    assert ready["reason"] == "ChildRejected" and refused in ready["message"]
    assert "oci://registry.example.com/models/m:1 is mounted as an image volume" in ready["message"]
    assert "ImageVolume feature" in ready["message"]
