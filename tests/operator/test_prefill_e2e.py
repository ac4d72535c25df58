"""Prefill/decode disaggregation end to end on one machine: the emulated API server, the real operator rendering
spec.prefill, the local kubelet (fleetkit) running the prefill and the decode Deployment as real `shoal-engine serve`
processes, and a real `shoal-gateway` with the flags the operator renders, discovering both roles through their
Services' EndpointSlices. Every answer equals one engine's, each prefill ran on the prefill engine and its KV was
pulled by the decode engine; with the prefill role scaled away the service keeps answering the same."""

from __future__ import annotations

import importlib

import pytest
from fleetkit import local_fleet, publish_gateway
from kubekit import isvc_body, wait_for
from prockit import EVENT_BOUND, http
from promkit import metric, parse_metrics

from shoal.engine import LLM, SamplingParams

openai = importlib.import_module("openai")

ISVC = "inferenceservices"
BLOCK = 16  # the engine's default block size: what the operator leaves it at
PROMPTS = ["Once upon a time there was a little shoal of fish that swam together in the warm sea, and every "
           "morning they went looking for food along the reef, far from the big boats of the harbour town",
           "Kubernetes runs pods on nodes; an operator reconciles custom resources into pods, services, network "
           "policies and disruption budgets, and reports their status back on the resource it watches"]


def metrics_of(url: str) -> dict[str, float]:
    status, raw, _ = http("GET", url + "/metrics", timeout=10)
    assert status == 200, status
    return parse_metrics(raw.decode())


@pytest.mark.slow
def test_prefill_and_decode_roles_answer_as_one_engine_and_survive_losing_the_prefill_role(env, ns, llama_model):
    name = "pd"
    with LLM(model=llama_model, block_size=BLOCK) as llm:
        want = [o.outputs[0].text for o in llm.generate(
            PROMPTS, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)]
    env.client.create(ISVC, ns, isvc_body(name, {
        "replicas": 1, "model": {"uri": f"file://{llama_model}", "servedName": "tiny"},
        "engine": {"attentionBackend": "sdpa", "maxNumSeqs": 8, "shutdownTimeoutSeconds": 10},
        "prefill": {"replicas": 1}}))
    wait_for(lambda: env.client.get("deployments", ns, f"{name}-prefill"), EVENT_BOUND, "the prefill Deployment")
    gateway_args = wait_for(lambda: env.client.get("deployments", ns, f"{name}-gateway"), EVENT_BOUND,
                            "the gateway Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    prefill_flags = ("--prefill-service", gateway_args[gateway_args.index("--prefill-service") + 1])
    with local_fleet(env, ns, name, extra=prefill_flags) as (kubelet, gateway):
        publish_gateway(env.client, ns, name, gateway.port, metrics_port=gateway.metrics_port)
        wait_for(lambda: len(kubelet.ready_pods()) == 2, 240, "the prefill and the decode engine ready")
        wait_for(lambda: metric(metrics_of(gateway.base), "shoal:gateway_ready_backends") == 1, 60,
                 "the gateway to see its decode engine")
        pods = {p.name.startswith(f"{name}-prefill-"): p for p in kubelet.pods.values()}
        prefill, decode = f"http://127.0.0.1:{pods[True].port}", f"http://127.0.0.1:{pods[False].port}"
        client = openai.OpenAI(base_url=gateway.base + "/v1", api_key="none", max_retries=0, timeout=120)

        def complete(prompt: str) -> str:
            return client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0,
                                             extra_body={"ignore_eos": True}).choices[0].text

        assert [complete(p) for p in PROMPTS] == want
        gw, p, d = metrics_of(gateway.base), metrics_of(prefill), metrics_of(decode)
        assert metric(gw, "shoal:gateway_remote_prefills_total", outcome="ok") == 2
        pulled = metric(d, "shoal:kv_transfer_blocks_total", direction="pulled")
        assert pulled >= 2 and pulled == metric(p, "shoal:kv_transfer_blocks_total", direction="served")
        assert metric(p, "shoal:generation_tokens_total") == 2  # one token per prefill
        # the prefill role goes away: the decode engine prefills itself, the answers stay
        env.client.patch(ISVC, ns, name, {"spec": {"prefill": None}})
        wait_for(lambda: env.client.get("deployments", ns, f"{name}-prefill") is None, EVENT_BOUND,
                 "the prefill Deployment removed")
        wait_for(lambda: len(kubelet.ready_pods()) == 1, 120, "the prefill pod gone")
        fresh = "A prompt that no engine has cached yet, so the decode engine computes all of it alone: " + PROMPTS[1]
        with LLM(model=llama_model, block_size=BLOCK) as llm:
            (alone,) = [o.outputs[0].text for o in llm.generate(
                [fresh], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)]
        assert complete(fresh) == alone
