"""POST /v1/messages and /v1/messages/count_tokens (Anthropic's Messages API), with Anthropic's error body.

Like the Responses API, a Messages request is translated into a ChatCompletionRequest and runs on the chat path
(openai_api.prepare_chat): `system` is a system message, content blocks become chat messages (`tool_use` blocks an
assistant's tool_calls, `tool_result` blocks tool messages, `thinking` blocks the assistant's reasoning_content),
`tools` become function tools, `tool_choice` auto / any / tool / none become auto / required / named / none,
`stop_sequences` are stop strings. A final assistant message is continued (Anthropic's prefill). The chat deltas
become content blocks: `thinking` (where the chat template thinks in <think> blocks), `text`, `tool_use`, streamed
as Anthropic's events (message_start, content_block_start/delta/stop, message_delta, message_stop).
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError

from shoal.engine.core.async_engine import EngineDeadError
from shoal.engine.server import openai_api as oai
from shoal.engine.server.gateway_contract import ANTHROPIC_PREFIX, anthropic_error
from shoal.engine.server.common import check_model, dumps, get_state, json_response, read_json, require_loaded
from shoal.engine.server.protocol import APIError, ChatCompletionRequest, validation_error_to_api_error
from shoal.engine.server.chat_relay import ChatRelay, DeltaBuilder
from shoal.engine.server.reasoning import ReasoningSplitter

PREFIX = ANTHROPIC_PREFIX
_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "abort": "end_turn"}


def error_response(e: APIError) -> web.Response:
    """Anthropic's error body: {"type": "error", "error": {"type", "message"}}."""
    return json_response(anthropic_error(e.status, e.message), status=e.status, headers=e.headers)


class MessagesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int = Field(ge=1)
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = None
    top_k: int | None = None
    stream: StrictBool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None


class CountTokensRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None


# ------------------------------------------------------------------------------------------ request -> chat
def _bad(msg: str, param: str = "messages") -> APIError:
    return APIError(msg, 400, param=param)


def _blocks(content: Any, where: str) -> list[dict]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list) or not all(isinstance(b, dict) for b in content):
        raise _bad(f"{where}.content must be a string or a list of content blocks")
    return content


def _text(content: Any, where: str) -> str:
    parts = []
    for j, b in enumerate(_blocks(content, where)):
        if b.get("type") != "text" or not isinstance(b.get("text"), str):
            raise _bad(f"{where}.content[{j}]: only text blocks are allowed here (got {b.get('type')!r})")
        parts.append(b["text"])
    return "\n".join(parts)


def to_chat_messages(system: Any, messages: list[dict]) -> list[dict]:
    out: list[dict] = []
    if system:
        out.append({"role": "system", "content": _text(system, "system")})
    tool_uses: set[str] = set()
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        role = m.get("role")
        if role not in ("user", "assistant"):
            raise _bad(f"{where}.role must be 'user' or 'assistant' (got {role!r})")
        texts, calls, thinking = [], [], []
        parts: list[dict] = []  # a user message's text and image blocks as chat content parts, in order
        for j, b in enumerate(_blocks(m.get("content"), where)):
            kind, at = b.get("type"), f"{where}.content[{j}]"
            if kind == "text" and isinstance(b.get("text"), str):
                texts.append(b["text"])
                parts.append({"type": "text", "text": b["text"]})
            elif kind == "image" and role == "user":
                parts.append({"type": "image_url", "image_url": {"url": _image_url(b.get("source"), at)}})
            elif kind == "tool_use" and role == "assistant":
                if not (isinstance(b.get("id"), str) and isinstance(b.get("name"), str)
                        and isinstance(b.get("input", {}), dict)):
                    raise _bad(f"{at}: a tool_use block needs string 'id' and 'name' and an object 'input'")
                tool_uses.add(b["id"])
                calls.append({"id": b["id"], "type": "function",
                              "function": {"name": b["name"], "arguments": json.dumps(b.get("input", {}))}})
            elif kind == "tool_result" and role == "user":
                use_id = b.get("tool_use_id")
                if use_id not in tool_uses:
                    raise _bad(f"{at}: tool_result for tool_use_id {use_id!r}, but no earlier tool_use block has "
                               "that id")
                result = b.get("content", "")
                text = _text(result, at) if result else ""
                if b.get("is_error"):
                    text = f"Error: {text}"
                out.append({"role": "tool", "tool_call_id": use_id, "content": text})
            elif kind in ("thinking", "redacted_thinking") and role == "assistant":
                if isinstance(b.get("thinking"), str):
                    thinking.append(b["thinking"])
            else:
                raise _bad(f"{at}: content block type {kind!r} is not supported in a {role} message (text, "
                           "tool_use and thinking from the assistant; text, image and tool_result from the user)")
        if role == "assistant":
            msg: dict = {"role": "assistant", "content": "".join(texts)}
            if calls:
                msg["tool_calls"] = calls
            if thinking:
                msg["reasoning_content"] = "\n".join(thinking)
            out.append(msg)
        elif len(parts) > len(texts):  # images among the blocks: the chat path reads them (server/images.py)
            out.append({"role": "user", "content": parts})
        elif texts:
            out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _image_url(source: Any, at: str) -> str:
    """An image block's source as a chat image_url: base64 data as a data URL; a URL source as itself (refused
    while fetching is off)."""
    if isinstance(source, dict) and source.get("type") == "base64" and isinstance(source.get("data"), str):
        return f"data:{source.get('media_type') or 'image/png'};base64,{source['data']}"
    if isinstance(source, dict) and source.get("type") == "url" and isinstance(source.get("url"), str):
        return source["url"]
    raise _bad(f"{at}: an image block needs a source {{'type': 'base64', 'media_type', 'data'}} (or 'url')")


def _chat_tools(tools: list[dict] | None) -> list[dict] | None:
    if not tools:
        return None
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type", "custom") != "custom" or not isinstance(t.get("name"), str):
            raise _bad(f"tools[{i}] must be a client tool {{'name', 'description', 'input_schema'}} (server tools "
                       "are not supported)", f"tools.{i}")
        fn = {"name": t["name"]}  # in OpenAI's order: templates render the tools as JSON text
        if t.get("description"):
            fn["description"] = t["description"]
        fn["parameters"] = t.get("input_schema", {"type": "object", "properties": {}})
        out.append({"type": "function", "function": fn})
    return out


def _chat_tool_choice(choice: dict | None) -> Any:
    if choice is None:
        return None
    kind = choice.get("type")
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        return "required"
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise _bad("tool_choice.type must be auto, any, tool (with a name) or none", "tool_choice")


def to_chat_request(req: MessagesRequest) -> ChatCompletionRequest:
    messages = to_chat_messages(req.system, req.messages)
    prefill = messages[-1]["role"] == "assistant" and not messages[-1].get("tool_calls")
    body = {"model": req.model, "messages": messages, "max_tokens": req.max_tokens, "temperature": req.temperature,
            "top_p": req.top_p, "top_k": req.top_k, "stop": req.stop_sequences, "stream": req.stream,
            "tools": _chat_tools(req.tools), "tool_choice": _chat_tool_choice(req.tool_choice),
            "add_generation_prompt": not prefill, "continue_final_message": prefill}
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
    except ValidationError as e:
        raise validation_error_to_api_error(e) from None


# ------------------------------------------------------------------------------------------ content blocks
class BlockBuilder(DeltaBuilder):
    """Chat deltas -> Anthropic content blocks and the stream events that build them."""

    def __init__(self, splitter: ReasoningSplitter | None):
        super().__init__(splitter)
        self.blocks: list[dict] = []
        self.open: dict | None = None  # the text or thinking block being written
        self.calls: dict[int, dict] = {}  # chat tool-call index -> tool_use block (arguments as text so far)
        self.args: dict[int, str] = {}

    def _start(self, block: dict) -> list[dict]:
        self.blocks.append(block)
        shown = {**block, "input": {}} if block["type"] == "tool_use" else dict(block)
        return [{"type": "content_block_start", "index": len(self.blocks) - 1, "content_block": shown}]

    def _stop(self) -> list[dict]:
        block, self.open = self.open, None
        return [] if block is None else [{"type": "content_block_stop", "index": self.blocks.index(block)}]

    def _text(self, kind: str, piece: str) -> list[dict]:
        events = []
        block_type = "thinking" if kind == "reasoning" else "text"
        if self.open is None or self.open["type"] != block_type:
            events += self._stop()
            self.open = {"type": "thinking", "thinking": "", "signature": ""} if block_type == "thinking" else {
                "type": "text", "text": ""}
            events += self._start(self.open)
        index = self.blocks.index(self.open)
        if block_type == "thinking":
            self.open["thinking"] += piece
            delta = {"type": "thinking_delta", "thinking": piece}
        else:
            self.open["text"] += piece
            delta = {"type": "text_delta", "text": piece}
        return events + [{"type": "content_block_delta", "index": index, "delta": delta}]

    def tool_calls(self, deltas: list[dict]) -> list[dict]:
        events = []
        for d in deltas:
            fn = d.get("function") or {}
            index = d.get("index", 0)
            if d.get("id"):
                events += self.flush_text() + self._stop() + self._close_calls()
                block = {"type": "tool_use", "id": d["id"], "name": fn.get("name", ""), "input": {}}
                self.calls[index], self.args[index] = block, ""
                events += self._start(block)
            piece = fn.get("arguments") or ""
            if index in self.calls and piece:
                self.args[index] += piece
                events.append({"type": "content_block_delta", "index": self.blocks.index(self.calls[index]),
                               "delta": {"type": "input_json_delta", "partial_json": piece}})
        return events

    def _close_calls(self) -> list[dict]:
        events = []
        for index, block in list(self.calls.items()):
            try:
                block["input"] = json.loads(self.args[index]) if self.args[index].strip() else {}
            except ValueError:
                block["input"] = {}
            events.append({"type": "content_block_stop", "index": self.blocks.index(block)})
            del self.calls[index]
        return events

    def finish(self) -> list[dict]:
        return self.flush_text() + self._stop() + self._close_calls()


# ------------------------------------------------------------------------------------------ routes
class _Run(ChatRelay):
    """One Messages request in flight: the chat jobs and the content blocks being built."""

    def __init__(self, state, api, model: str):
        super().__init__(state, api, BlockBuilder)
        self.model = model
        self.id = f"msg_{uuid.uuid4().hex}"
        self.stop_sequence: str | None = None

    def finished_by(self, completion) -> None:
        if isinstance(completion.stop_reason, str) and self.finish == "stop":
            self.finish, self.stop_sequence = "stop_sequence", completion.stop_reason

    def stop_reason(self) -> str:
        return self.finish if self.finish == "stop_sequence" else _STOP_REASONS.get(self.finish or "abort")

    def message(self, content: list[dict], stop_reason: str | None) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": stop_reason, "stop_sequence": self.stop_sequence,
                "usage": {"input_tokens": self.prompt_tokens, "output_tokens": self.output_tokens}}


async def create_message(request: web.Request) -> web.StreamResponse:
    state = get_state(request)
    req: MessagesRequest = await read_json(request, MessagesRequest)
    lora = check_model(state, req.model)
    require_loaded(state)
    api, params = await oai.prepare_chat(state, to_chat_request(req))
    run = _Run(state, api, req.model or state.served_model_name)
    async with run.running(request, run.id, params, 0, "messages", lora, "messages", run.model):
        if req.stream:
            return await _stream(request, run)
        await run.collect()
        run.out.finish()
        return json_response(run.message(run.out.blocks, run.stop_reason()), headers={"X-Request-Id": run.id})


def _event(event: dict) -> bytes:
    return f"event: {event['type']}\ndata: {dumps(event)}\n\n".encode()


async def _stream(request: web.Request, run: _Run) -> web.StreamResponse:
    resp = web.StreamResponse(status=200, headers={**oai.SSE_HEADERS, "X-Request-Id": run.id})
    await resp.prepare(request)
    start = run.message([], None)
    start["usage"]["output_tokens"] = 0
    await resp.write(_event({"type": "message_start", "message": start}))
    try:
        async for events in run.outputs():
            for event in events:
                await resp.write(_event(event))
        for event in run.out.finish():
            await resp.write(_event(event))
        await resp.write(_event({"type": "message_delta",
                                 "delta": {"stop_reason": run.stop_reason(), "stop_sequence": run.stop_sequence},
                                 "usage": {"output_tokens": run.output_tokens}}))
        await resp.write(_event({"type": "message_stop"}))
    except EngineDeadError as e:
        await resp.write(_event({"type": "error", "error": {"type": "api_error", "message": f"generation failed: {e}"}}))
    await resp.write_eof()
    return resp


async def count_tokens(request: web.Request) -> web.Response:
    state = get_state(request)
    req: CountTokensRequest = await read_json(request, CountTokensRequest)
    check_model(state, req.model)
    require_loaded(state)
    chat = to_chat_request(MessagesRequest(model=req.model, max_tokens=1, messages=req.messages, system=req.system,
                                           tools=req.tools))
    kwargs = {"tools": chat.tools} if chat.tools else {}
    ids = oai.render_chat_prompt(state, chat.messages, chat.add_generation_prompt, chat.continue_final_message,
                                 kwargs)
    return json_response({"input_tokens": len(ids)})


def add_routes(app: web.Application) -> None:
    app.router.add_post(PREFIX, create_message)
    app.router.add_post(PREFIX + "/count_tokens", count_tokens)
