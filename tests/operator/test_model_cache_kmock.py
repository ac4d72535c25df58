"""Bad model cache input against the emulated API and the real operator: a cache larger than the existing claim it
lives on is refused with the field named, and nothing is applied until it is fixed."""

from __future__ import annotations

from kubekit import condition, isvc_body, wait_for
from prockit import EVENT_BOUND
from test_operator_kmock import children, get_isvc, ready_is, settled

ISVC = "inferenceservices"


def test_a_cache_larger_than_its_claim_is_refused_and_nothing_is_applied(env, ns):
    env.client.create("persistentvolumeclaims", ns, {
        "apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "models"},
        "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "100Gi"}}},
        "status": {"phase": "Bound", "capacity": {"storage": "100Gi"}}})
    env.client.create(ISVC, ns, isvc_body("big", {"model": {
        "uri": "hf://org/m", "cache": {"claimName": "models", "size": "200Gi"}}}))
    cond = ready_is(env, ns, "big", "False", "InvalidSpec")
    assert cond["message"] == ("spec.model.cache.size: 200Gi is larger than the claim models (100Gi): the cache "
                               "would fill the volume before evicting")
    settled(env, ns, "big")
    assert set(children(env, ns)) == {("persistentvolumeclaims", "models")}  # the user's claim only
    env.client.patch(ISVC, ns, "big", {"spec": {"model": {"cache": {"size": "90Gi"}}}})
    wait_for(lambda: env.client.get("deployments", ns, "big"), EVENT_BOUND, "children once the size fits")
    wait_for(lambda: condition(get_isvc(env, ns, "big"), "Ready")["reason"] != "InvalidSpec", EVENT_BOUND,
             "InvalidSpec cleared")


def _pod_of(env, ns: str, deployment: str, name: str) -> dict:
    """A pod as the Deployment's ReplicaSet makes it, from the rendered template."""
    dep = wait_for(lambda: env.client.get("deployments", ns, deployment), EVENT_BOUND, "deployment")
    template = dep["spec"]["template"]
    return env.client.create("pods", ns, {"apiVersion": "v1", "kind": "Pod", "metadata": {
        "name": name, "labels": template["metadata"]["labels"],
        "ownerReferences": [{"apiVersion": "apps/v1", "kind": "Deployment", "name": deployment, "controller": True,
                             "uid": dep["metadata"]["uid"]}]}, "spec": template["spec"]})


def test_an_oci_model_that_does_not_resolve_is_a_clear_condition(env, ns):
    ref = "registry.example.com/models/missing:1"
    env.client.create(ISVC, ns, isvc_body("oci", {"model": {"uri": f"oci://{ref}"}}))
    # what the kubelet reports when the image volume cannot be pulled: the pull failure on the container
    # mounting it, the volume's reference in the message
    engine_image = _pod_of(env, ns, "oci", "oci-abc")["spec"]["containers"][0]["image"]
    pulled = (f'Failed to pull image "{ref}": rpc error: code = NotFound desc = failed to pull and unpack image '
              f'"{ref}": not found')
    env.client.patch("pods", ns, "oci-abc", {"status": {"phase": "Pending", "containerStatuses": [{
        "name": "engine", "ready": False, "restartCount": 0, "image": engine_image,
        "state": {"waiting": {"reason": "ErrImagePull", "message": pulled}}}]}}, sub="status")
    cond = ready_is(env, ns, "oci", "False", "ModelImagePullBackOff")
    assert f"oci://{ref} (spec.model.uri)" in cond["message"] and "not found" in cond["message"]
    assert get_isvc(env, ns, "oci")["status"]["phase"] == "Failed"
    # the kubelet's back-off that follows keeps the same reason
    env.client.patch("pods", ns, "oci-abc", {"status": {"containerStatuses": [{
        "name": "engine", "ready": False, "restartCount": 0, "state": {"waiting": {
            "reason": "ImagePullBackOff", "message": f'Back-off pulling image "{ref}": ErrImagePull: not found'}}}]}},
        sub="status")
    cond = wait_for(lambda: (c := condition(get_isvc(env, ns, "oci"), "Ready")) and "Back-off" in c["message"] and c,
                    EVENT_BOUND, "the back-off in the condition")
    assert cond["reason"] == "ModelImagePullBackOff" and f"oci://{ref}" in cond["message"]


def test_an_oci_model_pull_failure_only_in_the_pod_events_is_a_clear_condition(env, ns):
    ref = "registry.example.com/models/private:2"
    env.client.create(ISVC, ns, isvc_body("old", {"model": {"uri": f"oci://{ref}"}}))
    pod = _pod_of(env, ns, "old", "old-abc")
    # Kubernetes 1.31's kubelet: the pod stays ContainerCreating, the failed pull is told in its Events only
    said = f'Failed to pull image "{ref}": rpc error: code = Unknown desc = 401 Unauthorized'
    env.client.create("events", ns, {"apiVersion": "v1", "kind": "Event", "metadata": {"name": "old-abc.1"},
                                     "type": "Warning", "reason": "Failed", "message": said,
                                     "lastTimestamp": "2026-01-01T00:00:00Z",
                                     "involvedObject": {"kind": "Pod", "name": "old-abc", "namespace": ns,
                                                        "uid": pod["metadata"]["uid"]}})
    env.client.patch("pods", ns, "old-abc", {"status": {"phase": "Pending", "containerStatuses": [{
        "name": "engine", "ready": False, "restartCount": 0,
        "state": {"waiting": {"reason": "ContainerCreating"}}}]}}, sub="status")
    cond = ready_is(env, ns, "old", "False", "ModelImagePullBackOff", timeout=15)
    assert f"oci://{ref} (spec.model.uri): Failed: {said}" in cond["message"]
    assert get_isvc(env, ns, "old")["status"]["phase"] == "Failed"
