"""The gateway's aiohttp app: pick an engine per request and stream its answer back untouched.

One gateway serves one pool (a per-service gateway: `--endpoint` URLs or `--service`) or many (the shared gateway,
fleet.py: one pool per InferenceService, found by the request's `model`). Per proxied request:
  0. authentication: with an API key configured (the engines' key, from the same Secret), or with tenant keys (the
     shared gateway), a request without a valid key is answered 401 before anything else — it is never held,
     never counted as load and never wakes the autoscaler. The key (or a trusted header) names the tenant;
  1. admission: more than `max_pending` requests inside the gateway → 429; a body over `max_body_bytes` → 413;
     request bodies are kept until the answer starts (for a retry), so their sum is bounded too: a request whose
     body would take the bodies held above `max_buffered_bytes` → 429. Memory is bounded by construction;
  2. the pool: the shared gateway answers an unknown model 404 (listing nothing), a missing one 400;
  3. the prompt is rendered and hashed (prefix-load only); the pool admits the request (pool.py): at once while
     an engine has a free slot, else it waits in the pool's queue, by priority and fairly across tenants
     (admission.py), up to `queue_timeout` (then 429); the lowest priority is shed first (429) when more than
     `max_queued` requests wait. With no engine at all it is held up to `hold_timeout` (0: at once) → 503 +
     Retry-After. The router picks the engine among those with a free slot;
  4. the request goes to the engine with the client's headers (Authorization included: the engines check keys;
     the shared gateway sends the engines' own key instead of a tenant's); it is retried once on another engine
     only while the engine cannot be running it: a refused connection or connect timeout, a connection the engine
     dropped before answering, or a 429/503 answer (queue full, draining). A non-streaming generation sends
     nothing until it ends, so the engine's answer may take up to `response_timeout`; past it the request is cut
     at the engine (which aborts it) and the client gets 504 — never a second run elsewhere;
  5. status, headers and body chunks are relayed as they arrive (SSE is never buffered), each within
     `read_timeout` of the previous one; a client that goes away closes the engine connection, which aborts the
     request there. Its engine slot is then free for the next waiting request.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from shoal.operator import __version__
from shoal.engine.server.gateway_contract import (ANTHROPIC_PREFIX, RESPONSE_PATH, TENANT_HEADER, anthropic_error,
                                                   instance_of, not_found_error, previous_not_found_error)
from shoal.engine.server.keys import KeySet, read_keys
from shoal.operator.gateway import canary
from shoal.operator.gateway.admission import Shed, Ticket, request_cost
from shoal.operator.gateway.backends import Backend, BackendSet, HealthPolicy
from shoal.operator.gateway.kv_tokens import PromptTokens, tokenized_images
from shoal.operator.gateway.metric_names import RUNTIMES, for_runtime
from shoal.operator.gateway.metrics import GatewayMetrics
from shoal.operator.gateway.options import (ChartValue, SpecField, kv_events_endpoint, namespace_bound, nested,
                                            non_negative, non_negative_int, option, positive)
from shoal.operator.gateway.poller import Poller
from shoal.operator.gateway.pool import AdapterNotLoaded, Pool, Unavailable
from shoal.operator.gateway.prefix import block_hashes, render_prompt
from shoal.operator.gateway.quotas import OverQuota, QuotaPolicy, Quotas, Shares, share_cap
from shoal.operator.gateway.routing import ROUTINGS, Pick, PrefixIndex, make_router
from shoal.operator.gateway.tenants import (LOOPBACK, Caller, EngineKeys, Network, Tenancy, TenantKeys,
                                            parse_networks, presented_key)
from shoal.operator.gateway.tracing import GatewayTracer, tracing_configured
from shoal.operator.gateway.wake import EngineWaker

log = logging.getLogger("shoal.gateway")

# Hop-by-hop headers (RFC 9110 §7.6.1) are per connection and never forwarded; Host and Content-Length are
# recomputed for the engine's connection.
TRACE_KEY = web.RequestKey("shoal_trace", object)  # the request's tracing.RequestTrace (None: tracing is off)
HOP_BY_HOP = frozenset(h.lower() for h in (
    "Connection", "Keep-Alive", "Proxy-Authenticate", "Proxy-Authorization", "TE", "Trailer", "Trailers",
    "Transfer-Encoding", "Upgrade", "Host", "Content-Length"))
# The engine refused the request without running it: 429 (queue full) and 503 (draining, or a proxy in front of
# it could not connect). A 502/504 from a proxy in between may come while the engine still runs the request.
RETRY_STATUSES = frozenset({429, 503})
RETRY_REASONS = frozenset({"refused", "connect_timeout", "reset"})  # failures before the engine accepted it
ROUTED_PATHS = ("/v1/completions", "/v1/chat/completions")
# The engines' administration (vLLM's and Shoal's): the operator's adapter-sync sidecar calls them on localhost;
# no gateway forwards them from clients.
ADMIN_PATHS = frozenset({"/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/load_lora_adapter",
                         "/unload_lora_adapter", "/v1/lora_adapters", "/reset_prefix_cache", "/sleep", "/wake_up",
                         "/is_sleeping", "/collective_rpc", "/start_profile", "/stop_profile", "/scale_elastic_ep",
                         "/update_weights", "/pause", "/resume"})
# The shared gateway proxies only these (each names its model), and GET/DELETE /v1/responses/{id} (its id names the
# engine: gateway_contract.py); engine administration (loading adapters, ...) is never reachable through the
# platform's entry point.
SHARED_PATHS = (*ROUTED_PATHS, "/v1/embeddings", "/v1/responses", "/v1/messages", "/v1/messages/count_tokens",
                "/tokenize", "/detokenize")
KEY_HEADERS = ("authorization", "x-api-key")
ENGINE_DEFAULT_MAX_NUM_SEQS = 256  # Shoal's and vLLM's --max-num-seqs default
ENGINE_PRIORITY_SPAN = 2**20  # engine priority = -priority * span - how far the tenant is below its fair share


@dataclass
class GatewayConfig:
    """Every gateway setting. Fields with an `option(...)` are declared once for the CLI and, with a SpecField, for
    the CRD's spec.gateway and the operator's rendering (options.py)."""

    routing: str = option("prefix-load", "routing", "how an engine is picked", choices=ROUTINGS,
                          spec=SpecField("routing", str, "shoal-gateway --routing"), chart=ChartValue("routing"))
    block_chars: int = option(  # about 16 tokens of English: the engine's default KV block
        64, "routing", "characters per hashed prompt block", flag="--prefix-block-chars", type=positive(int))
    max_blocks: int = option(512, "routing", "hash at most this many leading blocks of a prompt",
                             flag="--prefix-max-blocks", type=positive(int))
    load_factor: float = option(1.25, "routing", "bounded-load factor c >= 1: an engine may take a request while its "
                                "load + 1 <= ceil(c * (total load + 1) / engines)")
    affinity_slack: float = option(2.0, "routing", "the engine holding a prompt's prefix keeps getting it while its "
                                   "load is at most the least loaded engine's + this many requests", type=non_negative)
    cold_slack: float = option(1.0, "routing", "a prompt prefix no engine holds goes to its consistent-hash engine "
                               "only while that engine's load is at most the least loaded one's + this many requests",
                               type=non_negative)
    index_size: int = option(200_000, "routing", "block hashes remembered for affinity (LRU)",
                             flag="--prefix-index-size", type=positive(int))
    # precise-prefix (kv_index.py, kv_subscriber.py, kv_tokens.py): the model's tokenizer, and where each engine
    # publishes its KV events (its pod IP and these ports; replay 0: none)
    tokenizer: str | None = option(
        None, "routing", "precise-prefix: the model's tokenizer.json (or a directory holding it), to turn completion "
        "prompts into the token ids the engines hash in the gateway; without it (and for chat requests always) an "
        "engine's /tokenize gives them", metavar="PATH")
    kv_events_port: int = option(5557, "routing", "precise-prefix: the port of each engine's KV-events PUB socket, "
                                 "at its pod IP (--kv-events-config endpoint)", type=positive(int))
    kv_events_replay_port: int = option(5558, "routing", "precise-prefix: the port of each engine's KV-events replay "
                                        "socket; 0: none", type=non_negative_int)
    kv_events_topic: str = option("", "routing", "precise-prefix: the topic the engines publish under (empty: every "
                                  "topic)")
    tokenize_timeout: float = 1.0  # an engine's /tokenize answer, else the request routes approximately
    # seconds a pool whose engines could not tokenize (no /tokenize, down, too slow) routes approximately before
    # they are asked again: a request never waits tokenize_timeout for engines known not to answer
    tokenize_backoff: float = 30.0
    kv_events_ports: dict[str, tuple[int, int | None]] = option(
        None, "routing", "precise-prefix: this --endpoint engine's KV-events ports, where they differ from "
        "--kv-events-port / --kv-events-replay-port (engines sharing one host; repeatable)", factory=dict,
        flag="--kv-events-endpoint", repeat=True, type=kv_events_endpoint, convert=dict,
        metavar="URL=PORT[,REPLAY_PORT]")
    max_pending: int = option(
        4096, "reliability", "requests inside the gateway at once; more get 429", type=positive(int),
        spec=SpecField("max_pending", int, "requests inside one gateway pod at once, held ones included; more get "
                                           "429 (--max-pending)", ge=1, le=1_000_000),
        chart=ChartValue("maxPending"))
    max_body_bytes: int = option(
        32 * 1024 * 1024, "reliability", "largest request body; larger get 413", type=positive(int),
        spec=SpecField("max_body_bytes", int, "largest request body; larger get 413 (--max-body-bytes)",
                       ge=1024, le=1024 * 1024 * 1024))
    max_buffered_bytes: int = option(
        128 * 1024 * 1024, "reliability",
        "request bodies held at once, all requests together; a request beyond gets 429", type=positive(int),
        spec=SpecField("max_buffered_bytes", int, "request bodies one gateway pod holds at once, all requests "
                                                  "together; a request beyond gets 429 (--max-buffered-bytes; at "
                                                  "least maxBodyBytes)", ge=1024, le=64 * 1024 * 1024 * 1024))
    hold_timeout: float = option(
        0.0, "reliability", "seconds a request waits for an engine when none is ready (scale from zero); 0 answers 503 "
        "at once. Shared gateway: services that scale to zero hold for their probes.startupTimeoutSeconds unless "
        "this is set", type=non_negative)
    wake_engines: bool = option(
        False, "reliability", "with --hold-timeout: wake a parked engine (POST /wake_up to an endpoint that is not "
        "Ready) when requests start waiting, and route to it as soon as it is awake (autoscaling.scaleToZero sleep)")
    retry_after: int = option(1, "reliability", "Retry-After seconds on 503/429", type=positive(int))
    connect_timeout: float = option(3.0, "reliability", "seconds to open a connection to an engine",
                                    type=positive(float))
    response_timeout: float = option(  # request sent -> response headers: a whole non-streaming generation
        3600.0, "reliability", "seconds an engine may take to start its answer — a whole non-streaming "
        "generation; past it the request is cancelled and the client gets 504, never a retry elsewhere",
        type=positive(float),
        spec=SpecField("response_timeout_seconds", int, "how long an engine may take to start answering — a whole "
                       "non-streaming generation; past it the request is cancelled and the client gets 504, never "
                       "a second run on another engine (shoal-gateway --response-timeout)", ge=1, le=86400))
    read_timeout: float = option(  # silence from an engine between response bytes, once it answered
        600.0, "reliability", "seconds of silence allowed between the bytes of an answer, e.g. stream chunks",
        type=positive(float),
        spec=SpecField("read_timeout_seconds", int, "silence allowed between the bytes of an answer, e.g. stream "
                                                    "chunks (--read-timeout)", ge=1, le=86400))
    poll_interval: float = option(0.25, "reliability", "seconds between polls of each engine's load",
                                  type=positive(float))
    poll_timeout: float = option(1.0, "reliability", "seconds a load poll may take", type=positive(float))
    # the engines' runtime: which readiness path and metric names to read (metric_names.py)
    runtime: str = option("shoal", "source", "the engines' runtime: their readiness path and load metric names",
                          choices=RUNTIMES)
    # the engines' key(s): checked here first, so unauthenticated requests cost nothing
    api_key: str | KeySet | None = None
    health: HealthPolicy = nested(HealthPolicy)
    # Admission (pool.py, admission.py): slots per engine (0: no limit, the engines queue), and the waiting room.
    max_inflight: int = option(
        0, "admission", "requests an engine runs or queues at once; more wait in the gateway, dispatched by priority "
        "and fairly across tenants as slots free (the shared gateway uses each service's engine.maxNumSeqs when "
        "set). 0: no limit, the engines queue", flag="--max-inflight-per-engine", type=non_negative_int, metavar="N",
        chart=ChartValue("maxInflightPerEngine"))
    max_queued: int = option(
        1024, "admission", "requests waiting for a slot, all models together; beyond, the newest request of the "
        "lowest priority below the newcomer's is shed with 429", type=positive(int), chart=ChartValue("maxQueued"))
    queue_timeout: float = option(60.0, "admission", "seconds a request waits for a slot before 429",
                                  type=positive(float), chart=ChartValue("queueTimeoutSeconds"))
    tenant_header: str | None = option(
        None, "admission", "trust this request header as the tenant's name (set by an authenticating proxy in front; "
        "e.g. x-gateway-inference-fairness-id), only from --trusted-proxies", metavar="NAME",
        chart=ChartValue("tenantHeader", schema=(("pattern", "^([A-Za-z0-9!#$%&'*+.^_`|~-]+)?$"),
                                                 ("maxLength", 256))))
    trusted_proxies: tuple[Network, ...] = option(  # the peers whose tenant header is believed
        LOOPBACK, "admission", "comma-separated CIDRs of the proxies whose --tenant-header is believed; from any "
        "other peer it is ignored (the shared gateway then answers 401)", metavar="CIDRS", cli_default="",
        convert=parse_networks,
        chart=ChartValue("trustedProxies", when="tenantHeader", join=",",
                         schema=(("items", {"type": "string", "minLength": 1}),
                                 ("description", "CIDRs of the proxies whose tenantHeader is believed; from any other "
                                                 "peer it is ignored (shoal-gateway --trusted-proxies)."))))
    allow_unauthenticated: bool = option(
        False, "admission", "UNSAFE: let the shared gateway serve callers it cannot identify (no --tenant-keys, no "
        "--tenant-header): anyone who reaches it uses every model it serves, with the engines' keys when "
        "--engine-keys is given", chart=ChartValue("allowUnauthenticated"))
    tenant_keys: TenantKeys | None = option(  # API key -> tenant (the shared gateway's clients)
        None, "admission", "shared gateway: a directory with one file per tenant holding its API keys, one per line "
        "(a mounted Secret; re-read when it changes); a request's key names its tenant, any other request gets 401",
        metavar="DIR", convert=TenantKeys)
    engine_keys: EngineKeys | None = option(  # the engines' keys per InferenceService (the shared gateway)
        None, "admission", "shared gateway: the engines' API keys, one file per InferenceService named "
        "<namespace>.<name>, sent to its engines instead of the client's key", metavar="DIR", convert=EngineKeys)
    models_interval: float = option(
        10.0, "admission", "shared gateway: seconds between polls of each service's /v1/models (adapters loaded at "
        "run time)", type=positive(float))
    engine_priority: bool = option(
        False, "admission", "the engines run --scheduling-policy priority: send each request an engine priority (the "
        "model's priority, then the tenant's requests already at that engine, fewest first). The shared gateway does "
        "so for services with engine.schedulingPolicy: priority")
    quotas: QuotaPolicy = nested(QuotaPolicy)  # per tenant (quotas.py)
    # The highest spec.priority the shared gateway honours, per namespace (else max_priority; None: unbounded)
    max_priority: int | None = option(
        None, "admission", "shared gateway: the highest spec.priority (and adapters' priority) it honours for a "
        "namespace without --namespace-max-priority; higher is clamped, reported as a PriorityClamped event on the "
        "InferenceService", cli_default=0, type=int, metavar="N", chart=ChartValue("maxPriority"))
    namespace_max_priority: dict[str, int] = option(
        None, "admission", "shared gateway: the highest priority this namespace may use (repeatable)", factory=dict,
        repeat=True, type=namespace_bound, convert=dict, metavar="NAMESPACE=N",
        chart=ChartValue("namespaceMaxPriority", schema=(("additionalProperties", {"type": "integer"}),)))
    # OpenAI Batches (batch_api.py): their files and state on this directory (None: the routes are not served);
    # batch requests in flight per engine, taken only from capacity no interactive request wants
    batch_dir: str | None = option(
        None, "batches", "serve OpenAI's Files and Batches API, keeping uploaded files, batches and their results in "
        "this directory (a volume: a restarted gateway resumes its batches, neither losing nor repeating a finished "
        "request; replicas sharing it run each batch once). Unset: not served", metavar="DIR")
    batch_per_engine: int = option(
        2, "batches", "batch requests this gateway runs on one engine at once; they take only capacity no "
        "interactive request waits for", flag="--batch-max-inflight-per-engine", type=positive(int), metavar="N",
        chart=ChartValue("batches.maxInflightPerEngine", when="batches.enabled", maximum=1024))
    batch_share: str = option(  # batch_runner.SHARES
        "idle", "batches", "which engines take batch requests: idle = only those where this gateway has no "
        "interactive request in flight (interactive time to first token unaffected while they run); spare = any "
        "free slot (more batch throughput, interactive requests share engine steps with batch ones)",
        choices=("idle", "spare"))


def parse_body(path: str, body: bytes) -> Any:
    """The JSON body of a request that names a model, or None (malformed JSON is the engine's 400 to answer)."""
    if path not in SHARED_PATHS or not body:
        return None
    try:
        return json.loads(body)
    except ValueError:
        return None


def model_of(parsed: Any) -> str | None:
    model = parsed.get("model") if isinstance(parsed, dict) else None
    return model if isinstance(model, str) and model else None


def request_model(path: str, body: bytes) -> str | None:
    """The `model` a completion request names (a LoRA adapter routes by residency); None when it names none."""
    if path not in ROUTED_PATHS or not body or b'"model"' not in body:
        return None
    return model_of(parse_body(path, body))


GATEWAY_ERROR = web.ResponseKey("shoal_gateway_error", str)  # the message of an error the gateway itself made


def error_response(status: int, message: str, type_: str, code: str | None = None,
                   headers: dict[str, str] | None = None, param: str | None = None) -> web.Response:
    """OpenAI's error body; on Anthropic's routes anthropic_errors turns it into Anthropic's."""
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    response = web.json_response(body, status=status, headers=headers)
    response[GATEWAY_ERROR] = message
    return response


@web.middleware
async def anthropic_errors(request: web.Request, handler):
    """The gateway's own errors (401, 404, 429, 503, ...) on /v1/messages* in Anthropic's shape, as the engine
    answers there: Anthropic's clients read no other. Engines' answers are relayed untouched."""
    response = await handler(request)
    message = response.get(GATEWAY_ERROR) if isinstance(response, web.Response) else None
    if message is None or not request.path.startswith(ANTHROPIC_PREFIX):
        return response
    headers = {k: v for k, v in response.headers.items() if k.lower() not in ("content-type", "content-length")}
    return web.json_response(anthropic_error(response.status, message), status=response.status, headers=headers)


def stored_reference(request: web.Request, parsed: Any) -> tuple[str, dict] | None:
    """The stored response a request is about, with the 404 error an unknown one gets: GET/DELETE
    /v1/responses/{id}, or a Responses request's `previous_response_id`. None for every other request."""
    if request.method in ("GET", "DELETE") and request.path.startswith(RESPONSE_PATH):
        rid = request.path[len(RESPONSE_PATH):]
        return (rid, not_found_error(rid)) if rid and "/" not in rid else None
    if request.path == "/v1/responses" and isinstance(parsed, dict) and \
            isinstance(rid := parsed.get("previous_response_id"), str):
        return rid, previous_not_found_error(rid)
    return None


def authorized(request: web.Request, keys: "str | KeySet") -> bool:
    """The engine's rule (engine/server/app.py): `Authorization: Bearer <key>` or `X-API-Key: <key>`, against one
    key or a KeySet (--api-key-file: every line, re-read when the mounted Secret changes)."""
    token = presented_key(request)
    if isinstance(keys, KeySet):
        return keys.accepts(token)
    return bool(token) and hmac.compare_digest(token.encode(), keys.encode())


class StaticPools:
    """A per-service gateway: one pool, whatever the request's model."""

    shared = False

    def __init__(self, pool: Pool):
        self.pool = pool

    def resolve(self, model: str | None, namespace: str | None = None) -> Pool:
        return self.pool

    def all(self) -> list[Pool]:
        return [self.pool]

    def usable(self, namespace: str | None = None) -> list[Pool]:
        return [self.pool]


class Gateway:
    def __init__(self, config: GatewayConfig, backends: BackendSet | None = None, namespace: str | None = None,
                 shared: bool = False, kube_api=None):
        """A per-service gateway (one pool of `backends`), or with `shared` the shared gateway of `namespace`
        (None: every namespace) whose pools follow the InferenceServices there (fleet.py)."""
        self.config = config
        self.tenancy = Tenancy(config.tenant_keys, config.tenant_header, config.trusted_proxies,
                               header_required=shared)
        self.metrics = GatewayMetrics(self)
        # tenants told apart: each gets its share of every global limit (quotas.py)
        self.per_tenant = self.tenancy.authenticates or config.tenant_header is not None
        self.quotas = Quotas(config.quotas)
        self.pending_shares, self.buffer_shares = Shares(), Shares()
        self.pending = 0
        self.buffered = 0  # bytes of request bodies reserved by the requests inside
        self.draining = False
        self.session: aiohttp.ClientSession | None = None
        self.tasks: list[asyncio.Task] = []
        self._pollers: dict[Pool, tuple[Poller, asyncio.Task]] = {}
        self._wakers: dict[Pool, Any] = {}
        self._engine_wakers: dict[Pool, EngineWaker] = {}
        self.kube_api = kube_api
        self._key_read: tuple[float, str | None] = (-1e9, None)  # (when, the newest line of --api-key-file)
        self.tracer = GatewayTracer() if tracing_configured() else None  # tracing.py; None: no cost
        self.batches = None
        if config.batch_dir:
            from shoal.operator.gateway.batch_api import BatchAPI

            self.batches = BatchAPI(self, config.batch_dir, config.batch_per_engine, share=config.batch_share)
        # precise-prefix: the engines' KV events per pool (the shared gateway: one index and its subscribers per
        # InferenceService); the prompt's token ids from --tokenizer (one model's: a per-service gateway) or from
        # the pool's own engines (/tokenize: each service's model, no tokenizer held here)
        self.remote_prefill = None  # disaggregation.RemotePrefill: the prefill engines (--prefill-endpoint/-service)
        self._kv_subscribers: dict[Pool, Any] = {}
        self._tokenize_down: dict[Pool, float] = {}  # pool -> until when its engines are not asked to tokenize
        self.precise = config.routing == "precise-prefix"
        self.prompt_tokenizer = None
        if self.precise and config.tokenizer and shared:
            raise ValueError("--tokenizer is one model's tokenizer: the shared gateway tokenizes each prompt with "
                             "the engines of the service it goes to (their /tokenize)")
        if self.precise and config.tokenizer:
            from shoal.operator.gateway.kv_tokens import PromptTokenizer

            self.prompt_tokenizer = PromptTokenizer(config.tokenizer)
        if shared:
            from shoal.operator.gateway.fleet import Fleet

            # one prefix index for every model: the memory bound stays index_size hashes, whatever the fleet
            self.prefix_index = PrefixIndex(config.index_size)
            self.pools = Fleet(self, namespace, kube_api, config.models_interval,
                               lambda ns: config.namespace_max_priority.get(ns, config.max_priority))
        else:
            self.prefix_index = None
            pool = self._new_pool(backends or BackendSet(config.health), config.hold_timeout, config.max_inflight)
            pool.engine_priority = config.engine_priority
            self._engine_wakers[pool].enabled = config.wake_engines
            self.pools = StaticPools(pool)

    # The per-service gateway's one pool (tests and the single-service CLI use these).
    @property
    def backends(self) -> BackendSet:
        return self.pools.pool.backends

    @property
    def on_hold(self) -> list:
        return self.pools.pool.on_hold

    # ---- pools -----------------------------------------------------------------------------------------------
    def _new_pool(self, backends: BackendSet, hold_timeout: float, max_inflight: int,
                  service: tuple[str, str] | None = None) -> Pool:
        """`service`: the shared gateway's (namespace, name), whose engines publish under its own topic at the
        ports their EndpointSlices name (set_kv_ports); else the per-service gateway's flags say where."""
        c = self.config
        kv_index = None
        if self.precise:
            from shoal.operator.gateway.kv_index import KVIndex

            # one per pool: an index never mixes two services' engines (two models, two namespaces)
            kv_index = KVIndex(c.max_blocks)
        router = make_router(c.routing, c.load_factor, c.affinity_slack, c.cold_slack, c.index_size,
                             index=self.prefix_index, kv_index=kv_index)
        pool = Pool(backends, router, hold_timeout=hold_timeout, max_inflight=max_inflight,
                    queue_timeout=c.queue_timeout)
        if kv_index is not None:
            from shoal.operator.gateway.kv_subscriber import KVSubscribers

            if service is None:
                self._kv_subscribers[pool] = KVSubscribers(backends, kv_index, c.kv_events_port,
                                                           c.kv_events_replay_port or None, c.kv_events_topic,
                                                           c.kv_events_ports)
            else:  # the topic filters out any other service's events, even at an address it held a moment ago
                from shoal.operator.contract import kv_events_topic

                self._kv_subscribers[pool] = KVSubscribers(backends, kv_index, None, None,
                                                           kv_events_topic(service[1], service[0]))
        pool.on_pick = self._observe_pick
        pool.on_dispatch = self._observe_dispatch
        pool.on_held = self.metrics.held.inc, self.metrics.held.dec
        waker = self._engine_wakers[pool] = EngineWaker(backends, lambda: self.poll_headers(pool))
        waker.session = self.session
        pool.on_hold.append(waker)
        return pool

    def open_pool(self, view) -> Pool:
        """A pool for an InferenceService of the shared gateway (fleet.ServiceView), polled from now on."""
        pool = self._new_pool(BackendSet(self.config.health), 0.0, 0, service=(view.namespace, view.name))
        self.configure_pool(pool, view)
        if self.session is not None:
            self._start_polling(pool, view.runtime)
        return pool

    def configure_pool(self, pool: Pool, view) -> None:
        c = self.config
        pool.namespace, pool.name, pool.served_name = view.namespace, view.name, view.served_name
        pool.adapters = frozenset(view.adapters)
        pool.runtime = view.runtime
        pool.priority = view.priority
        pool.model_priorities = dict(view.adapter_priorities)
        pool.engine_priority = view.engine_priority or c.engine_priority
        # engine.maxNumSeqs, else the gateway's flag, else the engines' default: fair queuing is always on, the
        # gateway's queue taking over where an engine would start queueing first come, first served
        pool.max_inflight = view.max_inflight or c.max_inflight or ENGINE_DEFAULT_MAX_NUM_SEQS
        pool.hold_timeout = (c.hold_timeout or view.hold_timeout) if view.hold_timeout else 0.0
        self._engine_wakers[pool].enabled = view.wake_engines
        if view.hold_timeout and pool not in self._wakers:
            from shoal.operator.contract import wake_configmap_name
            from shoal.operator.gateway.wake import Waker

            waker = Waker(view.namespace, wake_configmap_name(view.name), api=self.kube_api, session=self.session)
            self._wakers[pool] = waker
            pool.on_hold.append(waker)
        elif not view.hold_timeout and pool in self._wakers:
            pool.on_hold.remove(self._wakers.pop(pool))
        pool.pump()  # more slots, or another priority: waiting requests may go now

    def set_kv_ports(self, pool: Pool, ports: dict[str, tuple[int, int | None]]) -> None:
        """Which engines of a shared gateway's pool publish KV events, and where (their EndpointSlices' named
        ports): subscribed to before they become backends."""
        subscribers = self._kv_subscribers.get(pool)
        if subscribers is not None and ports != subscribers.ports:
            subscribers.set_ports(ports)

    def set_prefill_engines(self, pool: Pool, urls: set[str] | None) -> None:
        """A shared gateway pool's prefill engines (its service's spec.prefill, from their EndpointSlices), or None
        when the service has no prefill role: then the pool's engines prefill their own requests."""
        if urls is None:
            pool.remote_prefill = None
            return
        if pool.remote_prefill is None:
            from shoal.operator.gateway.disaggregation import RemotePrefill

            pool.remote_prefill = RemotePrefill(BackendSet(self.config.health), self.config.response_timeout,
                                                self.metrics)
        pool.remote_prefill.backends.replace(urls)

    def close_pool(self, pool: Pool, error: BaseException) -> None:
        pool.close(error)
        self._tokenize_down.pop(pool, None)
        poller = self._pollers.pop(pool, None)
        if poller is not None:
            poller[1].cancel()
            asyncio.get_running_loop().create_task(poller[0].close())
        waker = self._wakers.pop(pool, None)
        if waker is not None:
            asyncio.get_running_loop().create_task(waker.close())
        engine_waker = self._engine_wakers.pop(pool, None)
        if engine_waker is not None:
            engine_waker.close()
        subscribers = self._kv_subscribers.pop(pool, None)
        if subscribers is not None:
            asyncio.get_running_loop().create_task(subscribers.close())

    def _start_polling(self, pool: Pool, runtime: str) -> None:
        if pool in self._kv_subscribers:
            self._kv_subscribers[pool].start()
        poller = Poller(pool.backends, self.session, self.config.poll_interval, self.config.poll_timeout,
                        metrics=for_runtime(runtime), headers=lambda: self.poll_headers(pool))
        self._pollers[pool] = (poller, asyncio.create_task(poller.run(), name=f"gateway-poller-{pool.key}"))

    def _observe_pick(self, pick: Pick, seconds: float) -> None:
        self.metrics.pick_latency.observe(seconds)
        self.metrics.decisions.labels(pick.decision).inc()
        if pick.matched_blocks and pick.precise:
            self.metrics.precise_hits.inc()
            self.metrics.precise_blocks.inc(pick.matched_blocks)
        elif pick.matched_blocks:
            self.metrics.affinity_hits.inc()
            self.metrics.matched_chars.inc(pick.matched_blocks * self.config.block_chars)

    def _observe_dispatch(self, ticket: Ticket, waited: float) -> None:
        self.metrics.queue_wait.labels(str(ticket.priority)).observe(waited)

    def enqueue(self, ticket: Ticket) -> None:
        """The waiting room is bounded (all pools together): past `max_queued`, the newest request of the lowest
        priority below this one's is shed to make room, or — none lower — this one is refused."""
        pools = self.pools.all()
        if self.per_tenant:
            mine = sum(p.queue.tenants.get(ticket.tenant, 0) for p in pools)
            others = len({t for p in pools for t in p.queue.tenants} - {ticket.tenant})
            if mine + 1 > share_cap(self.config.max_queued, others):
                raise Shed("tenant_queue_full", f"{mine} of your requests are waiting for an engine slot: your "
                                                "share of the waiting room")
        if sum(len(p.queue) for p in pools) < self.config.max_queued:
            return
        victims = [(v.priority, -v.seq, v, p) for p in pools if (v := p.queue.victim(ticket.priority)) is not None]
        if not victims:
            raise Shed("queue_full", f"{self.config.max_queued} requests are waiting for an engine slot")
        _, _, victim, pool = min(victims, key=lambda x: x[:2])
        pool.queue.remove(victim)
        victim.refuse(Shed("shed", "shed for requests of a higher priority while every engine is busy"))

    # ---- lifecycle -------------------------------------------------------------------------------------------
    async def start(self, discovery=None, own_service=None, prefill_discovery=None) -> None:
        """Start polling the engines (found by `discovery`); a per-service gateway with `own_service`
        (own_service.OwnService) also watches its InferenceService's spec (declared adapters), and with
        `prefill_discovery` sends each completion's prefill to the prefill engines it finds (disaggregation.py)."""
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=30),
            auto_decompress=False,  # bytes pass through as the engine sent them
            skip_auto_headers=("Accept", "Accept-Encoding", "User-Agent", "Content-Type"),
            cookie_jar=aiohttp.DummyCookieJar(),
        )
        if self.batches is not None:  # resumes the directory's unfinished batches as engines appear
            await self.batches.runner.start()
        for engine_waker in self._engine_wakers.values():
            engine_waker.session = self.session
        if self.pools.shared:  # its pools open (and start polling) as the InferenceServices are listed
            await self.pools.start(self.session)
            return
        if discovery is not None:
            self.tasks.append(asyncio.create_task(discovery.run(self.backends), name="gateway-discovery"))
        if prefill_discovery is not None:
            from shoal.operator.gateway.disaggregation import RemotePrefill

            prefill = BackendSet(self.config.health)
            self.remote_prefill = RemotePrefill(prefill, self.config.response_timeout, self.metrics)
            self.tasks.append(asyncio.create_task(prefill_discovery.run(prefill), name="gateway-prefill-discovery"))
        if own_service is not None:
            self.tasks.append(asyncio.create_task(own_service.run(self.pools.pool), name="gateway-own-service"))
        self._start_polling(self.pools.pool, self.config.runtime)

    async def stop(self) -> None:
        if self.batches is not None:  # batch requests in flight run again after a restart; finished ones never
            await self.batches.runner.stop()
        if self.pools.shared:
            await self.pools.stop()
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for poller, task in self._pollers.values():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await poller.close()
        for waker in self._wakers.values():
            await waker.close()
        for engine_waker in self._engine_wakers.values():
            engine_waker.close()
        for subscribers in self._kv_subscribers.values():
            await subscribers.close()
        if self.session is not None:
            await self.session.close()
        if self.tracer is not None:
            await asyncio.to_thread(self.tracer.shutdown)

    def start_draining(self) -> None:
        """Readiness fails from now on, and requests waiting for an engine are answered 503 at once."""
        self.draining = True
        for pool in self.pools.all():
            pool.start_draining()

    # ---- routing ---------------------------------------------------------------------------------------------
    def prompt_hashes(self, path: str, parsed: Any, model: str | None, pool: Pool) -> list[bytes]:
        if self.config.routing not in ("prefix-load", "precise-prefix") or path not in ROUTED_PATHS or parsed is None:
            return []
        text = render_prompt(path, parsed)
        if text and model and any(model in b.lora_resident for b in pool.backends.all()):
            text = f"{model}\n{text}"  # engines cache each adapter's blocks apart: so does the prefix index
        salt = parsed.get("cache_salt") if isinstance(parsed, dict) else None
        if text and isinstance(salt, str) and salt:
            text = f"{salt}\n{text}"  # vLLM caches a salted prompt apart (its tenant's): so does the prefix index
        return block_hashes(text, self.config.block_chars, self.config.max_blocks) if text else []

    async def prompt_tokens(self, path: str, parsed: Any, model: str | None, pool: Pool) -> list[int] | None:
        """The prompt's token ids for precise-prefix routing: with --tokenizer, completion prompts here
        (kv_tokens.py); otherwise, and for chat or a completion with images, from an engine's /tokenize (the engine
        renders the chat template and places the images itself, so the ids are the ones it will cache). None whenever the ids cannot be had: the approximate index
        routes then. (A LoRA adapter's requests have the base model's tokenizer; the pool matches them against the
        blocks each engine stored under the adapter.)"""
        if not self.precise or path not in ROUTED_PATHS or not isinstance(parsed, dict):
            return None
        if parsed.get("cache_salt"):
            # vLLM hashes it into the prompt's blocks; the index holds no salted block (kv_index.py), so a tenant's
            # salted prompt is never matched against blocks hashed without its salt
            self.metrics.precise_fallbacks.labels("cache_salt").inc()
            return None
        # A completion with images (Shoal's multi_modal_data): only an engine knows its images' placements and
        # digests, so it is tokenized there like a chat.
        images = path.endswith("/completions") and bool(parsed.get("multi_modal_data"))
        if self.prompt_tokenizer is not None and not images:
            tokens = self.prompt_tokenizer.token_ids(path, parsed)
            if tokens is not None or not path.endswith("/chat/completions"):
                return tokens
        return await self._engine_tokens(path, parsed, pool)

    async def _engine_tokens(self, path: str, parsed: dict, pool: Pool) -> list[int] | None:
        body: dict[str, Any] = {"model": parsed.get("model")}
        if path.endswith("/chat/completions"):
            for key in ("messages", "tools", "chat_template_kwargs", "add_generation_prompt",
                        "continue_final_message"):
                if key in parsed:
                    body[key] = parsed[key]
        else:
            prompt = parsed.get("prompt")
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
                prompt = prompt[0]
            images = parsed.get("multi_modal_data")
            if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
                return None if images else prompt  # ids with images: their placements are the engine's to say
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
                prompt = prompt[0]
            if not isinstance(prompt, str):
                return None
            body["prompt"] = prompt
            for key in ("add_special_tokens", "multi_modal_data"):
                if key in parsed:
                    body[key] = parsed[key]
        engines = pool.backends.eligible()
        if not engines or self.session is None:
            return None
        kv_index = getattr(pool.router, "kv_index", None)
        if kv_index is not None and not any(v.blocks for v in kv_index.views.values()):
            self.metrics.precise_fallbacks.labels("no_events").inc()
            return None  # no engine reports a block: no ids could match, so no round trip for them
        now = time.monotonic()
        if self._tokenize_down.get(pool, now) > now:
            self.metrics.precise_fallbacks.labels("tokenizer_unavailable").inc()
            return None
        try:
            async with self.session.post(engines[0].url + "/tokenize", json=body, headers=self.poll_headers(pool),
                                         timeout=aiohttp.ClientTimeout(total=self.config.tokenize_timeout)) as r:
                if r.status in (400, 413, 422):  # this prompt refused (too long, malformed): not the engines' fault
                    self.metrics.precise_fallbacks.labels("tokenize_refused").inc()
                    return None
                if r.status != 200:
                    raise ValueError(f"HTTP {r.status} from {engines[0].url}/tokenize")
                answer = await r.json(content_type=None)
                tokens = answer.get("tokens")
                if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
                    raise ValueError(f"{engines[0].url}/tokenize answered no token ids")
                images = tokenized_images(answer.get("images"))
                if images:
                    tokens = PromptTokens(tokens, images)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, AttributeError) as e:
            self._tokenizer_unavailable(pool, e)
            return None
        if self._tokenize_down.pop(pool, None) is not None:
            log.info("precise-prefix: the engines of %s tokenize again", pool.key or "the pool")
        return tokens

    def _tokenizer_unavailable(self, pool: Pool, error: BaseException) -> None:
        """The pool's engines could not tokenize: its requests route by the approximate index (prefix-load's
        scoring) for tokenize_backoff seconds, then the engines are asked again."""
        self.metrics.precise_fallbacks.labels("tokenize_failed").inc()
        if pool not in self._tokenize_down:
            log.warning("precise-prefix: the engines of %s cannot tokenize (%s): its requests route by the "
                        "approximate prefix index, asked again every %gs", pool.key or "the pool",
                        str(error) or type(error).__name__, self.config.tokenize_backoff)
        self._tokenize_down[pool] = time.monotonic() + self.config.tokenize_backoff

    def engine_body(self, pool: Pool, ticket: Ticket, body: bytes, parsed: Any) -> bytes:
        """The body the engine gets: the client's, with an engine priority for engines that schedule by it (vLLM's
        `priority` field: lower runs first), overriding whatever a client put there. The model's priority ranks
        first (higher spec.priority, lower value); within it, a request whose tenant was below its fair share of
        the engine when it was sent (Ticket.share < 0: a trickle next to a flood) ranks ahead by as much, so the
        engine starts it before the flood's remaining prefill (scheduler.py). Every other request ranks 0: they
        keep their arrival order among themselves (one tenant alone is always at its share)."""
        if not isinstance(parsed, dict):
            return body
        if "kv_transfer_params" in parsed:  # a router's field: a client never tells an engine where to pull KV from
            parsed = {k: v for k, v in parsed.items() if k != "kv_transfer_params"}
            body = json.dumps(parsed).encode()
        if not pool.engine_priority:  # a client never sets its own rank, whatever the engines' policy
            return json.dumps({k: v for k, v in parsed.items() if k != "priority"}).encode() \
                if "priority" in parsed else body
        rank = -ticket.priority * ENGINE_PRIORITY_SPAN + max(-(ENGINE_PRIORITY_SPAN // 2), min(ticket.share, 0))
        return json.dumps({**parsed, "priority": rank}).encode()

    def poll_headers(self, pool: Pool) -> dict[str, str]:
        """What the poller sends with /v1/models: the engines' key (the shared gateway's per service; a per-service
        gateway's --api-key, or the newest line of --api-key-file, which the engines share)."""
        if self.pools.shared:
            key = self.engine_key(pool)
        elif isinstance(self.config.api_key, KeySet):
            key = self._newest_key(self.config.api_key)
        else:
            key = self.config.api_key
        return {"Authorization": f"Bearer {key}"} if key else {}

    def _newest_key(self, keys: KeySet) -> str | None:
        """The first line of --api-key-file (the newest key during a rotation), read at most once a second."""
        now = time.monotonic()
        if keys.path and now - self._key_read[0] >= 1.0:
            try:
                self._key_read = (now, read_keys(keys.path)[0])
            except (OSError, ValueError):
                self._key_read = (now, self._key_read[1])  # a half-written file: keep the key read before
        return self._key_read[1]

    def engine_key(self, pool: Pool) -> str | None:
        """The engines' own key of a shared gateway's pool (--engine-keys, read anew when the Secret changes)."""
        keys = self.config.engine_keys
        return keys.key_for(pool.namespace, pool.name) if keys is not None and pool.name else None

    def other_engine_key(self, pool: Pool) -> str | None:
        """The second key of a shared gateway's pool (the previous one during a rotation), if its Secret has one."""
        keys = self.config.engine_keys
        listed = keys.keys_for(pool.namespace, pool.name) if keys is not None and pool.name else []
        return listed[1] if len(listed) > 1 else None

    def engine_headers(self, request: web.Request, pool: Pool, tenant: str) -> dict[str, str]:
        # the tenant header is the gateway's to set (a client's own would claim another's stored responses)
        headers = {k: v for k, v in request.headers.items()
                   if k.lower() not in HOP_BY_HOP and k.lower() != TENANT_HEADER.lower()}
        key = self.engine_key(pool) if self.pools.shared else None
        if self.pools.shared and (self.tenancy.authenticates or key):
            # a tenant's key is the gateway's to check, never the engines' to see; the engines get their own
            headers = {k: v for k, v in headers.items() if k.lower() not in KEY_HEADERS}
            if key:
                headers["Authorization"] = f"Bearer {key}"
            if self.tenancy.authenticates:  # every tenant comes with the engines' key: the tenant owns what it stores
                headers[TENANT_HEADER] = tenant
        forwarded = request.headers.get("X-Forwarded-For")
        headers["X-Forwarded-For"] = f"{forwarded}, {request.remote}" if forwarded else (request.remote or "")
        return headers

    # ---- handlers --------------------------------------------------------------------------------------------
    def _authenticate(self, request: web.Request) -> Caller | None:
        """The request's caller, or None: refuse it (401)."""
        if self.config.api_key and not authorized(request, self.config.api_key):
            return None
        return self.tenancy.identify(request)

    def _unauthenticated(self) -> web.Response:
        self.metrics.rejected.labels("unauthenticated").inc()
        return error_response(401, "Invalid or missing API key (send 'Authorization: Bearer <key>' or "
                                   "'X-API-Key: <key>').",
                              "invalid_request_error", "invalid_api_key")

    async def handle_proxy(self, request: web.Request) -> web.StreamResponse:
        caller = self._authenticate(request)
        if caller is None:
            return self._unauthenticated()
        if request.path in ADMIN_PATHS or (self.pools.shared and request.path not in SHARED_PATHS
                                           and stored_reference(request, None) is None):
            return await self.not_found(request)
        c, tenant = self.config, caller.tenant
        if self.pending >= c.max_pending or \
                (self.per_tenant and not self.pending_shares.admits(tenant, 1, c.max_pending)):
            reason = "too_many_pending" if self.pending >= c.max_pending else "tenant_pending"
            self.metrics.rejected.labels(reason).inc()
            return error_response(429, f"the gateway has {self.pending} requests pending" + (
                "" if reason == "too_many_pending" else ", your share of them") + "; retry later",
                "rate_limit_error", reason, {"Retry-After": str(c.retry_after)})
        # a body of unknown length (chunked) may be as large as max_body_bytes: reserve that much
        reserve = 0 if not request.can_read_body else min(request.content_length or c.max_body_bytes,
                                                          c.max_body_bytes)
        if self.buffered + reserve > c.max_buffered_bytes or \
                (self.per_tenant and not self.buffer_shares.admits(tenant, reserve, c.max_buffered_bytes)):
            reason = "too_much_buffered" if self.buffered + reserve > c.max_buffered_bytes else "tenant_buffered"
            self.metrics.rejected.labels(reason).inc()
            return error_response(429, f"the gateway holds {self.buffered} bytes of request bodies" + (
                "" if reason == "too_much_buffered" else ", your share of them") + "; retry later",
                "rate_limit_error", reason, {"Retry-After": str(c.retry_after)})
        self.pending += 1
        self.buffered += reserve
        self.pending_shares.take(tenant, 1)
        self.buffer_shares.take(tenant, reserve)
        self.metrics.pending.inc()
        trace = self.tracer.request(request.headers, request.path, tenant) if self.tracer is not None else None
        request[TRACE_KEY] = trace
        status = 499  # the client went away
        try:
            response = await self._forward(request, caller)
            status = response.status
            return response
        finally:
            self.pending -= 1
            self.buffered -= reserve
            self.pending_shares.give(tenant, 1)
            self.buffer_shares.give(tenant, reserve)
            self.metrics.pending.dec()
            if trace is not None:
                trace.end(status)

    def _unavailable(self) -> web.Response:
        self.metrics.rejected.labels("no_backend").inc()
        self.metrics.requests.labels("none", "503").inc()
        return error_response(503, "no ready backend can serve this request; retry shortly",
                              "service_unavailable", "no_backend", {"Retry-After": str(self.config.retry_after)})

    async def _forward(self, request: web.Request, caller: Caller) -> web.StreamResponse:
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            self.metrics.rejected.labels("body_too_large").inc()
            return error_response(413, f"request body exceeds {self.config.max_body_bytes} bytes",
                                  "invalid_request_error", "body_too_large")
        parsed = parse_body(request.path, body)
        # a stored response lives in one engine's memory: its id's tag says which (gateway_contract.py)
        stored = stored_reference(request, parsed)
        instance = instance_of(stored[0]) if stored is not None else None
        if stored is not None and request.method != "POST" and (instance is not None or self.pools.shared):
            # GET/DELETE /v1/responses/{id}: no body and no model, only the id
            model, pool = None, await self._pool_storing(instance, self.pools.usable(caller.namespace))
            if pool is None:  # no engine of the caller's has it: the engine's own answer for an unknown id
                return stored_not_found(stored[1])
        else:
            model = model_of(parsed) if request.path in (SHARED_PATHS if self.pools.shared else ROUTED_PATHS) \
                else None
            try:
                pool = self.pools.resolve(model, caller.namespace)
            except LookupError as e:  # fleet.ModelAmbiguous: several namespaces granting the caller serve it
                self.metrics.rejected.labels("ambiguous_model").inc()
                return error_response(409, str(e), "invalid_request_error", "model_ambiguous", param="model")
            if pool is not None and instance is not None and await self._pool_storing(instance, [pool]) is None:
                return stored_not_found(stored[1])  # `previous_response_id` of no engine of this model's
        if pool is None:  # the shared gateway: the model names which service
            if parsed is None:
                return error_response(400, "the request body must be a JSON object naming a `model`",
                                      "invalid_request_error", "invalid_body")
            self.metrics.rejected.labels("unknown_model" if model else "no_model").inc()
            if not model:
                return error_response(400, "`model` is required: this endpoint serves several models",
                                      "invalid_request_error", "model_required", param="model")
            return model_not_found(model)
        ticket = Ticket(priority=pool.priority_of(model), tenant=caller.tenant,
                        cost=request_cost(len(body), parsed) if request.method == "POST" else 1.0,
                        model=model, hashes=self.prompt_hashes(request.path, parsed, model, pool),
                        tokens=await self.prompt_tokens(request.path, parsed, model, pool), instance=instance)
        if pool.backends.split:  # a canary revision exists (its share may be 0: then nothing goes there)
            ticket.revision = canary.revision_for(canary.conversation_key(request.headers, parsed),
                                                  pool.backends.canary_percent)
        if not self.quotas.policy.on:
            return await self._dispatch(request, pool, ticket, body, parsed, {})
        try:
            limits = self.quotas.admit(caller.tenant, ticket.cost)
        except OverQuota as e:
            self.metrics.rejected.labels(e.reason).inc()
            return error_response(429, str(e), "rate_limit_error", e.reason, {
                **e.headers, "Retry-After": str(max(1, math.ceil(e.retry_after))),
                "retry-after-ms": str(math.ceil(e.retry_after * 1000))})
        try:
            return await self._dispatch(request, pool, ticket, body, parsed, limits)
        finally:
            self.quotas.release(caller.tenant)

    async def _pool_storing(self, instance: str | None, pools: list[Pool]) -> Pool | None:
        """The pool of `pools` whose engine tags its stored responses `instance` (None: none). Engines this gateway
        has not heard from yet (it just started, or they just appeared) are waited for, a poll's time at most, so
        every replica finds the engine, not only the one that sent the response's first request."""
        deadline = time.monotonic() + self.config.poll_interval + self.config.poll_timeout
        while instance is not None:
            for pool in pools:
                if pool.storing(instance) is not None:
                    return pool
            if time.monotonic() >= deadline or all(b.last_answer is not None for p in pools for b in p.backends.all()):
                break
            await asyncio.sleep(0.05)
        return None

    async def _dispatch(self, request: web.Request, pool: Pool, ticket: Ticket, body: bytes, parsed: Any,
                        limits: dict[str, str]) -> web.StreamResponse:
        model = ticket.model
        trace = request.get(TRACE_KEY)
        if trace is not None:
            trace.queue_started(model)
        try:
            backend = await pool.admit(ticket, self.enqueue)
        except AdapterNotLoaded as e:
            self.metrics.rejected.labels("adapter_not_loaded").inc()
            self.metrics.requests.labels("none", "503").inc()
            return error_response(503, str(e), "service_unavailable", "adapter_not_loaded",
                                  {"Retry-After": str(self.config.retry_after)}, param="model")
        except Unavailable:
            return self._unavailable()
        except Shed as e:
            self.metrics.rejected.labels(e.reason).inc()
            return error_response(429, str(e), "rate_limit_error", e.reason,
                                  {"Retry-After": str(self.config.retry_after)})
        except LookupError:  # the service was deleted while the request waited (fleet.ModelNotFound)
            return model_not_found(model or "")
        if trace is not None:
            trace.queue_ended("admitted")
        body = self.engine_body(pool, ticket, body, parsed)
        headers = self.engine_headers(request, pool, ticket.tenant)
        remote = pool.remote_prefill or self.remote_prefill  # the shared gateway's per service, else --prefill-*
        if remote is not None and remote.applies(request.path, parsed) and \
                not pool.is_adapter(model, time.monotonic()):  # an adapter's KV roots differ per engine
            params = await remote.prefill(self.session, request.path, parsed, headers)
            if params is not None:
                body = json.dumps({**json.loads(body), "kv_transfer_params": params}).encode()
        tried: tuple[Backend, ...] = ()
        retry_reason: str | None = None
        sent_at = time.monotonic()
        while True:
            tried += (backend,)
            retry: Backend | None = None
            try:
                if trace is not None:
                    trace.attempt_started(backend.url, headers, retry_reason, len(tried), pool.router.name,
                                          ticket.pick)
                upstream = await self._send(pool, backend, request, headers, body)
                if not isinstance(upstream, str) and upstream.status == 401 and \
                        (other := self.other_engine_key(pool)) is not None:
                    # a key rotation under way: the engine does not know the newest key yet (or no longer the
                    # old one); the Secret lists both, so try the other once
                    upstream.release()
                    headers = {**headers, "Authorization": f"Bearer {other}"}
                    upstream = await self._send(pool, backend, request, headers, body)
                if trace is not None and (isinstance(upstream, str) or upstream.status in RETRY_STATUSES):
                    trace.attempt_ended(upstream if isinstance(upstream, str) else f"status_{upstream.status}")
                if upstream == "timeout":  # the engine may still be running it: never a second run elsewhere
                    self.metrics.requests.labels(backend.url, "504").inc()
                    self.metrics.revision_outcome(backend.revision, "504")
                    return error_response(504, f"the engine did not answer within {self.config.response_timeout:g}"
                                               " s; the request was cancelled", "timeout", "engine_timeout")
                if isinstance(upstream, str):
                    # the engine failed the attempt (refused, reset): its revision's error even when retried
                    self.metrics.revision_outcome(backend.revision, "503")
                    if len(tried) == 1 and (retry := pool.pick(ticket, tried, room=False)) is not None:
                        self.metrics.retries.labels(upstream).inc()
                        retry_reason = upstream
                        continue
                    return self._unavailable()
                if (upstream.status in RETRY_STATUSES or (upstream.status == 404 and pool.is_adapter(
                        model, time.monotonic()))) and len(tried) == 1 and \
                        (retry := pool.pick(ticket, tried, room=False)) is not None:
                    # a 404 for an adapter: this engine dropped it since its last poll (unloaded, restarted);
                    # another that lists it serves it
                    self.metrics.retries.labels(f"status_{upstream.status}").inc()
                    retry_reason = f"status_{upstream.status}"
                    if trace is not None:
                        trace.attempt_ended(retry_reason)
                    upstream.release()
                    continue
                return await self._relay(request, backend, upstream, limits, sent_at=sent_at)
            finally:
                pool.release(backend, ticket)
                backend = retry  # type: ignore[assignment]

    async def _send(self, pool: Pool, backend: Backend, request: web.Request, headers: dict, body: bytes):
        """The engine's response (headers received), or why it failed: one of RETRY_REASONS (the engine never
        accepted the request; worth one retry elsewhere) or "timeout" (no answer within response_timeout; the
        request is cancelled there, and not retried)."""
        # Body silence is bounded in _relay, once the response started; until then only response_timeout holds.
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.config.connect_timeout, sock_read=None)
        deadline = asyncio.timeout(self.config.response_timeout)
        try:
            async with deadline:
                return await self.session.request(request.method, backend.url + request.rel_url.raw_path_qs,
                                                  headers=headers, data=body or None, timeout=timeout,
                                                  allow_redirects=False)
        except aiohttp.ClientConnectorError:
            backend.on_refused(time.monotonic())
            pool.backends.notify()
            reason = "refused"
        except asyncio.TimeoutError:
            if deadline.expired():
                # a long generation, or an engine that hangs: its liveness probe and the poller judge it, not
                # the circuit breaker
                reason = "timeout"
            else:
                backend.on_failure(time.monotonic())
                reason = "connect_timeout"
        except (aiohttp.ClientError, OSError):
            backend.on_failure(time.monotonic())
            reason = "reset"
        log.warning("%s %s: engine %s failed before responding (%s)", request.method, request.path, backend.url,
                    reason)
        return reason

    async def _relay(self, request: web.Request, backend: Backend, upstream: aiohttp.ClientResponse,
                     limits: dict[str, str], sent_at: float | None = None):
        if upstream.status < 500:
            backend.on_success()
        code = str(upstream.status)
        out = web.StreamResponse(status=upstream.status, reason=upstream.reason)
        for k, v in upstream.headers.items():
            if k.lower() not in HOP_BY_HOP or k.lower() == "content-length":
                out.headers.add(k, v)
        out.headers.update(limits)  # the tenant's quotas, as OpenAI reports them
        first_byte: float | None = None
        trace = request.get(TRACE_KEY)
        usage = trace.usage_reader(upstream.headers.get("Content-Type", "")) if trace is not None else None
        try:
            await _to_client(out.prepare(request))
            loop = asyncio.get_running_loop()
            async with asyncio.timeout(self.config.read_timeout) as silence:
                while chunk := await upstream.content.readany():
                    if first_byte is None and sent_at is not None:
                        first_byte = time.monotonic() - sent_at
                    await _to_client(out.write(chunk))
                    if usage is not None:
                        usage.feed(chunk)
                    silence.reschedule(loop.time() + self.config.read_timeout)
            await _to_client(out.write_eof())
        except ClientGone:
            # the client went away while we wrote to it: the engine did nothing wrong (no circuit strike, no
            # retry); closing the upstream below aborts the request there
            code = "client_closed"
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            # The engine failed mid-answer: bytes already reached the client, so no retry; cut the connection
            # so the client sees an incomplete response rather than a silently truncated one.
            log.warning("engine %s failed mid-response: %r", backend.url, e)
            backend.on_failure(time.monotonic())
            code = "broken"
            if request.transport is not None:
                request.transport.close()
        except (ConnectionResetError, asyncio.CancelledError):
            code = "client_closed"
            raise
        finally:
            upstream.close()  # no-op after a full read; otherwise the engine sees a disconnect and aborts
            if usage is not None:
                usage.close()
            self.metrics.requests.labels(backend.url, code).inc()
            self.metrics.revision_outcome(backend.revision, code, first_byte)
        return out

    async def readyz(self, request: web.Request) -> web.Response:
        if self.draining:
            return web.json_response({"status": "draining"}, status=503)
        engines = sum(len(p.backends.eligible()) for p in self.pools.all())
        # While it may hold requests (scale from zero), the gateway is ready with no engine at all; so is the
        # shared gateway, whose models come and go (an unknown one is a 404, not the gateway's failure).
        if engines or self.config.hold_timeout > 0 or self.pools.shared:
            return web.json_response({"status": "ready", "backends": engines})
        return web.json_response({"status": "no_ready_backend"}, status=503)

    async def list_models(self, request: web.Request) -> web.Response:
        """The shared gateway's /v1/models: the models the caller may use (fleet.Fleet.models)."""
        caller = self._authenticate(request)
        if caller is None:
            return self._unauthenticated()
        return web.json_response({"object": "list", "data": self.pools.models(caller.namespace)})

    async def get_model(self, request: web.Request) -> web.Response:
        caller = self._authenticate(request)
        if caller is None:
            return self._unauthenticated()
        model = request.match_info["model"]
        for card in self.pools.models(caller.namespace):
            if card["id"] == model:
                return web.json_response(card)
        return model_not_found(model)

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": __version__})

    async def livez(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "alive"})

    async def metrics_route(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def not_found(self, request: web.Request) -> web.Response:
        return error_response(404, f"no route {request.method} {request.path} on the gateway",
                              "invalid_request_error", "not_found")


class ClientGone(Exception):
    """Writing to the client failed: it disconnected (never the engine's failure)."""


async def _to_client(write) -> None:
    """A write toward the client; its connection errors (aiohttp's ClientConnectionResetError is both a
    ClientError and a ConnectionResetError, so it would pass for the engine's) become ClientGone."""
    try:
        await write
    except (ConnectionError, aiohttp.ClientConnectionResetError) as e:
        raise ClientGone() from e


def build_metrics_app(gateway: Gateway) -> web.Application:
    """`--metrics-port`: /metrics alone, for a listener a service mesh leaves out of its mTLS (the operator's
    autoscaler, outside the mesh, reads the load there); nothing else is served on it."""
    app = web.Application()
    app.router.add_get("/metrics", gateway.metrics_route)
    return app


def model_not_found(model: str) -> web.Response:
    """OpenAI's answer for an unknown model; it names no other model (those may not be the caller's to see)."""
    return error_response(404, f"The model `{model}` does not exist.", "invalid_request_error", "model_not_found",
                          param="model")


def stored_not_found(error: dict) -> web.Response:
    """A stored response no engine of the caller's has: the very answer the engine gives for an unknown id, so
    nobody learns whether it exists elsewhere (another tenant's, another model's)."""
    return error_response(404, error["message"], error["type"], error["code"], param=error["param"])


def build_app(gateway: Gateway) -> web.Application:
    app = web.Application(client_max_size=gateway.config.max_body_bytes, middlewares=[anthropic_errors])
    r = app.router
    if gateway.pools.shared:
        r.add_get("/v1/models", gateway.list_models)
        r.add_get("/v1/models/{model}", gateway.get_model)
        r.add_get("/version", gateway.version)
    if gateway.batches is not None:  # before the proxied /v1/* routes
        gateway.batches.add_routes(r)
    for path in ("/v1/{tail:.*}", "/tokenize", "/detokenize", "/version"):
        r.add_route("*", path, gateway.handle_proxy)
    r.add_get("/readyz", gateway.readyz)
    r.add_get("/health", gateway.readyz)
    r.add_get("/livez", gateway.livez)
    r.add_get("/metrics", gateway.metrics_route)
    r.add_route("*", "/{tail:.*}", gateway.not_found)
    return app
