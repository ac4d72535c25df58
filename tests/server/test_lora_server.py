"""LoRA adapters through the real `shoal-engine serve` process and the official openai client: adapters named as
`model`, listed in /v1/models with their parent, loaded and unloaded at run time (vLLM's endpoints and bodies,
behind the API key) while requests run, with no failed request and no KV block left behind."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import openai
import pytest
from openai import AsyncOpenAI, OpenAI

from shoal.engine.tools.tiny_lora import ATTN, make_lora_adapter
from .conftest import metric
from .test_openai_server import wait_idle

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from hf_reference import hf_greedy  # noqa: E402
from lora_reference import merged_model  # noqa: E402

KEY = "sk-lora"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = "Once upon a time there was a little shoal of fish"


@pytest.fixture(scope="module")
def adapters(llama_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("server-loras")
    return {"all8": make_lora_adapter(root / "all8", llama_model, rank=8, alpha=16, seed=2),
            "attn4": make_lora_adapter(root / "attn4", llama_model, rank=4, alpha=8, targets=ATTN, seed=1),
            "r32": make_lora_adapter(root / "r32", llama_model, rank=32, seed=4)}


@pytest.fixture(scope="module")
def server(start_server, llama_model, adapters):
    return start_server(llama_model, "--max-model-len", "256", "--num-kv-blocks", "200", "--api-key", KEY,
                        "--enable-lora", "--lora-modules", f"all8={adapters['all8']}", "--max-loras", "2",
                        "--max-lora-rank", "16", "--max-cpu-loras", "3")


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=server.base + "/v1", api_key=KEY, max_retries=0, timeout=60)


def test_adapter_as_model_equals_the_merged_checkpoint(server, client, llama_model, adapters, tmp_path_factory):
    status, body, _ = server.post("/tokenize", {"prompt": PROMPT}, headers=AUTH)
    assert status == 200
    ids = body["tokens"]
    cards = {m.id: m for m in client.models.list().data}
    assert cards["all8"].model_extra["parent"] == "tiny" and cards["tiny"].model_extra["parent"] is None
    out = client.completions.create(model="all8", prompt=ids, max_tokens=8, temperature=0, logprobs=1)
    assert out.model == "all8"
    ref_ids, _ = hf_greedy(merged_model(llama_model, adapters["all8"], tmp_path_factory.getbasetemp()), ids, 8)
    base_ids, _ = hf_greedy(llama_model, ids, 8)
    assert ref_ids != base_ids
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(llama_model))
    assert out.choices[0].text == tok.decode(ref_ids)
    base = client.completions.create(model="tiny", prompt=ids, max_tokens=8, temperature=0)
    assert base.choices[0].text == tok.decode(base_ids)


def test_bad_adapters_and_names_are_4xx(server, client, adapters, tmp_path):
    status, _, _ = server.request("POST", "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/nowhere"})
    assert status == 401  # behind the API key
    with pytest.raises(openai.BadRequestError, match="above --max-lora-rank 16"):
        client.post("/load_lora_adapter", body={"lora_name": "r32", "lora_path": str(adapters["r32"])}, cast_to=str)
    with pytest.raises(openai.BadRequestError, match="not a directory"):
        client.post("/load_lora_adapter", body={"lora_name": "gone", "lora_path": str(tmp_path / "gone")},
                    cast_to=str)
    with pytest.raises(openai.BadRequestError, match="already been loaded"):
        client.post("/load_lora_adapter", body={"lora_name": "all8", "lora_path": str(adapters["all8"])},
                    cast_to=str)
    with pytest.raises(openai.NotFoundError):
        client.post("/unload_lora_adapter", body={"lora_name": "gone"}, cast_to=str)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gone", prompt="hi", max_tokens=2)
    assert client.completions.create(model="all8", prompt="hi", max_tokens=2).choices[0].text is not None


def test_load_and_unload_under_load(server, client, adapters):
    aclient = AsyncOpenAI(base_url=server.base + "/v1", api_key=KEY, max_retries=0, timeout=60)

    async def run():
        async def one(i, model):
            r = await aclient.completions.create(model=model, prompt=f"{PROMPT} {i}", max_tokens=24,
                                                 temperature=0, extra_body={"ignore_eos": True})
            return r.choices[0].finish_reason, r.usage.completion_tokens

        first = [asyncio.create_task(one(i, "all8" if i % 2 else "tiny")) for i in range(8)]
        await asyncio.sleep(0.3)
        await aclient.post("/load_lora_adapter", body={"lora_name": "attn4", "lora_path": str(adapters["attn4"])},
                           cast_to=str)
        second = [asyncio.create_task(one(i, "attn4")) for i in range(4)]
        await aclient.post("/unload_lora_adapter", body={"lora_name": "all8"}, cast_to=str)  # all8 still running
        return await asyncio.gather(*first, *second)

    results = asyncio.run(run())
    assert results == [("length", 24)] * 12
    models = {m.id for m in client.models.list().data}
    assert models == {"tiny", "attn4"}
    m = wait_idle(server)
    assert metric(m, "shoal:kv_cache_usage_perc") == 0
    assert metric(m, "shoal:lora_resident_info", resident_lora_adapters="attn4") > 0
    assert metric(m, "shoal:lora_requests_info", running_lora_adapters="", max_lora="2") > 0
    # Adapters back: all8 again from its directory.
    client.post("/load_lora_adapter", body={"lora_name": "all8", "lora_path": str(adapters["all8"])}, cast_to=str)
    assert {m.id for m in client.models.list().data} == {"tiny", "attn4", "all8"}
