"""Canary revisions without a cluster: the spec's rules, the rendered canary Deployment and engines Service, the
status, promotion's patch, and the judge's arithmetic (operator/canary.py, canary_judge.py)."""

from __future__ import annotations

import math

import kubernetes_validate
import pytest

from shoal.operator import api, canary, canary_judge, contract, render, status

K8S_VERSION = kubernetes_validate.latest_version()
SETTINGS = render.Settings(engine_image="registry.test/shoal-engine:1", fleet_image="registry.test/shoal-operator:1")
STABLE = {"model": {"uri": "hf://org/chat-v1", "servedName": "chat"}, "replicas": 3, "engine": {"maxNumSeqs": 8}}


def isvc(spec: dict, status_: dict | None = None) -> dict:
    return {"apiVersion": api.API_VERSION, "kind": api.KIND,
            "metadata": {"name": "llm", "namespace": "team-a", "uid": "u-1", "generation": 2},
            "spec": spec, "status": status_ or {}}


def by_name(children: list[dict]) -> dict[tuple[str, str], dict]:
    return {(c["kind"], c["metadata"]["name"]): c for c in children}


def with_canary(**canary_fields) -> dict:
    return {**STABLE, "canary": {"model": {"uri": "hf://org/chat-v2"}, "trafficPercent": 20, **canary_fields}}


def test_the_canary_is_its_own_deployment_behind_the_same_engines_service():
    plan = render.plan(isvc(with_canary(engine={"maxNumSeqs": 16}, image="registry.test/engine:2")), SETTINGS)
    children = by_name(plan.children)
    stable, canary_dep = children[("Deployment", "llm")], children[("Deployment", "llm-canary")]
    for obj in plan.children:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    # the canary: its own selector (a subset of the engine pods), its own replicas, the canary's server options
    assert canary_dep["spec"]["selector"]["matchLabels"] == {**render.pod_selector("llm"), contract.L_CANARY: "true"}
    assert canary_dep["spec"]["template"]["metadata"]["labels"][contract.L_CANARY] == "true"
    assert canary_dep["spec"]["replicas"] == 1
    args = canary_dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--model") + 1] == "/cache/shoal/models/org--chat-v2@main"  # its model-cache entry
    assert args[args.index("--served-model-name") + 1] == "chat"
    assert args[args.index("--max-num-seqs") + 1] == "16"
    assert canary_dep["spec"]["template"]["spec"]["containers"][0]["image"] == "registry.test/engine:2"
    assert "org/chat-v2" in canary_dep["spec"]["template"]["spec"]["initContainers"][0]["args"]
    # the stable revision is untouched by the canary's presence (no label added: no rollout of it)
    assert stable == by_name(render.plan(isvc(STABLE), SETTINGS).children)[("Deployment", "llm")]
    assert contract.L_CANARY not in stable["spec"]["template"]["metadata"]["labels"]
    # the engines Service selects both revisions' pods and carries the share to the gateways' slices
    engines = children[("Service", "llm-engines")]
    assert engines["spec"]["selector"] == render.pod_selector("llm")
    assert engines["metadata"]["labels"][contract.L_CANARY_PERCENT] == "20"
    assert contract.L_CANARY_PERCENT not in by_name(render.plan(isvc(STABLE), SETTINGS).children)[
        ("Service", "llm-engines")]["metadata"]["labels"]
    assert (plan.canary_percent, plan.canary_revision) == (20, canary.revision(plan.spec))


def test_the_revision_is_what_makes_a_different_server():
    base = api.validate("llm", with_canary())
    assert canary.revision(base) == canary.revision(api.validate("llm", with_canary(trafficPercent=50, replicas=2)))
    assert canary.revision(base) != canary.revision(api.validate("llm", with_canary(image="registry.test/e:3")))
    assert canary.revision(base) != canary.revision(api.validate("llm", with_canary(engine={"maxNumSeqs": 4})))


def test_a_rolled_back_canary_gets_no_traffic_and_no_deployment_until_its_revision_changes():
    spec = with_canary()
    revision = canary.revision(api.validate("llm", spec))
    rolled = {"canary": {"revision": revision, "rollback": {"revision": revision, "reason": "ErrorRateAboveSLO"}}}
    children = by_name(render.plan(isvc(spec, rolled), SETTINGS).children)
    assert ("Deployment", "llm-canary") not in children and ("Deployment", "llm") in children
    assert children[("Service", "llm-engines")]["metadata"]["labels"][contract.L_CANARY_PERCENT] == "0"
    # another revision (a new image) is a new attempt
    children = by_name(render.plan(isvc(with_canary(image="registry.test/e:3"), rolled), SETTINGS).children)
    assert ("Deployment", "llm-canary") in children
    assert children[("Service", "llm-engines")]["metadata"]["labels"][contract.L_CANARY_PERCENT] == "20"


@pytest.mark.parametrize("canary_spec, field, words", [
    ({"model": {"uri": "hf://org/other"}}, "spec.canary.model.servedName", "would serve `org/other`"),
    ({"model": {"servedName": "chat-2"}}, "spec.canary.model.servedName", "this service serves `chat`"),
    ({"engine": {"maxNumSeqs": 64, "maxNumBatchedTokens": 16}}, "spec.canary.engine.maxNumBatchedTokens",
     "at least maxNumSeqs"),
    ({"engine": {"tensorParallelSize": 16}}, "spec.canary", "single-pod replicas"),
    ({"trafficPercent": 101}, "spec.canary.trafficPercent", "less than or equal to 100"),
    ({"rollback": {"maxErrorRate": 2}}, "spec.canary.rollback.maxErrorRate", "less than or equal to 1"),
])
def test_bad_canaries_are_refused_naming_the_field(canary_spec, field, words):
    spec = {"model": {"uri": "hf://org/chat-v1"}, "canary": canary_spec} if "servedName" not in str(canary_spec) \
        else {**STABLE, "canary": canary_spec}
    with pytest.raises(api.SpecError) as e:
        render.plan(isvc(spec), SETTINGS)
    assert e.value.field == field and words in e.value.message, (e.value.field, e.value.message)


def test_a_canary_needs_the_gateway():
    with pytest.raises(api.SpecError) as e:
        api.validate("llm", {**with_canary(), "gateway": {"enabled": False}})
    assert e.value.field == "spec.canary" and "gateway" in e.value.message


def test_status_reports_both_revisions_and_keeps_the_judges_figures():
    spec = with_canary()
    plan = render.plan(isvc(spec), SETTINGS)
    revision = plan.canary_revision
    children = {("Deployment", "llm"): {"metadata": {"generation": 1}, "status": {
                    "observedGeneration": 1, "replicas": 3, "readyReplicas": 3, "updatedReplicas": 3}},
                ("Deployment", "llm-canary"): {"metadata": {"generation": 1}, "status": {
                    "observedGeneration": 1, "replicas": 1, "readyReplicas": 1}}}
    figures = {"requests": 10, "errors": 0}
    old = {"canary": {"revision": revision, "canary": figures, "figuresTime": "2026-01-01T00:00:00Z"}}
    pods = [{"metadata": {"name": "llm-canary-x", "labels": {contract.L_CANARY: "true"}},
             "status": {"phase": "Pending"}}]  # the canary's pods never count as the stable revision's
    new = status.compute_status(isvc(spec, old), plan, children, pods)
    assert new["readyReplicas"] == 3 and new["phase"] == "Ready"
    assert new["canary"] == {"revision": revision, "trafficPercent": 20, "split": "80/20", "replicas": 1,
                             "readyReplicas": 1, "canary": figures, "figuresTime": "2026-01-01T00:00:00Z"}
    ready = next(c for c in new["conditions"] if c["type"] == canary.CONDITION_READY)
    assert ready["status"] == "True" and "20%" in ready["message"]
    api.InferenceServiceStatus.model_validate(new)
    # without a canary everything said about one goes
    plain = render.plan(isvc(STABLE), SETTINGS)
    new = status.compute_status(isvc(STABLE, {**old, "conditions": [ready]}), plain, children, [])
    assert new["canary"] is None and not any(c["type"].startswith("Canary") for c in new["conditions"])


def test_promotion_moves_the_canarys_fields_into_the_spec():
    spec = with_canary(image="registry.test/e:2", engine={"maxNumSeqs": 16}, promote=True)
    patch = canary.promoted_spec(spec)
    assert patch == {"canary": None, "model": {"uri": "hf://org/chat-v2", "revision": None},
                     "image": "registry.test/e:2", "engine": {"maxNumSeqs": 16}}
    # what it leaves is the canary, as a whole spec
    merged = {**spec, **{k: v for k, v in patch.items() if k not in ("model", "engine")}}
    merged["model"] = {**spec["model"], **patch["model"]}
    merged["engine"] = {**spec["engine"], **patch["engine"]}
    merged = {k: v for k, v in merged.items() if v is not None}
    merged["model"] = {k: v for k, v in merged["model"].items() if v is not None}
    promoted = api.validate("llm", merged)
    expected = api.canary_spec(api.validate("llm", spec))
    assert (promoted.model, promoted.image, promoted.engine) == (expected.model, expected.image, expected.engine)


def gateway_text(revision_counts: dict[str, tuple[int, int]], first_byte: dict[str, list[float]]) -> str:
    """A gateway's /metrics as prometheus_client writes them, from its own metrics class."""
    from prometheus_client import generate_latest

    from shoal.operator.gateway.metrics import GatewayMetrics

    class NoPools:
        pools = type("P", (), {"all": lambda self: [], "shared": False})()
        batches = None

    m = GatewayMetrics(NoPools())
    for revision, (ok, errors) in revision_counts.items():
        for _ in range(ok):
            m.revision_outcome(revision, "200")
        for _ in range(errors):
            m.revision_outcome(revision, "500")
    for revision, times in first_byte.items():
        for t in times:
            m.revision_first_byte.labels(revision).observe(t)
    return generate_latest(m.registry).decode()


def test_the_judge_differences_counters_per_gateway_over_its_window():
    slo = api.CanaryRollback(max_error_rate=0.1, min_requests=20, window_seconds=10, max_p95_first_byte_seconds=1.0)
    window = canary_judge.Window("r1")
    first = {"gw-a": canary_judge.parse_gateway(gateway_text({"stable": (50, 0), "canary": (30, 30)}, {}))}
    total = window.observe(0.0, first, slo.window_seconds)
    assert total["canary"].requests == 0  # what came before the first sight is a baseline, not the window's
    later = {"gw-a": canary_judge.parse_gateway(gateway_text({"stable": (90, 1), "canary": (40, 32)}, {})),
             "gw-b": canary_judge.parse_gateway(gateway_text({"canary": (5, 0)}, {}))}
    total = window.observe(1.0, later, slo.window_seconds)  # gw-b: first sight, baseline
    assert (total["stable"].requests, total["stable"].errors) == (41, 1)
    assert (total["canary"].requests, total["canary"].errors) == (12, 2)
    assert canary_judge.breach(slo, total["canary"]) is None  # too few requests to judge
    again = {"gw-a": canary_judge.parse_gateway(gateway_text({"stable": (90, 1), "canary": (40, 40)}, {})),
             "gw-b": canary_judge.parse_gateway(gateway_text({"canary": (7, 2)}, {}))}
    total = window.observe(2.0, again, slo.window_seconds)
    reason, message = canary_judge.breach(slo, total["canary"])
    assert reason == "ErrorRateAboveSLO" and "12 of the canary's 24 requests" in message
    # a gateway restarted (its counters went back): its counts start over, never negative
    restarted = {"gw-a": canary_judge.parse_gateway(gateway_text({"canary": (1, 0)}, {})),
                 "gw-b": again["gw-b"]}
    total = window.observe(3.0, restarted, slo.window_seconds)
    assert total["canary"].requests == 25
    # the window slides: old increments leave it
    total = window.observe(20.0, restarted, slo.window_seconds)
    assert total["canary"].requests == 0


def test_the_judge_reads_the_p95_first_byte_from_the_histogram():
    slo = api.CanaryRollback(min_requests=10, max_p95_first_byte_seconds=1.0)
    fast = canary_judge.parse_gateway(gateway_text({"canary": (20, 0)}, {"canary": [0.2] * 20}))["canary"]
    assert fast.p95() == 0.25 and canary_judge.breach(slo, fast) is None
    slow = canary_judge.parse_gateway(gateway_text({"canary": (20, 0)}, {"canary": [0.2] * 18 + [3.0] * 2}))["canary"]
    assert slow.p95() == 4.0
    reason, message = canary_judge.breach(slo, slow)
    assert reason == "LatencyAboveSLO" and "4 s > maxP95FirstByteSeconds 1 s" in message
    assert canary_judge.figures(slow) == {"requests": 20, "errors": 0, "errorRate": 0.0, "p95FirstByteSeconds": 4.0}
    endless = canary_judge.parse_gateway(gateway_text({"canary": (10, 0)}, {"canary": [900.0] * 10}))["canary"]
    assert math.isinf(endless.p95())
