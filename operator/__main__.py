"""`shoal-operator` / `python -m shoal.operator`: `kopf run` with the package's handlers.

Every flag of `kopf run` is accepted and passed through (--standalone, -n/--namespace, -A/--all-namespaces,
-L/--liveness, -v/--verbose, -d/--debug, -q/--quiet, --log-format plain|full|json, --dev, -P/--peering, ...).
Shoal's own flags (each also settable by its environment variable):

  --engine-image IMAGE        default engine image for specs without spec.image   (SHOAL_ENGINE_IMAGE)
  --gateway-image IMAGE       shoal-gateway image (default: the operator image)   (SHOAL_GATEWAY_IMAGE)
  --fleet-image IMAGE         the engine pods' helper containers, shoal-podtools   (SHOAL_FLEET_IMAGE)
                              (model download, adapter sync; default: the operator image)
  --max-gpus-per-node N       GPUs one node offers; caps the default gpusPerPod   (SHOAL_MAX_GPUS_PER_NODE)
  --cluster-domain DOMAIN     for the status URL and rank-0 addresses             (SHOAL_CLUSTER_DOMAIN)
  --operator-namespace NS     namespace allowed to scrape engine metrics          (SHOAL_OPERATOR_NAMESPACE,
                                                                                   else POD_NAMESPACE)
  --metrics-namespace NS      Prometheus' namespace, admitted to /metrics by every (SHOAL_METRICS_NAMESPACES,
                              NetworkPolicy; repeatable                             comma-separated)
  --peering-priority auto     with kopf's --peering: a random priority of its own for this process, so that of
                              several replicas exactly one (the highest) reconciles and the others stand by
                              (kopf pauses every operator when two share a priority)
  --metrics-port PORT         serve the autoscaler's shoal:autoscaler_* metrics    (SHOAL_METRICS_PORT)
  --max-concurrent-upgrades N services moved to a new --engine-image at once; each (SHOAL_MAX_CONCURRENT_UPGRADES,
                              runs the image pinned in its status until then; 0:   default 1)
                              only on the annotation serving.shoal.dev/upgrade-engine-image
  --max-concurrent-scrapes N  the autoscaler's /metrics scrapes in flight at once,  (SHOAL_MAX_CONCURRENT_SCRAPES,
                              all InferenceServices together                        default 32)
  --peering-lifetime SECONDS  with --peering: how long a replica that died keeps   (SHOAL_PEERING_LIFETIME,
                              leading before a standby takes over (kopf's peer      default 60)
                              lifetime; a clean exit hands over at once)
  --rbac-scope SCOPE          cluster (default): kopf follows CRDs and namespaces  (SHOAL_RBAC_SCOPE)
                              as they appear (a ClusterRole); namespace: the
                              operator holds Roles in its -n namespaces only and
                              never asks for cluster-scoped objects (kopf's scans
                              off; CRDs installed later need a restart)
  --shared-gateway NS/SA      the shared gateway's namespace and ServiceAccount:   (SHOAL_SHARED_GATEWAY)
                              every engine NetworkPolicy admits its pods (label
                              app.kubernetes.io/component=shared-gateway), and it may wake services at zero
  --shared-gateway-routing R  the shared gateway's --routing; precise-prefix:      (SHOAL_SHARED_GATEWAY_ROUTING)
                              every service's engines publish KV events, which
                              the NetworkPolicy lets the shared gateway read
Credentials: in-cluster service account when running in a pod, else KUBECONFIG / ~/.kube/config.
Typical in-cluster command: shoal-operator --standalone -A --liveness=http://0.0.0.0:8080/healthz
"""

from __future__ import annotations

import argparse
import os
import re
import secrets
import sys

OWN_FLAGS = {
    "--engine-image": "SHOAL_ENGINE_IMAGE",
    "--gateway-image": "SHOAL_GATEWAY_IMAGE",
    "--fleet-image": "SHOAL_FLEET_IMAGE",
    "--max-gpus-per-node": "SHOAL_MAX_GPUS_PER_NODE",
    "--cluster-domain": "SHOAL_CLUSTER_DOMAIN",
    "--operator-namespace": "SHOAL_OPERATOR_NAMESPACE",
    "--metrics-port": "SHOAL_METRICS_PORT",
    "--max-concurrent-upgrades": "SHOAL_MAX_CONCURRENT_UPGRADES",
    "--max-concurrent-scrapes": "SHOAL_MAX_CONCURRENT_SCRAPES",
    "--peering-lifetime": "SHOAL_PEERING_LIFETIME",
    "--shared-gateway": "SHOAL_SHARED_GATEWAY",
    "--shared-gateway-routing": "SHOAL_SHARED_GATEWAY_ROUTING",
    "--rbac-scope": "SHOAL_RBAC_SCOPE",
}
# shoal-gateway --routing's choices (operator/gateway/routing.py ROUTINGS; not imported: this module stays light)
SHARED_GATEWAY_ROUTINGS = ("prefix-load", "precise-prefix", "least-load", "round-robin")
REPEATABLE = {"--metrics-namespace": "SHOAL_METRICS_NAMESPACES"}


def parse(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    """Split shoal's own flags (returned as env vars) from the rest (kopf run's)."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)  # --peering is kopf's, not ours
    for flag in OWN_FLAGS:
        parser.add_argument(flag)
    for flag in REPEATABLE:
        parser.add_argument(flag, action="append")
    known, rest = parser.parse_known_args(argv)
    env = {OWN_FLAGS[f]: str(v) for f in OWN_FLAGS if (v := getattr(known, f[2:].replace("-", "_"))) is not None}
    env |= {REPEATABLE[f]: ",".join(v) for f in REPEATABLE if (v := getattr(known, f[2:].replace("-", "_")))}
    if "SHOAL_METRICS_PORT" in env and not (env["SHOAL_METRICS_PORT"].isdigit()
                                             and 0 < int(env["SHOAL_METRICS_PORT"]) < 65536):
        raise SystemExit(f"--metrics-port must be a port number, got {env['SHOAL_METRICS_PORT']!r}")
    if "SHOAL_MAX_CONCURRENT_UPGRADES" in env and not env["SHOAL_MAX_CONCURRENT_UPGRADES"].isdigit():
        raise SystemExit(f"--max-concurrent-upgrades must be a whole number >= 0, got "
                         f"{env['SHOAL_MAX_CONCURRENT_UPGRADES']!r}")
    for flag, low in (("--max-concurrent-scrapes", 1), ("--peering-lifetime", 2)):
        value = env.get(OWN_FLAGS[flag])
        if value is not None and not (value.isdigit() and int(value) >= low):
            raise SystemExit(f"{flag} must be a whole number >= {low}, got {value!r}")
    if "SHOAL_SHARED_GATEWAY" in env and not re.match(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?/[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
                                                        env["SHOAL_SHARED_GATEWAY"]):
        raise SystemExit(f"--shared-gateway takes NAMESPACE/SERVICEACCOUNT, got {env['SHOAL_SHARED_GATEWAY']!r}")
    if env.get("SHOAL_SHARED_GATEWAY_ROUTING", "prefix-load") not in SHARED_GATEWAY_ROUTINGS:
        raise SystemExit(f"--shared-gateway-routing takes {', '.join(SHARED_GATEWAY_ROUTINGS)}, got "
                         f"{env['SHOAL_SHARED_GATEWAY_ROUTING']!r}")
    if "SHOAL_SHARED_GATEWAY_ROUTING" in env and "SHOAL_SHARED_GATEWAY" not in env:
        raise SystemExit("--shared-gateway-routing describes the shared gateway: give --shared-gateway NS/SA too")
    if env.get("SHOAL_RBAC_SCOPE", "cluster") not in ("cluster", "namespace"):
        raise SystemExit(f"--rbac-scope takes cluster or namespace, got {env['SHOAL_RBAC_SCOPE']!r}")
    if "--max-gpus-per-node" in [a.split("=")[0] for a in argv]:
        value = int(env["SHOAL_MAX_GPUS_PER_NODE"])
        if value < 1:
            raise SystemExit("--max-gpus-per-node must be at least 1")
    return env, rest


def watched_namespaces(kopf_argv: list[str]) -> str:
    """kopf's -n/--namespace values (they stay kopf's), for the autoscaler's own watches: comma-separated names,
    or "" for every namespace (-A, no -n, or a pattern such as `team-*`, which only a cluster-wide watch can
    follow)."""
    found, i = [], 0
    while i < len(kopf_argv):
        arg = kopf_argv[i]
        if arg in ("-n", "--namespace") and i + 1 < len(kopf_argv):
            found.append(kopf_argv[i + 1])
            i += 2
            continue
        if arg.startswith("--namespace="):
            found.append(arg.split("=", 1)[1])
        elif arg.startswith("-n") and len(arg) > 2 and not arg.startswith("--"):
            found.append(arg[2:].lstrip("="))
        i += 1
    if not found or any(set(ns) & set("*?[]!,") for ns in found):
        return ""
    return ",".join(dict.fromkeys(found))


def peering_priority(argv: list[str]) -> list[str]:
    """Replace `--peering-priority auto` by kopf's `--priority N` with N random and distinct per process."""
    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--peering-priority" or arg.startswith("--peering-priority="):
            value = arg.split("=", 1)[1] if "=" in arg else (argv[i + 1] if i + 1 < len(argv) else "")
            i += 1 if "=" in arg else 2
            if value != "auto":
                raise SystemExit("--peering-priority takes 'auto' (use kopf's --priority for a fixed one)")
            out += ["--priority", str(1 + secrets.randbelow(2**31 - 2))]
            continue
        out.append(arg)
        i += 1
    return out


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__)
        argv = ["--help"]
    env, rest = parse(peering_priority(argv))
    env["SHOAL_WATCH_NAMESPACES"] = watched_namespaces(rest)
    if env.get("SHOAL_RBAC_SCOPE") == "namespace" and not env["SHOAL_WATCH_NAMESPACES"]:
        raise SystemExit("--rbac-scope namespace needs the namespaces by name (-n NS, repeatable): without the "
                         "right to list namespaces, -A and patterns such as team-* cannot be served")
    os.environ.update(env)
    from kopf import cli

    from shoal.operator import HANDLER_MODULES

    modules = [arg for module in HANDLER_MODULES for arg in ("-m", module)]
    sys.exit(cli.main(["run", *rest, *modules], prog_name="shoal-operator", standalone_mode=True))


if __name__ == "__main__":
    main()
