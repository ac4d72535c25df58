"""A canary end to end on one machine: the emulated API server, the real operator, the local kubelet (fleetkit)
running the stable and the canary revision as real `shoal-engine serve` processes with a tiny random model, and a
real `shoal-gateway` discovering both through the engines Service's EndpointSlices.

A canary at 20 % gets 20 % ± 5 % of 500 conversations (counted by the gateway and by the engines themselves), nobody
sees an error, and promotion leaves one revision. (The rollback of a failing canary is exercised with stand-ins:
tests/operator/test_canary_kmock.py for the operator, tests/gateway/test_gateway_canary.py for the gateway.)
"""

from __future__ import annotations

import concurrent.futures
import importlib

import pytest
from fleetkit import local_fleet, publish_gateway
from kubekit import isvc_body, wait_for
from prockit import EVENT_BOUND, http
from promkit import metric, parse_metrics

openai = importlib.import_module("openai")

ISVC = "inferenceservices"


def metrics_of(url: str) -> dict[str, float]:
    status, raw, _ = http("GET", url + "/metrics", timeout=10)
    assert status == 200, status
    return parse_metrics(raw.decode())


@pytest.mark.slow
def test_a_canary_gets_its_share_of_500_conversations_and_promotion_leaves_one_revision(env, ns, llama_model):
    name = "chat"
    env.client.create(ISVC, ns, isvc_body(name, {
        "replicas": 1, "model": {"uri": f"file://{llama_model}", "servedName": "tiny"},
        "engine": {"attentionBackend": "sdpa", "maxNumSeqs": 8, "shutdownTimeoutSeconds": 10},
        "canary": {"engine": {"maxNumSeqs": 4}, "trafficPercent": 20}}))
    wait_for(lambda: env.client.get("deployments", ns, f"{name}-canary"), EVENT_BOUND, "the canary's Deployment")
    with local_fleet(env, ns, name) as (kubelet, gateway):
        publish_gateway(env.client, ns, name, gateway.port, metrics_port=gateway.metrics_port)
        # bounds, not expectations: a loaded 2-core machine takes a while to start two engines
        wait_for(lambda: len(kubelet.ready_pods()) == 2, 240, "the stable and the canary engine ready")
        wait_for(lambda: metric(metrics_of(gateway.base), "shoal:gateway_ready_backends") == 2 and
                 metric(metrics_of(gateway.base), "shoal:gateway_canary_backends") == 1 and
                 metric(metrics_of(gateway.base), "shoal:gateway_canary_percent") == 20, 60,
                 "the gateway to see both revisions and the 20 % split")
        canary_pod = next(p for p in kubelet.pods.values() if p.name.startswith(f"{name}-canary-"))
        client = openai.OpenAI(base_url=gateway.base + "/v1", api_key="none", max_retries=0, timeout=120)

        def converse(i: int) -> str:
            out = client.chat.completions.create(
                model="tiny", max_tokens=1,
                messages=[{"role": "user", "content": f"conversation {i}"}])  # fixed: a reproducible split
            return out.choices[0].message.content

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(converse, range(500)))  # raises on any client error
        assert len(answers) == 500
        gw = metrics_of(gateway.base)
        to_canary = metric(gw, "shoal:gateway_revision_requests_total", revision="canary", outcome="ok")
        to_stable = metric(gw, "shoal:gateway_revision_requests_total", revision="stable", outcome="ok")
        assert metric(gw, "shoal:gateway_revision_requests_total", outcome="error") == 0
        # the canary engine's own count agrees with the gateway's
        served = metric(metrics_of(f"http://127.0.0.1:{canary_pod.port}"), "shoal:request_success_total")
        print(f"canary: {to_canary:.0f} of {to_canary + to_stable:.0f} conversations "
              f"({to_canary / 500:.1%}; the canary engine counted {served:.0f})")
        assert to_canary + to_stable == 500 and served == to_canary
        assert 0.15 <= to_canary / 500 <= 0.25

        # promotion: the canary's engine options become the stable spec, one revision is left
        env.client.patch(ISVC, ns, name, {"spec": {"canary": {"promote": True}}})
        spec = wait_for(lambda: (s := env.client.get(ISVC, ns, name)["spec"]) and "canary" not in s and s,
                        EVENT_BOUND, "the canary folded into the spec")
        assert spec["engine"]["maxNumSeqs"] == 4
        wait_for(lambda: env.client.get("deployments", ns, f"{name}-canary") is None, EVENT_BOUND,
                 "the canary's Deployment removed")
        args = env.client.get("deployments", ns, name)["spec"]["template"]["spec"]["containers"][0]["args"]
        assert args[args.index("--max-num-seqs") + 1] == "4"
        wait_for(lambda: not any(p.startswith(f"{name}-canary-") for p in kubelet.pods), 60,
                 "the canary's engine gone")
        wait_for(lambda: metric(metrics_of(gateway.base), "shoal:gateway_canary_backends") == 0 and
                 metric(metrics_of(gateway.base), "shoal:gateway_canary_percent") == 0, 60,
                 "the gateway to drop the split")
        assert converse(501)  # still served, by the one revision left
        assert not (env.client.get(ISVC, ns, name).get("status") or {}).get("canary")
        assert kubelet.error is None, kubelet.error
