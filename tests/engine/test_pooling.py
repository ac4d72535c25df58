"""Embedding requests in the engine: pooled under chunked prefill and preemption exactly as transformers pools the
whole prompt, aborted without leaking blocks, and the pooler chosen from --pooler-config and sentence-transformers
files (unsupported pipelines refused at load)."""

from __future__ import annotations

import json

import pytest
import torch

from shoal.engine.config import EngineConfig, PoolerConfig
from shoal.engine.contracts import PoolingParams, SamplingParams
from shoal.engine.core.engine import LLMEngine
from shoal.engine.core.pooling import PoolerError, make_pooler

TEXT = "Continuous batching lets requests join and leave the running batch at every step of the engine loop. "


def hf_pooled(model_dir, token_ids: list[int], pooling: str) -> torch.Tensor:
    import transformers as tf

    model = tf.AutoModel.from_pretrained(str(model_dir)).eval()
    with torch.no_grad():
        h = model(input_ids=torch.tensor([token_ids])).last_hidden_state[0].float()
    return torch.nn.functional.normalize({"LAST": h[-1], "MEAN": h.mean(0), "CLS": h[0]}[pooling], dim=0)


def run(engine: LLMEngine) -> dict:
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


@pytest.mark.parametrize("pooling", ["MEAN", "CLS", "LAST"])
def test_pooling_survives_chunks_and_preemption(model_factory, pooling):
    """A 9-block pool: the embedding prompt's 40-token chunks fill it while a generation grows, so the embedding is
    preempted mid-prefill; recomputed from position 0 its vector is still transformers' whole-prompt pooling."""
    model = model_factory("llama")
    engine = LLMEngine(EngineConfig(model=str(model), max_model_len=144, block_size=16, num_kv_blocks=9,
                                    max_num_batched_tokens=40, pooler_config={"pooling_type": pooling},
                                    enable_prefix_caching=False))
    engine.add_request("gen", "Once upon a time", SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))
    for _ in range(50):  # ~54 tokens: 4 blocks, so the embedding's chunks fill the pool before gen needs a 5th
        engine.step()
    prompt = engine.tokenizer.encode(TEXT * 3)[:110]
    engine.add_request("emb", prompt, PoolingParams())
    done = run(engine)
    assert engine.scheduler.num_preemptions > 0, "the scenario no longer preempts the embedding prompt"
    got = done["emb"].embedding
    assert torch.allclose(got, hf_pooled(model, prompt, pooling), atol=1e-4), (got - hf_pooled(model, prompt,
                                                                                                 pooling)).abs().max()
    assert len(done["gen"].outputs[0].token_ids) == 100
    assert engine.pool.num_free == engine.pool.num_blocks


def test_offline_llm_embed(model_factory):
    from shoal.engine import LLM

    model = model_factory("llama")
    with LLM(model=str(model), max_model_len=256) as llm:
        outs = llm.embed([TEXT, {"prompt_token_ids": [5, 6, 7]}], use_tqdm=False)
    ids = llm.get_tokenizer().encode(TEXT)
    assert torch.allclose(outs[0].embedding, hf_pooled(model, ids, "LAST"), atol=1e-4)
    assert torch.allclose(outs[1].embedding, hf_pooled(model, [5, 6, 7], "LAST"), atol=1e-4)


def test_aborted_and_refused_embeddings_leak_no_block(model_factory):
    engine = LLMEngine(EngineConfig(model=str(model_factory("llama")), max_model_len=256,
                                    max_num_batched_tokens=32))
    engine.add_request("a", TEXT * 3, PoolingParams())
    engine.step()  # a first chunk holds blocks now
    assert engine.pool.num_free < engine.pool.num_blocks
    engine.abort_request("a")
    with pytest.raises(ValueError, match="maximum context length"):
        engine.add_request("b", [5] * 257, PoolingParams())
    with pytest.raises(ValueError, match="dimensions is not supported"):
        engine.add_request("c", "hi", PoolingParams(dimensions=8))
    assert engine.pool.num_free == engine.pool.num_blocks and not engine.has_unfinished_requests()


def _st_dir(tmp_path, modules: list[str], pooling: dict | None = None):
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "modules.json").write_text(json.dumps(
        [{"idx": i, "name": str(i), "path": f"{i}_{m}" if i else "", "type": f"sentence_transformers.models.{m}"}
         for i, m in enumerate(modules)]))
    if pooling is not None:
        (tmp_path / "1_Pooling").mkdir()
        (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    return tmp_path


class _Config:
    hidden_size = 32


def test_pooler_from_sentence_transformers_files_and_flag(tmp_path):
    d = _st_dir(tmp_path / "cls", ["Transformer", "Pooling"], {"pooling_mode_cls_token": True})
    p = make_pooler(d, _Config(), is_encoder=True, override=None)
    assert (p.pooling_type, p.normalize, p.source) == ("CLS", False, "sentence-transformers")
    p = make_pooler(d, _Config(), is_encoder=True, override=PoolerConfig(pooling_type="mean", normalize=True))
    assert (p.pooling_type, p.normalize) == ("MEAN", True)
    plain = tmp_path / "plain"
    plain.mkdir()
    assert make_pooler(plain, _Config(), is_encoder=False, override=None).pooling_type == "LAST"
    assert make_pooler(plain, _Config(), is_encoder=True, override=None).pooling_type == "MEAN"


@pytest.mark.parametrize("modules,pooling,match", [
    (["Transformer", "Pooling", "Dense", "Normalize"], {"pooling_mode_mean_tokens": True}, "Dense"),
    (["Transformer", "Pooling"], {"pooling_mode_max_tokens": True}, "pooling_mode_max_tokens"),
    (["Transformer", "Pooling"], {"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": True}, "2 kinds"),
])
def test_unsupported_sentence_transformers_pipelines_are_refused(tmp_path, modules, pooling, match):
    with pytest.raises(PoolerError, match=match):
        make_pooler(_st_dir(tmp_path, modules, pooling), _Config(), is_encoder=True, override=None)


def test_pooler_config_flag_is_checked():
    with pytest.raises(ValueError, match="pooling_type"):
        EngineConfig(model="x", pooler_config='{"pooling_type": "MAX"}')
    with pytest.raises(ValueError, match="extra"):
        EngineConfig(model="x", pooler_config='{"softmax": true}')
