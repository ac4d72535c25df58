"""Scale from zero to the first token on the local fleet, each with its breakdown (a benchmark, not a test):

    cd tests && python -m benches.bench_cold_start_fleet

(run from tests/, as bench_autoscale: the kits there import as under pytest). The fleet is the end-to-end tests':
kmock's emulated API, the real operator (kopf in a thread), a real `shoal-gateway` process per service and
fleetkit's local kubelet running each pod's init containers and its engine as real processes. Every figure is timed
from the client's first request (a real `openai` client, streaming, through the gateway) to its first token.

  fetch   spec.model.cache on a claim, replicas 0, the model not cached yet: the request wakes the operator, the
          pod's `shoal-podtools download` fetches the model from a local stand-in for the hub (hubkit), the engine
          starts from the cache entry
  cache   a second service on the same claim and model: the download container finds the entry (no byte fetched)
  file    the demo GGUF from zero, passed as the e2e tests pass a model (model.uri file://...): no cache involved
  sleep1  scaleToZero: sleep at sleepLevel 1: the replica parked asleep (KV cache freed); the gateway wakes it
  sleep2  the same at level 2 (the weights freed too, read again on wake-up)

Breakdown of a start from zero: decision (request -> the autoscaler's desiredReplicas 1), pod (-> the pod's first
container started: the Deployment scaled, the kubelet saw it), download (the model-download init container's run;
a check of the entry for `cache`), then the engine's own /startupz phases (process, imports, config, tokenizer,
weights, kernel_build, kv_cache, other...) inside engine (its spawn -> the kubelet's probe seeing it ready), and
first (-> the first token: the gateway's endpoint list, the held request's prefill, and any lazy first-use work,
such as a JIT kernel build not cached yet, which /startupz then lists as kernel_build). Of a wake-up: wake
(request -> /is_sleeping false: the gateway's POST /wake_up), first (-> the first token).

Every scenario serves the real SmolLM2-135M-Instruct Q4_1 GGUF (`find_demo_model()`): fetch and cache as a
llama.cpp repository on the stand-in hub (a folder holding the one GGUF file, which the model cache stores and the
engine serves), file by file://. When it is absent, a tiny random llama folder stands in, with a warning. Greedy
answers are compared within each model.
Other engineers' jobs may share this machine: read the load printed with the figures.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
import time
from pathlib import Path

import openai
from fleetkit import GatewayProcess, Kubelet, publish_gateway
from hubkit import FakeHub
from kubekit import Client, EmulatorServer, OperatorThread, isvc_body, wait_for, write_kubeconfig
from prockit import http

NS = "bench"
PROMPT = "Once upon a time there was a little shoal of fish"
DOWNLOAD = "model-download"  # the init container (shoal.operator.render.DOWNLOAD_CONTAINER)
# the engine's start-up phases in /startupz order, as printed (shoal.engine.startup.PHASES and `other`)
ENGINE_PHASES = ("process", "imports", "config", "tokenizer", "weights", "kernel_build", "kv_cache", "warmup",
                 "graph_capture", "other")
SCENARIOS = {  # name -> (the model group whose answers must agree, how it starts): one model serves them all
    "fetch": ("model", "zero"), "cache": ("model", "zero"), "file": ("model", "zero"),
    "sleep1": ("model", "sleep"), "sleep2": ("model", "sleep"),
}


def autoscaled(isvc: dict | None) -> int:
    return (((isvc or {}).get("status") or {}).get("autoscaling") or {}).get("desiredReplicas") or 0


def first_true(pred, stop: threading.Event) -> list[float]:
    """Polls pred every 10 ms in a thread; the returned list gets the first time it held."""
    out: list[float] = []

    def run():
        while not stop.is_set():
            try:
                if pred():
                    out.append(time.monotonic())
                    return
            except Exception:  # noqa: BLE001 - not yet answering: poll again
                pass
            time.sleep(0.01)

    threading.Thread(target=run, daemon=True).start()
    return out


def zero_breakdown(t0: float, decided: float, events: list[tuple[float, str]], startup: dict[str, float],
                   first: float) -> dict:
    """A start from zero, in seconds per part (pure: the bench's figures from its marks). events: the pod's
    (time, what) from the kubelet; startup: the engine's /startupz phases, shown inside `engine` (the wall time from
    its spawn to the kubelet's probe seeing it ready), not added to the parts."""
    at = {what: t for t, what in events}
    spawned, ready = at["started"], at["ready"]
    init_start = at.get(f"init {DOWNLOAD} started", spawned)
    init_end = next((t for what, t in at.items() if what.startswith(f"init {DOWNLOAD} exited")), init_start)
    # pod: the Deployment scaled and the kubelet's set-up, before and after the init container
    return {"decision": decided - t0, "pod": init_start - decided + spawned - init_end,
            "download": init_end - init_start,
            "engine": ready - spawned, "phases": {p: startup[p] for p in ENGINE_PHASES if startup.get(p)},
            "first": first - ready, "total": first - t0}


def wake_breakdown(t0: float, woke: float, first: float) -> dict[str, float]:
    return {"wake": woke - t0, "first": first - woke, "total": first - t0}


def line(name: str, r: dict, note: str = "") -> str:
    def fmt(v) -> str:
        return f"{v:.2f}s" if isinstance(v, float) else "(" + ", ".join(f"{k} {x:.2f}s" for k, x in v.items()) + ")"

    parts = ", ".join(f"{k} {fmt(v)}" if k != "phases" else fmt(v) for k, v in r.items() if k != "total")
    return (f"{name:<7} total {r['total']:6.2f}s to the first token = {parts}".replace(", (", " (")
            + (f"  [{note}]" if note else ""))


def answers_match(answers: dict[str, str]) -> dict[str, bool]:
    """Per model group: whether every scenario of that group got the same greedy answer."""
    groups: dict[str, set[str]] = {}
    for name, text in answers.items():
        groups.setdefault(SCENARIOS[name.split(":")[0]][0], set()).add(text)
    return {group: len(texts) == 1 for group, texts in groups.items()}


def stream(base: str, served: str) -> tuple[float, str]:
    """(the time of the first streamed token, the whole greedy answer) of one completion through the gateway."""
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=600)
    first, text = None, ""
    for chunk in client.completions.create(model=served, prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True}):
        if chunk.choices and chunk.choices[0].text:
            first = first or time.monotonic()
            text += chunk.choices[0].text
    assert first is not None, "no token streamed"
    return first, text


class Fleet:
    def __init__(self, server: EmulatorServer, client: Client, kubelet: Kubelet):
        self.server, self.client, self.kubelet = server, client, kubelet

    def pod_of(self, name: str):
        return next(p for n, p in self.kubelet.pods.items() if n.startswith(f"{name}-"))

    def gateway(self, name: str, *extra: str) -> GatewayProcess:
        gateway = GatewayProcess(NS, name, service=f"{name}-engines", hold_timeout=600, extra=extra)
        publish_gateway(self.client, NS, name, gateway.port)
        return gateway

    def remove(self, name: str) -> None:
        self.client.delete("inferenceservices", NS, name)
        wait_for(lambda: not any(n.startswith(f"{name}-") for n in self.kubelet.pods), 120, f"{name}'s pods gone")

    def from_zero(self, name: str, model: dict) -> tuple[dict, str]:
        self.client.create("inferenceservices", NS, isvc_body(name, {
            "replicas": 0, "model": {**model, "servedName": name},
            "engine": {"attentionBackend": "sdpa", "maxNumSeqs": 4, "shutdownTimeoutSeconds": 20},
            "autoscaling": {"minReplicas": 0, "maxReplicas": 1, "scaleToZeroAfterSeconds": 600}}))
        wait_for(lambda: self.client.get("deployments", NS, name), 30, f"{name}'s deployment")
        gateway = self.gateway(name)
        stop = threading.Event()
        try:
            decided = first_true(lambda: autoscaled(self.server.cluster.obj("inferenceservices", NS, name)) >= 1,
                                 stop)
            t0 = time.monotonic()
            first, text = stream(gateway.base, name)
            pod = self.pod_of(name)
            status, body, _ = http("GET", f"http://127.0.0.1:{pod.port}/startupz")
            assert status == 200, body
            startup = json.loads(body)["startup"]
            events = [(t, what) for t, p, what in self.kubelet.events if p == pod.name]
            return zero_breakdown(t0, decided[0], events, startup, first), text
        finally:
            stop.set()
            gateway.close()
            self.remove(name)

    def from_sleep(self, name: str, model: dict, level: int) -> tuple[dict, str, str, str]:
        self.client.create("inferenceservices", NS, isvc_body(name, {
            "replicas": 1, "model": {**model, "servedName": name},
            "engine": {"attentionBackend": "sdpa", "maxNumSeqs": 4, "shutdownTimeoutSeconds": 20,
                       "enableSleepMode": True},
            "autoscaling": {"minReplicas": 0, "maxReplicas": 1, "scaleUpStabilizationSeconds": 1,
                            "scaleDownStabilizationSeconds": 2, "scaleToZeroAfterSeconds": 3,
                            "scaleToZero": "sleep", "sleepLevel": level}}))
        wait_for(lambda: self.client.get("deployments", NS, name), 30, f"{name}'s deployment")
        gateway = self.gateway(name, "--wake-engines")
        stop = threading.Event()
        try:
            wait_for(lambda: any(n.startswith(f"{name}-") for n in self.kubelet.ready_pods()), 600,
                     f"{name}'s replica ready")
            pod = self.pod_of(name)
            _, before = stream(gateway.base, name)

            def sleeping() -> dict:
                return json.loads(http("GET", f"http://127.0.0.1:{pod.port}/is_sleeping")[1])

            wait_for(lambda: sleeping()["is_sleeping"], 120, f"{name} parked asleep")
            wait_for(lambda: pod.name not in self.kubelet.ready_pods(), 30, f"{name}'s parked pod not Ready")
            asleep = sleeping()
            woke = first_true(lambda: not sleeping()["is_sleeping"], stop)
            t0 = time.monotonic()
            first, text = stream(gateway.base, name)
            assert pod.proc.poll() is None and self.pod_of(name) is pod, "woken by a new pod, not a wake-up"
            note = (f"asleep at level {asleep['level']}: kv {asleep['kv_cache_bytes'] / 2**20:.0f} MiB, weights "
                    f"{asleep['weight_bytes'] / 2**20:.0f} MiB resident")
            return wake_breakdown(t0, woke[0], first), text, before, note
        finally:
            stop.set()
            gateway.close()
            self.remove(name)


def main() -> int:
    logging.basicConfig(level=logging.WARNING)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from shoal.engine.tools.demo_model import MODEL_LABEL, find_demo_model
    from shoal.engine.tools.tiny_model import make_model

    tiny = Path(make_model(tempfile.mkdtemp(prefix="bench-fleet-tiny-"), arch="llama"))
    gguf = find_demo_model()
    if gguf is None or not Path(gguf).exists():
        print(f"WARNING: {MODEL_LABEL} is not on this machine: every scenario serves a tiny random model")
        real, published = {"uri": f"file://{tiny}"}, tiny
    else:
        print(f"model: {MODEL_LABEL} at {gguf} (fetch and cache: published on the stand-in hub as a llama.cpp "
              "repository holding that one file)")
        real, published = {"uri": f"file://{gguf}"}, Path(tempfile.mkdtemp(prefix="bench-fleet-repo-"))
        (published / Path(gguf).name).symlink_to(gguf)
    print(f"load before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}, {os.cpu_count()} CPUs", flush=True)
    server = EmulatorServer()
    os.environ["KUBECONFIG"] = write_kubeconfig(Path(tempfile.mkdtemp()) / "config", server.url)
    operator = OperatorThread()
    client = Client(server.url)
    claim = tempfile.mkdtemp(prefix="bench-fleet-claim-")  # the ReadWriteMany volume fetch and cache share
    results: dict[str, tuple[dict, str]] = {}
    answers: dict[str, str] = {}
    try:
        with FakeHub() as hub:
            hub.publish("org/model", published)
            env = {"HF_ENDPOINT": hub.url}
            if os.environ.get("TORCH_EXTENSIONS_DIR"):  # a kernel cache the pods share, as a node's
                env["TORCH_EXTENSIONS_DIR"] = os.environ["TORCH_EXTENSIONS_DIR"]
            kubelet = Kubelet(Client(server.url), server.cluster, NS, engine_service=None, env=env,
                              claims={"models": claim})
            with kubelet:
                fleet = Fleet(server, client, kubelet)
                cached = {"uri": "hf://org/model", "cache": {"claimName": "models"}}
                for name in ("fetch", "cache", "file"):
                    r, answers[name] = fleet.from_zero(name, real if name == "file" else cached)
                    downloads = hub.file_downloads("org/model")
                    results[name] = (r, f"hub file downloads so far: {downloads}" if name != "file" else "")
                    print(line(name, *results[name]), flush=True)
                for level in (1, 2):
                    name = f"sleep{level}"
                    r, answers[name], answers[f"{name}:before"], note = fleet.from_sleep(name, real, level)
                    results[name] = (r, note)
                    print(line(name, r, note), flush=True)
                assert kubelet.error is None, kubelet.error
    finally:
        operator.stop()
        server.close()
    print(f"load after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print("summary:")
    for name, (r, note) in results.items():
        print("  " + line(name, r, note))
    match = answers_match(answers)
    print("greedy answers identical across scenarios (and before each sleep), per model: "
          + ", ".join(f"{g} {ok}" for g, ok in match.items()))
    return 0 if all(match.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
