"""Two operators joined by kopf peering (the chart's highAvailability): one reconciles, the other takes over."""

from __future__ import annotations

import logging

import pytest
from kubekit import Client, EmulatorServer, OperatorThread, isvc_body, wait_for, write_kubeconfig

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
        wait_for(lambda: client.get("deployments", "ha", "m"), 15, "children from the leader")
        leader.stop()  # a clean exit removes the leader from the peering: the standby resumes at once
        wait_for(lambda: [p["priority"] for p in peers(server).values() if p] == [100], 15, "leader gone")
        client.patch("inferenceservices", "ha", "m", {"spec": {"replicas": 3}})
        wait_for(lambda: client.get("deployments", "ha", "m")["spec"]["replicas"] == 3, 20, "standby reconciles")
    finally:
        leader.stop()
        standby.stop()
