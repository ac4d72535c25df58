"""/v1/completions and /v1/chat/completions: request -> SamplingParams -> AsyncEngine -> OpenAI JSON or SSE.
Images come as chat's image_url parts or a completion's multi_modal_data, both through server/images.py.

The engine streams deltas (only what is new since its previous output: display-safe text, token ids, logprobs),
so a streamed chunk is one delta rendered as the endpoint's choice, and a full response is the deltas added up.
What differs between the two endpoints is an `_Endpoint` (how a choice looks); one loop streams both and one
collects both. A client that disconnects (or whose handler is cancelled) has its requests aborted at once, which
frees their KV blocks.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from shoal.engine.core.async_engine import EngineDeadError, EngineError, RequestStream
from shoal.engine.core.outputs import CompletionOutput, PromptLogprobs, RequestOutput
from shoal.engine.core.structured_outputs import GrammarError
from shoal.engine.server import kv_transfer_api, structured, tools
from shoal.engine.server.common import (
    ServerState,
    check_model,
    dumps,
    engine_error_to_api_error,
    get_state,
    json_response,
    param_from_message,
    read_json,
    require_loaded,
)
from shoal.engine.server.images import chat_images, completion_images
from shoal.engine.server.protocol import APIError, ChatCompletionRequest, ChatMessage, CompletionRequest

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _make_params(kwargs: dict[str, Any]):
    from shoal.engine.contracts import SamplingParams

    try:
        return SamplingParams(**kwargs)
    except (ValueError, TypeError) as e:
        raise APIError(str(e), 400, param=param_from_message(str(e))) from None


def render_chat_prompt(state: ServerState, messages: list[ChatMessage], add_generation_prompt: bool = True,
                       continue_final_message: bool = False, chat_template_kwargs: dict | None = None,
                       add_special_tokens: bool = False) -> list[int]:
    """Apply the model's chat template (or --chat-template) and tokenize. 400 when the model has none."""
    tok = state.engine.tokenizer
    try:
        images = getattr(state.engine, "images", None)
        msgs = [m.to_template(images.placeholder if images is not None else None) for m in messages]
    except ValueError as e:
        raise APIError(str(e), 400, param="messages") from None
    if continue_final_message and add_generation_prompt:
        add_generation_prompt = False
    from shoal.engine.core import tokenizer as tk

    template = getattr(state.engine, "chat_template", None)
    try:
        extra = dict(chat_template_kwargs or {})
        if continue_final_message:
            extra["continue_final_message"] = True
        rendered = tk.render_chat(tok, msgs, chat_template=template, add_generation_prompt=add_generation_prompt,
                                  **extra)
    except tk.ChatTemplateError as e:
        raise APIError(str(e), 400, param="messages", code="no_chat_template") from None
    except (ValueError, TypeError, KeyError) as e:
        raise APIError(f"could not apply the chat template: {e}", 400, param="messages") from None
    except Exception as e:  # noqa: BLE001 - jinja errors from user-supplied content are bad input
        if type(e).__module__.startswith("jinja2"):
            raise APIError(f"could not apply the chat template: {e}", 400, param="messages") from None
        raise
    if isinstance(rendered, str):
        return list(tok.encode(rendered, add_special_tokens=add_special_tokens))
    return list(rendered)


async def _compile(state: ServerState, grammar: structured.GrammarRequest | None):
    """The compiled grammar for SamplingParams.structured_outputs (None when unconstrained); 400 naming the problem
    for an invalid or unsupported one. Counted in shoal:structured_output_requests."""
    if grammar is None:
        return None
    try:
        compiled = await state.engine.compile_grammar(grammar.spec)
    except GrammarError as e:
        raise APIError(f"{grammar.param}: {e}", 400, param=grammar.param) from None
    state.metrics.on_structured_request(grammar.kind)
    return compiled


def _vllm_prompt_logprobs(plp: PromptLogprobs | None) -> list | None:
    """vLLM's JSON shape of prompt_logprobs: per prompt token None or {token_id: {logprob, rank, decoded_token}}."""
    if plp is None:
        return None
    return [None if d is None else {str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
                                    for t, lp in d.items()} for d in plp]


# ------------------------------------------------------------------------------------------ engine streams
@dataclass
class Job:
    """One prompt of a request: its engine stream and the prompt's ids/text."""

    prompt_ids: list[int]
    prompt_text: str
    stream: RequestStream | None = None
    prompt_logprobs: PromptLogprobs | None = None  # from the engine's first output that carries them
    request_id: str = ""
    metrics: Any = None  # the engine's timing record (RequestMetrics), latest seen: for tracing
    images: list | None = None  # the prompt's images (core.images.ProcessedImage), one per placeholder token

    def seen(self, out: RequestOutput) -> None:
        """Take what the engine's latest output says of the request."""
        self.metrics = out.metrics or self.metrics
        if self.images is not None and out.prompt_token_ids:
            self.prompt_ids = out.prompt_token_ids  # each image's placeholder expanded: usage counts its tokens


async def merge_streams(jobs: list[Job]) -> AsyncIterator[tuple[int, RequestOutput | None]]:
    """(job index, output) from every stream as they come; (i, None) when stream i ended without finishing."""
    if len(jobs) == 1:
        async for out in jobs[0].stream:
            jobs[0].seen(out)
            yield 0, out
        if not jobs[0].stream.finished_normally:
            yield 0, None
        return
    q: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, s: RequestStream):
        try:
            async for out in s:
                q.put_nowait((i, out))
            q.put_nowait((i, None if not s.finished_normally else ...))
        except BaseException as e:  # noqa: BLE001
            q.put_nowait((i, e))

    tasks = [asyncio.create_task(pump(i, j.stream)) for i, j in enumerate(jobs)]
    try:
        remaining = len(jobs)
        while remaining:
            i, item = await q.get()
            if item is ...:
                remaining -= 1
            elif item is None:
                remaining -= 1
                yield i, None
            elif isinstance(item, BaseException):
                raise item
            else:
                jobs[i].seen(item)
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


async def start_jobs(state: ServerState, base_id: str, jobs: list[Job], params, priority: int,
                      prompt_param: str, lora: str | None = None) -> None:
    """Hand every prompt to the engine; on any failure abort those already added and raise an APIError."""
    try:
        for i, job in enumerate(jobs):
            rid = job.request_id = base_id if len(jobs) == 1 else f"{base_id}-{i}"
            job.stream = await state.engine.add_request(rid, job.prompt_ids, params, priority=priority,
                                                        lora_request=lora, images=job.images)
    except (EngineError, ValueError) as e:
        abort_jobs(jobs)
        raise engine_error_to_api_error(e, prompt_param) from None
    except BaseException:
        abort_jobs(jobs)
        raise


def abort_jobs(jobs: list[Job]) -> None:
    for j in jobs:
        if j.stream is not None:
            j.stream.abort()


def end_jobs(request: web.Request, state: ServerState, jobs: list[Job], operation: str, model: str) -> None:
    """A request's jobs are done with: abort what still runs (a disconnect, an error), trace what ran."""
    abort_jobs(jobs)
    if state.tracer is not None:
        for j in jobs:
            state.tracer.record(request.headers, operation, model, j.request_id, j.metrics, len(j.prompt_ids))


# ------------------------------------------------------------------------------------------ logprobs
def _token_str(state: ServerState, tid: int, lp: Any = None) -> str:
    """The token as text; a token that is only part of a UTF-8 character is shown by its vocabulary entry
    instead of U+FFFD, so distinct tokens stay distinct (completions' top_logprobs is keyed by this string)."""
    s = lp.decoded_token if lp is not None and getattr(lp, "decoded_token", None) is not None else None
    tok = state.engine.tokenizer
    if s is None:
        s = tok.decode([tid])
    if "\ufffd" in s:
        raw = tok.convert_ids_to_tokens(tid)
        if isinstance(raw, str):
            return raw
    return s


def _sorted_top(d: dict) -> list[tuple[int, Any]]:
    return sorted(d.items(), key=lambda kv: (kv[1].rank if kv[1].rank is not None else 1 << 30, -kv[1].logprob))


def _completion_logprobs(state: ServerState, token_ids: list[int], logprobs: list[dict | None], k: int,
                         text_offset: int) -> dict:
    """OpenAI's completions logprobs object for these tokens; offsets count from `text_offset`."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for tid, d in zip(token_ids, logprobs):
        d = d or {}
        lp = d.get(tid)
        s = _token_str(state, tid, lp)
        tokens.append(s)
        token_lps.append(lp.logprob if lp is not None else None)
        top = {_token_str(state, t, l): l.logprob for t, l in _sorted_top(d)[:k]}
        if lp is not None:
            top.setdefault(s, lp.logprob)
        tops.append(top or None)
        offsets.append(text_offset)
        text_offset += len(s)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def _chat_logprobs(state: ServerState, token_ids: list[int], logprobs: list[dict], k: int) -> dict:
    content = []
    for tid, d in zip(token_ids, logprobs):
        lp = d.get(tid)
        s = _token_str(state, tid, lp)
        top = []
        for t, l in _sorted_top(d)[:k]:
            ts = _token_str(state, t, l)
            top.append({"token": ts, "logprob": l.logprob, "bytes": list(ts.encode("utf-8"))})
        content.append({"token": s, "logprob": lp.logprob if lp is not None else None,
                        "bytes": list(s.encode("utf-8")), "top_logprobs": top})
    return {"content": content}


# ------------------------------------------------------------------------------------------ endpoints
class _Endpoint:
    """How one endpoint renders choices. `delta_choice` renders one engine delta (None: nothing to send);
    `final_choice` a whole completion. Per-choice state is only what OpenAI's format itself carries across
    chunks (the completions text offset, whether the echo was sent)."""

    object_full: str
    object_chunk: str

    def __init__(self, state: ServerState, jobs: list[Job], n: int):
        self.state, self.jobs, self.n = state, jobs, n

    def opening_choices(self) -> list[dict]:
        return []

    def delta_choice(self, index: int, job: Job, comp: CompletionOutput, out: RequestOutput) -> dict | None:
        raise NotImplementedError

    def final_choice(self, index: int, job: Job, comp: CompletionOutput, out: RequestOutput | None) -> dict:
        raise NotImplementedError

    def response_fields(self, finals: list[RequestOutput | None]) -> dict:
        """Extra top-level fields of a full response."""
        return {}

    def abort_choice(self, index: int) -> dict:
        raise NotImplementedError


class _Completions(_Endpoint):
    object_full = object_chunk = "text_completion"

    def __init__(self, state: ServerState, jobs: list[Job], req: CompletionRequest):
        super().__init__(state, jobs, req.n)
        self.req = req
        self.text_offset: dict[int, int] = {}  # per choice: characters before the next logprob token
        self.started: set[int] = set()  # choices whose echo (if any) was sent

    def _text_and_logprobs(self, index: int, job: Job, comp: CompletionOutput,
                           out: RequestOutput | None) -> tuple[str, dict | None]:
        req, text, lp = self.req, comp.text, None
        k = req.logprobs
        first = index not in self.started
        self.started.add(index)
        offset = self.text_offset.get(index, 0)
        if first and req.echo:
            text = job.prompt_text + text
            if k is not None:  # the prompt's own logprobs (the first token has none), then the generated ones
                lp = _completion_logprobs(self.state, job.prompt_ids,
                                          job.prompt_logprobs or [None] * len(job.prompt_ids), k, offset)
                offset += sum(len(t) for t in lp["tokens"])
        if k is not None and comp.token_ids:
            new = _completion_logprobs(self.state, comp.token_ids, comp.logprobs or [], k, offset)
            offset += sum(len(t) for t in new["tokens"])
            lp = new if lp is None else {key: lp[key] + new[key] for key in lp}
        self.text_offset[index] = offset
        return text, lp

    def delta_choice(self, index, job, comp, out):
        first = index not in self.started
        text, lp = self._text_and_logprobs(index, job, comp, out)
        if not (text or lp or comp.finish_reason is not None):
            return None
        choice = {"index": index, "text": text, "logprobs": lp, "finish_reason": comp.finish_reason}
        if first and self.req.prompt_logprobs is not None:
            choice["prompt_logprobs"] = _vllm_prompt_logprobs(job.prompt_logprobs)
        if comp.finish_reason is not None:
            choice["stop_reason"] = comp.stop_reason
        return choice

    def final_choice(self, index, job, comp, out):
        text, lp = self._text_and_logprobs(index, job, comp, out)
        choice = {"index": index, "text": text, "logprobs": lp, "finish_reason": comp.finish_reason or "abort",
                  "stop_reason": comp.stop_reason}
        if self.req.prompt_logprobs is not None:
            choice["prompt_logprobs"] = _vllm_prompt_logprobs(job.prompt_logprobs)
        return choice

    def abort_choice(self, index):
        return {"index": index, "text": "", "logprobs": None, "finish_reason": "abort"}


class _Chat(_Endpoint):
    """Chat choices; with tools, the text is a forced call's JSON (named / required: buffered or streamed as
    arguments) or free text a parser searches for calls (auto: content streams until a call may start)."""

    object_full, object_chunk = "chat.completion", "chat.completion.chunk"

    def __init__(self, state: ServerState, jobs: list[Job], req: ChatCompletionRequest, top: int | None,
                 plan: tools.ToolPlan):
        super().__init__(state, jobs, req.n)
        self.req, self.top, self.plan = req, top, plan
        self.text: dict[int, str] = {}  # tool modes: each choice's text so far
        self.sent: dict[int, int] = {}  # auto: characters of it already streamed as content
        self.named_ids: dict[int, str] = {}  # named: the call id announced in the first chunk

    def _logprobs(self, comp: CompletionOutput) -> dict | None:
        if self.top is None or not comp.token_ids:
            return None
        return _chat_logprobs(self.state, comp.token_ids, comp.logprobs or [], self.top)

    def _calls(self, text: str) -> tuple[str | None, list[tools.ToolCall]]:
        """(content, tool calls) of a whole choice's text."""
        if self.plan.mode in ("named", "required"):
            calls = tools.forced_calls(self.plan, text)
            return (None, calls) if calls else (text, [])
        if self.plan.mode == "auto":
            return self.plan.parser.extract(text)
        return text, []

    @staticmethod
    def _finish(reason: str | None, calls: list) -> str | None:
        return "tool_calls" if calls and reason == "stop" else reason

    def opening_choices(self):  # the role comes first, as OpenAI sends it
        return [{"index": c, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                for c in range(self.n)]

    def delta_choice(self, index, job, comp, out):
        lp = self._logprobs(comp)
        delta, finish = self._tool_delta(index, comp) if self.plan.mode != "none" else (
            {"content": comp.text} if comp.text else {}, comp.finish_reason)
        if not (delta or lp or finish is not None):
            return None
        choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}
        if finish is not None:
            choice["stop_reason"] = comp.stop_reason
        return choice

    def _tool_delta(self, index: int, comp: CompletionOutput) -> tuple[dict, str | None]:
        text = self.text.get(index, "") + comp.text
        self.text[index] = text
        done = comp.finish_reason is not None
        if self.plan.mode == "named":  # the output is the arguments: stream them as they come
            delta = {}
            if index not in self.named_ids:
                self.named_ids[index] = tools.ToolCall(self.plan.named, "").id
                delta = {"tool_calls": [{"index": 0, "id": self.named_ids[index], "type": "function",
                                         "function": {"name": self.plan.named, "arguments": comp.text}}]}
            elif comp.text:
                delta = {"tool_calls": [{"index": 0, "function": {"arguments": comp.text}}]}
            return delta, self._finish(comp.finish_reason, [True]) if done else None
        if self.plan.mode == "auto" and not done:  # stream content up to where a call may begin
            upto = self.plan.parser.safe_prefix(text)
            start = self.sent.get(index, 0)
            self.sent[index] = max(start, upto)
            return ({"content": text[start:upto]} if upto > start else {}), None
        if not done:  # required: the JSON array is parsed once complete
            return {}, None
        content, calls = self._calls(text)
        delta: dict = {}
        if self.plan.mode == "auto":  # the content not yet streamed: up to the first call, or all of it
            end = (self.plan.parser.call_start(text) or 0) if calls else len(text)
            start = self.sent.get(index, 0)
            if end > start:
                delta["content"] = text[start:end]
        elif not calls and text:  # required, cut short before the array was complete
            delta["content"] = text
        if calls:
            delta["tool_calls"] = [{"index": i, **c.to_openai()} for i, c in enumerate(calls)]
        return delta, self._finish(comp.finish_reason, calls)

    def final_choice(self, index, job, comp, out):
        content, calls = self._calls(comp.text)
        message = {"role": "assistant", "content": content,
                   "tool_calls": [c.to_openai() for c in calls]}
        return {"index": index, "message": message, "logprobs": self._logprobs(comp),
                "finish_reason": self._finish(comp.finish_reason, calls) or "abort", "stop_reason": comp.stop_reason}

    def response_fields(self, finals):
        if self.req.prompt_logprobs is None:
            return {}
        return {"prompt_logprobs": _vllm_prompt_logprobs(finals[0].prompt_logprobs if finals[0] else None)}

    def abort_choice(self, index):
        return {"index": index, "delta": {}, "logprobs": None, "finish_reason": "abort", "stop_reason": None}


# ------------------------------------------------------------------------------------------ responses
class _SSE:
    def __init__(self, request: web.Request, request_id: str):
        self.request = request
        self.resp = web.StreamResponse(status=200, headers={**SSE_HEADERS, "X-Request-Id": request_id})

    async def start(self) -> None:
        await self.resp.prepare(self.request)

    async def send(self, obj: Any) -> None:
        await self.resp.write(f"data: {dumps(obj)}\n\n".encode())

    async def done(self) -> None:
        await self.resp.write(b"data: [DONE]\n\n")
        await self.resp.write_eof()


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


async def _stream(request: web.Request, api: _Endpoint, base_id: str, created: int, model: str,
                  include_usage: bool) -> web.StreamResponse:
    """The one SSE loop: every engine delta becomes a chunk of the endpoint's shape."""
    sse = _SSE(request, base_id)
    await sse.start()
    n, jobs = api.n, api.jobs

    def chunk(choice: dict) -> dict:
        c = {"id": base_id, "object": api.object_chunk, "created": created, "model": model, "choices": [choice]}
        if include_usage:
            c["usage"] = None
        return c

    completion_tokens = 0
    open_choices = set(range(len(jobs) * n))
    try:
        for choice in api.opening_choices():
            await sse.send(chunk(choice))
        async for i, out in merge_streams(jobs):
            if out is None:  # aborted (shutdown): close the open choices
                for index in sorted(c for c in open_choices if c // n == i):
                    open_choices.discard(index)
                    await sse.send(chunk(api.abort_choice(index)))
                continue
            if out.prompt_logprobs is not None:
                jobs[i].prompt_logprobs = out.prompt_logprobs
            for comp in out.outputs:
                index = i * n + comp.index
                if index not in open_choices:
                    continue
                completion_tokens += len(comp.token_ids)
                if comp.finish_reason is not None:
                    open_choices.discard(index)
                choice = api.delta_choice(index, jobs[i], comp, out)
                if choice is not None:
                    await sse.send(chunk(choice))
        if include_usage:
            usage = _usage(sum(len(j.prompt_ids) for j in jobs), completion_tokens)
            await sse.send({"id": base_id, "object": api.object_chunk, "created": created, "model": model,
                            "choices": [], "usage": usage})
        await sse.done()
    except EngineDeadError as e:
        err = APIError(f"generation failed: {e}", 500, code="engine_dead")
        try:
            await sse.send(err.body())
            await sse.done()
        except ConnectionError:
            pass
    return sse.resp


async def _respond(api: _Endpoint, base_id: str, created: int, model: str,
                   extra: Callable[[], Awaitable[dict]] | None = None) -> web.Response:
    """The one non-streaming path: every job's deltas added up, then rendered; `extra`, once the jobs are done,
    gives more top-level fields (a prefill's kv_transfer_params)."""
    jobs, n = api.jobs, api.n
    finals: list[RequestOutput | None] = [None] * len(jobs)
    try:
        async for i, out in merge_streams(jobs):
            if out is not None:
                if finals[i] is None:
                    finals[i] = out
                else:
                    finals[i].add(out)
    except EngineDeadError as e:
        raise APIError(f"generation failed: {e}", 500, code="engine_dead") from None
    choices, completion_tokens = [], 0
    for i, job in enumerate(jobs):
        if finals[i] is not None:
            job.prompt_logprobs = finals[i].prompt_logprobs
        comps = {c.index: c for c in (finals[i].outputs if finals[i] is not None else [])}
        for c in range(n):
            comp = comps.get(c) or CompletionOutput(index=c, text="", token_ids=[], finish_reason="abort")
            completion_tokens += len(comp.token_ids)
            choices.append(api.final_choice(i * n + c, job, comp, finals[i]))
    usage = _usage(sum(len(j.prompt_ids) for j in jobs), completion_tokens)
    more = await extra() if extra is not None else {}
    return json_response({"id": base_id, "object": api.object_full, "created": created, "model": model,
                          "choices": choices, "usage": usage, "system_fingerprint": None,
                          **api.response_fields(finals), **more}, headers={"X-Request-Id": base_id})


async def _run(request: web.Request, state: ServerState, api: _Endpoint, params, req, id_prefix: str,
               prompt_param: str) -> web.StreamResponse:
    base_id = f"{id_prefix}-{uuid.uuid4().hex}"
    created = int(time.time())
    lora = check_model(state, req.model)  # a LoRA adapter's name, or None for the base model
    model = lora or state.served_model_name
    transfer = kv_transfer_api.parse(req.kv_transfer_params)
    kv_transfer_api.check(state, transfer, bool(req.stream))
    state.active_handlers += 1
    try:
        await kv_transfer_api.pull_before(request, state, transfer, api.jobs, lora)
        await start_jobs(state, base_id, api.jobs, params, req.priority, prompt_param, lora)
        try:
            if req.stream:
                return await _stream(request, api, base_id, created, model, req.include_usage)
            async def transfer_fields() -> dict:  # once prefilled: where the KV is, held for the pull
                return {"kv_transfer_params": await kv_transfer_api.producer_answer(request, state, api.jobs)}

            prefill = transfer is not None and transfer.do_remote_decode
            return await _respond(api, base_id, created, model, transfer_fields if prefill else None)
        finally:
            end_jobs(request, state, api.jobs, id_prefix, model)
    finally:
        state.active_handlers -= 1


# ------------------------------------------------------------------------------------------ routes
async def create_completion(request: web.Request) -> web.StreamResponse:
    state = get_state(request)
    req: CompletionRequest = await read_json(request, CompletionRequest)
    check_model(state, req.model)
    require_loaded(state)
    tok = state.engine.tokenizer
    try:
        prompts = req.prompts()
    except ValueError as e:
        raise APIError(str(e), 400, param="prompt") from None
    jobs: list[Job] = []
    for p in prompts:
        if isinstance(p, str):
            ids = list(tok.encode(p, add_special_tokens=req.add_special_tokens)) if p else []
            jobs.append(Job(ids, p))
        else:
            jobs.append(Job(list(p), ""))
    # the images of multi_modal_data (Shoal's extension), one per image placeholder the prompt (text or ids) holds
    jobs[0].images = await completion_images(state, req.multi_modal_data, [j.prompt_ids for j in jobs])
    kw = req.sampling_kwargs()
    kw["max_tokens"] = req.max_tokens
    if req.logprobs is not None:
        kw["logprobs"] = req.logprobs
        if req.echo:  # the echoed prompt tokens carry their logprobs too (what evaluation clients read)
            kw["prompt_logprobs"] = max(req.logprobs, req.prompt_logprobs or 0)
    kw["structured_outputs"] = await _compile(state, structured.from_request(req))
    params = _make_params(kw)
    if req.echo:
        for j in jobs:
            if not j.prompt_text:
                j.prompt_text = tok.decode(j.prompt_ids)
    return await _run(request, state, _Completions(state, jobs, req), params, req, "cmpl", "prompt")


async def create_chat_completion(request: web.Request) -> web.StreamResponse:
    state = get_state(request)
    req: ChatCompletionRequest = await read_json(request, ChatCompletionRequest)
    check_model(state, req.model)
    require_loaded(state)
    api, params = await prepare_chat(state, req)
    return await _run(request, state, api, params, req, "chatcmpl", "messages")


async def prepare_chat(state: ServerState, req: ChatCompletionRequest) -> tuple[_Chat, Any]:
    """The one place a chat conversation becomes a prompt and SamplingParams (chat completions, and the Responses
    and Anthropic Messages APIs, which translate their requests into a ChatCompletionRequest first)."""
    plan = tools.plan(req.tools, req.tool_choice, state.tool_call_parser)
    template_kwargs = dict(req.chat_template_kwargs or {})
    if plan.tools:
        template_kwargs.setdefault("tools", plan.tools)
    prompt_ids = render_chat_prompt(state, req.messages, req.add_generation_prompt, req.continue_final_message,
                                    template_kwargs)
    images = await chat_images(state, req.messages)
    kw = req.sampling_kwargs()
    kw["max_tokens"] = req.requested_max_tokens()
    top = req.requested_logprobs()
    if top is not None:
        kw["logprobs"] = top
    grammar = structured.from_request(req)
    if plan.grammar is not None:
        if grammar is not None:
            raise APIError(f"tool_choice {plan.mode!r} cannot be combined with {grammar.param}", 400,
                           param="tool_choice")
        grammar = plan.grammar
    if plan.mode == "auto" and isinstance(plan.parser, tools.MistralParser):
        kw["skip_special_tokens"] = False  # [TOOL_CALLS] is a special token
    kw["structured_outputs"] = await _compile(state, grammar)
    params = _make_params(kw)
    return _Chat(state, [Job(prompt_ids, "", images=images)], req, top, plan), params
