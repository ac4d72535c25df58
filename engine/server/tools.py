"""Tool calling on /v1/chat/completions: which mode a request is in, the grammar that enforces forced calls, and
the parsers that find calls in free text (`--enable-auto-tool-choice --tool-call-parser NAME`, vLLM's flags).

Modes (OpenAI's `tool_choice`):
- "none": tools are ignored (not rendered into the prompt), plain content comes back;
- a named function (`{"type": "function", "function": {"name": ...}}`): the output IS the call's arguments,
  a JSON object valid for the function's `parameters` schema (grammar-enforced);
- "required": the output is a JSON array of one or more `{"name", "parameters"}` objects, each valid for its
  function (grammar-enforced);
- "auto" (the default when tools are given): the model writes what it likes; the configured parser pulls tool
  calls out of the text (hermes: `<tool_call>{...}</tool_call>`, llama3_json: a bare JSON object,
  mistral: `[TOOL_CALLS][...]`). Without `--enable-auto-tool-choice` "auto" is a 400, as in vLLM.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from shoal.engine.server.protocol import APIError
from shoal.engine.server.structured import GrammarRequest, _spec

PARSERS = ("hermes", "llama3_json", "mistral")


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ToolPlan:
    """How one chat request handles tools."""

    mode: str  # none | auto | required | named
    tools: list[dict]  # the request's tools, as the chat template sees them (empty for "none")
    grammar: GrammarRequest | None = None  # forced calls
    named: str | None = None  # the forced function's name (mode "named")
    parser: "ToolParser | None" = None  # mode "auto"


def _functions(tools: list[Any]) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict):
            raise APIError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., 'parameters': ...}}}}",
                           400, param=f"tools.{i}")
        name = fn.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", name):
            raise APIError(f"tools[{i}].function.name must be 1-64 letters, digits, '_', '.' or '-'", 400,
                           param=f"tools.{i}.function.name")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise APIError(f"tools[{i}].function.parameters must be a JSON schema object", 400,
                           param=f"tools.{i}.function.parameters")
        out[name] = params
    return out


def plan(tools: list[Any] | None, tool_choice: Any, auto_parser: str | None) -> ToolPlan:
    """Resolve tools + tool_choice into a ToolPlan; 400 for anything malformed or not enabled."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise APIError("tool_choice needs tools", 400, param="tool_choice")
        return ToolPlan("none", [])
    functions = _functions(tools)
    choice = "auto" if tool_choice is None else tool_choice
    if choice == "none":
        return ToolPlan("none", [])
    if choice == "auto":
        if auto_parser is None:
            raise APIError('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set',
                           400, param="tool_choice")
        return ToolPlan("auto", list(tools), parser=make_parser(auto_parser))
    if choice == "required":
        calls = [{"type": "object", "properties": {"name": {"const": name}, "parameters": params},
                  "required": ["name", "parameters"], "additionalProperties": False}
                 for name, params in functions.items()]
        schema = {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
        return ToolPlan("required", list(tools), _tool_grammar(schema))
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in functions:
            raise APIError(f"tool_choice names the function {name!r}, which is not in tools", 400,
                           param="tool_choice")
        return ToolPlan("named", list(tools), _tool_grammar(functions[name]), named=name)
    raise APIError("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': "
                   "...}}", 400, param="tool_choice")


def _tool_grammar(schema: dict) -> GrammarRequest:
    return _spec("tools", "tool_call", json=schema)


def forced_calls(plan_: ToolPlan, text: str) -> list[ToolCall]:
    """The tool calls of a grammar-forced output (complete, or cut short by max_tokens: then none)."""
    if plan_.mode == "named":
        try:
            json.loads(text)
        except ValueError:
            return []
        return [ToolCall(plan_.named, text)]
    try:
        items = json.loads(text)
    except ValueError:
        return []
    return [ToolCall(c["name"], _dumps(c.get("parameters", {}))) for c in items
            if isinstance(c, dict) and isinstance(c.get("name"), str)]


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False)


# ------------------------------------------------------------------------------------------ auto parsers
class ToolParser:
    """Finds tool calls in a model's free text. `marker` starts a call; content before it streams as text."""

    marker: str = ""

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls): content is the text outside calls (None when there is none)."""
        raise NotImplementedError

    def call_start(self, text: str) -> int | None:
        """Where a tool call starts in text, if it does."""
        i = text.find(self.marker)
        return None if i < 0 else i

    def safe_prefix(self, text: str) -> int:
        """How much of text can stream as content: everything before a call, minus a tail that might be the start
        of the marker."""
        start = self.call_start(text)
        if start is not None:
            return start
        for k in range(min(len(self.marker) - 1, len(text)), 0, -1):
            if text.endswith(self.marker[:k]):
                return len(text) - k
        return len(text)


def _call_from_obj(obj: Any) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return ToolCall(obj["name"], args if isinstance(args, str) else _dumps(args))


class HermesParser(ToolParser):
    """Hermes / Qwen: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, possibly several."""

    marker = "<tool_call>"
    _CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def extract(self, text):
        start = text.find(self.marker)
        if start < 0:
            return text, []
        calls = []
        for body in self._CALL.findall(text[start:]):
            try:
                call = _call_from_obj(json.loads(body))
            except ValueError:
                call = None
            if call is not None:
                calls.append(call)
        if not calls:
            return text, []
        content = text[:start].strip()
        return content or None, calls


class Llama3JsonParser(ToolParser):
    """Llama 3.x JSON tool calls: the whole output is `{"name": ..., "parameters": {...}}` (optionally after
    `<|python_tag|>`, several separated by `;`)."""

    marker = "{"

    def call_start(self, text):
        stripped = text.lstrip()
        if stripped.startswith("<|python_tag|>") or stripped.startswith("{"):
            return 0
        return None

    def safe_prefix(self, text):
        stripped = text.lstrip()
        if not stripped or "<|python_tag|>".startswith(stripped) or self.call_start(text) is not None:
            return 0
        return len(text)

    def extract(self, text):
        body = text.strip()
        if body.startswith("<|python_tag|>"):
            body = body[len("<|python_tag|>"):].strip()
        if not body.startswith("{"):
            return text, []
        decoder = json.JSONDecoder()
        calls, i = [], 0
        while i < len(body):
            try:
                obj, end = decoder.raw_decode(body, i)
            except ValueError:
                return text, []
            call = _call_from_obj(obj)
            if call is None:
                return text, []
            calls.append(call)
            i = end
            while i < len(body) and body[i] in " \n\t;":
                i += 1
        return None, calls


class MistralParser(ToolParser):
    """Mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, or the v11 form
    `[TOOL_CALLS]name[ARGS]{...}` repeated. Mistral wants 9-character alphanumeric call ids."""

    marker = "[TOOL_CALLS]"

    def extract(self, text):
        start = text.find(self.marker)
        if start < 0:
            return text, []
        rest = text[start:]
        calls: list[ToolCall] = []
        for part in rest.split(self.marker)[1:]:
            part = part.strip()
            if part.startswith("["):
                try:
                    objs = json.JSONDecoder().raw_decode(part)[0]
                except ValueError:
                    continue
                calls += [c for c in (_call_from_obj(o) for o in (objs if isinstance(objs, list) else [objs])) if c]
            elif "[ARGS]" in part:
                name, _, args = part.partition("[ARGS]")
                try:
                    obj, _ = json.JSONDecoder().raw_decode(args.strip())
                except ValueError:
                    continue
                calls.append(ToolCall(name.strip(), _dumps(obj)))
        for c in calls:
            c.id = uuid.uuid4().hex[:9]
        if not calls:
            return text, []
        content = text[:start].strip()
        return content or None, calls


def make_parser(name: str) -> ToolParser:
    try:
        return {"hermes": HermesParser, "llama3_json": Llama3JsonParser, "mistral": MistralParser}[name]()
    except KeyError:
        raise ValueError(f"unknown tool call parser {name!r} (one of {', '.join(PARSERS)})") from None
