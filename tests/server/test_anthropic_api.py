"""POST /v1/messages through the official anthropic client (`client.messages.create` and `.stream`) against a
real `serve` started with an API key (the anthropic client sends it as `x-api-key`).

The Messages API runs on the chat path, so answers are checked against chat completions on the same conversation
(greedy: the same prompt gives the same tokens).
"""

from __future__ import annotations

import json

import anthropic
import jsonschema
import pytest
from openai import OpenAI

from .test_responses_api import TEMPLATE
from .test_structured_outputs import WEATHER

KEY = "anthropic-test-key"
TOOL = {"name": "get_weather", "description": WEATHER["function"]["description"],
        "input_schema": WEATHER["function"]["parameters"]}
GREEDY = dict(extra_body={"temperature": 0.0})  # this anthropic client has no sampling arguments of its own


@pytest.fixture(scope="module")
def server(start_server, model_factory, tmp_path_factory):
    template = tmp_path_factory.mktemp("tmpl") / "think.jinja"
    template.write_text(TEMPLATE)
    model = model_factory("llama", max_position_embeddings=2048)
    return start_server(model, "--max-model-len", "2048", "--num-kv-blocks", "512", "--max-num-seqs", "16",
                        "--chat-template", str(template), "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                        "--api-key", KEY, wait=False).wait_ready(timeout=300)  # a shared, busy test machine


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.base, api_key=KEY, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def oai(server):
    return OpenAI(base_url=server.base + "/v1", api_key=KEY, max_retries=0, timeout=300)


def _chat(oai, messages, **kw):
    return oai.chat.completions.create(model="tiny", messages=messages, temperature=0.0, **kw)


def _error(server, body, key=KEY, path="/v1/messages"):
    status, err, _ = server.post(path, body, headers={"x-api-key": key})
    assert err["type"] == "error" and set(err["error"]) == {"type", "message"}, err
    return status, err["error"]


def test_plain_message_and_count_tokens(client, oai):
    kw = dict(model="tiny", max_tokens=8, system="Be brief.", messages=[{"role": "user", "content": "Hello"}])
    m = client.messages.create(**kw, **GREEDY)
    chat = _chat(oai, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}],
                 max_tokens=8)
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_") and m.model == "tiny"
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == chat.choices[0].message.content
    assert m.stop_reason == "max_tokens" and m.stop_sequence is None
    assert (m.usage.input_tokens, m.usage.output_tokens) == (chat.usage.prompt_tokens, 8)
    count = client.messages.count_tokens(model="tiny", system="Be brief.",
                                         messages=[{"role": "user", "content": [{"type": "text", "text": "Hello"}]}])
    assert count.input_tokens == m.usage.input_tokens


def test_stream_and_events(client, server):
    kw = dict(model="tiny", max_tokens=12, messages=[{"role": "user", "content": "Tell me a story"}], **GREEDY)
    full = client.messages.create(**kw)
    with client.messages.stream(**kw) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == full.content[0].text == final.content[0].text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 12
    events = list(client.messages.create(stream=True, **kw))
    types = [e.type for e in events]
    assert types[:2] == ["message_start", "content_block_start"]
    assert types[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(types[2:-3]) == {"content_block_delta"} and len(types) > 6
    assert events[-2].delta.stop_reason == "max_tokens" and events[-2].usage.output_tokens == 12


def test_stop_sequences(client):
    kw = dict(model="tiny", max_tokens=30, messages=[{"role": "user", "content": "Count with me"}], **GREEDY)
    text = client.messages.create(**kw).content[0].text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    assert stop.strip(), text
    m = client.messages.create(stop_sequences=[stop, "never-written"], **kw)
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert m.content[0].text == text[:text.find(stop)]
    with client.messages.stream(stop_sequences=[stop], **kw) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.content[0].text == m.content[0].text


def test_tools_tool_use_and_tool_result(client, oai):
    kw = dict(model="tiny", max_tokens=100, tools=[TOOL], tool_choice={"type": "tool", "name": "get_weather"},
              messages=[{"role": "user", "content": "Weather in Paris?"}], **GREEDY)
    m = client.messages.create(**kw)
    (use,) = m.content
    assert m.stop_reason == "tool_use" and use.type == "tool_use" and use.name == "get_weather" and use.id
    jsonschema.validate(use.input, TOOL["input_schema"])
    with client.messages.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_message()
    partial = "".join(e.delta.partial_json for e in events
                      if e.type == "content_block_delta" and e.delta.type == "input_json_delta")
    assert json.loads(partial) == use.input == final.content[0].input and final.stop_reason == "tool_use"
    # The follow-up turn with the tool's result renders like chat's tool message.
    follow = client.messages.create(model="tiny", max_tokens=10, tools=[TOOL], **GREEDY, messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [use.model_dump()]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "21 degrees"}]}])
    chat = _chat(oai, [{"role": "user", "content": "Weather in Paris?"},
                       {"role": "assistant", "content": "", "tool_calls": [
                           {"id": use.id, "type": "function",
                            "function": {"name": "get_weather", "arguments": json.dumps(use.input)}}]},
                       {"role": "tool", "tool_call_id": use.id, "content": "21 degrees"}],
                 tools=[WEATHER], max_tokens=10)
    assert follow.usage.input_tokens == chat.usage.prompt_tokens
    assert follow.content[0].text == chat.choices[0].message.content


def test_assistant_prefill_is_continued(client, oai):
    msgs = [{"role": "user", "content": "Finish this"}, {"role": "assistant", "content": "The answer is"}]
    m = client.messages.create(model="tiny", max_tokens=6, messages=msgs, **GREEDY)
    chat = _chat(oai, msgs, max_tokens=6, extra_body={"continue_final_message": True,
                                                      "add_generation_prompt": False})
    assert m.content[0].text == chat.choices[0].message.content and m.usage.input_tokens == chat.usage.prompt_tokens


def test_errors_in_anthropic_shape(server, client):
    user = {"role": "user", "content": "hi"}
    cases = [
        ({"max_tokens": 4, "messages": [user, {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_never", "content": "x"}]}]}, 400, "toolu_never"),
        ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400,
         "image"),
        ({"max_tokens": 4, "messages": [{"role": "robot", "content": "x"}]}, 400, "robot"),
        ({"messages": [user]}, 400, "max_tokens"),
        ({"max_tokens": 4, "messages": [user], "tools": [{"type": "web_search_20250305", "name": "w"}]}, 400,
         "server tools"),
        ({"max_tokens": 4, "messages": [user], "model": "nope"}, 404, "nope"),
    ]
    for body, status, word in cases:
        got, err = _error(server, {"model": "tiny", **body})
        assert got == status and word in err["message"], (body, err)
        assert err["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    got, err = _error(server, {"model": "tiny", "max_tokens": 4, "messages": [user]}, key="wrong")
    assert got == 401 and err["type"] == "authentication_error"
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.base, api_key="wrong", max_retries=0).messages.create(
            model="tiny", max_tokens=2, messages=[user])
    with pytest.raises(anthropic.BadRequestError):
        client.messages.count_tokens(model="tiny", messages=[{"role": "user", "content": [{"type": "pdf"}]}])
    assert client.messages.create(model="tiny", max_tokens=2, messages=[user]).usage.output_tokens == 2
