"""The model cache end to end on one machine: the emulated API, the real operator, the local kubelet (fleetkit)
running each pod's `shoal-podtools download` init container, its `cache-lease` native sidecar and its real
`shoal-engine serve`, and a local stand-in for the hub (hubkit).

Two services on one ReadWriteMany claim serve the same hub model: the first pod downloads it (checked against the
hub's checksums), the second service's pod starts from the cache without fetching a byte; both answer the same
greedy tokens, status.modelCache says what is cached, and each running pod holds a lease on the entry.
"""

from __future__ import annotations

import os

from fleetkit import Kubelet
from hubkit import FakeHub
from kubekit import isvc_body, wait_for
from prockit import EVENT_BOUND, http

ISVC = "inferenceservices"


def _spec(served: str) -> dict:
    return {"model": {"uri": "hf://org/tiny", "servedName": served, "cache": {"claimName": "models"}},
            "engine": {"attentionBackend": "sdpa"}}  # (the gateway on: engines behind <name>-engines)


def _complete(port: int, model: str) -> str:
    import json

    status, body, _ = http("POST", f"http://127.0.0.1:{port}/v1/completions",
                           {"model": model, "prompt": "hello", "max_tokens": 6, "temperature": 0}, timeout=60)
    assert status == 200, body
    return json.loads(body)["choices"][0]["text"]


def test_two_services_share_one_download(env, ns, llama_model, tmp_path):
    claim = tmp_path / "models-claim"  # the ReadWriteMany volume both services mount at /cache
    claim.mkdir()
    files = len([f for f in os.listdir(llama_model) if os.path.isfile(os.path.join(llama_model, f))])
    with FakeHub() as hub:
        hub.publish("org/tiny", llama_model)
        kubelet_env = {"HF_ENDPOINT": hub.url}
        if os.environ.get("TORCH_EXTENSIONS_DIR"):  # this checkout's kernel builds, not a fresh build per test
            kubelet_env["TORCH_EXTENSIONS_DIR"] = os.environ["TORCH_EXTENSIONS_DIR"]
        kubelet = Kubelet(type(env.client)(env.server.url), env.cluster, ns, engine_service=None,
                          env=kubelet_env, claims={"models": str(claim)})
        with kubelet:
            env.client.create(ISVC, ns, isvc_body("first", _spec("first")))
            (first,) = wait_for(kubelet.ready_pods, 180, "the first service's pod to be Ready")
            assert hub.file_downloads("org/tiny") == files, hub.downloads
            env.client.create(ISVC, ns, isvc_body("second", _spec("second")))
            wait_for(lambda: len(kubelet.ready_pods()) == 2, 180, "the second service's pod to be Ready")
            assert kubelet.error is None, kubelet.error
            assert hub.file_downloads("org/tiny") == files, "the second service fetched the model again"
            (second,) = [p for p in kubelet.ready_pods() if p != first]

            def cache_status(name):
                return (env.client.get(ISVC, ns, name).get("status") or {}).get("modelCache")

            a = wait_for(lambda: cache_status("first"), EVENT_BOUND, "status.modelCache of the first service")
            b = wait_for(lambda: cache_status("second"), EVENT_BOUND, "status.modelCache of the second service")
            assert a["entry"] == b["entry"] == "org--tiny@main" and a["verified"] == b["verified"] == "hub"
            assert a["fetched"] is True and b["fetched"] is False and a["sizeBytes"] == b["sizeBytes"] > 0
            leases = sorted(os.listdir(claim / "shoal" / "models" / ".leases" / "org--tiny@main"))
            assert leases == sorted([first, second])
            assert _complete(kubelet.pods[first].port, "first") == _complete(kubelet.pods[second].port, "second")
