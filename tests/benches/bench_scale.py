"""Scale benchmark (not a test): N InferenceServices against the emulated API, time until all are reconciled.

    cd tests && python -m benches.bench_scale            # N = 50 and 200
    cd tests && python -m benches.bench_scale 500

(run from tests/, so that the test kits there import as they do under pytest: kubekit, prockit)

For each N, a fresh emulator (conftest.Cluster) and a fresh operator (kopf in its own thread). Three figures:
  children+status  all N have their Deployment, gateway Service, NetworkPolicy and PDB, and a status with
                   observedGeneration (Ready=False: no pod is ready yet);
  ready            after the test marks every Deployment ready (as the deployment controller would), all N
                   report Ready=True with readyReplicas=2;
  requests         API requests the operator made in total (kopf's and the reconciler's), per InferenceService.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from kubekit import Client, EmulatorServer, OperatorThread, condition, isvc_body, wait_for, write_kubeconfig

from shoal.operator import render

CHILDREN = {"deployments": "Deployment", "services": "Service", "networkpolicies": "NetworkPolicy",
            "poddisruptionbudgets": "PodDisruptionBudget"}


def children_per_isvc(spec: dict) -> dict[str, int]:
    """How many objects of each kind in CHILDREN one InferenceService renders to (the gateway's included)."""
    body = isvc_body("x", spec) | {"metadata": {"name": "x", "namespace": "bench"}}
    kinds = Counter(c["kind"] for c in render.render(body))
    return {plural: kinds[kind] for plural, kind in CHILDREN.items()}


def run(n: int) -> dict[str, float]:
    server = EmulatorServer()
    os.environ["KUBECONFIG"] = write_kubeconfig(Path(tempfile.mkdtemp()) / "config", server.url)
    operator = OperatorThread()
    cluster = server.cluster
    client = Client(server.url)
    ns = "bench"
    per_isvc = children_per_isvc({"replicas": 2})
    try:
        before = len(cluster._requests)
        t0 = time.monotonic()
        for i in range(n):
            client.create("inferenceservices", ns, isvc_body(f"svc-{i:04d}", {"replicas": 2}))
        t_submit = time.monotonic() - t0

        def all_reconciled() -> bool:
            if any(len(cluster.find(p, ns)) < n * per_isvc[p] for p in CHILDREN):
                return False
            return sum(1 for o in cluster.find("inferenceservices", ns)
                       if (o.get("status") or {}).get("observedGeneration")) == n
        wait_for(all_reconciled, 300, "every InferenceService reconciled")
        t_children = time.monotonic() - t0

        t1 = time.monotonic()
        for i in range(n):
            client.patch("deployments", ns, f"svc-{i:04d}", {"status": {
                "observedGeneration": 1, "replicas": 2, "readyReplicas": 2, "updatedReplicas": 2}}, sub="status")

        def all_ready() -> bool:
            return sum(1 for o in cluster.find("inferenceservices", ns)
                       if (condition(o, "Ready") or {}).get("status") == "True") == n
        wait_for(all_ready, 300, "every InferenceService Ready")
        t_ready = time.monotonic() - t1
        operator_requests = sum(1 for r in cluster._requests[before:]
                                if not r.headers.get("X-Test-Client"))
        dup = [p for p in CHILDREN if len(cluster.find(p, ns)) != n * per_isvc[p]]
        return {"n": n, "submit_s": t_submit, "children_and_status_s": t_children, "ready_s": t_ready,
                "requests_per_isvc": operator_requests / n, "duplicates": len(dup)}
    finally:
        operator.stop()
        client.http.close()
        server.close()


def main(argv: list[str]) -> None:
    logging.basicConfig(level=logging.WARNING)
    sizes = [int(a) for a in argv] or [50, 200]
    print(f"{'N':>5} {'submit':>8} {'children+status':>16} {'ready after deps':>17} {'API req/isvc':>13}")
    for n in sizes:
        r = run(n)
        print(f"{r['n']:>5} {r['submit_s']:>7.2f}s {r['children_and_status_s']:>15.2f}s {r['ready_s']:>16.2f}s "
              f"{r['requests_per_isvc']:>13.1f}" + ("" if not r["duplicates"] else "  DUPLICATES!"))


if __name__ == "__main__":
    main(sys.argv[1:])
