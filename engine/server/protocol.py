"""OpenAI-compatible request models (pydantic) and OpenAI's error body.

Requests are validated here for shape and type (a wrong type is a 400, never a 500); the ranges of sampling
parameters are checked once more by SamplingParams itself, whose ValueError names the field. Unknown fields are
ignored, as vLLM and OpenAI do, so clients sending newer fields keep working.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationError, ValidationInfo,
                      field_validator)

MAX_N = 128  # completions per request (the same cap as SamplingParams)
MAX_LOGPROBS = 20  # top alternatives per token (OpenAI's top_logprobs cap)
MAX_COMPLETION_LOGPROBS = 20


# --------------------------------------------------------------------------------------------------- errors
class APIError(Exception):
    """An error with an HTTP status and OpenAI's error body."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        *,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type or _DEFAULT_TYPES.get(status, "invalid_request_error")
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


_DEFAULT_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_error",
    503: "service_unavailable",
}


def error_body(message: str, status: int = 400, **kw) -> dict:
    return APIError(message, status, **kw).body()


def validation_error_to_api_error(e: ValidationError) -> APIError:
    """The first pydantic error as a 400 naming the offending field."""
    errs = e.errors(include_url=False)
    if not errs:
        return APIError(str(e), 400)
    first = errs[0]
    # Drop the union-branch names pydantic puts in the location (e.g. 'str', 'list[int]'); keep list indices.
    loc = [str(x) for x in first.get("loc", ())]
    loc = [x for x in loc if not any(c in x for c in "[]") and x not in {"str", "int", "float", "bool", "list"}]
    param = ".".join(loc) or None
    msg = first.get("msg", "invalid value")
    if param:
        msg = f"{param}: {msg}"
    extra = f" (and {len(errs) - 1} more error(s))" if len(errs) > 1 else ""
    return APIError(msg + extra, 400, param=param)


# --------------------------------------------------------------------------------------------------- requests
def _refused_when_set(cls, v, info: ValidationInfo):
    """A field OpenAI defines and the server does not implement: accepted while empty, a 400 naming it if set."""
    if v:
        raise ValueError(f"{info.field_name} is not supported")
    return v


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool | None = False
    continuous_usage_stats: StrictBool | None = False


class _SamplingFields(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI's plus vLLM's extras)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    model: str | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    best_of: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: StrictBool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    skip_special_tokens: StrictBool = True
    include_stop_str_in_output: StrictBool = False
    spaces_between_special_tokens: StrictBool = True
    priority: int = 0
    request_id: str | None = None
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs and its legacy guided_* fields
    # (turned into one grammar by server/structured.py).
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    # vLLM's prefill/decode disaggregation field (server/kv_transfer_api.py)
    kv_transfer_params: dict[str, Any] | None = None

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, v, info):
        if v is not None and v != info.data.get("n", 1):
            raise ValueError("best_of is not supported (use n)")
        return v

    @field_validator("stream_options")
    @classmethod
    def _stream_options(cls, v, info):
        if v is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed when stream is true")
        return v

    _logit_bias = field_validator("logit_bias")(_refused_when_set)

    def sampling_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for SamplingParams (without max_tokens / logprobs, which differ per endpoint)."""
        kw: dict[str, Any] = dict(
            n=self.n,
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
        )
        for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "seed", "top_k", "min_p",
                     "repetition_penalty"):
            v = getattr(self, name)
            if v is not None:
                kw[name] = v
        if self.stop is not None:
            kw["stop"] = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        if self.stop_token_ids:
            kw["stop_token_ids"] = list(self.stop_token_ids)
        if self.prompt_logprobs is not None:
            kw["prompt_logprobs"] = self.prompt_logprobs
        return kw

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


Prompt = str | list[int] | list[str] | list[list[int]]


class CompletionRequest(_SamplingFields):
    prompt: Prompt
    max_tokens: int | None = Field(default=16, ge=0)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    echo: StrictBool = False
    suffix: str | None = None
    add_special_tokens: StrictBool = True
    # Shoal's extension (vLLM's OpenAI server has no way to send images on completions): the prompt's images,
    # {"image": [{"url": "data:image/...;base64,..." | "https://..."}, ...]}, one per image placeholder written in
    # the prompt, in order; named after the offline API's (and vLLM's) prompt field, each image as chat's image_url
    multi_modal_data: dict[str, Any] | None = None

    _suffix = field_validator("suffix")(_refused_when_set)

    def prompts(self) -> list[str | list[int]]:
        """The prompt(s) as a list: each a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise ValueError("prompt must not be empty")
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)


class EmbeddingRequest(BaseModel):
    """/v1/embeddings: OpenAI's fields plus vLLM's add_special_tokens and priority."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    input: Prompt
    dimensions: StrictInt | None = None  # checked against the model by the engine (Matryoshka models only)
    encoding_format: Literal["float", "base64"] = "float"
    user: str | None = None
    add_special_tokens: StrictBool = True
    priority: int = 0

    def inputs(self) -> list[str | list[int]]:
        """The input(s) as a list, each a string or a list of token ids; ValueError for an empty one."""
        p = self.input
        if isinstance(p, str):
            items: list = [p]
        elif not p:
            raise ValueError("input must not be empty")
        elif all(isinstance(x, int) for x in p):
            items = [list(p)]
        else:
            items = list(p)
        for i, item in enumerate(items):
            if not item:
                raise ValueError(f"input[{i}] is empty" if len(items) > 1 else "input must not be empty")
        return items


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None

    def to_template(self, image_token: str | None = None) -> dict[str, Any]:
        """The message as the chat template sees it: text parts joined into one string (an image_url part as the
        model's image placeholder `image_token` in its place; None: the model takes text only); an assistant's
        tool_calls with their arguments as objects (templates render them with `tojson`), a tool result's
        tool_call_id kept."""
        d: dict[str, Any] = {k: v for k, v in self.model_dump(exclude_none=True).items()}
        calls = d.get("tool_calls")
        if calls is not None:
            if not isinstance(calls, list):
                raise ValueError("tool_calls must be a list")
            d["tool_calls"] = [_template_tool_call(i, c) for i, c in enumerate(calls)]
        c = self.content
        if isinstance(c, list):
            texts = []
            for i, part in enumerate(c):
                kind = part.get("type")
                if kind == "text" and isinstance(part.get("text"), str):
                    texts.append(part["text"])
                elif kind == "image_url" and image_token is not None:
                    texts.append(image_token)  # the part itself is read by server/images.py
                elif kind == "image_url":
                    raise ValueError(f"content part {i} is an image, but this model takes text only")
                else:
                    raise ValueError(f"content part {i} of type {kind!r} is not supported (text only)")
            d["content"] = "\n".join(texts)
        elif c is None:
            d["content"] = ""
        return d


def _template_tool_call(i: int, call: Any) -> dict[str, Any]:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ValueError(f"tool_calls[{i}] must be {{'id', 'type': 'function', 'function': {{'name', 'arguments'}}}}")
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            raise ValueError(f"tool_calls[{i}].function.arguments is not valid JSON") from None
    return {**call, "type": call.get("type", "function"), "function": {**fn, "arguments": args}}


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=0)
    max_completion_tokens: int | None = Field(default=None, ge=0)
    logprobs: StrictBool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: StrictBool | None = None
    # vLLM extras
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template_kwargs: dict[str, Any] | None = None
    echo: StrictBool = False

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def requested_logprobs(self) -> int | None:
        if not self.logprobs:
            if self.top_logprobs:
                raise APIError("top_logprobs requires logprobs to be true", 400, param="top_logprobs")
            return None
        return self.top_logprobs or 0


class LoadLoRAAdapterRequest(BaseModel):
    """vLLM's /v1/load_lora_adapter body."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(BaseModel):
    """vLLM's /v1/unload_lora_adapter body (lora_int_id, vLLM's alternative, is accepted and unused)."""

    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    multi_modal_data: dict[str, Any] | None = None  # with a prompt: its images, as /v1/completions takes them
    add_special_tokens: StrictBool | None = None
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    return_token_strs: StrictBool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: list[int]


Role = Literal["system", "user", "assistant", "tool", "developer"]
