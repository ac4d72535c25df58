"""Which grammar a request asks for: OpenAI's `response_format`, vLLM's `structured_outputs` and its legacy
`guided_json / guided_regex / guided_choice / guided_grammar` fields, and tool calling's `tool_choice` (see
tools.py) all become one StructuredOutputsParams, compiled off the event loop and off the engine loop."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shoal.engine.core.structured_outputs import GrammarError, StructuredOutputsParams
from shoal.engine.server.protocol import APIError

_STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class GrammarRequest:
    spec: StructuredOutputsParams
    param: str  # the request field it came from (named in a 400)
    kind: str  # metrics label: json_schema | json_object | regex | choice | grammar | tool_call


def _spec(param: str, kind: str, **fields: Any) -> GrammarRequest:
    try:
        return GrammarRequest(StructuredOutputsParams(**fields), param, kind)
    except GrammarError as e:
        raise APIError(f"{param}: {e}", 400, param=param) from None


def from_response_format(rf: dict[str, Any]) -> GrammarRequest | None:
    kind = rf.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return _spec("response_format", "json_object", json_object=True)
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise APIError("response_format.json_schema is required (an object with 'name' and 'schema')", 400,
                           param="response_format.json_schema")
        schema = js.get("schema", js.get("json_schema"))
        if not isinstance(schema, (dict, bool)):
            raise APIError("response_format.json_schema.schema is required and must be a JSON schema object", 400,
                           param="response_format.json_schema.schema")
        return _spec("response_format", "json_schema", json=schema)
    raise APIError(f"response_format type {kind!r} is not supported (text, json_object or json_schema)", 400,
                   param="response_format.type")


def from_request(req: Any) -> GrammarRequest | None:
    """The one grammar a completions or chat request asks for (tool_choice aside), or None. 400 when it asks
    for several or names an unknown kind."""
    found: list[GrammarRequest] = []
    if req.response_format is not None:
        g = from_response_format(req.response_format)
        if g is not None:
            found.append(g)
    so = req.structured_outputs
    if so is not None:
        given = {k: so[k] for k in _STRUCTURED_KEYS if so.get(k) not in (None, False)}
        if len(given) != 1:
            raise APIError("structured_outputs needs exactly one of json, regex, choice, grammar or json_object", 400,
                           param="structured_outputs")
        (key, value), = given.items()
        kind = {"json": "json_schema"}.get(key, key)
        found.append(_spec(f"structured_outputs.{key}", kind, **{key: value}))
    for field, key, kind in (("guided_json", "json", "json_schema"), ("guided_regex", "regex", "regex"),
                             ("guided_choice", "choice", "choice"), ("guided_grammar", "grammar", "grammar")):
        value = getattr(req, field)
        if value is not None:
            found.append(_spec(field, kind, **{key: value}))
    if len(found) > 1:
        raise APIError(f"give only one structured output constraint (got {', '.join(g.param for g in found)})",
                       400, param=found[1].param)
    return found[0] if found else None
