"""/v1/embeddings through the official `openai` client against real `shoal-engine serve` processes.

A tiny random Llama pooled by its last token (the default) and by mean, and a tiny random BERT (mean pooling from
its sentence-transformers files): every vector equals transformers' hidden states pooled the same way, base64 equals
float, `dimensions` truncates and renormalizes where the model allows it, bad input is a 400 in OpenAI's error body,
and no KV block is left behind. On the Llama engine a decode stream keeps producing tokens while a burst of
embedding requests is prefilled next to it.
"""

from __future__ import annotations

import base64
import json
import socket
import struct
import threading
import time

import openai
import pytest
import torch
from openai import OpenAI

from prockit import EVENT_BOUND, wait_for

from .conftest import metric

TEXTS = ["Continuous batching lets requests join and leave the running batch at every step of the engine loop.",
         "hello world",
         "def add(a, b):\n    return a + b"]


def reference(model_dir, texts, pooling: str, normalize: bool = True) -> list[torch.Tensor]:
    """transformers' last hidden states of each text, pooled and (optionally) L2-normalized."""
    import transformers as tf

    tok = tf.AutoTokenizer.from_pretrained(str(model_dir))
    model = tf.AutoModel.from_pretrained(str(model_dir)).eval()
    out = []
    for text in texts:
        ids = tok(text, return_tensors="pt")
        with torch.no_grad():
            h = model(**ids).last_hidden_state[0].float()
        v = {"LAST": h[-1], "MEAN": h.mean(0), "CLS": h[0]}[pooling]
        out.append(torch.nn.functional.normalize(v, dim=0) if normalize else v)
    return out


def client_of(server) -> OpenAI:
    return OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=600)


def assert_close(got, want, atol=1e-4):
    got = torch.tensor(got, dtype=torch.float32)
    assert got.shape == want.shape, (got.shape, want.shape)
    assert torch.allclose(got, want, atol=atol), f"max diff {(got - want).abs().max().item()}"


def assert_no_leak(server):
    def all_free():
        m = server.metrics()
        return metric(m, "shoal:num_free_kv_blocks") == metric(m, "shoal:num_kv_blocks") and \
            metric(m, "shoal:num_requests_running") == 0
    wait_for(all_free, EVENT_BOUND, "every KV block back in the pool after the embedding requests")


def bad_request(fn) -> dict:
    """The 400's OpenAI error body (the client raises BadRequestError for it)."""
    with pytest.raises(openai.BadRequestError) as e:
        fn()
    body = e.value.body
    assert set(body) >= {"message", "type", "param", "code"} and body["type"] == "invalid_request_error", body
    return body


@pytest.fixture(scope="module")
def llama(model_factory):
    # is_matryoshka: the config says the model accepts `dimensions` (a random model is as good as any here)
    return model_factory("llama", is_matryoshka=True)


@pytest.fixture(scope="module")
def llama_server(start_server, llama):
    # A small token budget: a burst of long embedding prompts spans many steps, each with the decodes in it.
    return start_server(llama, "--max-model-len", "512", "--max-num-batched-tokens", "64", "--max-num-seqs", "16")


def test_decoder_last_token_equals_transformers_base64_equals_float(llama_server, llama):
    client = client_of(llama_server)
    want = reference(llama, TEXTS, "LAST")
    r = client.embeddings.create(model="tiny", input=TEXTS)  # the client asks for base64 and decodes it
    assert [d.index for d in r.data] == [0, 1, 2]
    for d, w in zip(r.data, want):
        assert_close(d.embedding, w)
    # (A repeat is served partly from the prefix cache: equal within float32 rounding, not bit for bit.)
    floats = client.embeddings.create(model="tiny", input=TEXTS, encoding_format="float")
    for d, b in zip(floats.data, r.data):
        assert_close(d.embedding, torch.tensor(b.embedding), atol=1e-6)
    # The raw base64 is little-endian float32, as OpenAI sends it.
    status, raw, _ = llama_server.post("/v1/embeddings", {"model": "tiny", "input": TEXTS[1],
                                                          "encoding_format": "base64"})
    assert status == 200, raw
    blob = base64.b64decode(raw["data"][0]["embedding"])
    assert_close(struct.unpack(f"<{len(blob) // 4}f", blob), torch.tensor(floats.data[1].embedding), atol=1e-6)
    # Token ids (one list, or a list of lists) embed as their text does; usage counts the prompt tokens.
    tok = __import__("transformers").AutoTokenizer.from_pretrained(str(llama))
    ids = [tok(t)["input_ids"] for t in TEXTS]
    by_ids = client.embeddings.create(model="tiny", input=ids, encoding_format="float")
    one = client.embeddings.create(model="tiny", input=ids[0], encoding_format="float")
    assert_close(by_ids.data[0].embedding, torch.tensor(one.data[0].embedding), atol=1e-6)
    for d, w in zip(by_ids.data, want):
        assert_close(d.embedding, w)
    assert r.usage.prompt_tokens == r.usage.total_tokens == sum(len(i) for i in ids)
    assert r.model == "tiny"
    m = llama_server.metrics()
    assert metric(m, "shoal:embedding_requests_total", model_name="tiny") >= 10
    assert metric(m, "shoal:embedding_prompt_tokens_total", model_name="tiny") >= 3 * sum(len(i) for i in ids)
    assert_no_leak(llama_server)


def test_dimensions_truncate_and_renormalize(llama_server):
    client = client_of(llama_server)
    full = client.embeddings.create(model="tiny", input=TEXTS[0], encoding_format="float").data[0].embedding
    short = client.embeddings.create(model="tiny", input=TEXTS[0], dimensions=16, encoding_format="float")
    want = torch.nn.functional.normalize(torch.tensor(full[:16]), dim=0)
    assert_close(short.data[0].embedding, want, atol=1e-6)
    for bad in (0, 97):  # the model's hidden size is 96
        body = bad_request(lambda: client.embeddings.create(model="tiny", input="x", dimensions=bad))
        assert body["param"] == "dimensions" and "dimensions" in body["message"]


def test_bad_input_is_a_400_and_leaks_nothing(llama_server):
    client = client_of(llama_server)
    for bad in ("", [], [[]], ["a", ""]):
        body = bad_request(lambda: client.embeddings.create(model="tiny", input=bad, encoding_format="float"))
        assert body["param"] == "input" and "empty" in body["message"], body
    too_long = [5] * 513  # over --max-model-len 512
    body = bad_request(lambda: client.embeddings.create(model="tiny", input=[[5, 6], too_long]))
    assert body["code"] == "context_length_exceeded" and "512" in body["message"], body
    body = bad_request(lambda: client.embeddings.create(model="tiny", input=[[10**6]]))
    assert "out of range" in body["message"], body
    status, body, _ = llama_server.post("/v1/embeddings", {"model": "tiny", "input": "x", "encoding_format": "hex"})
    assert status == 400 and body["error"]["param"] == "encoding_format", body
    status, body, _ = llama_server.post("/v1/embeddings", {"model": "tiny", "input": "x", "dimensions": True})
    assert status == 400 and body["error"]["param"] == "dimensions", body
    status, body, _ = llama_server.post("/v1/embeddings", {"model": "nope", "input": "x"})
    assert status == 404 and body["error"]["code"] == "model_not_found", body
    # A client that gives up mid-request aborts its inputs: their blocks go back too. The request is sent whole on a
    # raw socket and the socket closed once the engine runs it (a client timeout could fire before the server had
    # the body, and nothing would be aborted). Distinct token ids: no prefix-cache hit shortens it; doubled if it
    # finished before the close on a fast machine.
    def counted(reason: str) -> float:
        return metric(llama_server.metrics(), "shoal:request_success_total", finished_reason=reason)

    for count in (16, 32, 64, 128):
        before, done_before = counted("abort"), counted("stop")
        long_inputs = [[10 + (i * 7 + j * 3) % 370 for j in range(500)] for i in range(count)]  # vocabulary 384
        raw = json.dumps({"model": "tiny", "input": long_inputs}).encode()
        with socket.create_connection(("127.0.0.1", llama_server.port)) as sock:
            sock.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(raw), raw))
            wait_for(lambda: metric(llama_server.metrics(), "shoal:num_requests_running") > 0
                     or counted("stop") > done_before, EVENT_BOUND, "the long embedding request running")
        wait_for(lambda: counted("abort") > before or counted("stop") > done_before, EVENT_BOUND,
                 "the abandoned embedding request ended")
        if counted("abort") > before:
            break
    else:
        raise AssertionError("128 inputs of 500 tokens always finished before the client closed its socket")
    assert_no_leak(llama_server)


def test_decode_keeps_running_while_a_burst_of_embeddings_is_served(llama_server):
    """A burst of 12 x 8 distinct prompts of ~150 tokens is prefilled 64 tokens a step, each step with the decode in
    it: the stream's tokens keep arriving all through the burst (no gap of a third of it), and nothing leaks."""
    client = client_of(llama_server)
    # First-use costs out of the way (the first decode steps capture the decode graph: seconds on a loaded CPU).
    client.embeddings.create(model="tiny", input=["warm " + TEXTS[0] * 4] * 2)
    client.completions.create(model="tiny", prompt="warm", max_tokens=8, extra_body={"ignore_eos": True})
    stream = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=480, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    chunks = iter(stream)
    next(chunks)  # decoding has started
    errors: list[BaseException] = []
    burst_end: list[float] = []

    def embed(i: int):
        try:
            # distinct prompts: none is served from the prefix cache, each is a full prefill
            r = client.embeddings.create(model="tiny", input=[f"{i} {j} " + TEXTS[0] * 4 for j in range(8)],
                                         encoding_format="float")
            assert len(r.data) == 8
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=embed, args=(i,)) for i in range(12)]
    started = time.monotonic()
    for t in threads:
        t.start()
    waiter = threading.Thread(target=lambda: ([t.join() for t in threads], burst_end.append(time.monotonic())))
    waiter.start()
    arrivals = []
    for c in chunks:
        if c.choices and c.choices[0].text:
            arrivals.append(time.monotonic())
        if burst_end:
            break
    waiter.join(EVENT_BOUND)
    stream.close()
    assert burst_end and not errors, errors
    burst = burst_end[0] - started
    during = [t for t in arrivals if t <= burst_end[0]]
    gaps = [b - a for a, b in zip([started] + during, during + burst_end)]
    assert len(during) >= 5 and max(gaps) < burst / 3, \
        f"the decode stream stalled: {len(during)} chunks in a {burst:.1f}s burst, longest gap {max(gaps):.2f}s"
    assert_no_leak(llama_server)


def test_mean_pooling_runner_pooling_refuses_generation(start_server, llama):
    server = start_server(llama, "--max-model-len", "512", "--runner", "pooling",
                          "--pooler-config", '{"pooling_type": "MEAN", "normalize": false}')
    client = client_of(server)
    r = client.embeddings.create(model="tiny", input=TEXTS)
    for d, w in zip(r.data, reference(llama, TEXTS, "MEAN", normalize=False)):
        assert_close(d.embedding, w)
    body = bad_request(lambda: client.completions.create(model="tiny", prompt="hi", max_tokens=2))
    assert "embeddings only" in body["message"]
    assert_no_leak(server)


def test_generate_runner_refuses_embeddings(start_server, llama):
    server = start_server(llama, "--max-model-len", "512", "--runner", "generate")
    body = bad_request(lambda: client_of(server).embeddings.create(model="tiny", input="hi"))
    assert "--runner" in body["message"]


def test_bert_mean_pooling_from_sentence_transformers_equals_transformers(start_server, tmp_path_factory):
    from shoal.engine.tools.tiny_model import make_bert_model

    bert = make_bert_model(tmp_path_factory.mktemp("bert"))
    server = start_server(bert)  # --runner auto: an encoder serves embeddings only
    client = client_of(server)
    r = client.embeddings.create(model="tiny", input=TEXTS + [TEXTS[0] * 2])
    for d, w in zip(r.data, reference(bert, TEXTS + [TEXTS[0] * 2], "MEAN")):
        assert_close(d.embedding, w)
    assert all(abs(torch.tensor(d.embedding).norm().item() - 1) < 1e-5 for d in r.data)
    body = bad_request(lambda: client.embeddings.create(model="tiny", input="x", dimensions=8))
    assert "Matryoshka" in body["message"] and body["param"] == "dimensions"
    body = bad_request(lambda: client.embeddings.create(model="tiny", input=[[5] * 129]))  # 128 positions
    assert body["code"] == "context_length_exceeded"
    body = bad_request(lambda: client.completions.create(model="tiny", prompt="hi", max_tokens=2))
    assert "embeddings only" in body["message"]
    assert_no_leak(server)
