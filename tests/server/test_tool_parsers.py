"""Auto tool choice parsers on canned model outputs (what Hermes/Qwen, Llama 3 and Mistral models write), and
how tools + tool_choice resolve."""

from __future__ import annotations

import json

import pytest

from shoal.engine.server import tools
from shoal.engine.server.protocol import APIError

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def _calls(parser, text):
    content, calls = tools.make_parser(parser).extract(text)
    return content, [(c.name, json.loads(c.arguments)) for c in calls], calls


def test_hermes():
    text = ('I will look that up.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>')
    content, calls, raw = _calls("hermes", text)
    assert content == "I will look that up."
    assert calls == [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Oslo"})]
    assert len({c.id for c in raw}) == 2 and all(c.id.startswith("call_") for c in raw)
    # An unclosed last call (cut by max_tokens after its JSON) still counts; broken JSON does not.
    assert _calls("hermes", '<tool_call>{"name": "f", "arguments": {}}')[1] == [("f", {})]
    assert _calls("hermes", '<tool_call>{"name": "f", "argu')[:2] == ('<tool_call>{"name": "f", "argu', [])
    assert _calls("hermes", "no tools here")[:2] == ("no tools here", [])


def test_llama3_json():
    assert _calls("llama3_json", '{"name": "get_weather", "parameters": {"city": "Rome"}}')[:2] == \
        (None, [("get_weather", {"city": "Rome"})])
    text = '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}'
    assert _calls("llama3_json", text)[1] == [("a", {"x": 1}), ("b", {})]
    assert _calls("llama3_json", "Hello {not a call}")[:2] == ("Hello {not a call}", [])
    assert _calls("llama3_json", '{"foo": 1}')[1] == []


def test_mistral():
    text = 'Sure. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Lima"}}, {"name": "b", "arguments": {}}]'
    content, calls, raw = _calls("mistral", text)
    assert content == "Sure." and calls == [("get_weather", {"city": "Lima"}), ("b", {})]
    assert all(len(c.id) == 9 and c.id.isalnum() for c in raw)  # Mistral's templates require 9-char ids
    assert _calls("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Bern"}')[1] == [("get_weather", {"city": "Bern"})]
    assert _calls("mistral", "plain")[:2] == ("plain", [])


@pytest.mark.parametrize("parser,text,safe", [
    ("hermes", "Hello <tool", len("Hello ")),  # might be the start of <tool_call>: held back
    ("hermes", "Hello <b>", len("Hello <b>")),
    ("hermes", 'Hi<tool_call>{"na', len("Hi")),
    ("mistral", "Ok [TOOL_", len("Ok ")),
    ("llama3_json", "  {", 0),
    ("llama3_json", "Sure", len("Sure")),
])
def test_streaming_holds_back_what_may_be_a_call(parser, text, safe):
    assert tools.make_parser(parser).safe_prefix(text) == safe


def test_plan_resolution():
    assert tools.plan(None, None, None).mode == "none"
    assert tools.plan([WEATHER], "none", "hermes").tools == []
    auto = tools.plan([WEATHER], None, "hermes")
    assert auto.mode == "auto" and isinstance(auto.parser, tools.HermesParser)
    with pytest.raises(APIError, match="--enable-auto-tool-choice") as ei:
        tools.plan([WEATHER], "auto", None)  # vLLM's rule: auto needs the flags
    assert ei.value.status == 400 and ei.value.param == "tool_choice"
    named = tools.plan([WEATHER], {"type": "function", "function": {"name": "get_weather"}}, None)
    assert named.mode == "named" and named.grammar.spec.json == WEATHER["function"]["parameters"]
    required = tools.plan([WEATHER], "required", None)
    assert required.grammar.spec.json["minItems"] == 1
    assert tools.forced_calls(required, '[{"name":"get_weather","parameters":{"city":"X"}}]')[0].name == "get_weather"
    assert tools.forced_calls(named, '{"city":') == []  # truncated: no call
    with pytest.raises(ValueError):
        tools.make_parser("nope")
