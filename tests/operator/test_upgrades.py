"""Upgrading the operator (a new default engine image) in the running operator against the emulated API: its own
module, since the upgrade budget is fleet-wide and services left by other tests would hold its slots."""

from __future__ import annotations

import time

from kubekit import condition, isvc_body, wait_for
from prockit import EVENT_BOUND

ISVC = "inferenceservices"


def get_isvc(env, ns: str, name: str) -> dict:
    return env.client.get(ISVC, ns, name)


def ready(env, ns: str, name: str) -> None:
    wait_for(lambda: (c := condition(get_isvc(env, ns, name), "Ready")) and c["status"] == "True", 10,
             f"{name} Ready")


def settled(env, ns: str, name: str) -> None:
    """Until the reconciler has nothing running or pending for ns/name."""
    reconciler = env.operator.memo.reconciler
    wait_for(lambda: not reconciler.queue.busy((ns, name)), 10, f"the reconciler to settle on {ns}/{name}")


def _engine_image(env, ns: str, name: str) -> str:
    dep = env.client.get("deployments", ns, name)
    return next(c["image"] for c in dep["spec"]["template"]["spec"]["containers"] if c["name"] == "engine")


def _deployment_status(env, ns: str, name: str, updated: int) -> None:
    """Play the Deployment controller: one replica, ready, `updated` of it on the current template."""
    dep = env.client.get("deployments", ns, name)
    env.client.patch("deployments", ns, name, {"status": {
        "observedGeneration": dep["metadata"]["generation"], "replicas": 1, "readyReplicas": 1,
        "updatedReplicas": updated, "availableReplicas": 1}}, sub="status")


def test_a_new_operator_image_rolls_the_fleet_one_service_at_a_time(env, ns, monkeypatch):
    """Upgrading the operator (a new default engine image) must not surge every GPU fleet at once: each service
    runs the image pinned in its status and moves under the --max-concurrent-upgrades budget (or when asked)."""
    old = "registry.test/shoal-engine:test"
    for name in ("up-a", "up-b", "up-c"):
        env.client.create(ISVC, ns, isvc_body(name))
    for name in ("up-a", "up-b", "up-c"):
        wait_for(lambda: env.client.get("deployments", ns, name), EVENT_BOUND, "deployment")
        _deployment_status(env, ns, name, updated=1)
        ready(env, ns, name)
        assert get_isvc(env, ns, name)["status"]["engineImage"] == old == _engine_image(env, ns, name)
    new = "registry.test/shoal-engine:v2"
    monkeypatch.setenv("SHOAL_ENGINE_IMAGE", new)
    monkeypatch.setenv("SHOAL_MAX_CONCURRENT_UPGRADES", "1")
    env.restart_operator()
    try:
        # up-c is asked to move now, whatever the budget; of the others one moves, one waits its turn
        env.client.patch(ISVC, ns, "up-c", {"metadata": {"annotations": {"serving.shoal.dev/upgrade-engine-image":
                                                                         "now"}}})
        wait_for(lambda: _engine_image(env, ns, "up-c") == new, EVENT_BOUND, "up-c upgraded on request")
        first = wait_for(lambda: next((n for n in ("up-a", "up-b") if _engine_image(env, ns, n) == new), None), 10,
                         "one service upgraded")
        second = "up-b" if first == "up-a" else "up-a"
        for name in (first, "up-c"):
            _deployment_status(env, ns, name, updated=0)  # rolling out the new template
        wait_for(lambda: get_isvc(env, ns, first)["status"].get("engineImage") == new, EVENT_BOUND, "pinned")
        settled(env, ns, second)
        time.sleep(1.0)  # the recheck interval of this module: a waiting service is looked at again meanwhile
        assert _engine_image(env, ns, second) == old and get_isvc(env, ns, second)["status"]["engineImage"] == old
        _deployment_status(env, ns, first, updated=1)  # its rollout ends (up-c's, asked for, takes no slot)
        wait_for(lambda: _engine_image(env, ns, second) == new, EVENT_BOUND, "the second service upgraded in its turn")
        events = [e for e in env.cluster.find("events", ns) if e["reason"] == "EngineImageUpgrade"]
        assert len(events) == 3
    finally:
        for name in ("up-a", "up-b", "up-c"):
            env.client.delete(ISVC, ns, name)


def test_a_vllm_service_whose_status_write_is_late_keeps_its_one_template(env, ns, monkeypatch):
    """On a real server the next reconcile often reads the service before its own status write (the engine-image
    pin) is visible. The pin must not then be taken from the workload the operator just rendered: a vLLM engine
    container runs vllm/vllm-openai, and pinning that rolled the service again on an EngineImageUpgrade (three
    ReplicaSets) for a spec that never changed."""
    monkeypatch.setenv("SHOAL_MAX_CONCURRENT_UPGRADES", "0")  # a wrong pin would stick: no budget to move it
    env.restart_operator()
    env.cluster.lag(ISVC, 1.5)  # the operator's index sees its status write 1.5 s late
    try:
        env.client.create(ISVC, ns, isvc_body("vl", {"runtime": "vllm", "model": {"uri": "hf://org/m"}}))
        dep = wait_for(lambda: env.client.get("deployments", ns, "vl"), 10, "deployment")
        _deployment_status(env, ns, "vl", updated=1)  # a child event: reconciled from the lagging index
        wait_for(lambda: (get_isvc(env, ns, "vl").get("status") or {}).get("readyReplicas") == 1, 15,
                 "the status of the reconcile that saw the Deployment ready")
        settled(env, ns, "vl")
        isvc = get_isvc(env, ns, "vl")
        assert isvc["status"]["engineImage"] == "registry.test/shoal-engine:test"
        after = env.client.get("deployments", ns, "vl")
        assert after["metadata"]["generation"] == dep["metadata"]["generation"] == 1  # one template, never rolled
        assert after["spec"]["template"] == dep["spec"]["template"]
        assert not [e for e in env.cluster.find("events", ns) if e["reason"] == "EngineImageUpgrade"]
    finally:
        env.cluster.lag(ISVC, 0)
        env.client.delete(ISVC, ns, "vl")
        monkeypatch.setenv("SHOAL_MAX_CONCURRENT_UPGRADES", "1")
        env.restart_operator()
