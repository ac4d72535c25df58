"""The chat path's deltas, relayed as another API's output (Anthropic Messages, OpenAI Responses).

Both APIs translate their request into a ChatCompletionRequest and run it on the chat path
(openai_api.prepare_chat). A ChatRelay is one such request in flight: it starts and ends the chat jobs, feeds each
engine output's chat delta (text, tool calls) to the API's output builder, with <think> reasoning split out where
the chat template thinks, counts the output tokens and keeps the finish reason. The API modules name the ids and
build the objects and events their clients expect.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, Callable

from aiohttp import web

from shoal.engine.core.async_engine import EngineDeadError
from shoal.engine.server import openai_api as oai
from shoal.engine.server.protocol import APIError
from shoal.engine.server.reasoning import ReasoningSplitter, template_thinks


def reasoning_splitter(state, api) -> ReasoningSplitter | None:
    """A splitter for templates that think in <think> blocks (none when the client continues its own message)."""
    template = getattr(state.engine, "chat_template", None) or getattr(state.engine.tokenizer, "chat_template", None)
    if not template_thinks(template) or api.req.continue_final_message:
        return None
    tail = state.engine.tokenizer.decode(api.jobs[0].prompt_ids[-8:])
    return ReasoningSplitter(opened_by_prompt=tail.rstrip().endswith("<think>"))


class DeltaBuilder:
    """The base of the APIs' output builders: chat text arrives in pieces, split into reasoning and answer where
    the template thinks; `_text(kind, piece)` turns one piece into the API's events."""

    def __init__(self, splitter: ReasoningSplitter | None):
        self.splitter = splitter

    def text(self, piece: str) -> list[dict]:
        pieces = self.splitter.feed(piece) if self.splitter else [("text", piece)] if piece else []
        return [e for kind, p in pieces for e in self._text(kind, p)]

    def flush_text(self) -> list[dict]:
        """What the splitter still holds (a partial "<think" tag, say), written out at the end or before a call."""
        pieces = self.splitter.finish() if self.splitter else []
        return [e for kind, p in pieces for e in self._text(kind, p)]

    def _text(self, kind: str, piece: str) -> list[dict]:
        raise NotImplementedError


class ChatRelay:
    """One translated chat request in flight; `out` is the API's builder, made with the reasoning splitter."""

    def __init__(self, state, api, builder: Callable[[ReasoningSplitter | None], Any]):
        self.state, self.api = state, api
        self.output_tokens = 0
        self.finish: str | None = None
        self.out = builder(reasoning_splitter(state, api))

    @property
    def prompt_tokens(self) -> int:
        return len(self.api.jobs[0].prompt_ids)

    @asynccontextmanager
    async def running(self, request: web.Request, request_id: str, params, priority: int, prompt_param: str,
                      lora: str | None, operation: str, model: str) -> AsyncIterator[None]:
        """The chat jobs run inside: started (a failure is the API's 4xx/5xx), then aborted if still running and
        traced on the way out; the server's drain waits for the handler meanwhile."""
        state = self.state
        state.active_handlers += 1
        try:
            await oai.start_jobs(state, request_id, self.api.jobs, params, priority, prompt_param, lora)
            try:
                yield
            finally:
                oai.end_jobs(request, state, self.api.jobs, operation, model)
        finally:
            state.active_handlers -= 1

    async def outputs(self) -> AsyncIterator[list[dict]]:
        """The API events each engine output causes, in order, until the request ends."""
        async for _, out in oai.merge_streams(self.api.jobs):
            if out is not None:
                yield self.feed(out)

    async def collect(self) -> None:
        """Runs the request to its end without streaming."""
        try:
            async for _ in self.outputs():
                pass
        except EngineDeadError as e:
            raise APIError(f"generation failed: {e}", 500, code="engine_dead") from None

    def feed(self, out) -> list[dict]:
        """One engine output -> the events it causes."""
        events = []
        for comp in out.outputs:
            self.output_tokens += len(comp.token_ids)
            choice = self.api.delta_choice(0, self.api.jobs[0], comp, out)
            if choice is None:
                continue
            delta = choice["delta"]
            if delta.get("content"):
                events += self.out.text(delta["content"])
            if delta.get("tool_calls"):
                events += self.out.tool_calls(delta["tool_calls"])
            if choice["finish_reason"] is not None:
                self.finish = choice["finish_reason"]
                self.finished_by(comp)
        return events

    def finished_by(self, completion) -> None:
        """Hook: the completion that ended the request (Anthropic reports which stop sequence matched)."""
