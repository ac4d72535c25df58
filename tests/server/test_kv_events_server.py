"""KV events from the real `shoal-engine serve` process (--kv-events-config, vLLM's flag) and vLLM's
POST /reset_prefix_cache: a completion's blocks arrive as BlockStored with the hashes a router recomputes from the
prompt's token ids (/tokenize), and a reset as AllBlocksCleared."""

from __future__ import annotations

import json

import msgpack
import pytest
import zmq

from prockit import free_port, wait_for
from shoal.engine.kv_hash import hash_chain


@pytest.fixture(scope="module")
def server_and_events(start_server, llama_model):
    port = free_port()
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}", "topic": "kv"}
    server = start_server(llama_model, "--block-size", "16", "--kv-events-config", json.dumps(config),
                          wait=False).wait_ready(timeout=300)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(f"tcp://127.0.0.1:{port}")
    try:
        yield server, sub
    finally:
        ctx.destroy(linger=0)


def events(sub) -> list:
    out = []
    while sub.poll(200):
        _topic, _seq, payload = sub.recv_multipart()
        out += msgpack.unpackb(payload)[1]
    return out


def test_served_completion_publishes_its_blocks_and_reset_clears_them(server_and_events):
    server, sub = server_and_events
    prompt = "The shoal of fish swam along the reef, " * 8
    status, tokenized, _ = server.post("/tokenize", {"model": server.model, "prompt": prompt})
    assert status == 200, tokenized
    expected = list(hash_chain(tokenized["tokens"], 16))
    assert len(expected) >= 3
    seen: list = []

    def stored_prompt():  # the subscription may reach the PUB socket after the first request: ask again
        status, body, _ = server.post("/v1/completions", {"model": server.model, "prompt": prompt, "max_tokens": 1})
        assert status == 200, body
        seen.extend(events(sub))
        return [e for e in seen if e[0] == "BlockStored" and e[1][0] == expected[0]]

    (stored,) = wait_for(stored_prompt, 60, "BlockStored for the prompt's blocks")
    assert stored[1] == expected[:len(stored[1])] and len(stored[1]) == len(expected)
    status, body, _ = server.post("/reset_prefix_cache", None)
    assert (status, body) == (200, {"reset": True})
    assert wait_for(lambda: [e for e in events(sub) if e == ["AllBlocksCleared"]], 30, "AllBlocksCleared")
