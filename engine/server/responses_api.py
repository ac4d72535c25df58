"""POST /v1/responses (OpenAI's Responses API), GET and DELETE /v1/responses/{id}.

A Responses request is translated into a ChatCompletionRequest (input items -> chat messages, function tools ->
chat tools, text.format -> response_format, max_output_tokens -> max_tokens) and runs on the chat path
(openai_api.prepare_chat: one place renders a conversation and plans tools and grammars). The chat deltas it
produces become output items: reasoning (where the chat template thinks in <think> blocks), a message, function
calls; streamed as the Responses event types, or returned whole.

With `store` (the default) the response and its conversation are kept in a ResponseStore, owned by the caller's
API key, so that `previous_response_id` continues it (its instructions are not carried over, as OpenAI's are not).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError

from shoal.engine.core.async_engine import EngineDeadError
from shoal.engine.server import openai_api as oai
from shoal.engine.server.common import check_model, dumps, get_state, json_response, read_json, require_loaded
from shoal.engine.server.protocol import APIError, ChatCompletionRequest, validation_error_to_api_error
from shoal.engine.server.chat_relay import ChatRelay, DeltaBuilder
from shoal.engine.server.reasoning import ReasoningSplitter
from shoal.engine.server.response_store import ResponseStore, StoredResponse, owner_of
from shoal.engine.server.gateway_contract import not_found_error, previous_not_found_error, response_id

STORE_KEY = web.AppKey("shoal_response_store", ResponseStore)
INPUT_TYPES = ("message", "function_call", "function_call_output", "reasoning")
# vLLM's sampling extras, passed to the chat request as they are (`extra_body` in the openai client).
EXTRAS = ("seed", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "stop",
          "stop_token_ids", "structured_outputs", "chat_template_kwargs", "priority", "ignore_eos", "min_tokens",
          "skip_special_tokens")


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: StrictBool | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    stream: StrictBool = False
    store: StrictBool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None


# ------------------------------------------------------------------------------------------ request -> chat
def _bad(msg: str, param: str = "input", status: int = 400, code: str | None = None) -> APIError:
    return APIError(msg, status, param=param, code=code)


def _text_of(content: Any, where: str) -> str:
    """A message's text: a string, or its input_text / output_text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"{where}.content must be a string or a list of content parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
            texts.append(part["text"])
        else:
            raise _bad(f"{where}.content[{j}] of type {kind!r} is not supported (input_text or output_text)")
    return "\n".join(texts)


def _user_content(content: Any, where: str, images: bool) -> str | list[dict]:
    """A user message's content: its text, or, where it has input_image parts (`images`: the model takes them),
    chat content parts (text and image_url, in order; server/images.py reads the images)."""
    if not images or not isinstance(content, list) or not any(isinstance(p, dict) and p.get("type") == "input_image"
                                                              for p in content):
        return _text_of(content, where)
    parts = []
    for j, part in enumerate(content):
        if isinstance(part, dict) and part.get("type") == "input_image":
            url = part.get("image_url")
            if not isinstance(url, str) or not url:
                raise _bad(f"{where}.content[{j}]: an input_image needs an image_url (a base64 data URL; file_id is "
                           "not supported)")
            parts.append({"type": "image_url", "image_url": {"url": url}})
        else:
            parts.append({"type": "text", "text": _text_of([part], f"{where}")})
    return parts


def _input_items(req: ResponsesRequest) -> list[dict]:
    if isinstance(req.input, str):
        return [{"type": "message", "role": "user", "content": req.input}]
    for i, item in enumerate(req.input):
        if not isinstance(item, dict):
            raise _bad(f"input[{i}] must be an object")
    return [dict(item) for item in req.input]


def to_chat_messages(items: list[dict], first_new: int, images: bool = False) -> list[dict]:
    """Responses items -> chat messages. Items before `first_new` come from the store (validated when they were
    new); errors name an item by its index in the request's own `input`. `images`: the model takes input_image
    parts (elsewhere they are refused as unsupported)."""
    msgs: list[dict] = []
    calls: set[str] = set()
    reasoning: str | None = None  # a reasoning item's text, for the assistant message that follows it
    for i, item in enumerate(items):
        where = f"input[{i - first_new}]"
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise _bad(f"{where}.role must be user, system, developer or assistant (got {role!r})")
            content = item.get("content")
            msg = {"role": "system" if role == "developer" else role,
                   "content": _user_content(content, where, images) if role == "user" else _text_of(content, where)}
            if role == "assistant" and reasoning is not None:
                msg["reasoning_content"], reasoning = reasoning, None
            msgs.append(msg)
        elif kind == "function_call":
            call_id, name, args = item.get("call_id"), item.get("name"), item.get("arguments", "")
            if not (isinstance(call_id, str) and call_id and isinstance(name, str) and name
                    and isinstance(args, str)):
                raise _bad(f"{where}: a function_call needs string 'call_id', 'name' and 'arguments'")
            calls.add(call_id)
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
            last = msgs[-1] if msgs else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)  # the calls of one turn: one assistant message
            else:
                msg = {"role": "assistant", "content": "", "tool_calls": [call]}
                if reasoning is not None:
                    msg["reasoning_content"], reasoning = reasoning, None
                msgs.append(msg)
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str) or call_id not in calls:
                raise _bad(f"{where}: function_call_output for call_id {call_id!r}, but no earlier function_call in "
                           "the conversation has that call_id")
            text = output if isinstance(output, str) else _text_of(output, where)
            msgs.append({"role": "tool", "tool_call_id": call_id, "content": text})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            if not isinstance(parts, list) or not all(isinstance(p, dict) and isinstance(p.get("text"), str)
                                                      for p in parts):
                raise _bad(f"{where}: a reasoning item's content must be a list of {{'type', 'text'}} parts")
            reasoning = "\n".join(p["text"] for p in parts)
        else:
            raise _bad(f"{where}.type {kind!r} is not supported (one of {', '.join(INPUT_TYPES)})")
    return msgs


def _chat_tools(tools: list[dict] | None) -> list[dict] | None:
    if not tools:
        return None
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else None
            raise _bad(f"tools[{i}].type {kind!r} is not supported (function tools only)", f"tools.{i}.type")
        fn = {k: t[k] for k in ("name", "description", "parameters") if t.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def _chat_tool_choice(choice: Any) -> Any:
    if choice is None or choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise _bad("tool_choice must be 'auto', 'none', 'required' or {'type': 'function', 'name': ...}", "tool_choice")


def _response_format(text: dict | None) -> dict | None:
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise _bad("text.format must be an object", "text.format")
    if fmt.get("type") == "json_schema":
        js = {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}
        if "schema" not in js:
            raise _bad("text.format.schema is required for type json_schema", "text.format.schema")
        return {"type": "json_schema", "json_schema": js}
    if fmt.get("type") in ("text", "json_object"):
        return {"type": fmt["type"]}
    raise _bad(f"text.format.type {fmt.get('type')!r} is not supported (text, json_object or json_schema)",
               "text.format.type")


def to_chat_request(req: ResponsesRequest, messages: list[dict]) -> ChatCompletionRequest:
    body: dict[str, Any] = {"model": req.model, "messages": messages, "stream": req.stream,
                            "max_tokens": req.max_output_tokens, "temperature": req.temperature, "top_p": req.top_p,
                            "tools": _chat_tools(req.tools), "tool_choice": _chat_tool_choice(req.tool_choice),
                            "response_format": _response_format(req.text), "user": req.user}
    if req.parallel_tool_calls is not None:
        body["parallel_tool_calls"] = req.parallel_tool_calls
    extra = req.model_extra or {}
    body.update({k: extra[k] for k in EXTRAS if k in extra})
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
    except ValidationError as e:
        raise validation_error_to_api_error(e) from None


# ------------------------------------------------------------------------------------------ output items
class OutputBuilder(DeltaBuilder):
    """Chat deltas -> Responses output items, and the stream events that build them (each method returns the
    events it caused; a non-streaming response drops them)."""

    def __init__(self, splitter: ReasoningSplitter | None):
        super().__init__(splitter)
        self.items: list[dict] = []
        self.open: dict | None = None  # the reasoning or message item text is going into
        self.calls: dict[int, dict] = {}  # chat tool-call index -> function_call item

    def _event(self, kind: str, **fields) -> dict:
        return {"type": kind, **fields}

    def _add(self, item: dict) -> list[dict]:
        self.items.append(item)
        return [self._event("response.output_item.added", output_index=len(self.items) - 1, item=dict(item))]

    def _where(self, item: dict) -> dict:
        return {"item_id": item["id"], "output_index": self.items.index(item)}

    def _text(self, kind: str, piece: str) -> list[dict]:
        events = []
        item_type = "reasoning" if kind == "reasoning" else "message"
        if self.open is None or self.open["type"] != item_type:
            events += self._close_open()
            if item_type == "reasoning":
                self.open = {"id": f"rs_{uuid.uuid4().hex}", "type": "reasoning", "summary": [], "content": [],
                             "status": "in_progress"}
                part = {"type": "reasoning_text", "text": ""}
            else:
                self.open = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant",
                             "status": "in_progress", "content": []}
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            events += self._add(self.open)
            self.open["content"].append(part)
            events.append(self._event("response.content_part.added", **self._where(self.open), content_index=0,
                                      part=dict(part)))
        part = self.open["content"][0]
        part["text"] += piece
        delta = "response.reasoning_text.delta" if item_type == "reasoning" else "response.output_text.delta"
        extra = {} if item_type == "reasoning" else {"logprobs": []}
        events.append(self._event(delta, **self._where(self.open), content_index=0, delta=piece, **extra))
        return events

    def _close_open(self) -> list[dict]:
        item, self.open = self.open, None
        if item is None:
            return []
        part, where = item["content"][0], self._where(item)
        item["status"] = "completed"
        if item["type"] == "reasoning":
            done = self._event("response.reasoning_text.done", **where, content_index=0, text=part["text"])
        else:
            done = self._event("response.output_text.done", **where, content_index=0, text=part["text"], logprobs=[])
        return [done, self._event("response.content_part.done", **where, content_index=0, part=dict(part)),
                self._event("response.output_item.done", **where, item=item)]

    def tool_calls(self, deltas: list[dict]) -> list[dict]:
        events = []
        for d in deltas:
            fn = d.get("function") or {}
            args = fn.get("arguments") or ""
            if d.get("id"):  # a new call
                events += self.flush_text() + self._close_open()
                item = {"id": f"fc_{uuid.uuid4().hex}", "type": "function_call", "call_id": d["id"],
                        "name": fn.get("name", ""), "arguments": "", "status": "in_progress"}
                self.calls[d.get("index", len(self.calls))] = item
                events += self._add(item)
            item = self.calls.get(d.get("index", 0))
            if item is not None and args:
                item["arguments"] += args
                events.append(self._event("response.function_call_arguments.delta", **self._where(item), delta=args))
        return events

    def finish(self) -> list[dict]:
        events = self.flush_text() + self._close_open()
        for item in self.calls.values():
            if item["status"] == "in_progress":
                item["status"] = "completed"
                where = self._where(item)
                events += [self._event("response.function_call_arguments.done", **where, name=item["name"],
                                       arguments=item["arguments"]),
                           self._event("response.output_item.done", **where, item=item)]
        return events

    def reasoning_text(self) -> str:
        return "".join(i["content"][0]["text"] for i in self.items if i["type"] == "reasoning")


# ------------------------------------------------------------------------------------------ the route
class _Run(ChatRelay):
    """One Responses request in flight: the chat jobs, the output being built, and the Response object."""

    def __init__(self, state, store: ResponseStore, req: ResponsesRequest, api, conversation: list[dict],
                 owner: str, model: str):
        super().__init__(state, api, OutputBuilder)
        self.store, self.req = store, req
        self.conversation, self.owner, self.model = conversation, owner, model
        self.id = response_id(store.instance)  # tagged: the gateways send what concerns it to this engine
        self.created = int(time.time())
        self.seq = 0

    def response(self, status: str) -> dict:
        req = self.req
        incomplete = {"reason": "max_output_tokens"} if self.finish == "length" else None
        error = ({"code": "server_error", "message": "generation was aborted"} if self.finish == "abort" else None)
        prompt_tokens = self.prompt_tokens
        reasoning = self.out.reasoning_text()
        reasoning_tokens = len(self.state.engine.tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status, "model": self.model,
            "output": self.out.items if status != "in_progress" else [], "error": error,
            "incomplete_details": incomplete, "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens, "previous_response_id": req.previous_response_id,
            "parallel_tool_calls": req.parallel_tool_calls if req.parallel_tool_calls is not None else True,
            "reasoning": req.reasoning or {"effort": None, "summary": None}, "store": req.store,
            "temperature": req.temperature, "top_p": req.top_p, "text": req.text or {"format": {"type": "text"}},
            "tool_choice": req.tool_choice or "auto", "tools": req.tools or [], "truncation": "disabled",
            "metadata": req.metadata or {}, "user": req.user,
            "usage": None if status == "in_progress" else {
                "input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": self.output_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
                "total_tokens": prompt_tokens + self.output_tokens},
        }

    def status(self) -> str:
        return {"length": "incomplete", "abort": "failed"}.get(self.finish or "abort", "completed")

    def finished(self) -> tuple[dict, list[dict]]:
        events = self.out.finish()
        response = self.response(self.status())
        if self.req.store and response["status"] != "failed":
            self.store.put(self.id, StoredResponse(self.owner, response, self.conversation + self.out.items))
        return response, events

    def numbered(self, event: dict) -> bytes:
        event["sequence_number"] = self.seq
        self.seq += 1
        return f"event: {event['type']}\ndata: {dumps(event)}\n\n".encode()


async def create_response(request: web.Request) -> web.StreamResponse:
    state = get_state(request)
    store = request.app[STORE_KEY]
    req: ResponsesRequest = await read_json(request, ResponsesRequest)
    lora = check_model(state, req.model)
    require_loaded(state)
    owner = owner_of(request.headers)
    history: list[dict] = []
    if req.previous_response_id is not None:
        prev = store.get(owner, req.previous_response_id)
        if prev is None:
            raise _not_found(previous_not_found_error(req.previous_response_id))
        history = prev.conversation
    new_items = _input_items(req)
    conversation = history + new_items
    messages = to_chat_messages(conversation, len(history), getattr(state.engine, "images", None) is not None)
    if req.instructions:
        messages.insert(0, {"role": "system", "content": req.instructions})
    chat = to_chat_request(req, messages)
    api, params = await oai.prepare_chat(state, chat)
    run = _Run(state, store, req, api, conversation, owner, lora or state.served_model_name)
    async with run.running(request, run.id, params, chat.priority, "input", lora, "responses", run.model):
        if req.stream:
            return await _stream(request, run)
        await run.collect()
        response, _ = run.finished()
        return json_response(response, headers={"X-Request-Id": run.id})


async def _stream(request: web.Request, run: _Run) -> web.StreamResponse:
    resp = web.StreamResponse(status=200, headers={**oai.SSE_HEADERS, "X-Request-Id": run.id})
    await resp.prepare(request)
    opening = run.response("in_progress")
    for kind in ("response.created", "response.in_progress"):
        await resp.write(run.numbered({"type": kind, "response": opening}))
    try:
        async for events in run.outputs():
            for event in events:
                await resp.write(run.numbered(event))
        response, events = run.finished()
        for event in events:
            await resp.write(run.numbered(event))
        final = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(response["status"],
                                                                                            "response.failed")
        await resp.write(run.numbered({"type": final, "response": response}))
    except EngineDeadError as e:
        await resp.write(run.numbered({"type": "error", "code": "engine_dead", "message": f"generation failed: {e}",
                                       "param": None}))
    await resp.write_eof()
    return resp


def _not_found(error: dict) -> APIError:
    """The 404 a gateway answers alike for an id of no engine it knows (gateway_contract.py)."""
    return APIError(error["message"], 404, type=error["type"], param=error["param"], code=error["code"])


def _stored(request: web.Request) -> StoredResponse:
    rid = request.match_info["response_id"]
    entry = request.app[STORE_KEY].get(owner_of(request.headers), rid)
    if entry is None:
        raise _not_found(not_found_error(rid))
    return entry


async def get_response(request: web.Request) -> web.Response:
    return json_response(_stored(request).response)


async def delete_response(request: web.Request) -> web.Response:
    rid = request.match_info["response_id"]
    if not request.app[STORE_KEY].delete(owner_of(request.headers), rid):
        raise _not_found(not_found_error(rid))
    return json_response({"id": rid, "object": "response.deleted", "deleted": True})


def add_routes(app: web.Application, store: ResponseStore) -> None:
    app[STORE_KEY] = store
    app.router.add_post("/v1/responses", create_response)
    app.router.add_get("/v1/responses/{response_id}", get_response)
    app.router.add_delete("/v1/responses/{response_id}", delete_response)
