"""The model cache end to end on one machine: the emulated API, the real operator, the local kubelet (fleetkit)
running each pod's `shoal-podtools download` init container, its `cache-lease` native sidecar and its real
`shoal-engine serve` (with /cache read-only, as the pod mounts it), and a local stand-in for the hub (hubkit).

* Two services on one ReadWriteMany claim serve the same hub model: the first pod downloads it (checked against
  the hub's checksums), the second service's pod starts from the cache without fetching a byte; both answer the
  same greedy tokens, status.modelCache says what is cached, and each running pod holds a lease on the entry.
* A cache entry corrupted on the volume is found by the next pod's check at start, and fetched again.
* Under a cap that fits one model and a bit, a second model never evicts the first while its pod runs: the second
  service's download fails with the entry in use named; once the first service is gone, it evicts and starts.
"""

from __future__ import annotations

import os
import subprocess
import sys

import fleetkit
import pytest
from fleetkit import Kubelet
from hubkit import FakeHub
from kubekit import isvc_body, wait_for
from prockit import EVENT_BOUND, http

from shoal.operator.podtools.modelcache import ModelCache

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


def _kubelet(env, ns: str, hub: FakeHub, claim) -> Kubelet:
    """The local kubelet, its pods fetching from `hub`, the claim "models" the folder `claim`."""
    kubelet_env = {"HF_ENDPOINT": hub.url}
    if os.environ.get("TORCH_EXTENSIONS_DIR"):  # this checkout's kernel builds, not a fresh build per test
        kubelet_env["TORCH_EXTENSIONS_DIR"] = os.environ["TORCH_EXTENSIONS_DIR"]
    return Kubelet(type(env.client)(env.server.url), env.cluster, ns, engine_service=None, env=kubelet_env,
                   claims={"models": str(claim)})


def _files(folder) -> int:
    return len([f for f in os.listdir(folder) if os.path.isfile(os.path.join(folder, f))])


def _cache_status(env, ns: str, name: str) -> dict | None:
    return (env.client.get(ISVC, ns, name).get("status") or {}).get("modelCache")


def test_the_local_kubelet_refuses_writes_to_a_read_only_mount(tmp_path):
    """What makes these tests fail should an engine write to its read-only /cache: the mount is enforced."""
    if not fleetkit._can_remount():
        pytest.skip("no mount namespace on this machine: readOnly mounts are not enforced here")
    claim, own = tmp_path / "claim", tmp_path / "claim" / "shoal" / "engine"
    own.mkdir(parents=True)
    write = "import sys; open(sys.argv[1], 'w').write('x')"
    argv = [sys.executable, "-c", write]
    assert subprocess.run(fleetkit.read_only_argv([*argv, str(own / "kernel")], [str(claim)], [str(own)])
                          ).returncode == 0  # the engine's writable subPath, inside the read-only claim
    refused = subprocess.run(fleetkit.read_only_argv([*argv, str(claim / "entry")], [str(claim)], [str(own)]),
                             capture_output=True, text=True)
    assert refused.returncode != 0 and "Read-only file system" in refused.stderr
    assert (own / "kernel").exists() and not (claim / "entry").exists()


def test_two_services_share_one_download(env, ns, llama_model, tmp_path):
    claim = tmp_path / "models-claim"  # the ReadWriteMany volume both services mount at /cache
    claim.mkdir()
    files = _files(llama_model)
    with FakeHub() as hub:
        hub.publish("org/tiny", llama_model)
        kubelet = _kubelet(env, ns, hub, claim)
        with kubelet:
            env.client.create(ISVC, ns, isvc_body("first", _spec("first")))
            (first,) = wait_for(kubelet.ready_pods, 180, "the first service's pod to be Ready")
            assert hub.file_downloads("org/tiny") == files, hub.downloads
            env.client.create(ISVC, ns, isvc_body("second", _spec("second")))
            wait_for(lambda: len(kubelet.ready_pods()) == 2, 180, "the second service's pod to be Ready")
            assert kubelet.error is None, kubelet.error
            assert hub.file_downloads("org/tiny") == files, "the second service fetched the model again"
            (second,) = [p for p in kubelet.ready_pods() if p != first]
            a = wait_for(lambda: _cache_status(env, ns, "first"), EVENT_BOUND, "status.modelCache of the first service")
            b = wait_for(lambda: _cache_status(env, ns, "second"), EVENT_BOUND,
                         "status.modelCache of the second service")
            assert a["entry"] == b["entry"] == "org--tiny@main" and a["verified"] == b["verified"] == "hub"
            assert a["fetched"] is True and b["fetched"] is False and a["sizeBytes"] == b["sizeBytes"] > 0
            leases = sorted(os.listdir(claim / "shoal" / "models" / ".leases" / "org--tiny@main"))
            assert leases == sorted([first, second])
            assert _complete(kubelet.pods[first].port, "first") == _complete(kubelet.pods[second].port, "second")


def _corrupt(path) -> None:
    """Flip bytes in the middle of a file, keeping its size (only the sha256 check can tell), as a new inode: the
    running engine's open (or mapped) copy stays what it loaded."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 64] = bytes(b ^ 0xFF for b in data[middle:middle + 64])
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(bytes(data))
    os.replace(tmp, path)


@pytest.mark.slow
def test_a_corrupted_entry_is_detected_at_start_and_fetched_again(env, ns, llama_model, tmp_path):
    claim = tmp_path / "models-claim"
    claim.mkdir()
    files = _files(llama_model)
    entry = claim / "shoal" / "models" / "org--tiny@main"
    with FakeHub() as hub:
        hub.publish("org/tiny", llama_model)
        with _kubelet(env, ns, hub, claim) as kubelet:
            env.client.create(ISVC, ns, isvc_body("svc", _spec("svc")))
            (first,) = wait_for(kubelet.ready_pods, 180, "the first pod to be Ready")
            answer = _complete(kubelet.pods[first].port, "svc")
            assert hub.file_downloads("org/tiny") == files
            _corrupt(entry / "model.safetensors")
            env.client.delete("pods", ns, first)  # the Deployment makes a new pod, which checks the entry
            (second,) = wait_for(lambda: [p for p in kubelet.ready_pods() if p != first], 180,
                                 "the replacement pod to be Ready")
            assert kubelet.error is None, kubelet.error
            assert hub.file_downloads("org/tiny") == 2 * files, "the corrupt entry was not fetched again"
            assert ModelCache(claim / "shoal" / "models").verify("org--tiny@main") == []
            report = wait_for(lambda: (s := _cache_status(env, ns, "svc")) and s["fetched"] and s, EVENT_BOUND,
                              "status.modelCache of the replacement pod")
            assert report["entry"] == "org--tiny@main" and report["verified"] == "hub"
            assert _complete(kubelet.pods[second].port, "svc") == answer


@pytest.mark.slow
def test_eviction_under_the_cap_never_removes_an_entry_a_running_pod_leases(env, ns, llama_model, tmp_path):
    claim = tmp_path / "models-claim"
    claim.mkdir()
    models = claim / "shoal" / "models"
    size = sum(p.stat().st_size for p in llama_model.iterdir() if p.is_file())
    cap = str(size * 3 // 2)  # one model and a half: a second one fits only by evicting the first

    def spec(served: str, repo: str) -> dict:
        body = _spec(served)
        body["model"].update(uri=f"hf://{repo}", cache={"claimName": "models", "size": cap})
        return body

    with FakeHub() as hub:
        hub.publish("org/a", llama_model)
        hub.publish("org/b", llama_model)
        with _kubelet(env, ns, hub, claim) as kubelet:
            env.client.create(ISVC, ns, isvc_body("first", spec("first", "org/a")))
            (first,) = wait_for(kubelet.ready_pods, 180, "the first service's pod to be Ready")
            env.client.create(ISVC, ns, isvc_body("second", spec("second", "org/b")))
            failed = wait_for(lambda: kubelet.error, 120, "the second service's download to fail")
            assert "org--b@main needs" in str(failed) and "in use: org--a@main" in str(failed), failed
            assert f"leased by {first}" in str(failed)
            assert ModelCache(models).verify("org--a@main") == [], "the leased entry was touched"
            assert not (models / "org--b@main").exists() and kubelet.ready_pods() == [first]
            assert _complete(kubelet.pods[first].port, "first")  # its pod still serves from the entry
            # once nobody runs on it, the entry is evicted for the second model
            env.client.delete(ISVC, ns, "first")
            (second,) = wait_for(lambda: [p for p in kubelet.ready_pods() if p.startswith("second-")], 180,
                                 "the second service's pod to be Ready once the first is gone")
            assert not (models / "org--a@main").exists() and ModelCache(models).verify("org--b@main") == []
            report = wait_for(lambda: _cache_status(env, ns, "second"), EVENT_BOUND, "status.modelCache")
            assert report["entry"] == "org--b@main" and report["evicted"] == ["org--a@main"]
            assert _complete(kubelet.pods[second].port, "second")
