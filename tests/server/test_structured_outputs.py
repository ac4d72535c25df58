"""Structured outputs and tool calling through the official openai client against a real `serve` process.

The model has random weights, so whatever it "wants" to write is noise: every output below holds only because
the grammar enforces it. Each one is validated against its schema / regex / choice list, over many seeds,
streaming and not, with n > 1.
"""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
from openai import OpenAI

from .conftest import metric

# Renders tools, assistant tool_calls and tool results (the tiny model's own template knows none of them).
TOOL_TEMPLATE = (
    "{% if tools %}<|system|>Tools: {{ tools | tojson }}<|end|>{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>"
    "{% if m.get('tool_calls') %}{% for c in m['tool_calls'] %}<tool_call>{\"name\": \"{{ c['function']['name'] }}\", "
    "\"arguments\": {{ c['function']['arguments'] | tojson }}}</tool_call>{% endfor %}{% endif %}"
    "{% if m['role'] == 'tool' %}[{{ m['tool_call_id'] }}] {% endif %}{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["red", "green", "blue"]}, "maxItems": 3},
        "active": {"type": "boolean"},
        "address": {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "tags", "active", "address"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": -99,
                                                                         "maximum": 99},
                                                                   "b": {"type": "integer", "minimum": -99,
                                                                         "maximum": 99}},
                                  "required": ["a", "b"], "additionalProperties": False}}}
SEEDS = range(6)
MSGS = [{"role": "user", "content": "Tell me about someone."}]


@pytest.fixture(scope="module")
def server(start_server, model_factory, tmp_path_factory):
    template = tmp_path_factory.mktemp("tmpl") / "tools.jinja"
    template.write_text(TOOL_TEMPLATE)
    model = model_factory("llama", max_position_embeddings=2048)  # tool schemas in the prompt are long
    return start_server(model, "--max-model-len", "2048", "--num-kv-blocks", "1024", "--max-num-seqs", "32",
                        "--chat-template", str(template), "--enable-auto-tool-choice", "--tool-call-parser", "hermes")


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=120)


def _stream_texts(stream, n: int) -> tuple[list[str], list[str | None]]:
    texts, finish = [""] * n, [None] * n
    for chunk in stream:
        for c in chunk.choices:
            piece = c.delta.content if hasattr(c, "delta") else c.text
            texts[c.index] += piece or ""
            finish[c.index] = c.finish_reason or finish[c.index]
    return texts, finish


def _chat_texts(client, stream: bool, **kw) -> tuple[list[str], list[str | None]]:
    """The n choices' texts and finish reasons of one chat completion, streamed or not."""
    if stream:
        return _stream_texts(client.chat.completions.create(stream=True, **kw), kw["n"])
    r = client.chat.completions.create(**kw)
    return [c.message.content for c in r.choices], [c.finish_reason for c in r.choices]


# ------------------------------------------------------------------------------------------ JSON schema
@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_chat_always_valid(client, stream):
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    for seed in SEEDS:
        kw = dict(model="tiny", messages=MSGS, n=3, seed=seed, temperature=1.0, max_tokens=300, response_format=rf)
        texts, finish = _chat_texts(client, stream, **kw)
        for text, reason in zip(texts, finish):
            # Bounded schema: it always ends (well before max_tokens), compact, and valid.
            assert reason == "stop", (seed, text)
            jsonschema.validate(json.loads(text), PERSON)
            assert ": " not in text and ", " not in text.replace('", "', "")  # no whitespace between tokens


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_completions_and_vllm_fields(client, stream):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 1,
                                                                               "maximum": 9}},
              "required": ["ok", "n"], "additionalProperties": False}
    bodies = [{"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}},
              {"structured_outputs": {"json": schema}}, {"guided_json": schema}, {"guided_json": json.dumps(schema)}]
    for i, body in enumerate(bodies):
        kw = dict(model="tiny", prompt="JSON:", n=2, seed=i, temperature=1.0, max_tokens=64, extra_body=body)
        if stream:
            texts, finish = _stream_texts(client.completions.create(stream=True, **kw), 2)
        else:
            r = client.completions.create(**kw)
            texts, finish = [c.text for c in r.choices], [c.finish_reason for c in r.choices]
        for text, reason in zip(texts, finish):
            assert reason == "stop", (body, text)
            jsonschema.validate(json.loads(text), schema)


def test_json_object(client):
    for seed in SEEDS:
        r = client.chat.completions.create(model="tiny", messages=MSGS, seed=seed, temperature=1.0, max_tokens=48,
                                           response_format={"type": "json_object"})
        c = r.choices[0]
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.message.content), dict)
        else:  # an unbounded object may run out of tokens; it was still on its way to one
            assert c.finish_reason == "length" and c.message.content.startswith("{")
            assert r.usage.completion_tokens == 48


# ------------------------------------------------------------------------------------------ regex / choice / grammar
@pytest.mark.parametrize("stream", [False, True])
def test_regex_choice_and_grammar(client, stream):
    regex = r"[a-c]{2,5}-[0-9]{1,3}"
    cases = [
        ({"structured_outputs": {"regex": regex}}, lambda t: re.fullmatch(regex, t)),
        ({"guided_regex": regex}, lambda t: re.fullmatch(regex, t)),
        ({"structured_outputs": {"choice": ["yes", "no", "maybe not"]}}, lambda t: t in ("yes", "no", "maybe not")),
        ({"guided_choice": ["alpha", "beta"]}, lambda t: t in ("alpha", "beta")),
        ({"structured_outputs": {"grammar": 'start: "(" NUM ("+" NUM)* ")"\nNUM: /[0-9]/'}},
         lambda t: re.fullmatch(r"\([0-9](\+[0-9])*\)", t)),
        ({"guided_grammar": 'root ::= "A" | "B" "C"'}, lambda t: t in ("A", "BC")),
    ]
    for body, ok in cases:
        for seed in SEEDS[:3]:
            kw = dict(model="tiny", messages=MSGS, n=2, seed=seed, temperature=1.0, max_tokens=40, extra_body=body)
            texts, finish = _chat_texts(client, stream, **kw)
            for text, reason in zip(texts, finish):
                if reason == "length":  # only the unbounded grammar may run out of tokens, as a valid prefix
                    assert "grammar" in body.get("structured_outputs", {}) and text.startswith("(")
                    continue
                assert reason == "stop" and ok(text), (body, text)


def test_max_tokens_truncation_and_stop_strings(client):
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    r = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=3, seed=1, response_format=rf)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3
    # A stop string inside the constrained text ends it there, as for unconstrained output.
    r = client.completions.create(model="tiny", prompt="x", max_tokens=20, stop=["-"],
                                  extra_body={"guided_regex": "abc-def"})
    assert r.choices[0].text == "abc" and r.choices[0].finish_reason == "stop"


# ------------------------------------------------------------------------------------------ errors
@pytest.mark.parametrize("body,param,words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     "response_format", "foo"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema",
     "schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "xml"),
    ({"guided_regex": "[a-"}, "guided_regex", "regex"),
    ({"guided_json": "{not json"}, "guided_json", "JSON"),
    ({"structured_outputs": {"grammar": "start: nothing_defined"}}, "structured_outputs.grammar", "nothing_defined"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
    ({"guided_choice": []}, "guided_choice", "choice"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "only one"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"$ref": "#/definitions/missing"}}}}}}, "response_format", "missing"),
])
def test_invalid_constraints_are_400_naming_the_problem(server, body, param, words):
    status, err, _ = server.post("/v1/chat/completions", {"model": "tiny", "messages": MSGS, **body})
    assert status == 400, err
    assert err["error"]["param"] == param and words.lower() in err["error"]["message"].lower(), err
    status, _, _ = server.post("/v1/completions", {"model": "tiny", "prompt": "x", **body})
    assert status == 400


# ------------------------------------------------------------------------------------------ tools
def _args_valid(call, tool):
    assert call.type == "function" and call.id and call.function.name == tool["function"]["name"]
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


def test_named_tool_choice(client):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    for seed in SEEDS:
        r = client.chat.completions.create(model="tiny", messages=MSGS, tools=[ADD, WEATHER], tool_choice=choice,
                                           n=2, seed=seed, temperature=1.0, max_tokens=100)
        for c in r.choices:
            assert c.finish_reason == "tool_calls" and c.message.content is None
            assert len(c.message.tool_calls) == 1
            _args_valid(c.message.tool_calls[0], WEATHER)
    # Streamed: the first delta names the call (id, type, name), the rest carry its arguments in pieces.
    stream = client.chat.completions.create(model="tiny", messages=MSGS, tools=[WEATHER], tool_choice=choice,
                                            seed=3, temperature=1.0, max_tokens=100, stream=True)
    deltas, finish = [], None
    for chunk in stream:
        for c in chunk.choices:
            deltas += c.delta.tool_calls or []
            finish = c.finish_reason or finish
    assert finish == "tool_calls" and deltas[0].id and deltas[0].function.name == "get_weather"
    assert all(d.index == 0 and d.id is None for d in deltas[1:])
    args = "".join(d.function.arguments or "" for d in deltas)
    jsonschema.validate(json.loads(args), WEATHER["function"]["parameters"])


@pytest.mark.parametrize("stream", [False, True])
def test_required_tool_choice(client, stream):
    by_name = {"get_weather": WEATHER, "add": ADD}
    for seed in SEEDS:
        kw = dict(model="tiny", messages=MSGS, tools=[WEATHER, ADD], tool_choice="required", seed=seed,
                  temperature=1.0, max_tokens=300)
        if stream:
            calls, finish = {}, None
            for chunk in client.chat.completions.create(stream=True, **kw):
                for c in chunk.choices:
                    for d in c.delta.tool_calls or []:
                        calls.setdefault(d.index, d)
                    finish = c.finish_reason or finish
            calls = [calls[i] for i in sorted(calls)]
        else:
            c = client.chat.completions.create(**kw).choices[0]
            calls, finish = c.message.tool_calls, c.finish_reason
        if finish == "length":  # an unbounded list of calls may run out of tokens
            continue
        assert finish == "tool_calls" and calls
        assert len({c.id for c in calls}) == len(calls)
        for call in calls:
            _args_valid(call, by_name[call.function.name])


def test_tool_choice_none_and_auto_with_hermes_parser(client):
    r = client.chat.completions.create(model="tiny", messages=MSGS, tools=[WEATHER], tool_choice="none",
                                       max_tokens=5, temperature=0)
    assert not r.choices[0].message.tool_calls and r.choices[0].finish_reason in ("stop", "length")
    # Auto: the model's text is searched with the hermes parser. Random weights never write a call on their own,
    # so a regex makes them write one: content, then a hermes tool call.
    canned = 'Let me check.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}</tool_call>'
    kw = dict(model="tiny", messages=MSGS, tools=[WEATHER], max_tokens=200,
              extra_body={"guided_regex": re.escape(canned)})
    c = client.chat.completions.create(**kw).choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content == "Let me check."
    assert c.message.tool_calls[0].function.name == "get_weather"
    assert json.loads(c.message.tool_calls[0].function.arguments) == {"city": "Paris", "unit": "c"}
    content, calls, finish = "", [], None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            content += ch.delta.content or ""
            calls += ch.delta.tool_calls or []
            finish = ch.finish_reason or finish
    assert content == "Let me check." and finish == "tool_calls" and len(calls) == 1
    assert calls[0].id and json.loads(calls[0].function.arguments) == {"city": "Paris", "unit": "c"}
    # Plain text stays content.
    c = client.chat.completions.create(**dict(kw, extra_body={"guided_regex": "just text"})).choices[0]
    assert c.message.content == "just text" and not c.message.tool_calls and c.finish_reason == "stop"


def test_tool_errors_are_400(client):
    bad = [dict(tools=[{"type": "function"}]),
           dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}),
           dict(tools=[WEATHER], tool_choice="sometimes"),
           dict(tool_choice="required"),
           dict(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"})]
    for kw in bad:
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=4, **kw)


def test_tool_messages_render_through_the_chat_template(server):
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": '{"city": "Paris", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"},
    ]
    status, tok, _ = server.post("/tokenize", {"messages": messages, "tools": [WEATHER]})
    assert status == 200, tok
    _, text, _ = server.post("/detokenize", {"tokens": tok["tokens"]})
    text = text["prompt"]
    assert '"name": "get_weather"' in text and '"city": "Paris"' in text and "[call_1] 21 degrees" in text
    assert "Tools: " in text and "Current weather" in text
    # The same conversation is accepted by chat completions (arguments given as a JSON string, as OpenAI sends).
    status, body, _ = server.post("/v1/chat/completions", {"model": "tiny", "messages": messages, "max_tokens": 2})
    assert status == 200, body


def test_structured_requests_are_counted(server, client):
    before = server.metrics()
    client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=5, extra_body={"guided_choice": ["a"]})
    client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=40, tools=[ADD], tool_choice="required")
    after = server.metrics()
    name = "shoal:structured_output_requests_total"
    assert metric(after, name, kind="choice") == metric(before, name, kind="choice") + 1
    assert metric(after, name, kind="tool_call") == metric(before, name, kind="tool_call") + 1
