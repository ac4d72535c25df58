"""The aiohttp application: routes, auth, OpenAI error bodies, health with Kubernetes semantics, metrics.

Routes
  POST /v1/completions, /v1/chat/completions     OpenAI shapes, `stream: true` as SSE ending in `data: [DONE]`
  POST /v1/responses, GET/DELETE /v1/responses/{id}  OpenAI's Responses API on the chat path (responses_api.py)
  POST /v1/messages, /v1/messages/count_tokens   Anthropic's Messages API on the chat path (anthropic_api.py),
                                                 errors in Anthropic's body
  POST /v1/embeddings                            OpenAI's embeddings, pooled hidden states (embeddings_api.py)
  GET  /v1/models, /version                      adapters listed with `parent` (--enable-lora)
  POST /v1/load_lora_adapter, /unload_lora_adapter  vLLM's bodies: {"lora_name", "lora_path"} / {"lora_name"}
  POST /tokenize, /detokenize                    vLLM's shapes
  GET  /tokenizer_info                           vLLM's: the tokenizer's class and configuration
  GET  /metrics                                  Prometheus text (per-app registry)
  GET  /startupz /readyz /livez                  model loaded / serving (a full queue too) / loop alive
  GET  /health                                   vLLM's: model loaded and engine loop alive (503 while loading)
  POST /sleep?level=1|2, /wake_up; GET /is_sleeping  vLLM's sleep mode (--enable-sleep-mode), with memory figures
  POST /reset_prefix_cache                       vLLM's: forget every cached prefix (409 while requests hold blocks)

`--api-key` protects every route except the health endpoints and /metrics. Access logs carry method, path,
status and duration, never bodies (so never prompt text); health and metrics requests are not logged.
"""

from __future__ import annotations

import logging

from aiohttp import web
from aiohttp.abc import AbstractAccessLogger

from shoal.engine import startup
from shoal.engine.core.async_engine import AsyncEngine, EngineError
from shoal.engine.core.engine import SleepError
from shoal.engine.server import anthropic_api, embeddings_api, kv_transfer_api
from shoal.engine.server import openai_api as oai
from shoal.engine.server import responses_api
from shoal.engine.server.common import (
    STATE_KEY,
    ServerState,
    api_error_response,
    check_model,
    engine_error_to_api_error,
    get_state,
    json_response,
    read_json,
    require_loaded,
)
from shoal.engine.server.images import chat_images, completion_images
from shoal.engine.server.keys import KeySet
from shoal.engine.server.metrics import ServerMetrics
from shoal.engine.server.response_store import ResponseStore
from shoal.engine.server.protocol import (
    APIError,
    DetokenizeRequest,
    LoadLoRAAdapterRequest,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
)

logger = logging.getLogger("shoal.engine.server")

OPEN_PATHS = frozenset({"/health", "/livez", "/readyz", "/startupz", "/metrics"})
QUIET_PATHS = OPEN_PATHS


def version() -> str:
    try:
        from importlib.metadata import version as v

        return v("shoal")
    except Exception:  # noqa: BLE001
        return "0.0.0"


# --------------------------------------------------------------------------------------------- middlewares
@web.middleware
async def error_middleware(request: web.Request, handler):
    try:
        return await _errors_as_responses(request, handler)
    except APIError as e:  # Anthropic's clients read Anthropic's error body
        return anthropic_api.error_response(e) if request.path.startswith(anthropic_api.PREFIX) else \
            api_error_response(e)


async def _errors_as_responses(request: web.Request, handler):
    """The handler's answer; bad input, unknown routes and bugs as APIError (never a crash, never a traceback)."""
    try:
        return await handler(request)
    except APIError:
        raise
    except web.HTTPException as e:
        if e.status < 400:
            raise
        msg = {404: f"route {request.method} {request.path} not found",
               405: f"method {request.method} not allowed on {request.path}",
               413: "request body too large"}.get(e.status, e.reason)
        raise APIError(msg, e.status, code=None) from None
    except (ConnectionResetError, ConnectionError):
        raise
    except Exception:  # noqa: BLE001 - a bug, not bad input: log it and answer 500, never crash
        logger.exception("unhandled error on %s %s", request.method, request.path)
        raise APIError("internal server error", 500) from None


@web.middleware
async def auth_middleware(request: web.Request, handler):
    keys = get_state(request).api_keys
    if keys is not None and request.path not in OPEN_PATHS:
        given = request.headers.get("Authorization", "")
        token = given[7:].strip() if given[:7].lower() == "bearer " else request.headers.get("X-API-Key", "")
        if not keys.accepts(token.strip()):
            raise APIError("Invalid or missing API key (send 'Authorization: Bearer <key>' or 'X-API-Key: <key>').", 401,
                           code="invalid_api_key")
    return await handler(request)


class AccessLogger(AbstractAccessLogger):
    """Method, path (no query), status, size, duration. Never bodies; health and metrics not logged."""

    def log(self, request, response, time):  # noqa: A002 - aiohttp's signature
        if request.path in QUIET_PATHS:
            return
        self.logger.info('%s "%s %s" %s %s %.3fs', request.remote, request.method, request.path,
                         response.status, response.body_length, time)

    @property
    def enabled(self) -> bool:
        return self.logger.isEnabledFor(logging.INFO)


# --------------------------------------------------------------------------------------------- health/misc
STARTUP_WAIT_LIMIT = 30.0  # seconds /startupz?wait= may hold a probe


async def startupz(request: web.Request) -> web.Response:
    """200 once the model is loaded, 503 before (or after a failed load). `?wait=S` (at most 30): while loading,
    the answer is held up to S seconds and given the moment the model is loaded — the startup probe's long poll,
    so the kubelet sees a finished start at once instead of at its probe's next period."""
    eng = get_state(request).engine
    raw = request.query.get("wait", "0")
    try:
        wait = float(raw)
    except ValueError:
        wait = -1.0
    if not 0 <= wait <= STARTUP_WAIT_LIMIT:
        raise APIError(f"wait must be a number of seconds from 0 to {STARTUP_WAIT_LIMIT:.0f}, got {raw!r}", 400,
                       param="wait")
    if wait and not eng.is_loaded and eng.fatal_error is None:
        try:
            await eng.wait_loaded(wait)
        except (TimeoutError, EngineError):  # still loading, or the load failed: answered below
            pass
    if eng.is_loaded:  # with where the start-up went (shoal.engine.startup: seconds per phase)
        startup.ready()  # (this answer may come before the server's own "ready" line)
        return json_response({"status": "started", "startup": startup.breakdown()})
    if eng.fatal_error is not None:
        return json_response({"status": "failed", "error": str(eng.fatal_error)}, 503)
    return json_response({"status": "loading"}, 503)


async def readyz(request: web.Request) -> web.Response:
    """`instance`: the tag this process puts in its stored responses' ids, read by the gateways' poll to route
    `previous_response_id` and GET/DELETE /v1/responses/{id} here (gateway_contract.py)."""
    eng = get_state(request).engine
    instance = request.app[responses_api.STORE_KEY].instance
    if eng.is_ready():
        return json_response({"status": "ready", "instance": instance})
    reason = ("failed" if eng.fatal_error is not None else "loading" if not eng.is_loaded
              else "not_alive" if not eng.is_alive() else "draining" if eng.draining
              else "sleeping" if eng.sleep_level else "not_ready")
    return json_response({"status": reason, "instance": instance}, 503)


async def livez(request: web.Request) -> web.Response:
    eng = get_state(request).engine
    if eng.is_alive():
        return json_response({"status": "alive", "heartbeat_age_s": round(eng.heartbeat_age(), 3)})
    reason = f"engine loop died: {eng.fatal_error}" if eng.fatal_error else "engine loop heartbeat is stale"
    return json_response({"status": "dead", "reason": reason}, 503)


async def health(request: web.Request) -> web.Response:
    """vLLM's meaning (vLLM listens only once ready, so clients poll /health and then send traffic): 200 only
    while the model is loaded and the engine loop alive; 503 while loading and once the loop stopped or died."""
    eng = get_state(request).engine
    return web.Response(status=200 if eng.is_healthy() else 503)


async def metrics_route(request: web.Request) -> web.Response:
    body, ctype = get_state(request).metrics.render()
    resp = web.Response(body=body)
    resp.headers["Content-Type"] = ctype
    return resp


async def version_route(request: web.Request) -> web.Response:
    return json_response({"version": version()})


async def models_route(request: web.Request) -> web.Response:
    state = get_state(request)
    require_loaded(state)
    eng = state.engine
    card = {
        "id": state.served_model_name,
        "object": "model",
        "created": state.created,
        "owned_by": "shoal",
        "root": eng.config.model,
        "parent": None,
        "max_model_len": eng.max_model_len,
        "permission": [],
        "input_modalities": ["text", "image"] if getattr(eng, "images", None) is not None else ["text"],
    }
    cards = [card]
    stats = eng.snapshot.stats
    for name, path, created in getattr(stats, "lora_registered", None) or []:
        cards.append({"id": name, "object": "model", "created": created, "owned_by": "shoal", "root": path,
                      "parent": state.served_model_name, "max_model_len": eng.max_model_len, "permission": []})
    return json_response({"object": "list", "data": cards})


async def load_lora_adapter(request: web.Request) -> web.Response:
    """vLLM's POST /v1/load_lora_adapter {"lora_name", "lora_path"}: validate, load on every rank, register."""
    return await _change_lora(request, LoadLoRAAdapterRequest, "lora_path", "added",
                              lambda engine, req: engine.add_lora(req.lora_name, req.lora_path))


async def unload_lora_adapter(request: web.Request) -> web.Response:
    """vLLM's POST /v1/unload_lora_adapter {"lora_name"}: unregister; its running requests finish first."""
    return await _change_lora(request, UnloadLoRAAdapterRequest, "lora_name", "removed",
                              lambda engine, req: engine.remove_lora(req.lora_name))


async def _change_lora(request: web.Request, body: type[LoadLoRAAdapterRequest | UnloadLoRAAdapterRequest],
                       param: str, done: str, change) -> web.Response:
    """The adapter endpoints' one path: vLLM's body, a loaded engine with LoRA on, `change(engine, body)` run in
    the engine (every rank); an engine's refusal is a client error on `param`, and success is vLLM's text."""
    state = get_state(request)
    req = await read_json(request, body)
    require_loaded(state)
    _require_lora(state)
    try:
        await state.engine.run_in_engine(lambda engine: change(engine, req))
    except (EngineError, ValueError) as e:
        raise engine_error_to_api_error(e, param) from None
    return web.Response(text=f"Success: LoRA adapter '{req.lora_name}' {done} successfully.")


# --------------------------------------------------------------------------------------------- sleep mode
def _require_sleep_mode(state: ServerState) -> None:
    require_loaded(state)
    if not state.engine.config.enable_sleep_mode:
        raise APIError("sleep mode is not enabled on this server (start it with --enable-sleep-mode)", 400,
                       code="sleep_mode_disabled")


def _sleep_state(eng: AsyncEngine, memory: dict) -> dict:
    return {"is_sleeping": bool(eng.sleep_level), "level": eng.sleep_level or None, **memory}


async def sleep_route(request: web.Request) -> web.Response:
    """vLLM's POST /sleep?level=1|2 (default 1). Refused with 409 while requests are in flight: they would lose
    their KV cache. Answers the state it sleeps in (/is_sleeping's body)."""
    state = get_state(request)
    _require_sleep_mode(state)
    raw = request.query.get("level", "1")
    if raw not in ("1", "2"):
        raise APIError(f"level must be 1 (free the KV cache, keep the weights) or 2 (free the weights too), "
                       f"got {raw!r}", 400, param="level")
    if state.engine.sleep_level:
        raise APIError(f"the engine is already asleep (level {state.engine.sleep_level}); POST /wake_up first", 400,
                       code="already_sleeping")
    try:
        memory = await state.engine.sleep(int(raw))
    except SleepError as e:
        raise APIError(str(e), 409 if e.conflict else 400, code="requests_in_flight" if e.conflict else None)
    return json_response(_sleep_state(state.engine, memory))


async def reset_prefix_cache_route(request: web.Request) -> web.Response:
    """vLLM's POST /reset_prefix_cache: every cached prefix forgotten (an AllBlocksCleared KV event). Refused with
    409 while requests hold KV blocks."""
    eng = get_state(request).engine
    if not await eng.run_in_engine(lambda engine: engine.reset_prefix_cache()):
        raise APIError("requests in flight hold KV blocks: the prefix cache can be reset once they finish", 409,
                       code="requests_in_flight")
    return json_response({"reset": True})


async def wake_up_route(request: web.Request) -> web.Response:
    """vLLM's POST /wake_up: weights back (level 1) or reloaded (level 2), a fresh KV cache, /readyz 200 again."""
    state = get_state(request)
    _require_sleep_mode(state)
    if not state.engine.sleep_level:
        raise APIError("the engine is awake; there is nothing to wake up", 400, code="not_sleeping")
    try:
        memory = await state.engine.wake_up()
    except SleepError as e:
        raise APIError(str(e), 400) from None
    return json_response(_sleep_state(state.engine, memory))


async def is_sleeping_route(request: web.Request) -> web.Response:
    """vLLM's GET /is_sleeping {"is_sleeping": bool}, plus the level and the KV-cache and weight bytes rank 0
    holds now (what sleep freed shows as 0)."""
    state = get_state(request)
    _require_sleep_mode(state)
    return json_response(_sleep_state(state.engine, await state.engine.memory_bytes()))


def _require_lora(state: ServerState) -> None:
    if not state.engine.config.enable_lora:
        raise APIError("LoRA adapters are not enabled on this server (start it with --enable-lora)", 400)


async def _tokenizer_request(request: web.Request, body: type[TokenizeRequest | DetokenizeRequest]):
    """The tokenizer endpoints' preamble: (state, the body for the served model, the tokenizer) once it is loaded."""
    state = get_state(request)
    req = await read_json(request, body)
    check_model(state, req.model)
    require_loaded(state)
    return state, req, state.engine.tokenizer


async def tokenize_route(request: web.Request) -> web.Response:
    state, req, tok = await _tokenizer_request(request, TokenizeRequest)
    if (req.prompt is None) == (req.messages is None):
        raise APIError("give exactly one of 'prompt' or 'messages'", 400)
    placed = None
    if req.prompt is not None:
        add_special = True if req.add_special_tokens is None else req.add_special_tokens
        ids = list(tok.encode(req.prompt, add_special_tokens=add_special))
        images = await completion_images(state, req.multi_modal_data, [ids])
    else:
        kwargs = dict(req.chat_template_kwargs or {})
        if req.tools:
            kwargs.setdefault("tools", req.tools)
        ids = oai.render_chat_prompt(state, [m for m in req.messages], req.add_generation_prompt,
                                 req.continue_final_message, kwargs,
                                 add_special_tokens=bool(req.add_special_tokens))
        images = await chat_images(state, req.messages)
    if images:  # each image's placeholder expanded to its tokens, as the engine counts them
        try:
            ids, placed = state.engine.images.place(ids, images, 1)
        except ValueError as e:
            raise APIError(str(e), 400, param="prompt" if req.prompt is not None else "messages") from None
    out = {"count": len(ids), "max_model_len": state.engine.max_model_len, "tokens": ids, "token_strs": None}
    if placed is not None:
        # Shoal's addition: where each image's tokens sit and the digest its KV blocks are keyed by (kv_hash), so a
        # precise-prefix router hashes the prompt's image blocks as the engine does (it cannot run the processor)
        out["images"] = [{"offset": o, "length": n, "digest": d.hex()} for o, n, d in placed.key_images]
    if req.return_token_strs:
        out["token_strs"] = tok.convert_ids_to_tokens(ids)
    return json_response(out)


async def detokenize_route(request: web.Request) -> web.Response:
    state, req, tok = await _tokenizer_request(request, DetokenizeRequest)
    vocab = len(tok)
    bad = [t for t in req.tokens if t < 0 or t >= vocab]
    if bad:
        raise APIError(f"token id {bad[0]} is out of range [0, {vocab})", 400, param="tokens")
    return json_response({"prompt": tok.decode(req.tokens)})


async def tokenizer_info_route(request: web.Request) -> web.Response:
    """vLLM's /tokenizer_info: the tokenizer's class and configuration (evaluation clients probe it)."""
    state = get_state(request)
    require_loaded(state)
    tok = state.engine.tokenizer
    info = {k: v for k, v in getattr(tok, "init_kwargs", {}).items()
            if isinstance(v, (str, int, float, bool, type(None))) or k == "added_tokens_decoder"}
    info.pop("added_tokens_decoder", None)  # AddedToken objects; not JSON
    info.update(tokenizer_class=type(tok).__name__, model_max_length=state.engine.max_model_len,
                vocab_size=len(tok), eos_token=tok.eos_token, bos_token=tok.bos_token, pad_token=tok.pad_token,
                chat_template=getattr(state.engine, "chat_template", None) or getattr(tok, "chat_template", None))
    return json_response(info)


# --------------------------------------------------------------------------------------------- app
async def _close_media(app: web.Application) -> None:
    await app[STATE_KEY].media.close()


def build_app(engine: AsyncEngine, metrics: ServerMetrics, *, api_key: str | KeySet | None = None,
              client_max_size: int = 64 * 1024 * 1024, tool_call_parser: str | None = None,
              response_store: ResponseStore | None = None, tracer=None) -> web.Application:
    """`api_key`: one key, or a KeySet (--api-key-file: several, re-read when the file changes)."""
    app = web.Application(middlewares=[error_middleware, auth_middleware], client_max_size=client_max_size)
    keys = api_key if isinstance(api_key, KeySet) else KeySet([api_key]) if api_key else None
    app[STATE_KEY] = ServerState(engine, metrics, keys, tool_call_parser)
    app[STATE_KEY].tracer = tracer
    app.on_cleanup.append(_close_media)
    r = app.router
    r.add_post("/v1/completions", oai.create_completion)
    r.add_post("/v1/chat/completions", oai.create_chat_completion)
    r.add_post("/v1/embeddings", embeddings_api.create_embedding)
    responses_api.add_routes(app, ResponseStore() if response_store is None else response_store)
    anthropic_api.add_routes(app)
    kv_transfer_api.add_routes(app)
    r.add_get("/v1/models", models_route)
    r.add_post("/v1/load_lora_adapter", load_lora_adapter)
    r.add_post("/v1/unload_lora_adapter", unload_lora_adapter)
    r.add_post("/tokenize", tokenize_route)
    r.add_post("/detokenize", detokenize_route)
    r.add_get("/tokenizer_info", tokenizer_info_route)
    r.add_get("/version", version_route)
    r.add_get("/metrics", metrics_route)
    r.add_get("/startupz", startupz)
    r.add_get("/readyz", readyz)
    r.add_get("/livez", livez)
    r.add_get("/health", health)
    r.add_post("/sleep", sleep_route)
    r.add_post("/wake_up", wake_up_route)
    r.add_post("/reset_prefix_cache", reset_prefix_cache_route)
    r.add_get("/is_sleeping", is_sleeping_route)
    return app
