"""/v1/completions and /v1/chat/completions: request -> SamplingParams -> AsyncEngine -> OpenAI JSON or SSE.

The engine hands back cumulative, display-safe text per completion (never a partial UTF-8 character, never a
prefix of a stop string still pending); this module turns it into deltas for SSE. A client that disconnects
(or whose handler is cancelled) has its requests aborted at once, which frees their KV blocks.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from shoal.engine.core.async_engine import EngineDeadError, EngineError, RequestStream
from shoal.engine.core.outputs import CompletionOutput, RequestOutput
from shoal.engine.server.app import (
    ServerState,
    check_model,
    engine_error_to_api_error,
    get_state,
    read_json,
    require_loaded,
)
from shoal.engine.server.protocol import APIError, ChatCompletionRequest, ChatMessage, CompletionRequest

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def _make_params(kwargs: dict[str, Any]):
    from shoal.engine.execution.sampling import SamplingParams

    try:
        return SamplingParams(**kwargs)
    except (ValueError, TypeError) as e:
        msg = str(e)
        head = msg.split(" ", 1)[0].strip(":,'\"`")
        raise APIError(msg, 400, param=head if head in kwargs else None) from None


def _prompt_too_long(max_model_len: int, prompt_len: int, max_tokens: int, where: str) -> APIError:
    return APIError(
        f"This model's maximum context length is {max_model_len} tokens. However, you requested "
        f"{prompt_len + max_tokens} tokens ({prompt_len} in the {where}, {max_tokens} for the completion). "
        f"Please reduce the length of the {where} or the maximum number of tokens.",
        400, param="max_tokens" if prompt_len < max_model_len else "prompt", code="context_length_exceeded",
    )


def _resolve_max_tokens(state: ServerState, prompt_len: int, requested: int | None, where: str) -> int:
    max_len = state.engine.max_model_len
    if prompt_len == 0:
        raise APIError(f"the {where} is empty", 400, param="prompt" if where == "prompt" else "messages")
    if max_len is None:
        return requested if requested is not None else 16
    if prompt_len >= max_len and requested != 0:
        raise _prompt_too_long(max_len, prompt_len, requested or 0, where)
    if requested is None:
        return max_len - prompt_len
    if prompt_len + requested > max_len:
        raise _prompt_too_long(max_len, prompt_len, requested, where)
    return requested


def render_chat_prompt(state: ServerState, messages: list[ChatMessage], add_generation_prompt: bool = True,
                       continue_final_message: bool = False, chat_template_kwargs: dict | None = None,
                       add_special_tokens: bool = False) -> list[int]:
    """Apply the model's chat template (or --chat-template) and tokenize. 400 when the model has none."""
    tok = state.engine.tokenizer
    try:
        msgs = [m.to_template() for m in messages]
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


# ------------------------------------------------------------------------------------------ per-choice state
@dataclass
class _Choice:
    index: int
    prompt_text: str = ""
    echo: bool = False
    text_len: int = 0  # characters of the engine's cumulative text already sent
    num_tokens: int = 0  # tokens whose logprobs were already sent
    text_offset: int = 0  # running offset for completions logprobs
    started: bool = False  # chat: role delta sent
    finish_reason: str | None = None
    stop_reason: Any = None
    final: CompletionOutput | None = None
    token_ids: list[int] = field(default_factory=list)


@dataclass
class _Job:
    """One prompt of a request: its engine stream and the prompt's ids/text."""

    prompt_ids: list[int]
    prompt_text: str
    stream: RequestStream | None = None


async def _merge_streams(jobs: list[_Job]) -> AsyncIterator[tuple[int, RequestOutput | None]]:
    """(job index, output) from every stream as they come; (i, None) when stream i ended without finishing."""
    if len(jobs) == 1:
        async for out in jobs[0].stream:
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
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


async def _start_jobs(state: ServerState, base_id: str, jobs: list[_Job], params, priority: int) -> None:
    """Hand every prompt to the engine; on any failure abort those already added and raise an APIError."""
    try:
        for i, job in enumerate(jobs):
            rid = base_id if len(jobs) == 1 else f"{base_id}-{i}"
            job.stream = await state.engine.add_request(rid, job.prompt_ids, params, priority=priority)
    except (EngineError, ValueError) as e:
        _abort_jobs(jobs)
        raise engine_error_to_api_error(e) from None
    except BaseException:
        _abort_jobs(jobs)
        raise


def _abort_jobs(jobs: list[_Job]) -> None:
    for j in jobs:
        if j.stream is not None:
            j.stream.abort()


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


def _new_logprobs(comp: CompletionOutput, start: int) -> list[dict] | None:
    """The per-token logprob dicts for tokens [start:], whether the engine reports them cumulatively or not."""
    lps = comp.logprobs
    if lps is None:
        return None
    n = len(comp.token_ids)
    if len(lps) == n:
        return lps[start:]
    return lps[-(n - start):] if n > start else []


def _completion_logprobs(state: ServerState, comp: CompletionOutput, start: int, end: int, k: int,
                         choice: _Choice) -> dict:
    tokens, token_lps, tops, offsets = [], [], [], []
    lps = _new_logprobs(comp, start) or []
    for j, tid in enumerate(comp.token_ids[start:end]):
        d = lps[j] if j < len(lps) else {}
        lp = d.get(tid)
        s = _token_str(state, tid, lp)
        tokens.append(s)
        token_lps.append(lp.logprob if lp is not None else None)
        top = {_token_str(state, t, l): l.logprob for t, l in _sorted_top(d)[:k]}
        if lp is not None:
            top.setdefault(s, lp.logprob)
        tops.append(top or None)
        offsets.append(choice.text_offset)
        choice.text_offset += len(s)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def _echo_logprobs(state: ServerState, prompt_ids: list[int], choice: _Choice) -> dict:
    tokens = [state.engine.tokenizer.decode([t]) for t in prompt_ids]
    offsets = []
    for s in tokens:
        offsets.append(choice.text_offset)
        choice.text_offset += len(s)
    return {"tokens": tokens, "token_logprobs": [None] * len(tokens), "top_logprobs": [None] * len(tokens),
            "text_offset": offsets}


def _merge_lp(a: dict | None, b: dict) -> dict:
    if a is None:
        return b
    return {k: a[k] + b[k] for k in a}


def _chat_logprobs(state: ServerState, comp: CompletionOutput, start: int, end: int, k: int) -> dict:
    content = []
    lps = _new_logprobs(comp, start) or []
    for j, tid in enumerate(comp.token_ids[start:end]):
        d = lps[j] if j < len(lps) else {}
        lp = d.get(tid)
        s = _token_str(state, tid, lp)
        top = []
        for t, l in _sorted_top(d)[:k]:
            ts = _token_str(state, t, l)
            top.append({"token": ts, "logprob": l.logprob, "bytes": list(ts.encode("utf-8"))})
        content.append({"token": s, "logprob": lp.logprob if lp is not None else None,
                        "bytes": list(s.encode("utf-8")), "top_logprobs": top})
    return {"content": content}


# ------------------------------------------------------------------------------------------ SSE helpers
class _SSE:
    def __init__(self, request: web.Request, request_id: str):
        self.request = request
        self.resp = web.StreamResponse(status=200, headers={**SSE_HEADERS, "X-Request-Id": request_id})

    async def start(self) -> None:
        await self.resp.prepare(self.request)

    async def send(self, obj: Any) -> None:
        await self.resp.write(f"data: {_dumps(obj)}\n\n".encode())

    async def done(self) -> None:
        await self.resp.write(b"data: [DONE]\n\n")
        await self.resp.write_eof()


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _track(state: ServerState):
    class _Active:
        def __enter__(self):
            state.active_handlers += 1

        def __exit__(self, *exc):
            state.active_handlers -= 1

    return _Active()


# ------------------------------------------------------------------------------------------ completions
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
    jobs: list[_Job] = []
    for p in prompts:
        if isinstance(p, str):
            ids = list(tok.encode(p, add_special_tokens=req.add_special_tokens)) if p else []
            jobs.append(_Job(ids, p))
        else:
            jobs.append(_Job(list(p), ""))
    max_tokens = None
    for j in jobs:
        mt = _resolve_max_tokens(state, len(j.prompt_ids), req.max_tokens, "prompt")
        max_tokens = mt if max_tokens is None else min(max_tokens, mt)
    kw = req.sampling_kwargs()
    kw["max_tokens"] = max_tokens
    if req.logprobs is not None:
        kw["logprobs"] = req.logprobs
    params = _make_params(kw)
    if req.echo:
        for j in jobs:
            if not j.prompt_text:
                j.prompt_text = tok.decode(j.prompt_ids)
    base_id = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    model = state.served_model_name
    n = req.n
    choices = {i * n + c: _Choice(index=i * n + c, echo=req.echo, prompt_text=jobs[i].prompt_text)
               for i in range(len(jobs)) for c in range(n)}
    with _track(state):
        await _start_jobs(state, base_id, jobs, params, req.priority)
        try:
            if req.stream:
                return await _stream_completion(request, state, req, jobs, choices, base_id, created, model)
            return await _full_completion(state, req, jobs, choices, base_id, created, model)
        finally:
            _abort_jobs(jobs)


def _completion_delta(state: ServerState, req: CompletionRequest, job: _Job, ch: _Choice,
                      comp: CompletionOutput) -> tuple[str, dict | None]:
    """New text (and logprobs) of one choice since the last send; advances the choice's cursors."""
    text = comp.text[ch.text_len:]
    lp = None
    if not ch.started:
        ch.started = True
        if ch.echo:
            text = ch.prompt_text + text
            if req.logprobs is not None:
                lp = _echo_logprobs(state, job.prompt_ids, ch)
    ntok = len(comp.token_ids)
    if req.logprobs is not None and ntok > ch.num_tokens:
        lp = _merge_lp(lp, _completion_logprobs(state, comp, ch.num_tokens, ntok, req.logprobs, ch))
    ch.text_len = len(comp.text)
    ch.num_tokens = ntok
    return text, lp


async def _stream_completion(request, state, req: CompletionRequest, jobs, choices, base_id, created, model):
    sse = _SSE(request, base_id)
    await sse.start()
    n = req.n
    include_usage = req.include_usage
    completion_tokens: dict[int, int] = {}
    try:
        async for i, out in _merge_streams(jobs):
            comps = out.outputs if out is not None else []
            if out is None:  # aborted (shutdown): close the open choices
                for c in range(n):
                    ch = choices[i * n + c]
                    if ch.finish_reason is None:
                        ch.finish_reason = "abort"
                        await sse.send(_completion_chunk(base_id, created, model, ch.index, "", None, "abort",
                                                         include_usage))
                continue
            for comp in comps:
                ch = choices[i * n + comp.index]
                if ch.finish_reason is not None:
                    continue
                text, lp = _completion_delta(state, req, jobs[i], ch, comp)
                completion_tokens[ch.index] = len(comp.token_ids)
                if comp.finish_reason is not None:
                    ch.finish_reason = comp.finish_reason
                    ch.stop_reason = comp.stop_reason
                if text or lp or comp.finish_reason is not None:
                    chunk = _completion_chunk(base_id, created, model, ch.index, text, lp, comp.finish_reason,
                                              include_usage)
                    if comp.finish_reason is not None:
                        chunk["choices"][0]["stop_reason"] = comp.stop_reason
                    await sse.send(chunk)
        if include_usage:
            usage = _usage(sum(len(j.prompt_ids) for j in jobs), sum(completion_tokens.values()))
            await sse.send({"id": base_id, "object": "text_completion", "created": created, "model": model,
                            "choices": [], "usage": usage})
        await sse.done()
    except EngineDeadError as e:
        await _send_stream_error(sse, e)
    return sse.resp


async def _send_stream_error(sse: _SSE, e: Exception) -> None:
    err = APIError(f"generation failed: {e}", 500, code="engine_dead")
    try:
        await sse.send(err.body())
        await sse.done()
    except ConnectionError:
        pass


def _completion_chunk(base_id, created, model, index, text, lp, finish_reason, include_usage) -> dict:
    chunk = {"id": base_id, "object": "text_completion", "created": created, "model": model,
             "choices": [{"index": index, "text": text, "logprobs": lp, "finish_reason": finish_reason}]}
    if include_usage:
        chunk["usage"] = None
    return chunk


async def _collect(jobs: list[_Job]) -> list[RequestOutput | None]:
    finals: list[RequestOutput | None] = [None] * len(jobs)
    try:
        async for i, out in _merge_streams(jobs):
            if out is not None:
                finals[i] = out if finals[i] is None else _merge_outputs(finals[i], out)
    except EngineDeadError as e:
        raise APIError(f"generation failed: {e}", 500, code="engine_dead") from None
    return finals


def _merge_outputs(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    by = {c.index: c for c in a.outputs}
    by.update({c.index: c for c in b.outputs})
    b.outputs = [by[k] for k in sorted(by)]
    return b


async def _full_completion(state, req: CompletionRequest, jobs, choices, base_id, created, model):
    finals = await _collect(jobs)
    out_choices = []
    completion_tokens = 0
    for i, job in enumerate(jobs):
        comps = {c.index: c for c in (finals[i].outputs if finals[i] is not None else [])}
        for c in range(req.n):
            ch = choices[i * req.n + c]
            comp = comps.get(c) or CompletionOutput(index=c, text="", token_ids=[], finish_reason="abort")
            text, lp = _completion_delta(state, req, job, ch, comp)
            completion_tokens += len(comp.token_ids)
            out_choices.append({"index": ch.index, "text": text, "logprobs": lp,
                                "finish_reason": comp.finish_reason or "abort", "stop_reason": comp.stop_reason})
    usage = _usage(sum(len(j.prompt_ids) for j in jobs), completion_tokens)
    from shoal.engine.server.app import json_response

    return json_response({"id": base_id, "object": "text_completion", "created": created, "model": model,
                          "choices": out_choices, "usage": usage, "system_fingerprint": None},
                         headers={"X-Request-Id": base_id})


# ------------------------------------------------------------------------------------------ chat
async def create_chat_completion(request: web.Request) -> web.StreamResponse:
    state = get_state(request)
    req: ChatCompletionRequest = await read_json(request, ChatCompletionRequest)
    check_model(state, req.model)
    require_loaded(state)
    prompt_ids = render_chat_prompt(state, req.messages, req.add_generation_prompt, req.continue_final_message,
                                    req.chat_template_kwargs)
    kw = req.sampling_kwargs()
    kw["max_tokens"] = _resolve_max_tokens(state, len(prompt_ids), req.requested_max_tokens(), "messages")
    top = req.requested_logprobs()
    if top is not None:
        kw["logprobs"] = top
    params = _make_params(kw)
    jobs = [_Job(prompt_ids, "")]
    base_id = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    model = state.served_model_name
    choices = {c: _Choice(index=c) for c in range(req.n)}
    with _track(state):
        await _start_jobs(state, base_id, jobs, params, req.priority)
        try:
            if req.stream:
                return await _stream_chat(request, state, req, jobs, choices, base_id, created, model, top)
            return await _full_chat(state, req, jobs, choices, base_id, created, model, top)
        finally:
            _abort_jobs(jobs)


def _chat_chunk(base_id, created, model, index, delta, lp, finish_reason, include_usage, stop_reason=None) -> dict:
    choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish_reason}
    if finish_reason is not None:
        choice["stop_reason"] = stop_reason
    chunk = {"id": base_id, "object": "chat.completion.chunk", "created": created, "model": model,
             "choices": [choice]}
    if include_usage:
        chunk["usage"] = None
    return chunk


async def _stream_chat(request, state, req: ChatCompletionRequest, jobs, choices, base_id, created, model, top):
    sse = _SSE(request, base_id)
    await sse.start()
    include_usage = req.include_usage
    completion_tokens: dict[int, int] = {}
    try:
        for ch in choices.values():  # the role comes first, as OpenAI sends it
            ch.started = True
            await sse.send(_chat_chunk(base_id, created, model, ch.index, {"role": "assistant", "content": ""},
                                       None, None, include_usage))
        async for _, out in _merge_streams(jobs):
            if out is None:
                for ch in choices.values():
                    if ch.finish_reason is None:
                        ch.finish_reason = "abort"
                        await sse.send(_chat_chunk(base_id, created, model, ch.index, {}, None, "abort",
                                                   include_usage))
                continue
            for comp in out.outputs:
                ch = choices.get(comp.index)
                if ch is None or ch.finish_reason is not None:
                    continue
                text = comp.text[ch.text_len:]
                ntok = len(comp.token_ids)
                lp = None
                if top is not None and ntok > ch.num_tokens:
                    lp = _chat_logprobs(state, comp, ch.num_tokens, ntok, top)
                completion_tokens[ch.index] = ntok
                if not (text or lp or comp.finish_reason is not None):
                    continue
                ch.text_len = len(comp.text)
                ch.num_tokens = ntok
                delta = {"content": text} if text else {}
                if comp.finish_reason is not None:
                    ch.finish_reason = comp.finish_reason
                await sse.send(_chat_chunk(base_id, created, model, ch.index, delta, lp, comp.finish_reason,
                                           include_usage, comp.stop_reason))
        if include_usage:
            usage = _usage(len(jobs[0].prompt_ids), sum(completion_tokens.values()))
            await sse.send({"id": base_id, "object": "chat.completion.chunk", "created": created, "model": model,
                            "choices": [], "usage": usage})
        await sse.done()
    except EngineDeadError as e:
        await _send_stream_error(sse, e)
    return sse.resp


async def _full_chat(state, req: ChatCompletionRequest, jobs, choices, base_id, created, model, top):
    finals = await _collect(jobs)
    comps = {c.index: c for c in (finals[0].outputs if finals[0] is not None else [])}
    out_choices = []
    completion_tokens = 0
    for c in range(req.n):
        comp = comps.get(c) or CompletionOutput(index=c, text="", token_ids=[], finish_reason="abort")
        completion_tokens += len(comp.token_ids)
        lp = _chat_logprobs(state, comp, 0, len(comp.token_ids), top) if top is not None else None
        out_choices.append({"index": c, "message": {"role": "assistant", "content": comp.text, "tool_calls": []},
                            "logprobs": lp, "finish_reason": comp.finish_reason or "abort",
                            "stop_reason": comp.stop_reason})
    from shoal.engine.server.app import json_response

    return json_response({"id": base_id, "object": "chat.completion", "created": created, "model": model,
                          "choices": out_choices, "usage": _usage(len(jobs[0].prompt_ids), completion_tokens),
                          "system_fingerprint": None}, headers={"X-Request-Id": base_id})
