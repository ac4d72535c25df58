"""Canary revisions in the running operator, against the emulated API: the test plays the gateways (their /metrics,
served by fleetkit.FakeEngines, published as the gateway Service's endpoints) and the engines' controllers are not
needed (the Deployments are only read).

A canary breaking its error-rate SLO is rolled back (status, condition, Event, share 0, Deployment removed) and a new
revision of it tries again; `promote: true` leaves one revision; a canary with another served name is refused with
a condition naming the field, and nothing of it is applied.
"""

from __future__ import annotations

import time

import pytest
from fleetkit import FakeEngines, GatewayProcess, StandInChatEngines, publish_gateway
from kubekit import condition, isvc_body, slice_labels, wait_for
from prockit import EVENT_BOUND, http

from shoal.operator import contract

ISVC = "inferenceservices"
STABLE = {"model": {"uri": "hf://org/chat-v1", "servedName": "chat"}, "replicas": 2}


@pytest.fixture
def gateways():
    e = FakeEngines()
    yield e
    e.close()


def counts(stable: tuple[int, int], canary: tuple[int, int]) -> str:
    """A gateway's per-revision counters: (ok, errors) of each revision."""
    lines = []
    for revision, (ok, errors) in (("stable", stable), ("canary", canary)):
        lines += [f'{contract.GATEWAY_REVISION_REQUESTS}_total{{revision="{revision}",outcome="ok"}} {ok}',
                  f'{contract.GATEWAY_REVISION_REQUESTS}_total{{revision="{revision}",outcome="error"}} {errors}']
    return "\n".join(lines) + "\n"


def canary_status(env, ns: str, name: str) -> dict:
    return (env.client.get(ISVC, ns, name).get("status") or {}).get("canary") or {}


def engines_percent(env, ns: str, name: str) -> str | None:
    svc = env.client.get("services", ns, f"{name}-engines") or {}
    return (svc.get("metadata", {}).get("labels") or {}).get(contract.L_CANARY_PERCENT)


def test_a_canary_breaking_its_error_slo_is_rolled_back_and_a_new_revision_tries_again(env, ns, gateways):
    env.client.create(ISVC, ns, isvc_body("llm", {**STABLE, "canary": {
        "model": {"uri": "hf://org/chat-v2"}, "trafficPercent": 20,
        "rollback": {"maxErrorRate": 0.1, "minRequests": 10, "windowSeconds": 60}}}))
    wait_for(lambda: env.client.get("deployments", ns, "llm-canary"), EVENT_BOUND, "the canary's Deployment")
    wait_for(lambda: engines_percent(env, ns, "llm") == "20", EVENT_BOUND, "the share on the engines Service")
    isvc = wait_for(lambda: (i := env.client.get(ISVC, ns, "llm")) and (i.get("status") or {}).get("canary") and i,
                    EVENT_BOUND, "status.canary")
    assert isvc["status"]["canary"]["split"] == "80/20" and isvc["status"]["canary"]["trafficPercent"] == 20
    revision = isvc["status"]["canary"]["revision"]

    # the gateways report: first a healthy baseline, then the canary fails 15 of 20 requests
    gateways.texts["gw"] = counts((100, 0), (25, 0))
    publish_gateway(env.client, ns, "llm", 1, metrics_port=gateways.port("gw"))
    wait_for(lambda: (canary_status(env, ns, "llm").get("stable") or {}).get("requests") == 0, EVENT_BOUND,
             "the judge's first figures (a baseline)")
    gateways.texts["gw"] = counts((180, 1), (30, 15))
    st = wait_for(lambda: (s := canary_status(env, ns, "llm")).get("rollback") and s, EVENT_BOUND, "rollback")
    assert st["rollback"]["revision"] == revision and st["rollback"]["reason"] == "ErrorRateAboveSLO"
    assert "15 of the canary's 20 requests" in st["rollback"]["message"]
    # (no first-byte histogram reported: no p95, and a merge patch drops the null)
    assert st["canary"]["errors"] == 15 and st["stable"] == {"requests": 81, "errors": 1, "errorRate": 0.0123}
    isvc = env.client.get(ISVC, ns, "llm")
    rolled = condition(isvc, "CanaryRolledBack")
    assert rolled["status"] == "True" and rolled["reason"] == "ErrorRateAboveSLO"
    events = wait_for(lambda: [e for e in env.cluster.find("events", ns) if e["reason"] == "CanaryRolledBack"],
                      EVENT_BOUND, "a CanaryRolledBack Event")
    assert events[0]["type"] == "Warning" and revision in events[0]["message"]
    # the reconciler: share 0 to the gateways, the canary's Deployment removed, the stable one untouched
    wait_for(lambda: engines_percent(env, ns, "llm") == "0", EVENT_BOUND, "share 0")
    wait_for(lambda: env.client.get("deployments", ns, "llm-canary") is None, EVENT_BOUND, "canary removed")
    assert env.client.get("deployments", ns, "llm")["spec"]["replicas"] == 2
    ready = wait_for(lambda: (c := condition(env.client.get(ISVC, ns, "llm"), "CanaryReady")) and
                     c["reason"] == "RolledBack" and c, EVENT_BOUND, "CanaryReady=False RolledBack")
    assert ready["status"] == "False"
    assert canary_status(env, ns, "llm")["split"] == "100/0"
    # the spec is the user's: a rollback never rewrites it
    assert env.client.get(ISVC, ns, "llm")["spec"]["canary"]["trafficPercent"] == 20

    # a new revision (another model) is a new attempt: back at 20 %, the old rollback forgotten
    gateways.texts["gw"] = counts((180, 1), (30, 15))
    env.client.patch(ISVC, ns, "llm", {"spec": {"canary": {"model": {"uri": "hf://org/chat-v3"}}}})
    wait_for(lambda: env.client.get("deployments", ns, "llm-canary"), EVENT_BOUND, "the new canary's Deployment")
    wait_for(lambda: engines_percent(env, ns, "llm") == "20", EVENT_BOUND, "share 20 again")
    st = wait_for(lambda: (s := canary_status(env, ns, "llm")).get("revision") != revision and s, EVENT_BOUND,
                  "the new revision in status")
    assert not st.get("rollback") and condition(env.client.get(ISVC, ns, "llm"), "CanaryRolledBack") is None
    env.client.delete(ISVC, ns, "llm")


def test_promotion_leaves_one_revision(env, ns):
    env.client.create(ISVC, ns, isvc_body("llm", {**STABLE, "engine": {"maxNumSeqs": 8}, "canary": {
        "model": {"uri": "hf://org/chat-v2"}, "engine": {"maxNumSeqs": 16}, "trafficPercent": 50}}))
    wait_for(lambda: env.client.get("deployments", ns, "llm-canary"), EVENT_BOUND, "the canary's Deployment")
    # the operator's promotion patch conflicts once (a write it did not see, e.g. its own status, which starts no
    # new pass): it must read the service again and promote that version, not wait for an event that never comes
    conflict = env.cluster.inject("update", "inferenceservices", 409, 1, subresource=None)
    env.client.patch(ISVC, ns, "llm", {"spec": {"canary": {"promote": True}}})
    spec = wait_for(lambda: (s := env.client.get(ISVC, ns, "llm")["spec"]) and "canary" not in s and s,
                    EVENT_BOUND, "spec.canary folded into the spec")
    assert spec["model"] == {"uri": "hf://org/chat-v2", "servedName": "chat"} | {
        k: v for k, v in spec["model"].items() if k not in ("uri", "servedName")}
    assert spec["engine"]["maxNumSeqs"] == 16 and spec["replicas"] == 2
    assert conflict.remaining == 0, "the promotion patch never met the injected conflict"

    def stable_args() -> list[str]:
        return env.client.get("deployments", ns, "llm")["spec"]["template"]["spec"]["containers"][0]["args"]

    wait_for(lambda: env.client.get("deployments", ns, "llm-canary") is None, EVENT_BOUND, "the canary removed")
    wait_for(lambda: "/cache/shoal/models/org--chat-v2@main" in stable_args(), EVENT_BOUND,  # its cache entry
             "the stable Deployment on the canary's model")
    args = stable_args()
    assert args[args.index("--max-num-seqs") + 1] == "16" and args[args.index("--served-model-name") + 1] == "chat"
    wait_for(lambda: not canary_status(env, ns, "llm") and engines_percent(env, ns, "llm") is None, EVENT_BOUND,
             "no canary left in status or on the engines Service")
    engines = [d["metadata"]["name"] for d in env.cluster.find("deployments", ns)
               if d["metadata"]["labels"].get("app.kubernetes.io/component") == "engine"]
    assert engines == ["llm"]
    events = [e for e in env.cluster.find("events", ns) if e["reason"] == "CanaryPromoted"]
    assert len(events) == 1
    env.client.delete(ISVC, ns, "llm")


def test_a_canary_with_another_served_name_is_refused_and_nothing_of_it_is_applied(env, ns):
    env.client.create(ISVC, ns, isvc_body("llm", STABLE))
    dep = wait_for(lambda: env.client.get("deployments", ns, "llm"), EVENT_BOUND, "the Deployment")
    wait_for(lambda: env.client.get("deployments", ns, "llm-gateway"), EVENT_BOUND, "every child (the gateway last)")
    wait_for(lambda: (env.client.get(ISVC, ns, "llm").get("status") or {}).get("observedGeneration") == 1,
             EVENT_BOUND, "the first pass's status")
    hashes = {(o["kind"], o["metadata"]["name"]): o["metadata"]["annotations"][contract.A_SPEC_HASH]
              for plural in ("deployments", "services") for o in env.cluster.find(plural, ns)}
    # a canary serving the hub id `org/chat-v2` instead of `chat`
    env.client.patch(ISVC, ns, "llm", {"spec": {"replicas": 3, "canary": {
        "model": {"uri": "hf://org/chat-v2", "servedName": "chat-v2"}}}})
    cond = wait_for(lambda: (c := condition(env.client.get(ISVC, ns, "llm"), "Ready")) and
                    c["reason"] == "InvalidSpec" and c, EVENT_BOUND, "Ready=False InvalidSpec")
    assert cond["status"] == "False"
    assert cond["message"].startswith("spec.canary.model.servedName: the canary would serve `chat-v2` but this "
                                      "service serves `chat`")
    # nothing half-applied: no canary, and not the replica change that came with it either
    assert env.client.get("deployments", ns, "llm-canary") is None
    assert env.client.get("deployments", ns, "llm")["spec"]["replicas"] == dep["spec"]["replicas"] == 2
    assert hashes == {(o["kind"], o["metadata"]["name"]): o["metadata"]["annotations"][contract.A_SPEC_HASH]
                      for plural in ("deployments", "services") for o in env.cluster.find(plural, ns)}
    # fixed: the canary is applied
    env.client.patch(ISVC, ns, "llm", {"spec": {"canary": {"model": {"servedName": "chat"}}}})
    wait_for(lambda: env.client.get("deployments", ns, "llm-canary"), EVENT_BOUND, "the canary's Deployment")
    env.client.delete(ISVC, ns, "llm")


def test_a_failing_canary_is_rolled_back_through_the_real_gateway_within_its_error_budget(env, ns):
    """The whole loop: clients -> a real shoal-gateway -> stand-in engines (the canary's answer 500) -> the gateway's
    per-revision metrics -> the operator's judge -> the engines Service's share 0 -> its slices (the test plays the
    EndpointSlice controller, copying the Service's labels) -> the gateway stops sending conversations there."""
    env.client.create(ISVC, ns, isvc_body("llm", {**STABLE, "replicas": 1, "canary": {
        "model": {"uri": "hf://org/chat-v2"}, "trafficPercent": 30,
        "rollback": {"maxErrorRate": 0.2, "minRequests": 10, "windowSeconds": 60}}}))
    wait_for(lambda: engines_percent(env, ns, "llm") == "30", EVENT_BOUND, "the share on the engines Service")
    pods = ["llm-7bd9f8c6d4-aaaaa", "llm-canary-5d8c9b7f6-ccccc"]
    engines = StandInChatEngines(pods)
    engines.failing.add(pods[1])
    published: dict[str, str] = {}

    def publish() -> None:  # the EndpointSlice controller: the Service's labels on every slice, kept current
        labels = slice_labels(env.client, ns, "llm-engines")
        for pod, port in engines.ports.items():
            body = {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": "IPv4",
                    "metadata": {"name": f"llm-engines-{pod}", "labels": labels},
                    "ports": [{"name": "http", "port": port, "protocol": "TCP"}],
                    "endpoints": [{"addresses": ["127.0.0.1"], "conditions": {"ready": True},
                                   "targetRef": {"kind": "Pod", "name": pod}}]}
            if pod not in published:
                env.client.create("endpointslices", ns, body)
            elif published[pod] != labels.get(contract.L_CANARY_PERCENT):
                env.client.patch("endpointslices", ns, body["metadata"]["name"], {"metadata": {"labels": labels}})
            published[pod] = labels.get(contract.L_CANARY_PERCENT)

    gateway = None
    try:
        publish()
        gateway = GatewayProcess(ns, "llm", service="llm-engines")
        publish_gateway(env.client, ns, "llm", gateway.port, metrics_port=gateway.metrics_port)
        wait_for(lambda: b"shoal:gateway_canary_backends 1.0" in http("GET", gateway.base + "/metrics")[1],
                 30, "the gateway to see the canary")
        statuses, rolled_at = [], None
        for i in range(300):
            publish()
            status_code, _raw, _ = http("POST", gateway.base + "/v1/chat/completions", {
                "model": "chat", "messages": [{"role": "user", "content": f"conversation {i}"}]}, timeout=30)
            statuses.append(status_code)
            time.sleep(0.1)  # ~10 conversations a second, ~3 of them the canary's
            if rolled_at is None and canary_status(env, ns, "llm").get("rollback"):
                rolled_at = i
        failed = [i for i, s in enumerate(statuses) if s != 200]
        print(f"rolled back after request {rolled_at}; {len(failed)} of 300 clients saw an error (the canary's "
              f"answers until then), the last at request {failed[-1] if failed else None}")
        assert rolled_at is not None and canary_status(env, ns, "llm")["rollback"]["reason"] == "ErrorRateAboveSLO"
        # the budget: minRequests judged failures, plus the canary's share of what arrived while the judge (a tick
        # a second; a gateway's counts before its first scrape are only a baseline) and the watches acted: ~5 s
        assert 10 <= len(failed) <= 10 + 15, failed
        assert max(failed) <= rolled_at + 20, (failed, rolled_at)
        assert all(s == 200 for s in statuses[-100:])  # nothing reaches the canary any more
        assert all(statuses[i] == 500 for i in failed)  # the canary's own error, relayed untouched
        assert engines_percent(env, ns, "llm") == "0"
    finally:
        if gateway is not None:
            gateway.close()
        engines.close()
        env.client.delete(ISVC, ns, "llm")
