"""`shoal-gateway`: the inference-aware gateway's command line."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from dataclasses import dataclass
from typing import Sequence

from aiohttp import web

from shoal.engine.server.keys import KeySet
from shoal.operator.gateway.discovery import EndpointSliceDiscovery, StaticDiscovery
from shoal.operator.gateway.options import (ChartValue, add_flags, config_kwargs, endpoint_url,
                                            non_negative, option)
from shoal.operator.gateway.proxy import Gateway, GatewayConfig, build_app, build_metrics_app

log = logging.getLogger("shoal.gateway")


@dataclass(frozen=True)
class Process:
    """Where the gateway listens, where its engines are and how it logs: the flags that are no GatewayConfig
    setting (each declared once, as GatewayConfig's are: options.py)."""

    host: str | None = option(None, "server", "address to bind (default: every interface)")
    port: int = option(8000, "server", "port to serve on", type=int)
    metrics_port: int | None = option(
        None, "server", "also serve /metrics (and nothing else) on this port: one a service mesh can leave out of "
        "its mTLS for scrapers outside the mesh, such as the operator's autoscaler", type=int)
    shutdown_timeout: float = option(
        30.0, "server", "on SIGTERM, seconds in-flight requests may take to finish", type=non_negative,
        # a pod's in-flight streams get ten minutes on a rollout (the chart's terminationGracePeriodSeconds)
        chart=ChartValue("shutdownTimeoutSeconds", maximum=86400, schema=(("type", "integer"),)))
    log_level: str = option("info", "server", "how much to log", choices=("debug", "info", "warning", "error"))
    endpoint: tuple[str, ...] = option((), "source", "an engine's base URL, e.g. http://127.0.0.1:8001 (repeatable)",
                                       repeat=True, type=endpoint_url, metavar="URL")
    service: str | None = option(None, "source", "discover engines from this Kubernetes Service's EndpointSlices")
    namespace: str | None = option(
        None, "source", "the Service's namespace; alone, the namespace whose InferenceServices the shared gateway "
        "serves (default: the pod's own namespace)")
    inference_service: str | None = option(
        None, "source", "with --service: the InferenceService (in --namespace) these engines serve; its spec is "
        "watched, so a request for an adapter spec.adapters declares that no engine lists yet is held until one "
        "loads it (up to --queue-timeout, then 503 adapter_not_loaded) instead of reaching an engine that 404s "
        "(needs get/list/watch on that InferenceService)", metavar="NAME")
    all_namespaces: bool = option(False, "source", "the shared gateway serves the InferenceServices of every "
                                  "namespace", aliases=("-A",))
    port_name: str | None = option(None, "source", "the EndpointSlice port to use (default: the first TCP port)")
    prefill_endpoint: tuple[str, ...] = option(
        (), "source", "a prefill engine's base URL (repeatable): prefill/decode disaggregation. Each completion's "
        "prefill runs there first and its engine from --endpoint/--service decodes, pulling the prompt's KV "
        "(engines started with --kv-transfer-config: kv_producer here, kv_consumer there); with no prefill engine "
        "usable the decode engine prefills itself", repeat=True, type=endpoint_url, metavar="URL")
    prefill_service: str | None = option(
        None, "source", "discover the prefill engines from this Kubernetes Service's EndpointSlices (in --namespace)",
        metavar="NAME")
    api_key: str | None = option(
        None, "authentication", "the engines' API key: requests without it get 401 from the gateway, before they "
        "are held or counted as load (also: $SHOAL_API_KEY, --api-key-file)")
    api_key_file: str | None = option(
        None, "authentication", "accept every key in this file, one per line, re-read when it changes (a mounted "
        "Secret: list the new and the old key during a rotation)", metavar="PATH")
    wake_configmap: str | None = option(
        None, "reliability", "with --hold-timeout: annotate this ConfigMap (in --namespace; the operator renders "
        "<inferenceservice>-wake) when requests start waiting, so the operator's autoscaler wakes at once (scale "
        "from zero)", metavar="NAME")


# --help's sections, in order ("server": the top level)
GROUPS = {
    "source": "backends (one source)",
    "routing": "routing",
    "admission": "admission: priority and fairness",
    "quotas": "per-tenant quotas (0: none); past one, 429 with Retry-After and x-ratelimit-* headers",
    "authentication": "authentication",
    "reliability": "reliability",
    "batches": "batches (OpenAI /v1/files and /v1/batches)",
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="shoal-gateway",
        description="Inference-aware gateway for shoal-engine replicas: prefix-cache and load-aware routing of "
                    "the OpenAI routes (/v1/*, /tokenize, /detokenize), SSE passed through unbuffered. With neither "
                    "--endpoint nor --service it is the shared gateway: one endpoint for every InferenceService of "
                    "--namespace (or of the cluster, --all-namespaces), routing each request by its `model`.")
    groups = {"server": p, **{key: p.add_argument_group(title) for key, title in GROUPS.items()}}
    add_flags(Process, groups)
    add_flags(GatewayConfig, groups)
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
    return GatewayConfig(**config_kwargs(GatewayConfig, args),  # every declared option (options.py)
                         api_key=None if shared else resolve_api_key(args))


def own_namespace() -> str | None:
    try:
        with open("/var/run/secrets/kubernetes.io/serviceaccount/namespace", encoding="utf-8") as f:
            return f.read().strip()
    except OSError:
        return None


async def serve(config: GatewayConfig, discovery, host: str | None, port: int, shutdown_timeout: float,
                waker=None, metrics_port: int | None = None, shared_namespace: str | None = None,
                shared: bool = False, own_service=None, prefill_discovery=None) -> int:
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
    await gateway.start(discovery, own_service, prefill_discovery)
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
    if shared_mode(args) and (args.prefill_endpoint or args.prefill_service):
        parser.error("--prefill-endpoint and --prefill-service pair one service's prefill and decode engines: give "
                     "its decode engines too (--endpoint or --service)")
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
    if args.prefill_endpoint and args.prefill_service:
        parser.error("give the prefill engines either as --prefill-endpoint URL (repeatable) or as --prefill-service")
    prefill_discovery = None
    if args.prefill_endpoint:
        prefill_discovery = StaticDiscovery(args.prefill_endpoint)
    elif args.prefill_service:
        if not namespace:
            parser.error("--prefill-service needs --namespace outside a pod")
        prefill_discovery = EndpointSliceDiscovery(args.prefill_service, namespace, port_name=args.port_name)
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
                             metrics_port=args.metrics_port, own_service=own_service,
                             prefill_discovery=prefill_discovery))


if __name__ == "__main__":
    sys.exit(main())
