"""`shoal-gateway`: the inference-aware gateway's command line."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from typing import Sequence
from urllib.parse import urlsplit

from aiohttp import web

from shoal.engine.server.keys import KeySet
from shoal.operator.gateway.backends import HealthPolicy
from shoal.operator.gateway.discovery import EndpointSliceDiscovery, StaticDiscovery
from shoal.operator.gateway.options import add_flags, config_kwargs, non_negative, non_negative_int, positive
from shoal.operator.gateway.proxy import Gateway, GatewayConfig, build_app, build_metrics_app
from shoal.operator.gateway.quotas import QuotaPolicy
from shoal.operator.gateway.tenants import EngineKeys, TenantKeys, parse_networks

log = logging.getLogger("shoal.gateway")


def endpoint_url(text: str) -> str:
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/"):
        raise argparse.ArgumentTypeError(f"{text!r} is not an engine base URL like http://10.0.0.5:8000")
    try:
        parts.port
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None
    return text.rstrip("/")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="shoal-gateway",
        description="Inference-aware gateway for shoal-engine replicas: prefix-cache and load-aware routing of "
                    "the OpenAI routes (/v1/*, /tokenize, /detokenize), SSE passed through unbuffered. With neither "
                    "--endpoint nor --service it is the shared gateway: one endpoint for every InferenceService of "
                    "--namespace (or of the cluster, --all-namespaces), routing each request by its `model`.")
    p.add_argument("--host", default=None, help="address to bind (default: every interface)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--metrics-port", type=int, default=None,
                   help="also serve /metrics (and nothing else) on this port: one a service mesh can leave out of "
                        "its mTLS for scrapers outside the mesh, such as the operator's autoscaler")
    src = p.add_argument_group("backends (one source)")
    src.add_argument("--endpoint", action="append", type=endpoint_url, default=[], metavar="URL",
                     help="an engine's base URL, e.g. http://127.0.0.1:8001 (repeatable)")
    src.add_argument("--service", help="discover engines from this Kubernetes Service's EndpointSlices")
    src.add_argument("--namespace", help="the Service's namespace; alone, the namespace whose InferenceServices the "
                                          "shared gateway serves (default: the pod's own namespace)")
    src.add_argument("--inference-service", metavar="NAME",
                     help="with --service: the InferenceService (in --namespace) these engines serve; its spec is "
                          "watched, so a request for an adapter spec.adapters declares that no engine lists yet is "
                          "held until one loads it (up to --queue-timeout, then 503 adapter_not_loaded) instead of "
                          "reaching an engine that 404s (needs get/list/watch on that InferenceService)")
    src.add_argument("--all-namespaces", "-A", action="store_true",
                     help="the shared gateway serves the InferenceServices of every namespace")
    src.add_argument("--port-name", help="the EndpointSlice port to use (default: the first TCP port)")
    r = p.add_argument_group("routing")
    r.add_argument("--tokenizer", metavar="PATH",
                   help="precise-prefix: the model's tokenizer.json (or a directory holding it), to turn "
                        "completion prompts into the token ids the engines hash in the gateway; without it (and "
                        "for chat requests always) an engine's /tokenize gives them")
    r.add_argument("--kv-events-endpoint", action="append", default=[], type=kv_events_endpoint,
                   metavar="URL=PORT[,REPLAY_PORT]",
                   help="precise-prefix: this --endpoint engine's KV-events ports, where they differ from "
                        "--kv-events-port / --kv-events-replay-port (engines sharing one host; repeatable)")
    adm = p.add_argument_group("admission: priority and fairness")
    adm.add_argument("--max-priority", type=int, default=0, metavar="N",
                     help="shared gateway: the highest spec.priority (and adapters' priority) it honours for a "
                          "namespace without --namespace-max-priority; higher is clamped, reported as a "
                          "PriorityClamped event on the InferenceService (default %(default)s)")
    adm.add_argument("--namespace-max-priority", action="append", default=[], metavar="NAMESPACE=N",
                     help="shared gateway: the highest priority this namespace may use (repeatable)")
    adm.add_argument("--engine-priority", action="store_true",
                     help="the engines run --scheduling-policy priority: send each request an engine priority (the "
                          "model's priority, then the tenant's requests already at that engine, fewest first). The "
                          "shared gateway does so for services with engine.schedulingPolicy: priority")
    adm.add_argument("--tenant-header", metavar="NAME",
                     help="trust this request header as the tenant's name (set by an authenticating proxy in front; "
                          "e.g. x-gateway-inference-fairness-id), only from --trusted-proxies")
    adm.add_argument("--trusted-proxies", metavar="CIDRS", default="",
                     help="comma-separated CIDRs of the proxies whose --tenant-header is believed; from any other "
                          "peer it is ignored (the shared gateway then answers 401)")
    adm.add_argument("--allow-unauthenticated", action="store_true",
                     help="UNSAFE: let the shared gateway serve callers it cannot identify (no --tenant-keys, no "
                          "--tenant-header): anyone who reaches it uses every model it serves, with the engines' "
                          "keys when --engine-keys is given")
    adm.add_argument("--tenant-keys", metavar="DIR",
                     help="shared gateway: a directory with one file per tenant holding its API keys, one per line "
                          "(a mounted Secret; re-read when it changes); a request's key names its tenant, any "
                          "other request gets 401")
    adm.add_argument("--engine-keys", metavar="DIR",
                     help="shared gateway: the engines' API keys, one file per InferenceService named "
                          "<namespace>.<name>, sent to its engines instead of the client's key")
    q = p.add_argument_group("per-tenant quotas (0: none); past one, 429 with Retry-After and x-ratelimit-* headers")
    q.add_argument("--tenant-requests-per-minute", type=non_negative_int, default=0, metavar="N")
    q.add_argument("--tenant-tokens-per-minute", type=non_negative_int, default=0, metavar="N",
                   help="tokens estimated per request: prompt characters / 4 + max_tokens")
    q.add_argument("--tenant-max-concurrent", type=non_negative_int, default=0, metavar="N",
                   help="a tenant's requests inside the gateway at once (waiting or running)")
    auth = p.add_argument_group("authentication")
    auth.add_argument("--api-key", help="the engines' API key: requests without it get 401 from the gateway, before "
                                        "they are held or counted as load (also: $SHOAL_API_KEY, --api-key-file)")
    auth.add_argument("--api-key-file", metavar="PATH",
                      help="accept every key in this file, one per line, re-read when it changes (a mounted Secret: "
                           "list the new and the old key during a rotation)")
    rel = p.add_argument_group("reliability")
    rel.add_argument("--wake-configmap", metavar="NAME",
                     help="with --hold-timeout: annotate this ConfigMap (in --namespace; the operator renders "
                          "<inferenceservice>-wake) when requests start waiting, so the operator's autoscaler "
                          "wakes at once (scale from zero)")
    rel.add_argument("--wake-engines", action="store_true",
                     help="with --hold-timeout: wake a parked engine (POST /wake_up to an endpoint that is not "
                          "Ready) when requests start waiting, and route to it as soon as it is awake "
                          "(autoscaling.scaleToZero sleep)")
    h = HealthPolicy()
    rel.add_argument("--stale-after", type=positive(float), default=h.stale_after,
                     help="engine load data older than this is unknown (default %(default)s s)")
    rel.add_argument("--stall-after", type=positive(float), default=h.stall_after,
                     help="an engine silent this long is skipped while others answer (default %(default)s s)")
    rel.add_argument("--circuit-failures", type=positive(int), default=h.circuit_failures)
    rel.add_argument("--circuit-cooldown", type=positive(float), default=h.circuit_cooldown)
    b = p.add_argument_group("batches (OpenAI /v1/files and /v1/batches)")
    b.add_argument("--batch-dir", metavar="DIR",
                   help="serve OpenAI's Files and Batches API, keeping uploaded files, batches and their results in "
                        "this directory (a volume: a restarted gateway resumes its batches, neither losing nor "
                        "repeating a finished request; replicas sharing it run each batch once). Unset: not served")
    add_flags(GatewayConfig, {"source": src, "routing": r, "admission": adm, "reliability": rel, "batches": b})
    p.add_argument("--shutdown-timeout", type=non_negative, default=30.0,
                   help="on SIGTERM, seconds in-flight requests may take to finish (default %(default)s)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p


def resolve_api_key(args: argparse.Namespace) -> "str | KeySet | None":
    """--api-key, else --api-key-file, else $SHOAL_API_KEY (what the operator sets from the Secret), as the engine."""
    if args.api_key:
        return args.api_key
    if args.api_key_file:
        try:
            return KeySet.from_file(args.api_key_file)  # every line, re-read when the mounted Secret changes
        except OSError as e:
            raise ValueError(f"--api-key-file: cannot read {args.api_key_file}: {e.strerror}") from None
        except ValueError:
            raise ValueError(f"--api-key-file: {args.api_key_file} is empty") from None
    return os.environ.get("SHOAL_API_KEY") or None


def shared_mode(args: argparse.Namespace) -> bool:
    return not args.endpoint and not args.service


def config_from_args(args: argparse.Namespace) -> GatewayConfig:
    if args.tokenizer:
        from shoal.operator.gateway.kv_tokens import tokenizer_file

        tokenizer_file(args.tokenizer)  # a missing file is a usage error now, not a traceback at start-up
    shared = shared_mode(args)
    if not shared and (args.tenant_keys or args.engine_keys):
        raise ValueError("--tenant-keys and --engine-keys are for the shared gateway (no --endpoint/--service); "
                         "a per-service gateway checks the engines' own key (--api-key)")
    if shared and (args.api_key or args.api_key_file or args.wake_configmap or args.runtime != "shoal"):
        raise ValueError("the shared gateway takes no --api-key, --wake-configmap or --runtime: it reads each "
                         "InferenceService's runtime and wake-up ConfigMap, and its clients' keys are tenant keys "
                         "(--tenant-keys)")
    if shared and (args.tokenizer or args.kv_events_endpoint):
        raise ValueError("--tokenizer and --kv-events-endpoint are one service's: the shared gateway tokenizes each "
                         "prompt with the engines of the service it goes to (/tokenize) and finds where they publish "
                         "KV events in their EndpointSlices")
    if args.inference_service and not args.service:
        raise ValueError("--inference-service names the InferenceService of the engines of --service (a per-service "
                         "gateway); the shared gateway reads every InferenceService itself")
    if args.tenant_header and not args.trusted_proxies:
        raise ValueError("--tenant-header needs --trusted-proxies: the CIDRs of the authenticating proxies that set "
                         "it (from anyone else the header would let a caller name any tenant)")
    if shared and not (args.tenant_keys or args.tenant_header) and not args.allow_unauthenticated:
        raise ValueError("the shared gateway must know who is asking: give --tenant-keys DIR (or --tenant-header with "
                         "--trusted-proxies); --allow-unauthenticated serves anyone who reaches it, unsafe"
                         + (", and would hand them the engines' keys (--engine-keys)" if args.engine_keys else ""))
    if args.load_factor < 1.0:
        raise ValueError(f"--load-factor must be >= 1, got {args.load_factor}")
    if args.max_buffered_bytes < args.max_body_bytes:
        raise ValueError(f"--max-buffered-bytes ({args.max_buffered_bytes}) must be at least --max-body-bytes "
                         f"({args.max_body_bytes}), or the largest body could never be admitted")
    if args.batch_dir:
        from shoal.operator.gateway.batch_store import Store

        try:
            Store(args.batch_dir)  # creates its folders and checks it can write there
        except OSError as e:
            raise ValueError(f"--batch-dir: cannot keep batches in {args.batch_dir}: {e.strerror}") from None
    bounds = {}
    for item in args.namespace_max_priority:
        namespace, _, value = item.partition("=")
        try:
            bounds[namespace.strip()] = int(value)
        except ValueError:
            raise ValueError(f"--namespace-max-priority: {item!r} is not NAMESPACE=N") from None
        if not namespace.strip():
            raise ValueError(f"--namespace-max-priority: {item!r} is not NAMESPACE=N")
    return GatewayConfig(
        **config_kwargs(GatewayConfig, args),  # the declared options (options.py)
        max_priority=args.max_priority, namespace_max_priority=bounds,
        tokenizer=args.tokenizer, kv_events_ports=dict(args.kv_events_endpoint), wake_engines=args.wake_engines,
        api_key=None if shared else resolve_api_key(args),
        health=HealthPolicy(stale_after=args.stale_after, stall_after=args.stall_after,
                            circuit_failures=args.circuit_failures, circuit_cooldown=args.circuit_cooldown),
        tenant_header=args.tenant_header, trusted_proxies=parse_networks(args.trusted_proxies),
        tenant_keys=TenantKeys(args.tenant_keys) if args.tenant_keys else None,
        engine_keys=EngineKeys(args.engine_keys) if args.engine_keys else None,
        engine_priority=args.engine_priority, batch_dir=args.batch_dir,
        quotas=QuotaPolicy(args.tenant_requests_per_minute, args.tenant_tokens_per_minute,
                           args.tenant_max_concurrent))


def kv_events_endpoint(text: str) -> tuple[str, tuple[int, int | None]]:
    """URL=PORT[,REPLAY_PORT] -> (the engine's URL as --endpoint normalises it, (port, replay port or None))."""
    url, sep, ports = text.rpartition("=")
    try:
        port, _, replay = ports.partition(",")
        numbers = (int(port), int(replay) if replay else None)
    except ValueError:
        numbers = None
    if not sep or numbers is None or not all(0 < n < 65536 for n in numbers if n is not None):
        raise argparse.ArgumentTypeError(f"expected URL=PORT[,REPLAY_PORT], got {text!r}")
    return endpoint_url(url), numbers


def own_namespace() -> str | None:
    try:
        with open("/var/run/secrets/kubernetes.io/serviceaccount/namespace", encoding="utf-8") as f:
            return f.read().strip()
    except OSError:
        return None


async def serve(config: GatewayConfig, discovery, host: str | None, port: int, shutdown_timeout: float,
                waker=None, metrics_port: int | None = None, shared_namespace: str | None = None,
                shared: bool = False, own_service=None) -> int:
    gateway = Gateway(config, namespace=shared_namespace, shared=shared)
    if waker is not None:
        try:
            await waker.start()  # credentials now, not on the scale-from-zero path
        except Exception as e:  # noqa: BLE001 - retried on the first held request
            log.warning("wake-ups for %s/%s: %s", waker.namespace, waker.name, e)
        gateway.on_hold.append(waker)
    app = build_app(gateway)
    # aiohttp reads a shutdown timeout of 0 as "no timeout" (wait for every handler); ours means "do not wait".
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=max(shutdown_timeout, 0.001),
                           access_log=None)
    await runner.setup()
    metrics_runner = web.AppRunner(build_metrics_app(gateway), access_log=None) if metrics_port else None
    try:
        site = web.TCPSite(runner, host, port, reuse_address=True)
        await site.start()
        if metrics_runner is not None:
            await metrics_runner.setup()
            await web.TCPSite(metrics_runner, host, metrics_port, reuse_address=True).start()
    except OSError as e:
        log.error("cannot listen on %s:%s%s: %s", host or "0.0.0.0", port,
                  f" and {metrics_port}" if metrics_port else "", e)
        await runner.cleanup()
        if metrics_runner is not None:
            await metrics_runner.cleanup()
        return 1
    await gateway.start(discovery, own_service)
    if shared:
        log.info("shoal-gateway listening on http://%s:%d: the InferenceServices of %s, routing %s",
                 host or "0.0.0.0", port, shared_namespace and f"namespace {shared_namespace}" or "every namespace",
                 config.routing)
    else:
        log.info("shoal-gateway listening on http://%s:%d, routing %s", host or "0.0.0.0", port, config.routing)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    # Readiness fails first, in-flight requests finish (aiohttp waits up to shutdown_timeout for handlers).
    gateway.start_draining()
    log.info("shutting down: finishing in-flight requests (up to %.0fs)", shutdown_timeout)
    await runner.cleanup()
    if metrics_runner is not None:
        await metrics_runner.cleanup()
    await gateway.stop()
    if waker is not None:
        await waker.close()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.endpoint and args.service:
        parser.error("give the engines either as --endpoint URL (repeatable) or as --service NAME")
    if args.all_namespaces and (args.endpoint or args.service or args.namespace):
        parser.error("--all-namespaces is the shared gateway of the whole cluster: no --endpoint, --service or "
                     "--namespace with it")
    try:
        config = config_from_args(args)
    except ValueError as e:
        parser.error(str(e))
    namespace = args.namespace or own_namespace()
    if shared_mode(args):
        if not namespace and not args.all_namespaces:
            parser.error("give the engines as --endpoint URL or --service NAME, or serve every InferenceService of "
                         "--namespace (or --all-namespaces) as the shared gateway")
        return asyncio.run(serve(config, None, args.host, args.port, args.shutdown_timeout,
                                 metrics_port=args.metrics_port,
                                 shared_namespace=None if args.all_namespaces else namespace, shared=True))
    if args.endpoint:
        discovery = StaticDiscovery(args.endpoint)
    else:
        if not namespace:
            parser.error("--service needs --namespace outside a pod")
        discovery = EndpointSliceDiscovery(args.service, namespace, port_name=args.port_name)
    own_service = None
    if args.inference_service:
        from shoal.operator.gateway.own_service import OwnService

        own_service = OwnService(args.inference_service, namespace)
    waker = None
    if args.wake_configmap:
        if not namespace:
            parser.error("--wake-configmap needs --namespace outside a pod")
        from shoal.operator.gateway.wake import Waker

        waker = Waker(namespace, args.wake_configmap)
    return asyncio.run(serve(config, discovery, args.host, args.port, args.shutdown_timeout, waker,
                             metrics_port=args.metrics_port, own_service=own_service))


if __name__ == "__main__":
    sys.exit(main())
