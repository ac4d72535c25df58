"""The fleet half's one informer (shoal.operator.k8s.informer) against kmock's API emulator over HTTP: it resumes a
watch from its resourceVersion, relists with backoff after 410 Gone, splits long watch lines itself, and keeps its
indexes and its consumers (per-event or whole-list) in step."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

import pytest
from kubekit import Client, EmulatorServer

from shoal.operator.k8s.client import Client as KubeClient
from shoal.operator.k8s.client import KubeAPI, collection_path
from shoal.operator.k8s.events import post_event
from shoal.operator.k8s.informer import Informer

BOUND = 30.0  # seconds: far above any realistic event on a loaded machine


@pytest.fixture(scope="module")
def server():
    s = EmulatorServer()
    yield s
    s.close()


@pytest.fixture
def ns() -> str:
    return "inf-" + uuid.uuid4().hex[:8]


def configmap(name: str, data: dict | None = None, labels: dict | None = None) -> dict:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name, "labels": labels or {}},
            "data": data or {}}


async def until(condition, what: str, bound: float = BOUND) -> None:
    deadline = time.monotonic() + bound
    while not condition():
        assert time.monotonic() < deadline, f"waited {bound:.0f} s for {what}"
        await asyncio.sleep(0.02)


async def started(informer: Informer) -> asyncio.Task:
    task = asyncio.create_task(informer.run())
    await asyncio.wait_for(informer.synced.wait(), BOUND)
    return task


async def stopped(task: asyncio.Task) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def test_a_watch_that_times_out_resumes_from_its_resource_version(server, ns):
    client = Client(server.url)
    client.create("configmaps", ns, configmap("a", labels={"app": "x"}))
    events: list[tuple[str, str]] = []
    informer = Informer(KubeAPI(server.url), collection_path("v1", "configmaps", ns), watch_timeout=1,
                        index=lambda o: (o["metadata"].get("labels") or {}).get("app"),
                        on_event=lambda kind, o: events.append((kind, o["metadata"]["name"])))
    task = await started(informer)
    try:
        assert events == [("ADDED", "a")] and [o["metadata"]["name"] for o in informer.by_index("x")] == ["a"]
        await until(lambda: informer.watches >= 2, "the first watch to end at its server timeout and resume")
        client.create("configmaps", ns, configmap("b", labels={"app": "x"}))
        client.delete("configmaps", ns, "a")
        await until(lambda: ("DELETED", "a") in events, "the deletion of a")
        assert sorted(o["metadata"]["name"] for o in informer.by_index("x")) == ["b"]
        await until(lambda: informer.watches >= 4, "two more resumed watches")
        assert informer.lists == 1, "a watch that ended at its timeout must resume, not relist"
        assert events == [("ADDED", "a"), ("ADDED", "b"), ("DELETED", "a")]  # nothing replayed twice
    finally:
        await stopped(task)


async def test_410_gone_relists_with_backoff_and_reconciles_the_cache(server, ns, caplog):
    client = Client(server.url)
    client.create("configmaps", ns, configmap("kept"))
    client.create("configmaps", ns, configmap("dropped"))
    informer = Informer(KubeAPI(server.url), collection_path("v1", "configmaps", ns), watch_timeout=1)
    task = await started(informer)
    try:
        assert {o["metadata"]["name"] for o in informer.values()} == {"kept", "dropped"}
        await until(lambda: informer.watches >= 2, "the first resumed watch")  # quiet: no event before the fault
        server.cluster.inject("watch", "configmaps", 410, 1, message="too old resource version")
        # changes the informer can only learn from the relist (its next watch is refused)
        client.delete("configmaps", ns, "dropped")
        client.create("configmaps", ns, configmap("new"))
        with caplog.at_level(logging.INFO, logger="shoal.operator.informer"):
            await until(lambda: informer.lists >= 2, "the relist after 410 Gone")
            await until(lambda: {o["metadata"]["name"] for o in informer.values()} == {"kept", "new"},
                        "the cache to match the cluster after the relist")
        assert any("relisting in 0.5s" in r.getMessage() and "410" in r.getMessage() for r in caplog.records)
    finally:
        await stopped(task)


async def test_long_watch_lines_and_whole_list_consumers(server, ns):
    """An object far above aiohttp's line limit arrives whole; an on_list consumer gets each list at once."""
    client = Client(server.url)
    client.create("configmaps", ns, configmap("small"))
    lists: list[list[str]] = []
    events: list[str] = []
    informer = Informer(KubeAPI(server.url), collection_path("v1", "configmaps", ns),
                        on_list=lambda items: lists.append([o["metadata"]["name"] for o in items]),
                        on_event=lambda kind, o: events.append(f"{kind} {o['metadata']['name']}"))
    task = await started(informer)
    try:
        assert lists == [["small"]] and events == []  # the list went to on_list, not as ADDED events
        big = "x" * (512 << 10)  # 512 KiB on one watch line (aiohttp's readline stops at 128 KiB)
        client.create("configmaps", ns, configmap("big", {"blob": big}))
        await until(lambda: informer.get(ns, "big") is not None, "the 512 KiB ConfigMap through the watch")
        assert informer.get(ns, "big")["data"]["blob"] == big and events == ["ADDED big"] and informer.lists == 1
    finally:
        await stopped(task)


async def test_events_are_posted_through_the_one_client(server, ns):
    client = KubeClient(KubeAPI(server.url))
    involved = {"apiVersion": "serving.shoal.dev/v1alpha1", "kind": "InferenceService",
                "metadata": {"name": "llm", "namespace": ns, "uid": "u-1"}}
    try:
        await post_event(client, involved, "Normal", "ScaledUp", "replicas 1 -> 2")
    finally:
        await client.close()
    (event,) = Client(server.url).list("events", ns)
    assert event["reason"] == "ScaledUp" and event["involvedObject"]["uid"] == "u-1"
    assert event["source"] == {"component": "shoal-operator"} and event["metadata"]["name"].startswith("llm.")
