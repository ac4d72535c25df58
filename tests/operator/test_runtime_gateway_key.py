"""The per-service gateway checks the engines' API key for every runtime: run the real shoal-gateway exactly as the
operator renders it for a `runtime: vllm` service that scales from zero (its args, its env or key file with the Secret's
value filled in as the kubelet would) against the emulated API. An unauthenticated request is refused at once and wakes
nothing; an authenticated one is held and wakes the service (so the absence of a wake-up means something)."""

from __future__ import annotations

import sys

from kubekit import isvc_body, wait_for
from prockit import LoggedProcess, free_port, http

ISVC = "inferenceservices"
KEY = "sk-vllm-test"


def gateway_process(env, ns: str, name: str, key_file) -> LoggedProcess:
    dep = wait_for(lambda: env.client.get("deployments", ns, f"{name}-gateway"), 10, "the gateway deployment")
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    args = list(c["args"])
    port, metrics = free_port(), free_port()
    args[args.index("--port") + 1] = str(port)
    args[args.index("--metrics-port") + 1] = str(metrics)
    if "--api-key-file" in args:  # the key Secret mounted as a file (the kubelet writes it): here, a local file
        key_file.write_text(KEY + "\n")
        args[args.index("--api-key-file") + 1] = str(key_file)
    process_env = {}
    for var in c.get("env") or []:  # the kubelet resolves the Secret reference into the value
        ref = (var.get("valueFrom") or {}).get("secretKeyRef")
        process_env[var["name"]] = KEY if ref == {"name": "vllm-key", "key": "token"} else var.get("value", "")
    return LoggedProcess([sys.executable, "-m", "shoal.operator.gateway", *args, "--host", "127.0.0.1"], port,
                         log_prefix="vllm-gateway-", env=process_env)


def wake_patches(env, ns: str, name: str) -> int:
    return sum(1 for w in env.cluster.writes if w == ("patch", "configmaps", ns, f"{name}-wake"))


def test_a_vllm_services_gateway_refuses_unauthenticated_requests_and_wakes_nothing(env, ns, tmp_path):
    env.client.create(ISVC, ns, isvc_body("vl", {
        "runtime": "vllm", "replicas": 0, "model": {"uri": "hf://org/m"},
        "security": {"apiKeySecretRef": {"name": "vllm-key", "key": "token"}},
        "autoscaling": {"minReplicas": 0, "maxReplicas": 1}}))
    wait_for(lambda: env.client.get("configmaps", ns, "vl-wake"), 10, "the wake-up ConfigMap")
    gateway = gateway_process(env, ns, "vl", tmp_path / "api-key")
    try:
        gateway.wait_ready(30)
        body = b'{"model": "vl", "prompt": "hi", "max_tokens": 1}'
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            status, _, _ = http("POST", gateway.url + "/v1/completions", body=body,
                                headers={"Content-Type": "application/json", **headers}, timeout=5)
            assert status == 401
        assert wake_patches(env, ns, "vl") == 0
        # the right key: held for an engine (none comes here: the client gives up after 1 s), and the service woken
        http("POST", gateway.url + "/v1/completions", body=body, timeout=1,
             headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
        wait_for(lambda: wake_patches(env, ns, "vl") >= 1, 10, "the authenticated request to wake the service")
    finally:
        gateway.stop()
        env.client.delete(ISVC, ns, "vl")
