"""Autoscaling benchmark (not a test): a scripted load trace through a local fleet, and the figures issue 10 asks for.

    cd tests && python -m benches.bench_autoscale [--clients 6] [--target 2] [--max-replicas 4]

(run from tests/, so that the test kits there import as they do under pytest: kubekit, fleetkit, prockit)

The fleet is the end-to-end test's: kmock's emulated API, the real operator (kopf in a thread), a real
`shoal-gateway` process, and fleetkit's local kubelet running every engine pod as `shoal-engine serve` with a tiny
random model. The trace, with closed-loop streaming clients (each sends its next request when the last ends):

  A. from zero: one request; the gateway holds it and wakes the operator
  B. ramp: one more client every 2 s up to --clients, then steady for --steady s (40) (needs ceil(clients / target))
  C. down: a single client with long streams while the fleet shrinks; then nothing until the fleet is at zero

Figures:
  decision latency   first request -> replicas 0->1 (target < 1 s); ramp step -> first scale-up decision
  scale-from-zero    TTFT of the first request minus the time its replica took to get ready (target < 2 s)
  peak replicas      max replicas (status.autoscaling.desiredReplicas) over the run vs ceil(clients / target) (target <= 1.25x)
  streams cut        streams that ended early or with an error (target 0), over all phases
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import tempfile
import threading
import time
from pathlib import Path

import openai
from fleetkit import GatewayProcess, Kubelet, publish_gateway
from kubekit import Client, EmulatorServer, OperatorThread, isvc_body, write_kubeconfig

NS, NAME = "bench", "chat"


def autoscaled(isvc: dict) -> int:
    """The replica count the autoscaler set (status.autoscaling.desiredReplicas; spec.replicas is the manifest's)."""
    return ((isvc.get("status") or {}).get("autoscaling") or {}).get("desiredReplicas") or 0


class Recorder(threading.Thread):
    """Samples the autoscaler's replica count and the ready pods every 10 ms: (time, replicas, ready)."""

    def __init__(self, server: EmulatorServer, kubelet: Kubelet):
        super().__init__(daemon=True)
        self.server, self.kubelet = server, kubelet
        self.samples: list[tuple[float, int, int]] = []
        self.stop_flag = threading.Event()

    def run(self) -> None:
        while not self.stop_flag.is_set():
            obj = self.server.cluster.obj("inferenceservices", NS, NAME)
            if obj is not None:
                sample = (autoscaled(obj), len(self.kubelet.ready_pods()))
                if not self.samples or self.samples[-1][1:] != sample:
                    self.samples.append((time.monotonic(), *sample))
            self.stop_flag.wait(0.01)

    def first(self, after: float, pred) -> float | None:
        return next((t for t, r, ready in self.samples if t >= after and pred(r, ready)), None)


class Clients:
    """Closed-loop streaming clients; every stream is checked for completeness."""

    def __init__(self, base: str, max_tokens: int):
        self.client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=180)
        self.max_tokens = max_tokens
        self.threads: list[tuple[threading.Thread, threading.Event]] = []
        self.results: list[dict] = []
        self.lock = threading.Lock()

    def one(self, max_tokens: int | None = None) -> dict:
        max_tokens = max_tokens or self.max_tokens
        start, first, tokens, finish, error = time.monotonic(), None, 0, None, None
        try:
            stream = self.client.completions.create(model="tiny", prompt="hello " * 8, max_tokens=max_tokens,
                                                    stream=True, extra_body={"ignore_eos": True})
            for chunk in stream:
                if chunk.choices:
                    if chunk.choices[0].text:
                        first = first or time.monotonic()
                        tokens += 1
                    finish = chunk.choices[0].finish_reason or finish
        except Exception as e:  # noqa: BLE001 - counted
            error = repr(e)
        result = {"start": start, "first": first, "end": time.monotonic(), "finish": finish, "error": error,
                  "cut": error is not None or finish != "length"}
        with self.lock:
            self.results.append(result)
        return result

    def add(self, max_tokens: int | None = None) -> None:
        stop = threading.Event()

        def loop():
            while not stop.is_set():
                self.one(max_tokens)

        t = threading.Thread(target=loop, daemon=True)
        t.start()
        self.threads.append((t, stop))

    def stop_all(self) -> None:
        for _t, stop in self.threads:
            stop.set()
        for t, _stop in self.threads:
            t.join(120)
        self.threads.clear()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, default=6)
    ap.add_argument("--target", type=int, default=2, help="targetInFlightPerReplica")
    ap.add_argument("--max-replicas", type=int, default=4)
    ap.add_argument("--steady", type=float, default=40.0, help="seconds of steady load after the ramp")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    from shoal.engine.tools.tiny_model import make_model

    model = make_model(tempfile.mkdtemp(prefix="bench-autoscale-"), arch="llama")
    server = EmulatorServer()
    os.environ["KUBECONFIG"] = write_kubeconfig(Path(tempfile.mkdtemp()) / "config", server.url)
    operator = OperatorThread()
    client = Client(server.url)
    client.create("inferenceservices", NS, isvc_body(NAME, {
        "replicas": 0, "model": {"uri": f"file://{model}", "servedName": "tiny"},
        "engine": {"attentionBackend": "sdpa", "maxNumSeqs": 8, "shutdownTimeoutSeconds": 30},
        "autoscaling": {"minReplicas": 0, "maxReplicas": args.max_replicas,
                        "targetInFlightPerReplica": args.target, "scaleUpStabilizationSeconds": 2,
                        "scaleDownStabilizationSeconds": 10, "scaleToZeroAfterSeconds": 10}}))
    while client.get("deployments", NS, NAME) is None:
        time.sleep(0.05)
    kubelet = Kubelet(Client(server.url), server.cluster, NS, engine_service=f"{NAME}-engines")
    gateway = None
    try:
        with kubelet:
            gateway = GatewayProcess(NS, NAME, service=f"{NAME}-engines", hold_timeout=180)
            publish_gateway(client, NS, NAME, gateway.port)
            rec = Recorder(server, kubelet)
            rec.start()
            clients = Clients(gateway.base, max_tokens=32)

            # A. scale from zero
            first = clients.one()
            t0 = first["start"]
            decided = rec.first(t0, lambda r, ready: r >= 1)
            ready_at = rec.first(t0, lambda r, ready: ready >= 1)
            print(f"A. from zero: decision {decided - t0:.3f} s after the first request; replica ready after "
                  f"{ready_at - t0:.1f} s; TTFT {first['first'] - t0:.1f} s = ready + "
                  f"{first['first'] - ready_at:.2f} s")

            # B. ramp
            ramp_start = time.monotonic()
            for _ in range(args.clients):
                clients.add()
                time.sleep(2.0)
            steady_from = time.monotonic()
            time.sleep(args.steady)
            needed = math.ceil(args.clients / args.target)
            up = rec.first(ramp_start, lambda r, ready: r >= 2)
            print(f"B. ramp to {args.clients} clients: first scale-up decision {up - ramp_start:.2f} s after the "
                  f"ramp began" if up else "B. no scale-up")
            clients.stop_all()

            # C. down: one long-streaming client while the fleet shrinks, then idle to zero
            down_start = time.monotonic()
            clients.add(max_tokens=160)
            try:
                while time.monotonic() - down_start < 120:
                    obj = server.cluster.obj("inferenceservices", NS, NAME)
                    if autoscaled(obj) <= 1 and len(kubelet.pods) <= 1:
                        break
                    time.sleep(0.2)
                time.sleep(3.0)
            finally:
                clients.stop_all()
            zero = None
            while time.monotonic() - down_start < 180:
                if autoscaled(server.cluster.obj("inferenceservices", NS, NAME)) == 0 and not kubelet.pods:
                    zero = time.monotonic()
                    break
                time.sleep(0.2)
            rec.stop_flag.set()
            rec.join()

            peak = max(r for _t, r, _ready in rec.samples)
            cut = [r for r in clients.results if r["cut"]]
            during_down = [r for r in clients.results if r["end"] >= down_start]
            print(f"   peak replicas {peak} for {needed} needed ({peak / needed:.2f}x); "
                  f"ready replicas while steady: "
                  f"{sorted({ready for t, _r, ready in rec.samples if steady_from <= t < down_start})}")
            print(f"C. scale-down: {len(during_down)} streams ran during it, "
                  f"{sum(1 for r in during_down if r['cut'])} cut; fleet at zero "
                  f"{(zero - down_start):.1f} s after the load dropped" if zero else "C. not at zero in time")
            print(f"streams: {len(clients.results)} in total, {len(cut)} cut or failed")
            for r in cut[:5]:
                print("   cut:", r)
            print("replica timeline (s since the first request: replicas / ready):")
            print("   " + ", ".join(f"{t - t0:.1f}:{r}/{ready}" for t, r, ready in rec.samples))
            with open("/proc/loadavg") as f:
                print("load average:", f.read().strip())
    finally:
        if gateway is not None:
            gateway.close()
        operator.stop()
        server.close()


if __name__ == "__main__":
    main()
