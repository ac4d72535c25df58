"""Two operators joined by kopf peering (the chart's highAvailability): one reconciles and scales, the other takes
over — after a clean exit at once, after a kill once the dead one's peering lifetime has passed."""

from __future__ import annotations

import logging
import sys
import tempfile
from signal import SIGKILL

import pytest
from fleetkit import FakeEngines, publish_slices
from kubekit import Client, EmulatorServer, OperatorThread, isvc_body, wait_for, write_kubeconfig
from prockit import EVENT_BOUND, LoggedProcess, free_port
from promkit import parse_metrics

PEERING = "/apis/kopf.dev/v1/clusterkopfpeerings"


@pytest.fixture
def cluster(tmp_path_factory):
    server = EmulatorServer()
    mp = pytest.MonkeyPatch()
    mp.setenv("KUBECONFIG", write_kubeconfig(tmp_path_factory.mktemp("kube") / "config", server.url))
    mp.setenv("SHOAL_ENGINE_IMAGE", "registry.test/shoal-engine:test")
    logging.getLogger("kopf").setLevel(logging.WARNING)
    client = Client(server.url)
    client.http.post(server.url + PEERING, json={"apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering",
                                                 "metadata": {"name": "shoal"}}).raise_for_status()
    try:
        yield server, client
    finally:
        client.http.close()
        server.close()
        mp.undo()


def peers(server) -> dict:
    return (server.cluster.obj("clusterkopfpeerings", None, "shoal") or {}).get("status") or {}


def test_the_standby_operator_takes_over_when_the_leader_leaves(cluster):
    server, client = cluster
    leader = OperatorThread(peering=("shoal", 200))
    standby = OperatorThread(peering=("shoal", 100))
    try:
        wait_for(lambda: sorted(p["priority"] for p in peers(server).values() if p) == [100, 200], 20,
                 "both operators in the peering")
        client.create("inferenceservices", "ha", isvc_body("m", {"replicas": 1}))
        wait_for(lambda: client.get("deployments", "ha", "m"), EVENT_BOUND, "children from the leader")
        leader.stop()  # a clean exit removes the leader from the peering: the standby resumes at once
        wait_for(lambda: [p["priority"] for p in peers(server).values() if p] == [100], EVENT_BOUND, "leader gone")
        client.patch("inferenceservices", "ha", "m", {"spec": {"replicas": 3}})
        wait_for(lambda: client.get("deployments", "ha", "m")["spec"]["replicas"] == 3, EVENT_BOUND, "standby reconciles")
    finally:
        leader.stop()
        standby.stop()


class OperatorProcess(LoggedProcess):
    """`shoal-operator` as the chart runs it with highAvailability: peered, with a random priority of its own; its
    --metrics-port says whether its autoscaler leads and how often it decided."""

    def __init__(self, lifetime: int):
        port = free_port()
        super().__init__([sys.executable, "-m", "shoal.operator", "--peering=shoal", "--peering-priority=auto",
                          f"--peering-lifetime={lifetime}", "--all-namespaces", "--metrics-port", str(port)], port,
                         env={"SHOAL_RECHECK_SECONDS": "1"}, log_prefix="operator-", cwd=tempfile.gettempdir())

    def sample(self, metric_name: str, labels: str = "") -> float:
        """The value of `metric_name{labels}` (labels as exposed, sorted: 'name="x",namespace="y"'); 0 if absent."""
        status, raw = self.get("/metrics", timeout=2)
        key = f"{metric_name}{{{labels}}}" if labels else metric_name
        return parse_metrics(raw.decode()).get(key, 0.0) if status == 200 else 0.0

    def leading(self) -> bool:
        return self.sample("shoal:autoscaler_leading") == 1.0


def scaled_up(server, ns: str) -> list[str]:
    return sorted(e["message"].split(" (")[0] for e in server.cluster.find("events", ns) if e["reason"] == "ScaledUp")


@pytest.mark.slow
def test_a_follower_takes_over_a_scale_up_from_a_killed_leader_without_scaling_twice(cluster):
    """Two operator processes; the leader scales 1 -> 2 and is killed (SIGKILL: no clean hand-over) while the new
    replica is still starting. Once the dead leader's peering lifetime has passed the follower leads: it counts
    the starting replica as capacity and keeps 2 for the same load, then scales once more when the load grows —
    one scaling per change of load, each decided by one replica."""
    server, client = cluster
    engines = FakeEngines()
    operators = [OperatorProcess(lifetime=3) for _ in range(2)]
    try:
        wait_for(lambda: len([p for p in peers(server).values() if p]) == 2, 60, "both operators in the peering")
        (leader,) = wait_for(lambda: len(lead := [o for o in operators if o.leading()]) == 1 and lead, 20,
                             "exactly one leading operator")
        follower = next(o for o in operators if o is not leader)
        client.create("inferenceservices", "ha", isvc_body("chat", {"replicas": 1, "autoscaling": {
            "minReplicas": 1, "maxReplicas": 4, "targetInFlightPerReplica": 10, "scaleUpStabilizationSeconds": 0,
            "scaleDownStabilizationSeconds": 600}}))
        wait_for(lambda: client.get("deployments", "ha", "chat"), EVENT_BOUND, "children from the leader")
        engines.load["chat-a"] = (15, 0, 0.1)
        publish_slices(client, "ha", "chat-engines", ["chat-a"], engines)
        wait_for(lambda: scaled_up(server, "ha") == ["replicas 1 -> 2"], EVENT_BOUND, "the leader scales 1 -> 2")
        leader.signal(SIGKILL)  # mid scale-up: the second replica never got an endpoint
        leader.proc.wait(10)
        wait_for(follower.leading, 30, "the follower leading after the dead leader's lifetime")
        decisions = ("shoal:autoscaler_decision_seconds_count", 'name="chat",namespace="ha"')
        decided = follower.sample(*decisions)
        wait_for(lambda: follower.sample(*decisions) >= decided + 3, EVENT_BOUND, "three decisions of the follower")
        status = client.get("inferenceservices", "ha", "chat")["status"]["autoscaling"]
        assert status["desiredReplicas"] == 2 and scaled_up(server, "ha") == ["replicas 1 -> 2"], status
        engines.load["chat-a"] = (25, 0, 0.1)  # more load: the follower scales, once
        wait_for(lambda: client.get("deployments", "ha", "chat")["spec"]["replicas"] == 3, 20,
                 "the follower's autoscaler and reconciler at work")
        assert scaled_up(server, "ha") == ["replicas 1 -> 2", "replicas 2 -> 3"]
    except BaseException:
        print("peering:", peers(server))
        for o in operators:
            print("operator log:", o.logs()[-4000:])
        raise
    finally:
        for o in operators:
            o.stop(timeout=15)
        engines.close()
