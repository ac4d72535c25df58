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
