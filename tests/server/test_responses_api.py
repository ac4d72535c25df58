"""POST /v1/responses through the official openai client (`client.responses.create`) against a real `serve`.

The Responses API runs on the chat path, so every answer is checked against chat completions on the same
conversation (greedy: the same prompt gives the same tokens) — that is what proves the input items, tools,
tool results, instructions and previous_response_id turned into the right prompt.
"""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
from openai import OpenAI
from prockit import wait_for

from .conftest import metric
from .test_structured_outputs import PERSON, WEATHER

# Renders tools, tool calls, tool results and reasoning; `thinking` opens a <think> block for the answer
# (as Qwen3's template does), so the model's first words are reasoning.
TEMPLATE = (
    "{% if tools %}<|system|>Tools: {{ tools | tojson }}<|end|>{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>"
    "{% if m.get('reasoning_content') %}<think>{{ m['reasoning_content'] }}</think>{% endif %}"
    "{% if m.get('tool_calls') %}{% for c in m['tool_calls'] %}<tool_call>{\"name\": \"{{ c['function']['name'] }}\", "
    "\"arguments\": {{ c['function']['arguments'] | tojson }}}</tool_call>{% endfor %}{% endif %}"
    "{% if m['role'] == 'tool' %}[{{ m['tool_call_id'] }}] {% endif %}{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% if thinking %}<think>\n{% endif %}{% endif %}"
)
FN_WEATHER = {"type": "function", **WEATHER["function"]}  # the Responses API's flat function tool
GREEDY = dict(temperature=0.0)


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    path = tmp_path_factory.mktemp("tmpl") / "think.jinja"
    path.write_text(TEMPLATE)
    return path


@pytest.fixture(scope="module")
def model(model_factory):
    return model_factory("llama", max_position_embeddings=2048)


@pytest.fixture(scope="module")
def server(start_server, model, template):
    return start_server(model, "--max-model-len", "2048", "--num-kv-blocks", "512", "--max-num-seqs", "16",
                        "--chat-template", str(template), "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                        wait=False).wait_ready(timeout=300)  # a shared, busy test machine


def _client(server, key="key-a"):
    return OpenAI(base_url=server.base + "/v1", api_key=key, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def client(server):
    return _client(server)


def _chat(client, messages, **kw):
    return client.chat.completions.create(model="tiny", messages=messages, **GREEDY, **kw)


def _error(server, body, headers=None):
    status, err, _ = server.post("/v1/responses", body, headers=headers)
    assert set(err) == {"error"} and set(err["error"]) == {"message", "type", "param", "code"}, err
    return status, err["error"]


def _idle(server):
    def idle():
        m = server.metrics()
        return metric(m, "shoal:num_requests_running") + metric(m, "shoal:kv_cache_usage_perc") == 0
    wait_for(idle, 15, "no running request and no KV block in use")


# ------------------------------------------------------------------------------------------ plain
def test_plain_input_and_instructions_equal_chat(client):
    r = client.responses.create(model="tiny", input="Hello there", max_output_tokens=8, **GREEDY)
    chat = _chat(client, [{"role": "user", "content": "Hello there"}], max_tokens=8)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == "tiny"
    assert r.output_text == chat.choices[0].message.content
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.usage.output_tokens == 8
    (msg,) = r.output
    assert msg.type == "message" and msg.role == "assistant" and msg.content[0].type == "output_text"
    # instructions are a system message; input items with content parts are the same as plain strings
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Hello there"}]}]
    r = client.responses.create(model="tiny", input=items, instructions="Be brief.", max_output_tokens=6, **GREEDY)
    chat = _chat(client, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}],
                 max_tokens=6)
    assert r.output_text == chat.choices[0].message.content and r.instructions == "Be brief."
    assert r.usage.input_tokens == chat.usage.prompt_tokens


def test_streaming_events(client):
    kw = dict(model="tiny", input="Tell me a story", max_output_tokens=12, **GREEDY)
    full = client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    # A reader that lags gets the tokens that piled up as one delta (RequestStream adds them up), so how many
    # deltas arrive depends on timing; what they add up to does not.
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert deltas and all(deltas) and "".join(deltas) == full.output_text == events[-4].text
    final = events[-1].response
    assert final.output_text == full.output_text and final.usage.output_tokens == 12
    assert events[0].response.status == "in_progress" and events[0].response.id == final.id


def test_json_schema_text_format(client):
    fmt = {"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}}
    for seed in range(3):
        r = client.responses.create(model="tiny", input="Someone", text=fmt, temperature=1.0, max_output_tokens=300,
                                    extra_body={"seed": seed})
        assert r.status == "completed", r.incomplete_details
        jsonschema.validate(json.loads(r.output_text), PERSON)


# ------------------------------------------------------------------------------------------ tools
def test_function_call_and_follow_up_turn(server, client):
    r = client.responses.create(model="tiny", input="Weather in Paris?", tools=[FN_WEATHER],
                                tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=100,
                                **GREEDY)
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id and r.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER["function"]["parameters"])
    # The follow-up turn: the tool's result for that call, continuing the stored response.
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "21 degrees"}
    follow = client.responses.create(model="tiny", previous_response_id=r.id, input=[result], tools=[FN_WEATHER],
                                     max_output_tokens=10, **GREEDY)
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": call.call_id, "type": "function",
                     "function": {"name": "get_weather", "arguments": call.arguments}}]},
                {"role": "tool", "tool_call_id": call.call_id, "content": "21 degrees"}]
    chat = _chat(client, messages, tools=[WEATHER], max_tokens=10)
    assert follow.output_text == chat.choices[0].message.content
    assert follow.usage.input_tokens == chat.usage.prompt_tokens
    status, tok, _ = server.post("/tokenize", {"messages": messages, "tools": [WEATHER]})
    _, text, _ = server.post("/detokenize", {"tokens": tok["tokens"]})
    assert f"[{call.call_id}] 21 degrees" in text["prompt"] and '"city":' in text["prompt"]
    # The same turn with the whole conversation sent as items (no store) is the same prompt.
    items = [{"role": "user", "content": "Weather in Paris?"}, call.model_dump(exclude_none=True), result]
    again = client.responses.create(model="tiny", input=items, tools=[FN_WEATHER], max_output_tokens=10, store=False,
                                    **GREEDY)
    assert again.output_text == follow.output_text and again.usage.input_tokens == follow.usage.input_tokens


def test_streamed_function_call(client):
    kw = dict(model="tiny", input="Weather?", tools=[FN_WEATHER], tool_choice={"type": "function",
                                                                               "name": "get_weather"},
              max_output_tokens=100, **GREEDY)
    full = client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert [i.type for i in added] == ["function_call"] and added[0].name == "get_weather"
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert args == done.arguments == full.output[0].arguments
    assert events[-1].type == "response.completed" and events[-1].response.output[0].call_id == added[0].call_id


# ------------------------------------------------------------------------------------------ reasoning
def test_reasoning_items_where_the_template_thinks(client):
    # The template opens <think>; a regex makes the random model close it and answer.
    extra = {"chat_template_kwargs": {"thinking": True},
             "structured_outputs": {"regex": re.escape("Paris is in France.</think>\n\nParis")}}
    kw = dict(model="tiny", input="Capital of France?", max_output_tokens=50, extra_body=extra)
    r = client.responses.create(**kw)
    assert [o.type for o in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == "Paris is in France." and r.output_text == "Paris"
    assert r.usage.output_tokens_details.reasoning_tokens > 0
    events = list(client.responses.create(stream=True, **kw))
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    answer = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert (thought, answer) == ("Paris is in France.", "Paris")
    assert [e.item.type for e in events if e.type == "response.output_item.done"] == ["reasoning", "message"]
    # Without the template opening it, all the output is the answer.
    plain = client.responses.create(model="tiny", input="Capital of France?", max_output_tokens=5, **GREEDY)
    assert [o.type for o in plain.output] == ["message"]


# ------------------------------------------------------------------------------------------ the store
def test_previous_response_id_get_delete_and_keys(server, client):
    first = client.responses.create(model="tiny", input="Hi", max_output_tokens=6, **GREEDY)
    second = client.responses.create(model="tiny", previous_response_id=first.id, input="And then?",
                                     max_output_tokens=6, **GREEDY)
    chat = _chat(client, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": first.output_text},
                          {"role": "user", "content": "And then?"}], max_tokens=6)
    assert second.output_text == chat.choices[0].message.content
    assert second.usage.input_tokens == chat.usage.prompt_tokens and second.previous_response_id == first.id
    got = client.responses.retrieve(first.id)
    assert got.id == first.id and got.output_text == first.output_text
    # Another API key sees none of it: not the response, not its conversation.
    other = _client(server, "key-b")
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError) as ei:
        other.responses.create(model="tiny", previous_response_id=first.id, input="x", max_output_tokens=2)
    assert ei.value.body["param"] == "previous_response_id" and "Hi" not in str(ei.value.body)
    with pytest.raises(openai.NotFoundError):
        other.responses.delete(first.id)
    # Deleted, it is gone; store=false keeps nothing.
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    unstored = client.responses.create(model="tiny", input="Hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    assert client.responses.retrieve(second.id).id == second.id


def test_expired_previous_response_is_404(start_server, model, template):
    server = start_server(model, "--max-model-len", "512", "--num-kv-blocks", "64", "--chat-template", str(template),
                          "--response-store-ttl", "2", wait=False).wait_ready(timeout=300)
    client = _client(server)
    r = client.responses.create(model="tiny", input="Hi", max_output_tokens=2)
    assert client.responses.retrieve(r.id).id == r.id  # stored for 2 s

    def expired():
        try:
            client.responses.retrieve(r.id)
        except openai.NotFoundError:
            return True
        return False

    wait_for(expired, 15, "the stored response to expire")
    with pytest.raises(openai.NotFoundError) as ei:
        client.responses.create(model="tiny", previous_response_id=r.id, input="more", max_output_tokens=2)
    assert ei.value.body["code"] == "previous_response_not_found"


# ------------------------------------------------------------------------------------------ bad input
def test_bad_input_is_a_clear_4xx(server, client):
    cases = [
        ({"input": [{"type": "image_generation_call", "id": "x"}]}, 400, "input", "image_generation_call"),
        ({"input": [{"type": "function_call_output", "call_id": "call_never", "output": "x"}]}, 400, "input",
         "call_never"),
        ({"input": [{"role": "wizard", "content": "x"}]}, 400, "input", "wizard"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400, "input",
         "input_image"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, 400, "tools.0.type", "web_search"),
        ({"input": "x", "text": {"format": {"type": "xml"}}}, 400, "text.format.type", "xml"),
        ({"input": "x", "previous_response_id": "resp_nope"}, 404, "previous_response_id", "resp_nope"),
        ({"input": 5}, 400, "input", ""),
        ({"input": "x", "max_output_tokens": 0}, 400, "max_output_tokens", ""),
    ]
    for body, status, param, word in cases:
        got, err = _error(server, {"model": "tiny", **body})
        assert (got, err["param"]) == (status, param), (body, err)
        assert word in err["message"], (body, err)
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model="tiny", input=[{"type": "nonsense"}])
    _idle(server)
    assert client.responses.create(model="tiny", input="still fine", max_output_tokens=2).usage.output_tokens == 2
