"""What every route handler shares: the server's state, JSON in and out, and the mapping of engine errors to
OpenAI error bodies. Imported by app.py and openai_api.py; imports neither."""

from __future__ import annotations

import json
import time
from typing import Any

from aiohttp import web
from pydantic import ValidationError

from shoal.engine.core.async_engine import (
    AsyncEngine,
    DrainingError,
    EngineDeadError,
    EngineNotReadyError,
    QueueFullError,
    RequestFailedError,
    SleepingError,
)
from shoal.engine.core.engine import ContextLengthError
from shoal.engine.core.lora import LoRACapacityError, LoRANotFoundError
from shoal.engine.server.media import MediaFetcher
from shoal.engine.server.metrics import ServerMetrics
from shoal.engine.server.keys import KeySet
from shoal.engine.server.protocol import APIError, validation_error_to_api_error

RETRY_AFTER_SECONDS = 1
STATE_KEY = web.AppKey("shoal_state", object)


class ServerState:
    def __init__(self, engine: AsyncEngine, metrics: ServerMetrics, api_keys: KeySet | None,
                 tool_call_parser: str | None = None):
        self.engine = engine
        self.metrics = metrics
        self.api_keys = api_keys  # None: no authentication
        self.tool_call_parser = tool_call_parser  # tool_choice "auto" enabled with this parser
        self.active_handlers = 0  # generation requests whose HTTP response is not finished yet
        self.tracer = None  # tracing.RequestTracer when tracing is on
        self.created = int(time.time())
        # image_url http(s) fetching (off unless --allowed-media-domains); tests may build a state without a config
        config = getattr(engine, "config", None)
        self.media = MediaFetcher.from_config(config) if config is not None else MediaFetcher(None, 1, 1.0, False)

    @property
    def served_model_name(self) -> str:
        return self.engine.model_name


def get_state(request: web.Request) -> ServerState:
    return request.app[STATE_KEY]


def dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def json_response(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=dumps(data).encode(), status=status, content_type="application/json", headers=headers)


def api_error_response(e: APIError) -> web.Response:
    return json_response(e.body(), status=e.status, headers=e.headers)


# Request fields an engine or SamplingParams error message can start with.
_PARAMS = frozenset({"n", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty", "seed", "stop", "stop_token_ids", "max_tokens", "min_tokens", "logprobs",
                     "prompt_logprobs", "prompt", "dimensions", "input"})


def param_from_message(msg: str) -> str | None:
    """The request field a ValueError's message names first ("top_p must be in (0, 1]" -> "top_p"), if any."""
    head = msg.split(" ", 1)[0].strip(":,'\"`")
    return head if head in _PARAMS else None


def engine_error_to_api_error(e: Exception, prompt_param: str = "prompt") -> APIError:
    """Map AsyncEngine's admission errors (and ValueError for bad input) to HTTP errors."""
    retry = {"Retry-After": str(RETRY_AFTER_SECONDS)}
    if isinstance(e, QueueFullError):
        return APIError(str(e), 429, code="queue_full", headers=retry)
    if isinstance(e, DrainingError):
        return APIError("the server is shutting down; retry on another replica", 503, code="draining",
                        headers=retry)
    if isinstance(e, SleepingError):
        return APIError(f"{e}; retry on another replica or once it is awake", 503, code="sleeping", headers=retry)
    if isinstance(e, EngineNotReadyError):
        return APIError("the model is still loading", 503, code="loading", headers=retry)
    if isinstance(e, EngineDeadError):
        return APIError(f"the engine is not running: {e}", 503, code="engine_dead")
    if isinstance(e, ContextLengthError):
        param = "max_tokens" if e.prompt_len < e.max_model_len else prompt_param
        return APIError(str(e), 400, param=param, code="context_length_exceeded")
    if isinstance(e, LoRANotFoundError):
        return APIError(str(e), 404, param="model", code="model_not_found")
    if isinstance(e, LoRACapacityError):
        return APIError(str(e), 429, code="lora_capacity", headers=retry)
    if isinstance(e, ValueError):
        return APIError(str(e), 400, param=param_from_message(str(e)))
    if isinstance(e, RequestFailedError):
        return APIError(str(e), 500)
    return APIError("internal server error", 500)


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


async def read_json(request: web.Request, model: type) -> Any:
    """Parse the body into `model`: 400 for malformed JSON, a non-object body, or a field of the wrong type."""
    raw = await request.read()
    try:
        data = json.loads(raw, parse_constant=_reject_constant) if raw else None
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise APIError(f"request body is not valid JSON: {e}", 400) from None
    if not isinstance(data, dict):
        raise APIError("request body must be a JSON object", 400)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise validation_error_to_api_error(e) from None
    except APIError:
        raise
    except ValueError as e:
        raise APIError(str(e), 400) from None


def lora_names(state: ServerState) -> set[str]:
    """The LoRA adapters registered on the engine (its latest stats snapshot)."""
    stats = state.engine.snapshot.stats
    return {name for name, _, _ in getattr(stats, "lora_registered", None) or []}


def check_model(state: ServerState, name: str | None) -> str | None:
    """404 unless `name` is the base model or a registered LoRA adapter; the adapter's name, None for the base."""
    if name is None or name == "":
        return None
    if name in (state.served_model_name, state.engine.config.model):
        return None
    if name in lora_names(state):
        return name
    raise APIError(f"The model `{name}` does not exist.", 404, param="model", code="model_not_found")


def require_loaded(state: ServerState) -> None:
    eng = state.engine
    if eng.fatal_error is not None:
        raise engine_error_to_api_error(EngineDeadError(str(eng.fatal_error)))
    if not eng.is_loaded:
        raise engine_error_to_api_error(EngineNotReadyError())
