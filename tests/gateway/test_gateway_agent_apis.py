"""The Responses and Messages APIs through the gateways, with the official `openai` and `anthropic` clients: two real
`shoal-engine serve` replicas behind two replicas of a per-service gateway, and behind two replicas of the shared
gateway (the emulated API server, tests/kubekit.py, holds the InferenceService and one EndpointSlice per engine;
the test plays the EndpointSlice controller).

A stored response lives in one engine's memory. Every gateway routes round-robin here, so two requests in a row
from one gateway would meet both engines: a `previous_response_id` follow-up or a GET/DELETE answers only because
the gateway sends it to the engine that stored the response (its id's tag, gateway_contract.py), from either
gateway replica. Behind the shared gateway every tenant reaches the engines with their one key: another tenant of
the same namespace gets the 404 of an unknown id for everything about tenant A's response.
"""

from __future__ import annotations

import json
import uuid

import anthropic
import openai
import pytest
from kubekit import isvc_body

from .gwkit import Proc, engine_cmd, http, metric, publish, running, wait_for

pytestmark = pytest.mark.slow

ENGINE_KEY = "engine-key"
PROMPT = dict(model="tiny", max_output_tokens=6, temperature=0.0)


@pytest.fixture(scope="module")
def engines(fleet_model):
    with running([Proc([*engine_cmd(fleet_model), "--api-key", ENGINE_KEY]) for _ in range(2)]) as procs:
        yield procs


def oai(gateway: Proc, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key=key, max_retries=0, timeout=300)


def claude(gateway: Proc, key: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gateway.url, api_key=key, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def per_service(engines, start_gateway):
    """Two replicas of a per-service gateway (the engines' key is the clients' key)."""
    urls = [e.url for e in engines]
    extra = ("--api-key", ENGINE_KEY)
    return [start_gateway(*urls, routing="round-robin", extra=extra) for _ in range(2)]


@pytest.fixture(scope="module")
def shared(engines, api, start_gateway, tmp_path_factory):
    """Two replicas of the shared gateway of namespace `ns`, whose tenants `ns.a` and `ns.b` hold keys sk-a and
    sk-b; the service's engines get their own key from --engine-keys."""
    ns = "agents-" + uuid.uuid4().hex[:6]
    keys = tmp_path_factory.mktemp("keys")
    (keys / "tenants").mkdir()
    (keys / "tenants" / f"{ns}.a").write_text("sk-a\n")
    (keys / "tenants" / f"{ns}.b").write_text("sk-b\n")
    (keys / "engines").mkdir()
    (keys / "engines" / f"{ns}.llm").write_text(ENGINE_KEY + "\n")
    api.create("inferenceservices", ns, isvc_body("llm", {"model": {"uri": "file:///models/t", "servedName": "tiny"}}))
    for i, e in enumerate(engines):
        publish(api, ns, "llm", e, f"x{i}")
    extra = ("--namespace", ns, "--tenant-keys", str(keys / "tenants"), "--engine-keys", str(keys / "engines"),
             "--models-interval", "0.5")
    gateways = [start_gateway(routing="round-robin", extra=extra) for _ in range(2)]
    for g in gateways:
        wait_for(lambda: all(metric(g.metrics(), "shoal:gateway_backend_healthy", backend=e.url) == 1
                             for e in engines), 60, "the shared gateway to find both engines")
    return gateways


def text_of(response) -> str:
    return "".join(c.text for item in response.output if item.type == "message" for c in item.content)


def converse(first: openai.OpenAI, second: openai.OpenAI) -> str:
    """A stored conversation through two gateway replicas: create, follow-ups (plain and streamed), GET, DELETE.
    The id of the (deleted) first response."""
    r1 = first.responses.create(input="Say hello", **PROMPT)
    assert r1.status in ("completed", "incomplete") and r1.store and r1.output
    for _ in range(2):  # round-robin: without routing by the id, one of these meets the other engine (404)
        follow = second.responses.create(input="And again", previous_response_id=r1.id, **PROMPT)
        assert follow.previous_response_id == r1.id and follow.output
    events = list(second.responses.create(input="Once more", previous_response_id=r1.id, stream=True, **PROMPT))
    assert events[0].type == "response.created" and events[-1].type in ("response.completed", "response.incomplete")
    streamed = events[-1].response
    assert streamed.previous_response_id == r1.id and streamed.id != r1.id and text_of(streamed)
    for client in (second, second, first):
        got = client.responses.retrieve(r1.id)
        assert (got.id, text_of(got)) == (r1.id, text_of(r1))
    first.responses.delete(r1.id)
    for client in (second, second):
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(r1.id)
    return r1.id


def messages(client: anthropic.Anthropic) -> None:
    kw = dict(model="tiny", max_tokens=6, messages=[{"role": "user", "content": "Hello"}],
              extra_body={"temperature": 0.0})
    m = client.messages.create(**kw)
    assert m.type == "message" and m.role == "assistant" and m.content[0].type == "text"
    with client.messages.stream(**kw) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text == m.content[0].text
    count = client.messages.count_tokens(model="tiny", messages=[{"role": "user", "content": "Hello"}])
    assert count.input_tokens == m.usage.input_tokens


def anthropic_error(e: anthropic.APIStatusError, kind: str) -> str:
    """The error's body is Anthropic's, of this type; its message."""
    assert e.body["type"] == "error" and set(e.body["error"]) == {"type", "message"}, e.body
    assert e.body["error"]["type"] == kind, e.body
    return e.body["error"]["message"]


def test_per_service_gateway_responses_and_messages(per_service):
    first, second = (oai(g, ENGINE_KEY) for g in per_service)
    converse(first, second)
    messages(claude(per_service[0], ENGINE_KEY))
    with pytest.raises(anthropic.AuthenticationError) as e:  # the gateway's own 401, in Anthropic's shape
        claude(per_service[1], "wrong").messages.create(model="tiny", max_tokens=2,
                                                        messages=[{"role": "user", "content": "hi"}])
    assert "API key" in anthropic_error(e.value, "authentication_error")
    with pytest.raises(openai.AuthenticationError) as oe:  # ... and OpenAI's on the Responses API
        oai(per_service[1], "wrong").responses.create(input="hi", **PROMPT)
    assert oe.value.body["code"] == "invalid_api_key"


def test_shared_gateway_responses_and_messages(shared):
    first, second = (oai(g, "sk-a") for g in shared)
    converse(first, second)
    messages(claude(shared[1], "sk-a"))  # the anthropic client sends its key as x-api-key
    with pytest.raises(anthropic.NotFoundError) as e:  # the gateway's own 404, in Anthropic's shape
        claude(shared[0], "sk-a").messages.create(model="nope", max_tokens=2,
                                                  messages=[{"role": "user", "content": "hi"}])
    assert "nope" in anthropic_error(e.value, "not_found_error")
    with pytest.raises(anthropic.AuthenticationError) as e:
        claude(shared[0], "sk-unknown").messages.count_tokens(model="tiny",
                                                              messages=[{"role": "user", "content": "hi"}])
    anthropic_error(e.value, "authentication_error")


def test_another_tenant_gets_404_for_everything_about_a_stored_response(shared):
    a, b = oai(shared[0], "sk-a"), oai(shared[1], "sk-b")
    r = a.responses.create(input="A secret", **PROMPT)
    for _ in range(2):  # both engines: neither tells B anything
        with pytest.raises(openai.NotFoundError) as e:
            b.responses.retrieve(r.id)
        assert e.value.body["code"] == "not_found"
        with pytest.raises(openai.NotFoundError) as e:
            b.responses.create(input="Tell me", previous_response_id=r.id, **PROMPT)
        assert e.value.body["code"] == "previous_response_not_found"
        with pytest.raises(openai.NotFoundError):
            b.responses.delete(r.id)
    assert a.responses.retrieve(r.id).id == r.id  # still A's, untouched


def test_an_id_of_no_known_engine_is_answered_as_an_unknown_id(shared, per_service):
    """The gateway's 404 for an id whose engine it does not know (restarted, gone, made up) is the engine's own for
    an unknown id of an engine it knows: nobody learns which ids exist."""
    r = oai(shared[0], "sk-a").responses.create(input="Hello", **PROMPT)
    tag = r.id[len("resp_"):len("resp_") + 12]
    unknown_here = f"resp_{tag}{uuid.uuid4().hex}"  # a known engine, an id it never issued: the engine answers
    unknown_tag = f"resp_{uuid.uuid4().hex[:12]}{uuid.uuid4().hex}"  # no such engine: the gateway answers
    for gateway, key in ((shared[1], "sk-a"), (per_service[0], ENGINE_KEY)):
        bodies = []
        for rid in (unknown_here, unknown_tag):
            status, body, _ = http("GET", f"{gateway.url}/v1/responses/{rid}", headers={"Authorization": f"Bearer {key}"})
            assert status == 404, body
            bodies.append(json.loads(body)["error"] | {"message": None})
        assert bodies[0] == bodies[1] == {"message": None, "type": "invalid_request_error", "param": "response_id",
                                          "code": "not_found"}
        status, body, _ = http("POST", gateway.url + "/v1/responses", {**PROMPT, "input": "x",
                                                                       "previous_response_id": unknown_tag},
                               headers={"Authorization": f"Bearer {key}"})
        assert status == 404 and json.loads(body)["error"]["code"] == "previous_response_not_found", body
