"""Fixtures of the operator tests: one emulated API (tests/kubekit.py) and one running operator per module."""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass

import pytest

from kubekit import Client, Cluster, EmulatorServer, OperatorThread, write_kubeconfig


@dataclass
class Env:
    server: EmulatorServer
    client: Client
    operator: OperatorThread | None

    @property
    def cluster(self) -> Cluster:
        assert self.server.cluster is not None
        return self.server.cluster

    def restart_operator(self) -> None:
        if self.operator is not None:
            self.operator.stop()
        self.operator = OperatorThread()


def _kubeconfig(tmp_path_factory, url: str) -> str:
    return write_kubeconfig(tmp_path_factory.mktemp("kube") / "config", url)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """One emulator + one running operator per test module; tests use their own namespaces."""
    server = EmulatorServer()
    mp = pytest.MonkeyPatch()
    mp.setenv("KUBECONFIG", _kubeconfig(tmp_path_factory, server.url))
    mp.setenv("SHOAL_ENGINE_IMAGE", "registry.test/shoal-engine:test")
    mp.setenv("SHOAL_OPERATOR_NAMESPACE", "shoal-system")
    mp.setenv("SHOAL_RECHECK_SECONDS", "1")
    logging.getLogger("kopf").setLevel(logging.WARNING)
    e = Env(server=server, client=Client(server.url), operator=None)
    e.restart_operator()
    try:
        yield e
    finally:
        if e.operator is not None:
            e.operator.stop()
        e.client.http.close()
        server.close()
        mp.undo()


@pytest.fixture
def ns(request) -> str:
    return "t-" + request.node.name.lower().replace("_", "-")[:40].strip("-") + "-" + uuid.uuid4().hex[:4]



