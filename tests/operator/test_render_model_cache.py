"""What render/ makes of the model cache (spec.model.cache), OCI model images and the kernel cache, validated
against the Kubernetes schemas; status.modelCache from the download's termination message."""

from __future__ import annotations

import json

import kubernetes_validate
import pytest

from shoal.operator import api, render, status
from test_render import K8S_VERSION, SETTINGS, by_kind, container, flag, isvc


def _pod(spec: dict) -> dict:
    children = render.render(isvc(spec), SETTINGS)
    for obj in children:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    return by_kind(children)[("Deployment", "llm")]["spec"]["template"]["spec"]


def test_a_shared_cache_gets_a_capped_download_a_lease_sidecar_and_the_kernel_cache():
    pod = _pod({"model": {"uri": "hf://org/m", "revision": "v2", "cache": {"claimName": "models", "size": "200Gi"}},
                "replicas": 2})
    download, lease = pod["initContainers"]
    entry = "/cache/shoal/models/org--m@v2"
    assert flag(container({"spec": {"template": {"spec": pod}}})["args"], "--model") == entry
    assert "--revision" not in pod["containers"][0]["args"]  # the entry is that revision already
    assert download["args"][:7] == ["download", "--model", "org/m", "--revision", "v2", "--cache-dir",
                                    "/cache/shoal/models"]
    assert flag(download["args"], "--max-cache-bytes") == str(200 * 2**30)  # LRU eviction keeps the cache under size
    # a native sidecar: started before the engine, stopped after it, refreshing this pod's lease on the entry
    assert lease["name"] == render.LEASE_CONTAINER and lease["restartPolicy"] == "Always"
    assert lease["args"] == ["cache-lease", "--model", "org/m", "--revision", "v2", "--cache-dir",
                             "/cache/shoal/models"]
    engine = pod["containers"][0]
    env = {e["name"]: e.get("value") for e in engine["env"]}
    # the engine mounts the shared cache read-only; the kernels it builds (once per claim and CPU tier) and its
    # other caches go to a writable subPath of the same claim, outside the model entries
    assert {"name": "cache", "mountPath": "/cache", "readOnly": True} in engine["volumeMounts"]
    assert {"name": "cache", "mountPath": "/engine-cache", "subPath": "shoal/engine"} in engine["volumeMounts"]
    assert env["TORCH_EXTENSIONS_DIR"] == "/engine-cache/torch_extensions"
    assert env["XDG_CACHE_HOME"] == "/engine-cache" and env["SHOAL_CACHE"] == "/engine-cache/shoal"
    # the download and the lease write the cache: read-write, and their env points into /cache
    for helper in (download, lease):
        (mount,) = [m for m in helper["volumeMounts"] if m["name"] == "cache"]
        assert mount == {"name": "cache", "mountPath": "/cache"}
        assert {e["name"]: e.get("value") for e in helper["env"]}["SHOAL_CACHE"] == "/cache/shoal"


def test_a_pod_own_cache_has_no_lease_and_a_read_only_engine_mount():
    pod = _pod({"model": {"uri": "hf://org/m", "cache": {"size": "20Gi"}}})
    (download,) = pod["initContainers"]
    assert flag(download["args"], "--max-cache-bytes") == str(20 * 2**30)
    assert {"name": "cache", "mountPath": "/cache", "readOnly": True} in pod["containers"][0]["volumeMounts"]


def test_spec_env_still_wins_over_the_engine_cache_locations():
    pod = _pod({"model": {"uri": "hf://org/m"}, "env": [{"name": "XDG_CACHE_HOME", "value": "/tmp/mine"}]})
    env = pod["containers"][0]["env"]
    assert [e["value"] for e in env if e["name"] == "XDG_CACHE_HOME"] == ["/tmp/mine"]
    assert {e["name"]: e["value"] for e in env}["TORCH_EXTENSIONS_DIR"] == "/engine-cache/torch_extensions"


def test_an_oci_model_is_an_image_volume():
    pod = _pod({"model": {"uri": "oci://registry.example.com/models/smollm2:135m"}})
    assert "initContainers" not in pod  # nothing to download: the kubelet pulls the image
    (volume,) = [v for v in pod["volumes"] if v["name"] == "model"]
    assert volume == {"name": "model", "image": {"reference": "registry.example.com/models/smollm2:135m",
                                                 "pullPolicy": "IfNotPresent"}}
    c = pod["containers"][0]
    assert {"name": "model", "mountPath": "/models", "readOnly": True} in c["volumeMounts"]
    assert flag(c["args"], "--model") == "/models" and flag(c["args"], "--served-model-name") == "llm"


@pytest.mark.parametrize("ref", ["smollm2:135m", "registry.example.com/models/smollm2",
                                 "registry.example.com/Models/x:1", "registry.example.com//x:1"])
def test_a_malformed_oci_reference_is_refused_with_the_field(ref):
    with pytest.raises(api.SpecError) as e:
        render.render(isvc({"model": {"uri": f"oci://{ref}"}}), SETTINGS)
    assert e.value.field == "spec.model.uri" and "not a full OCI image reference" in str(e.value)


def test_status_model_cache_is_the_newest_download_report():
    def pod(name: str, finished: str, **summary) -> dict:
        message = json.dumps({"modelCache": {"entry": "org--m@main", "sizeBytes": 10, "verified": "hub", **summary}})
        return {"metadata": {"name": name}, "status": {"initContainerStatuses": [
            {"name": render.DOWNLOAD_CONTAINER, "state": {"terminated": {"exitCode": 0, "message": message,
                                                                          "finishedAt": finished}}}]}}

    pods = [pod("a", "2026-01-01T10:00:00Z", fetched=True), pod("b", "2026-01-01T10:05:00Z", fetched=False),
            {"metadata": {"name": "c"}, "status": {}}]
    assert status.model_cache_status(pods) == {"entry": "org--m@main", "sizeBytes": 10, "verified": "hub",
                                               "fetched": False, "pods": 2}
    api.ModelCacheStatus.model_validate(status.model_cache_status(pods))
    assert status.model_cache_status([pods[2]]) is None


def test_status_model_cache_lists_what_the_cache_holds_and_where():
    recent = [{"entry": f"org--m{i}@main", "sizeBytes": 10 + i, "leases": i % 2, "lastUsed": "2026-01-01T10:00:00Z"}
              for i in range(12)]
    message = json.dumps({"modelCache": {"entry": "org--m0@main", "sizeBytes": 10, "verified": "hub",
                                         "fetched": True, "evicted": ["org--gone@main"], "cache": {
                                             "entries": 12, "usedBytes": 186, "capBytes": 1000, "recent": recent}}})
    pod = {"metadata": {"name": "a"}, "status": {"initContainerStatuses": [{"name": render.DOWNLOAD_CONTAINER,
                                                                             "state": {"terminated": {
                                                                                 "exitCode": 0, "message": message}}}]}}
    spec = api.InferenceServiceSpec.model_validate({"model": {"uri": "hf://org/m0", "cache": {"claimName": "models"}}})
    found = status.model_cache_status([pod], render.cache_location("llm", spec))
    assert found["volume"] == "persistentVolumeClaim models, shared by every pod that mounts it"
    assert found["cachedEntries"] == 12 and found["usedBytes"] == 186 and found["capBytes"] == 1000
    assert found["evicted"] == ["org--gone@main"]
    assert found["cached"] == recent[:10]  # bounded, whatever the cache holds
    api.ModelCacheStatus.model_validate(found)
    own = api.InferenceServiceSpec.model_validate({"model": {"uri": "hf://org/m0"}})
    assert render.cache_location("llm", own) == "each pod's own emptyDir: the newest pod's is listed"


def test_a_model_that_does_not_fit_shows_the_download_reason():
    reason = ("model cache: org--big@main needs 30.00 GiB; the model cache (20.00 GiB) has 5.00 GiB free after "
              "evicting every unused entry; in use: org--m@main (15.00 GiB, leased by llm-abc)")
    pod = {"metadata": {"name": "llm-xyz"}, "status": {"phase": "Pending", "initContainerStatuses": [
        {"name": render.DOWNLOAD_CONTAINER, "restartCount": 3,
         "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 40s"}},
         "lastState": {"terminated": {"exitCode": 1, "reason": "Error", "message": reason}}}]}}
    found = status.pod_problem(pod)
    assert found[0] == "CrashLoopBackOff" and found[1].endswith(reason[:300])
