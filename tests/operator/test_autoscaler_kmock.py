"""The autoscaling loop in the running operator, against the emulated API: the test plays the gateway (wake
annotation), the EndpointSlice controller (slices pointing at a metrics endpoint it serves) and the engines
(Prometheus text with the load it chooses)."""

from __future__ import annotations

import pytest
from fleetkit import FakeEngines, publish_slices
from kubekit import condition, isvc_body, slice_labels, wait_for
from prockit import EVENT_BOUND, free_port

from shoal.operator.gateway.wake import wake_patch
from shoal.operator.autoscaler import A_DELETION_COST, A_WAKE, REGISTRY

ISVC = "inferenceservices"


@pytest.fixture
def engines():
    e = FakeEngines()
    yield e
    e.close()


def decisions(ns: str, name: str) -> float:
    """How many times the autoscaler (in this process, on kopf's thread) has decided for ns/name."""
    return REGISTRY.get_sample_value("shoal:autoscaler_decision_seconds_count", {"namespace": ns, "name": name}) or 0


def running(env, ns: str, name: str) -> int | None:
    """The autoscaler's replica count (status.autoscaling.desiredReplicas): spec.replicas stays the manifest's."""
    return ((env.client.get(ISVC, ns, name).get("status") or {}).get("autoscaling") or {}).get("desiredReplicas")


def test_wake_annotation_scales_from_zero_at_once_and_reports_it(env, ns):
    body = isvc_body("chat", {"replicas": 0, "autoscaling": {
        "minReplicas": 0, "maxReplicas": 3, "scaleUpStabilizationSeconds": 30}})
    env.client.create(ISVC, ns, body)
    wait_for(lambda: env.client.get("deployments", ns, "chat"), EVENT_BOUND, "deployment")
    # the gateway's wake-up object; a stamp left from a wake-up long ago, as a restarted operator (or a new
    # leader) finds it, must not wake anything
    wait_for(lambda: env.client.get("configmaps", ns, "chat-wake"), EVENT_BOUND, "wake-up configmap")
    env.client.patch("configmaps", ns, "chat-wake", {"metadata": {"annotations": {A_WAKE: "2026-01-01T00:00:00.000Z"}}})
    # idle at zero: the loop runs and says why it stays there
    st = wait_for(lambda: (env.client.get(ISVC, ns, "chat").get("status") or {}).get("autoscaling"), 10,
                  "status.autoscaling")
    assert st["desiredReplicas"] == 0
    ticks = decisions(ns, "chat")
    wait_for(lambda: decisions(ns, "chat") >= ticks + 2, EVENT_BOUND, "two more autoscaler decisions")
    assert running(env, ns, "chat") == 0  # still at zero
    # the gateway holds a request and asks for capacity
    env.client.patch("configmaps", ns, "chat-wake", wake_patch())
    wait_for(lambda: running(env, ns, "chat") == 1, EVENT_BOUND, "replicas 1")
    wait_for(lambda: env.client.get("deployments", ns, "chat")["spec"]["replicas"] == 1, EVENT_BOUND, "deployment scaled")
    isvc = wait_for(lambda: (i := env.client.get(ISVC, ns, "chat")) and
                    (i["status"].get("autoscaling") or {}).get("desiredReplicas") == 1 and i, 5, "status")
    st = isvc["status"]["autoscaling"]
    assert st["lastScaleTime"] and st["currentReplicas"] in (0, 1)
    cond = condition(isvc, "Autoscaling")
    assert cond["status"] == "True" and "the autoscaler owns the replica count" in cond["message"]
    assert env.client.get(ISVC, ns, "chat")["spec"]["replicas"] == 0  # the manifest's field is never written
    assert condition(isvc, "Ready") is not None  # the reconciler's conditions survive next to it
    events = wait_for(lambda: [e for e in env.cluster.find("events", ns) if e["reason"] == "ScaledUp"], EVENT_BOUND, "event")
    assert "0 -> 1 (ScaleFromZero)" in events[0]["message"]
    # removing spec.autoscaling hands replicas back and removes what the autoscaler reported
    env.client.patch(ISVC, ns, "chat", {"spec": {"autoscaling": None}})
    wait_for(lambda: "autoscaling" not in (env.client.get(ISVC, ns, "chat").get("status") or {}) and
             condition(env.client.get(ISVC, ns, "chat"), "Autoscaling") is None, 10, "status cleaned")


def test_load_scales_up_and_idle_scales_down_least_busy_pods_first(env, ns, engines):
    env.client.create(ISVC, ns, isvc_body("qa", {"replicas": 1, "autoscaling": {
        "minReplicas": 1, "maxReplicas": 4, "targetInFlightPerReplica": 10, "scaleUpStabilizationSeconds": 0,
        "scaleDownStabilizationSeconds": 2}}))
    wait_for(lambda: env.client.get("deployments", ns, "qa"), EVENT_BOUND, "deployment")
    engines.load["qa-a"] = (8, 27, 0.3)
    publish_slices(env.client, ns, "qa-engines", ["qa-a"], engines)
    wait_for(lambda: running(env, ns, "qa") == 4, EVENT_BOUND, "scaled up to 4 (35/10)")
    wait_for(lambda: env.client.get("deployments", ns, "qa")["spec"]["replicas"] == 4, EVENT_BOUND, "deployment scaled")
    st = wait_for(lambda: (s := env.client.get(ISVC, ns, "qa")["status"]["autoscaling"]).get("neededReplicas") == 4
                  and s, 5, "status of the scale-up")
    assert st["neededReplicas"] == 4 and st["inputs"]["inFlight"] == 35 and st["inputs"]["kvCacheUsage"] == 0.3
    # the new replicas came up, the load went away; qa-c stays busy the longest
    for pod in ("qa-a", "qa-b", "qa-c", "qa-d"):
        env.client.create("pods", ns, {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": pod}})
    publish_slices(env.client, ns, "qa-engines", ["qa-b", "qa-c", "qa-d"], engines)
    engines.load.update({"qa-a": (0, 0, 0.0), "qa-b": (1, 0, 0.1), "qa-c": (5, 0, 0.1), "qa-d": (0, 0, 0.0)})
    wait_for(lambda: running(env, ns, "qa") == 1, EVENT_BOUND, "scaled down to 1 (6/10)")
    costs = {p: int(env.client.get("pods", ns, p)["metadata"]["annotations"][A_DELETION_COST])
             for p in ("qa-a", "qa-b", "qa-c", "qa-d")}
    assert max(costs, key=costs.get) == "qa-c", costs  # the busiest pod is the one kept
    assert costs["qa-b"] < 0 and costs["qa-a"] < 0 and costs["qa-d"] < 0
    events = [e["reason"] for e in env.cluster.find("events", ns)]
    assert "ScaledUp" in events and "ScaledDown" in events
    # the operator's own metrics (served on --metrics-port)
    from prometheus_client import generate_latest

    from shoal.operator.autoscaler import REGISTRY

    text = generate_latest(REGISTRY).decode()
    assert f'shoal:autoscaler_desired_replicas{{name="qa",namespace="{ns}"}} 1.0' in text
    assert f'shoal:autoscaler_scalings_total{{name="qa",namespace="{ns}",reason="ScaleUp"}} 1.0' in text


def test_requests_held_by_the_gateways_scale_from_zero_to_what_they_need(env, ns, engines):
    env.client.create(ISVC, ns, isvc_body("hold", {"replicas": 0, "autoscaling": {
        "minReplicas": 0, "maxReplicas": 8, "targetInFlightPerReplica": 16}}))
    wait_for(lambda: env.client.get("deployments", ns, "hold"), EVENT_BOUND, "deployment")
    # two gateway pods behind the Service "hold" hold 40 requests between them (no wake-up annotation)
    engines.held.update({"hold-gw-1": 25, "hold-gw-2": 15})
    publish_slices(env.client, ns, "hold", ["hold-gw-1", "hold-gw-2"], engines)
    wait_for(lambda: running(env, ns, "hold") == 3, EVENT_BOUND, "scaled to ceil(40/16)")
    st = wait_for(lambda: (s := env.client.get(ISVC, ns, "hold")["status"].get("autoscaling")) and
                  s.get("neededReplicas") == 3 and s, 5, "status")
    assert st["inputs"]["held"] == 40 and st["inputs"]["inFlight"] == 40


def test_reapplying_the_manifest_does_not_fight_the_autoscaler(env, ns, engines):
    """`kubectl apply` of the same manifest (or an Argo CD self-heal) while the autoscaler holds 3 replicas: the
    fleet stays at 3 — spec.replicas is where a new fleet starts, the count is the autoscaler's."""
    manifest = isvc_body("git", {"replicas": 1, "autoscaling": {
        "minReplicas": 1, "maxReplicas": 4, "targetInFlightPerReplica": 10, "scaleUpStabilizationSeconds": 0,
        "scaleDownStabilizationSeconds": 30}})
    env.client.create(ISVC, ns, manifest)
    wait_for(lambda: env.client.get("deployments", ns, "git"), EVENT_BOUND, "deployment")
    engines.load["git-a"] = (10, 15, 0.2)
    publish_slices(env.client, ns, "git-engines", ["git-a"], engines)
    wait_for(lambda: env.client.get("deployments", ns, "git")["spec"]["replicas"] == 3, EVENT_BOUND, "scaled up to 3 (25/10)")
    assert env.client.get(ISVC, ns, "git")["spec"]["replicas"] == 1  # the manifest's field is left alone
    # the GitOps tool re-applies the manifest: replicas 1, and the spec changes (a new generation) at the same time
    env.client.patch(ISVC, ns, "git", {"spec": {**manifest["spec"], "replicas": 1,
                                                "engine": {"maxNumSeqs": 32}}})
    wait_for(lambda: "--max-num-seqs" in env.client.get("deployments", ns, "git")["spec"]["template"]["spec"][
        "containers"][0]["args"], 10, "the new spec rendered")
    ticks = decisions(ns, "git")
    wait_for(lambda: decisions(ns, "git") >= ticks + 3, EVENT_BOUND, "three more autoscaler decisions")
    assert env.client.get("deployments", ns, "git")["spec"]["replicas"] == 3
    assert running(env, ns, "git") == 3
    assert not [e for e in env.cluster.find("events", ns) if e["reason"] == "ScaledDown"]


def test_metrics_port_flag():
    from shoal.operator.__main__ import parse

    env, rest = parse(["--metrics-port", "9090", "--standalone"])
    assert env["SHOAL_METRICS_PORT"] == "9090" and rest == ["--standalone"]
    with pytest.raises(SystemExit, match="port number"):
        parse(["--metrics-port", "http"])



def test_no_finalizer_and_endpoints_come_from_a_watch_not_a_list_per_decision(env, ns, engines):
    """The autoscaler is no kopf daemon (those put a finalizer on every autoscaled service, which then cannot be
    deleted once the operator is uninstalled) and reads EndpointSlices from its watch-fed cache: decisions go on,
    no LIST of EndpointSlices comes with them."""
    env.client.create(ISVC, ns, isvc_body("watched", {"replicas": 1, "autoscaling": {
        "minReplicas": 1, "maxReplicas": 3, "targetInFlightPerReplica": 10, "scaleUpStabilizationSeconds": 0}}))
    wait_for(lambda: env.client.get("deployments", ns, "watched"), EVENT_BOUND, "deployment")
    engines.load["watched-a"] = (12, 0, 0.1)
    publish_slices(env.client, ns, "watched-engines", ["watched-a"], engines)
    wait_for(lambda: running(env, ns, "watched") == 2, EVENT_BOUND, "scaled to 2 from the watched slice (12/10)")
    lists = sum(1 for plural, _ in env.cluster.lists if plural == "endpointslices")
    ticks = decisions(ns, "watched")
    wait_for(lambda: decisions(ns, "watched") >= ticks + 3, EVENT_BOUND, "three more decisions")
    assert sum(1 for plural, _ in env.cluster.lists if plural == "endpointslices") == lists
    assert not env.client.get(ISVC, ns, "watched")["metadata"].get("finalizers")
    env.client.delete(ISVC, ns, "watched")  # nothing to wait for: gone at once, operator or not
    assert env.client.get(ISVC, ns, "watched") is None
    # the finalizer an older operator's kopf daemon left is removed, so the service can go without an operator
    old = isvc_body("upgraded", {"replicas": 1, "autoscaling": {"minReplicas": 1, "maxReplicas": 2}})
    old["metadata"]["finalizers"] = ["kopf.zalando.org/KopfFinalizerMarker"]
    env.client.create(ISVC, ns, old)
    wait_for(lambda: not env.client.get(ISVC, ns, "upgraded")["metadata"].get("finalizers"), EVENT_BOUND, "finalizer gone")


def test_engines_the_operator_cannot_reach_scale_from_the_gateways_view(env, ns, engines):
    """Engines behind Istio STRICT mTLS refuse the operator's plaintext scrape; the gateways, inside the mesh,
    report the engines' load (loadSource auto, the default): the fleet still scales, with the engines' gauges
    where a gateway polled them and the gateways' own in-flight counts where not."""
    from shoal.operator.autoscaler import REGISTRY as R

    env.client.create(ISVC, ns, isvc_body("mesh", {"replicas": 1, "autoscaling": {
        "minReplicas": 1, "maxReplicas": 6, "targetInFlightPerReplica": 10, "scaleUpStabilizationSeconds": 0}}))
    wait_for(lambda: env.client.get("deployments", ns, "mesh"), EVENT_BOUND, "deployment")
    refused = free_port()  # nobody listens there: every scrape of the engines fails, as a STRICT sidecar's would
    labels = slice_labels(env.client, ns, "mesh-engines")
    for pod, port in (("mesh-a", refused), ("mesh-b", refused)):
        env.client.create("endpointslices", ns, {
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": "IPv4",
            "metadata": {"name": f"mesh-engines-{pod}", "labels": labels},
            "ports": [{"name": "http", "port": port, "protocol": "TCP"}],
            "endpoints": [{"addresses": [f"127.0.0.{1 + (pod == 'mesh-b')}"], "conditions": {"ready": True},
                           "targetRef": {"kind": "Pod", "name": pod, "namespace": ns}}]})
    a, b = f"http://127.0.0.1:{refused}", f"http://127.0.0.2:{refused}"
    # both gateways polled engine a (same gauges); none has fresh data of b, to which they have 9 + 8 in flight
    polled = (f'shoal:gateway_backend_running_requests{{backend="{a}"}} 20\n'
              f'shoal:gateway_backend_waiting_requests{{backend="{a}"}} 4\n'
              f'shoal:gateway_backend_kv_cache_usage{{backend="{a}"}} 0.5\n')
    engines.texts["mesh-gw-1"] = polled + f'shoal:gateway_inflight_requests{{backend="{a}"}} 12\n' \
                        f'shoal:gateway_inflight_requests{{backend="{b}"}} 9\nshoal:gateway_held_requests 0\n'
    engines.texts["mesh-gw-2"] = polled + f'shoal:gateway_inflight_requests{{backend="{a}"}} 12\n' \
                        f'shoal:gateway_inflight_requests{{backend="{b}"}} 8\nshoal:gateway_held_requests 0\n'
    publish_slices(env.client, ns, "mesh", ["mesh-gw-1", "mesh-gw-2"], engines)
    # 24 on a (its own gauges, via the gateways) + 17 on b (the gateways' counts) = 41 -> ceil(41/10) = 5
    wait_for(lambda: running(env, ns, "mesh") == 5, EVENT_BOUND, "scaled to 5 from the gateways' view")
    st = wait_for(lambda: (s := env.client.get(ISVC, ns, "mesh")["status"].get("autoscaling")) and
                  s.get("neededReplicas") == 5 and s, 5, "status")
    assert st["inputs"]["inFlight"] == 41 and st["inputs"]["kvCacheUsage"] == 0.5
    assert st["reason"] != "LoadUnknown"
    # the failing engines are scraped ever more rarely while the gateways cover them
    wait_for(lambda: (R.get_sample_value("shoal:autoscaler_scrapes_total",
                                         {"target": "engine", "result": "skipped"}) or 0) > 0, 10, "backoff")


def test_an_external_autoscaler_gets_the_inputs_and_owns_the_replica_count(env, ns, engines):
    """autoscalerClass external (an HPA or a KEDA ScaledObject on the scale subresource): the operator observes and
    exports shoal:autoscaler_* but writes no replica count; spec.replicas, as the HPA sets it, is what runs."""
    env.client.create(ISVC, ns, isvc_body("keda", {"replicas": 1, "autoscaling": {
        "minReplicas": 1, "maxReplicas": 5, "targetInFlightPerReplica": 10, "scaleUpStabilizationSeconds": 0,
        "autoscalerClass": "external"}}))
    wait_for(lambda: env.client.get("deployments", ns, "keda"), EVENT_BOUND, "deployment")
    engines.load["keda-a"] = (25, 5, 0.4)
    publish_slices(env.client, ns, "keda-engines", ["keda-a"], engines)
    sample = {"namespace": ns, "name": "keda"}
    wait_for(lambda: REGISTRY.get_sample_value("shoal:autoscaler_needed_replicas", sample) == 3, EVENT_BOUND, "needed 3")
    assert REGISTRY.get_sample_value("shoal:autoscaler_in_flight_requests", sample) == 30
    ticks = decisions(ns, "keda")
    wait_for(lambda: decisions(ns, "keda") >= ticks + 2, EVENT_BOUND, "two more decisions")
    assert "autoscaling" not in (env.client.get(ISVC, ns, "keda").get("status") or {})
    assert env.client.get("deployments", ns, "keda")["spec"]["replicas"] == 1
    env.client.patch(ISVC, ns, "keda", {"spec": {"replicas": 3}}, sub="scale")  # the HPA acts
    wait_for(lambda: env.client.get("deployments", ns, "keda")["spec"]["replicas"] == 3, EVENT_BOUND, "deployment follows")


def prefill_text(running: int, tokens: int) -> str:
    """A prefill engine's /metrics: requests it prefills and the prompt tokens waiting for it."""
    return (f'shoal:num_requests_running{{model_name="m"}} {running}\nshoal:num_requests_waiting{{model_name="m"}} 0\n'
            f'shoal:kv_cache_usage_perc{{model_name="m"}} 0.9\n'
            f'shoal:num_waiting_prefill_tokens{{model_name="m"}} {tokens}\n')


def test_the_prefill_role_scales_on_its_own_signal_while_the_decode_count_stays(env, ns, engines):
    """spec.prefill.autoscaling: the prefill engines' waiting prompt tokens size the prefill Deployment (through
    status.prefill.desiredReplicas), up under load and back down when it goes; the decode replicas, autoscaled
    on their own in-flight load, stay where that load puts them."""
    env.client.create(ISVC, ns, isvc_body("pd", {
        "replicas": 2, "autoscaling": {"minReplicas": 1, "maxReplicas": 4, "targetInFlightPerReplica": 10,
                                       "scaleUpStabilizationSeconds": 0, "scaleDownStabilizationSeconds": 2},
        "prefill": {"replicas": 1, "autoscaling": {
            "minReplicas": 1, "maxReplicas": 4, "targetWaitingPrefillTokensPerReplica": 1000,
            "scaleUpStabilizationSeconds": 0, "scaleDownStabilizationSeconds": 2}}}))
    wait_for(lambda: env.client.get("deployments", ns, "pd-prefill"), EVENT_BOUND, "prefill deployment")
    # decode: 15 in flight over 2 engines -> 2 replicas (the count it has); prefill: 2500 tokens waiting -> 3
    engines.load.update({"pd-a": (8, 0, 0.2), "pd-b": (7, 0, 0.2)})
    publish_slices(env.client, ns, "pd-engines", ["pd-a", "pd-b"], engines)
    engines.texts["pd-p1"] = prefill_text(2, 2500)
    publish_slices(env.client, ns, "pd-prefill", ["pd-p1"], engines)

    def prefill(isvc=None) -> dict:
        return ((isvc or env.client.get(ISVC, ns, "pd")).get("status") or {}).get("prefill") or {}

    wait_for(lambda: prefill().get("desiredReplicas") == 3, EVENT_BOUND, "prefill scaled up to 3 (2500/1000)")
    wait_for(lambda: env.client.get("deployments", ns, "pd-prefill")["spec"]["replicas"] == 3, EVENT_BOUND,
             "prefill deployment scaled")
    st = wait_for(lambda: (p := prefill()).get("neededReplicas") == 3 and p.get("inputs") and p, 10, "status.prefill")
    assert st["inputs"]["waitingPrefillTokens"] == 2500 and st["inputs"]["inFlight"] == 2 and st["lastScaleTime"]
    assert st["reason"] == "ScaleUp" and "waiting prefill" in st["message"]
    assert env.client.get(ISVC, ns, "pd")["spec"]["prefill"]["replicas"] == 1  # the manifest's field is left alone
    ticks = decisions(ns, "pd")
    wait_for(lambda: decisions(ns, "pd") >= ticks + 3, EVENT_BOUND, "three more decisions")
    assert running(env, ns, "pd") == 2 and env.client.get("deployments", ns, "pd")["spec"]["replicas"] == 2
    assert REGISTRY.get_sample_value("shoal:autoscaler_prefill_desired_replicas", {"namespace": ns, "name": "pd"}) == 3
    # the new prefill engines came up and the prompts were prefilled; pd-p2 still has a little to do
    for pod in ("pd-p1", "pd-p2", "pd-p3"):
        env.client.create("pods", ns, {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": pod}})
    engines.texts.update({"pd-p1": prefill_text(0, 0), "pd-p2": prefill_text(1, 300), "pd-p3": prefill_text(0, 0)})
    publish_slices(env.client, ns, "pd-prefill", ["pd-p2", "pd-p3"], engines)
    wait_for(lambda: prefill().get("desiredReplicas") == 1, EVENT_BOUND, "prefill scaled back down to 1")
    wait_for(lambda: env.client.get("deployments", ns, "pd-prefill")["spec"]["replicas"] == 1, EVENT_BOUND,
             "prefill deployment scaled down")
    costs = {p: int(env.client.get("pods", ns, p)["metadata"]["annotations"][A_DELETION_COST])
             for p in ("pd-p1", "pd-p2", "pd-p3")}
    assert max(costs, key=costs.get) == "pd-p2", costs  # the prefill engine still busy is the one kept
    reasons = [e["reason"] for e in env.cluster.find("events", ns)]
    assert "PrefillScaledUp" in reasons and "PrefillScaledDown" in reasons
    # the decode replicas never moved: their load is theirs
    assert running(env, ns, "pd") == 2 and env.client.get("deployments", ns, "pd")["spec"]["replicas"] == 2
    assert "ScaledUp" not in reasons and "ScaledDown" not in reasons


def test_an_idle_prefill_role_goes_to_zero_and_the_decode_engines_prefill_load_brings_it_back(env, ns, engines):
    """Only the prefill role autoscaled, minReplicas 0: idle, its engines go (the decode engines prefill
    themselves); the prompt tokens then waiting on the decode engines scale it from zero at once, to what they
    need. The decode replicas are spec.replicas throughout (no status.autoscaling)."""
    env.client.create(ISVC, ns, isvc_body("pz", {"replicas": 1, "prefill": {"replicas": 1, "autoscaling": {
        "minReplicas": 0, "maxReplicas": 5, "targetWaitingPrefillTokensPerReplica": 1000,
        "scaleDownStabilizationSeconds": 1, "scaleToZeroAfterSeconds": 1}}}))
    wait_for(lambda: env.client.get("deployments", ns, "pz-prefill"), EVENT_BOUND, "prefill deployment")
    engines.load["pz-a"] = (3, 0, 0.1)
    publish_slices(env.client, ns, "pz-engines", ["pz-a"], engines)
    engines.texts["pz-p1"] = prefill_text(0, 0)
    publish_slices(env.client, ns, "pz-prefill", ["pz-p1"], engines)

    def prefill() -> dict:
        return (env.client.get(ISVC, ns, "pz").get("status") or {}).get("prefill") or {}

    wait_for(lambda: prefill().get("desiredReplicas") == 0, EVENT_BOUND, "prefill scaled to zero")
    wait_for(lambda: env.client.get("deployments", ns, "pz-prefill")["spec"]["replicas"] == 0, EVENT_BOUND,
             "prefill deployment at zero")
    env.client.delete("endpointslices", ns, "pz-prefill-pz-p1")  # its pod went
    # the decode engine now prefills 3500 prompt tokens itself
    engines.texts["pz-a"] = prefill_text(3, 3500)
    wait_for(lambda: prefill().get("desiredReplicas") == 4, EVENT_BOUND, "prefill scaled from zero to 4")
    st = wait_for(lambda: (p := prefill()).get("reason") == "ScaleFromZero" and p, 10, "status.prefill")
    assert "on the decode engines" in st["message"] and st["inputs"]["waitingPrefillTokens"] == 3500
    wait_for(lambda: env.client.get("deployments", ns, "pz-prefill")["spec"]["replicas"] == 4, EVENT_BOUND,
             "prefill deployment from zero")
    isvc = env.client.get(ISVC, ns, "pz")
    assert "autoscaling" not in isvc["status"] and env.client.get("deployments", ns, "pz")["spec"]["replicas"] == 1
