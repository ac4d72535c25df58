"""`--model FILE.gguf`: config, tokenizer and weights from one GGUF file; transformers' own GGUF loader is the
oracle (the same file, dequantized by transformers; greedy tokens equal and logprobs close in float32).

These tests read the file dequantized (SHOAL_GGUF_DEQUANTIZE=1), the form transformers computes in exactly; the
packed kernels' decode steps round activations to 16 bits, and test_gguf_packed.py holds them to this path."""

from __future__ import annotations

import importlib
import functools
import json
from pathlib import Path

import pytest
import torch

from gguf_fixtures import write_gguf
from shoal.engine import LLM, SamplingParams
from shoal.engine.execution.weights import WeightError

pytestmark = pytest.mark.numerics

importlib.import_module("gguf")

TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K"]
PROMPTS = ["Hello world! The quick brown", "Once upon a time there was a little shoal of fish", "def add(a, b):"]
MAX_NEW = 10
OPTIONS = dict(dtype="float32", max_model_len=128, block_size=4)
# K-quants need rows that are multiples of 256 weights: hidden 256, intermediate 512.
SHAPE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)


@pytest.fixture(autouse=True)
def dequantized(monkeypatch):
    monkeypatch.setenv("SHOAL_GGUF_DEQUANTIZE", "1")


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("gguf")


@pytest.fixture(scope="module")
def hf_llama(model_factory):
    return model_factory("llama", **SHAPE)


@functools.lru_cache(maxsize=4)
def _oracle(path: str):
    from transformers import AutoModelForCausalLM

    p = Path(path)
    model = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def check_against_transformers_gguf(path: Path, llm: LLM, logprob_tol: float = 2e-4) -> None:
    tok = llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=3)
    outputs = llm.generate(PROMPTS, params)
    model = _oracle(str(path))
    for prompt, out in zip(PROMPTS, outputs):
        ids = tok.encode(prompt)
        with torch.no_grad():
            ref = model.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True)
        ref_ids = ref.sequences[0, len(ids):].tolist()
        ref_lp = torch.log_softmax(torch.stack([step[0] for step in ref.logits]).float(), dim=-1)
        got = out.outputs[0]
        assert got.token_ids == ref_ids, f"{path.name} {prompt!r}: {got.token_ids} != transformers {ref_ids}"
        for step, entry in enumerate(got.logprobs):
            for tid, lp in entry.items():
                assert lp.logprob == pytest.approx(float(ref_lp[step, tid]), abs=logprob_tol), (prompt, step, tid)


@pytest.mark.parametrize("qtype", TYPES)
def test_each_tensor_type_matches_transformers_gguf_loader(hf_llama, gguf_dir, qtype, caplog):
    path = write_gguf(hf_llama, gguf_dir / f"tiny-llama-{qtype}.gguf", weight_type=qtype)
    caplog.set_level("INFO", logger="shoal.engine.execution.gguf_model")
    with LLM(model=str(path), **OPTIONS) as llm:
        check_against_transformers_gguf(path, llm)
    log = caplog.text
    assert f"{qtype} x" in log
    if qtype not in ("F32", "F16", "BF16"):
        assert f"{qtype} dequantized on load" in log  # served packed by default: test_gguf_packed compares both


def test_config_tokenizer_and_chat_template_come_from_the_file(hf_llama, gguf_dir):
    from transformers import AutoTokenizer

    path = write_gguf(hf_llama, gguf_dir / "tiny-meta.gguf", weight_type="Q8_0")
    with LLM(model=str(path), **OPTIONS) as llm:
        cfg = llm.llm_engine.hf_config
        assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_key_value_heads) == (256, 2, 2)
        assert cfg.architectures == ["LlamaForCausalLM"]
        ours = llm.get_tokenizer()
        ref = AutoTokenizer.from_pretrained(str(hf_llama))
        for text in PROMPTS + ["Ünïcödé 🐟 naïve café"]:
            assert ours.encode(text) == ref.encode(text)
        assert ours.chat_template and "<|assistant|>" in ours.chat_template
        rendered = ours.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                            add_generation_prompt=True)
        assert rendered == "<|user|>hi<|end|><|assistant|>"
        assert ours.eos_token_id in llm.llm_engine.eos_token_ids


def test_tokenizer_flag_overrides_the_files_tokenizer(hf_llama, gguf_dir, tmp_path):
    from shoal.engine.tools.tiny_model import make_tokenizer

    path = write_gguf(hf_llama, gguf_dir / "tiny-tokover.gguf", weight_type="F16")
    other = make_tokenizer(tmp_path / "tok", vocab_size=300, chat_template=False)
    with LLM(model=str(path), tokenizer=str(tmp_path / "tok"), **OPTIONS) as llm:
        assert llm.get_tokenizer().encode("Hello world") == other.encode("Hello world")
        assert llm.get_tokenizer().chat_template is None


def test_tied_q8_embedding_with_q4_1_layers_like_smollm2(hf_llama, gguf_dir):
    path = write_gguf(hf_llama, gguf_dir / "tiny-mixed.gguf", weight_type="Q4_1", embed_type="Q8_0")
    with LLM(model=str(path), **OPTIONS) as llm:
        assert llm.llm_engine.hf_config.tie_word_embeddings is False  # the fixture's llama has an lm_head
        check_against_transformers_gguf(path, llm)


def test_qwen2_gguf_with_qkv_bias_and_tied_embeddings(model_factory, gguf_dir):
    hf = model_factory("qwen2", **SHAPE)
    path = write_gguf(hf, gguf_dir / "tiny-qwen2.gguf", weight_type="Q8_0")
    with LLM(model=str(path), **OPTIONS) as llm:
        assert llm.llm_engine.hf_config.tie_word_embeddings is True
        check_against_transformers_gguf(path, llm)


def test_bad_files_get_clear_errors(tmp_path, hf_llama, gguf_dir):
    not_gguf = tmp_path / "weights.bin"
    not_gguf.write_bytes(b"\0" * 64)
    with pytest.raises(WeightError, match="not a GGUF file"):
        LLM(model=str(not_gguf))
    good = write_gguf(hf_llama, gguf_dir / "tiny-trunc.gguf", weight_type="Q8_0").read_bytes()
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(good[:2000])
    with pytest.raises(WeightError, match="truncated.gguf"):
        LLM(model=str(truncated))


@pytest.mark.parametrize("qtype", ["F16", "BF16", "Q8_0", "Q4_1", "Q4_K", "Q6_K"])
def test_a_tensor_parallel_rank_dequantizes_only_its_slices(hf_llama, gguf_dir, monkeypatch, qtype):
    """At tp=2 every weight matrix is read as a half: rows are byte ranges, columns whole blocks of each row;
    the slices equal the same slices of the fully dequantized tensor. (The dequantizing path: test_gguf_packed
    covers packed slices.)"""
    import gguf.quants

    monkeypatch.setenv("SHOAL_GGUF_DEQUANTIZE", "1")
    from shoal.engine.distributed.parallel_state import ParallelState, using_parallel_state
    from shoal.engine.execution.gguf_model import GGUFWeightSource, gguf_config
    from shoal.engine.execution.model_loader import load_model

    path = write_gguf(hf_llama, gguf_dir / f"tiny-tp-{qtype}.gguf", weight_type=qtype)
    config = gguf_config(path)
    src = GGUFWeightSource(path, config)
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
                 "model.layers.1.mlp.down_proj.weight", "model.layers.0.self_attn.o_proj.weight"):
        full = src.load(name)
        for dim in (0, 1):
            half = full.shape[dim] // 2
            torch.testing.assert_close(src.load(name, dim=dim, start=half, length=half), full.narrow(dim, half, half))

    read, original = [], gguf.quants.dequantize
    monkeypatch.setattr(gguf.quants, "dequantize", lambda data, qt: read.append(data.size) or original(data, qt))
    with using_parallel_state(ParallelState(tp_rank=1, tp_size=2)):
        load_model(path, config, torch.float32, torch.device("cpu"), None, 64)
    matrices = [t for t in src._tensors.values() if len(t.shape) == 2]
    # The vocabulary is split too (embedding and LM head); norms are tiny and replicated.
    assert max(read) <= max(t.data.size for t in matrices) // 2
    assert sum(read) < 0.55 * sum(t.data.size for t in src._tensors.values())


def test_qwen3_gguf_with_qk_norm(model_factory, gguf_dir):
    # transformers' GGUF loader leaves Qwen3's head_dim at its default, 128: use that so it can be the oracle.
    hf = model_factory("qwen3", hidden_size=256, intermediate_size=256, num_attention_heads=2, num_key_value_heads=1,
                       head_dim=128, num_hidden_layers=2)
    path = write_gguf(hf, gguf_dir / "tiny-qwen3.gguf", weight_type="Q8_0")
    with LLM(model=str(path), **OPTIONS) as llm:
        assert type(llm.llm_engine.executor.runner.model).__name__ == "Qwen3ForCausalLM"
        check_against_transformers_gguf(path, llm)


def test_mixtral_gguf_with_stacked_experts(model_factory, gguf_dir):
    """llama.cpp's Mixtral layout (llama + expert_count, experts stacked per layer). transformers cannot read it,
    so the oracle is transformers on the Hugging Face directory the F32 file was written from; a Q8_0 file must stay
    within its rounding of that (measured 0.12 nats at most on the first step; a near-tie in the router can flip an
    expert, hence the margin; a wrong expert slice is several nats off)."""
    from hf_reference import assert_greedy_matches

    hf = model_factory("mixtral")
    f32 = write_gguf(hf, gguf_dir / "tiny-mixtral-f32.gguf", weight_type="F32")
    q8 = write_gguf(hf, gguf_dir / "tiny-mixtral-q8.gguf", weight_type="Q8_0")
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=3)
    with LLM(model=str(f32), **OPTIONS) as llm:
        assert llm.llm_engine.hf_config.num_local_experts == 4
        tok = llm.get_tokenizer()
        exact = llm.generate(PROMPTS, params)
    assert_greedy_matches(hf, tok, PROMPTS, exact, MAX_NEW)
    with LLM(model=str(q8), **OPTIONS) as llm:
        quant = llm.generate(PROMPTS, params)
    for a, b in zip(exact, quant):
        first_a, first_b = a.outputs[0].logprobs[0], b.outputs[0].logprobs[0]
        assert max(abs(first_a[t].logprob - first_b[t].logprob) for t in set(first_a) & set(first_b)) < 0.5


@pytest.mark.parametrize("arch", ["qwen2_moe", "qwen3_moe"])
def test_qwen_moe_gguf_matches_the_checkpoint(model_factory, gguf_dir, arch):
    """llama.cpp's qwen2moe / qwen3moe layout (stacked experts, Qwen2-MoE's shared expert and its [H] gate, every
    layer sparse, top-k renormalised for Qwen3-MoE only): an F32 file holds the checkpoint's exact weights, so
    transformers on the source directory is the oracle."""
    from hf_reference import assert_greedy_matches

    hf = model_factory(arch, mlp_only_layers=None)
    path = write_gguf(hf, gguf_dir / f"tiny-{arch}-f32.gguf", weight_type="F32")
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=3)
    with LLM(model=str(path), **OPTIONS) as llm:
        assert type(llm.llm_engine.executor.runner.model).__name__ == f"{arch.title().replace('_', '')}ForCausalLM"
        tok = llm.get_tokenizer()
        outputs = llm.generate(PROMPTS, params)
    assert_greedy_matches(hf, tok, PROMPTS, outputs, MAX_NEW)


@pytest.mark.parametrize("arch", ["deepseek_v3", "deepseek_v2"])
def test_deepseek_gguf_matches_the_checkpoint(model_factory, gguf_dir, arch):
    """llama.cpp's deepseek2 layout (MLA as multi-query attention over the latent, kv_b_proj split into attn_k_b and
    attn_v_b, stacked experts, the router's bias as exp_probs_b, YaRN's mscale as a log multiplier): an F32 file
    holds the checkpoint's exact weights, so transformers on the source directory is the oracle, and an older
    file with one attn_kv_b gives the same tokens. (Packed: test_gguf_packed.py.)"""
    from gguf_fixtures import write_mla_gguf
    from hf_reference import assert_greedy_matches
    from transformers import AutoTokenizer

    from shoal.engine.execution.gguf_model import gguf_config
    from shoal.engine.execution.layers.mla import LatentAttention

    hf = model_factory(arch)
    path = write_mla_gguf(hf, gguf_dir / f"tiny-{arch}-f32.gguf")
    config = gguf_config(path)
    source = json.loads((hf / "config.json").read_text())
    for field in ("kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
                  "num_key_value_heads", "first_k_dense_replace", "n_routed_experts", "n_shared_experts", "n_group",
                  "topk_group", "norm_topk_prob", "routed_scaling_factor"):
        assert getattr(config, field) == source.get(field, getattr(config, field)), field
    # A tensor-parallel rank's heads of kv_b_proj, joined from attn_k_b and attn_v_b, are the checkpoint's rows.
    from shoal.engine.execution.gguf_model import GGUFWeightSource
    from shoal.engine.execution.weights import WeightSource

    name, rows = "model.layers.1.self_attn.kv_b_proj.weight", source["qk_nope_head_dim"] + source["v_head_dim"]
    full = WeightSource(hf).load(name)
    gg = GGUFWeightSource(path, config)
    assert gg.shape(name) == tuple(full.shape)
    torch.testing.assert_close(gg.load(name, tuple(full.shape), dim=0, start=rows, length=2 * rows),
                               full[rows:3 * rows], rtol=0, atol=0)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=3)
    with LLM(model=str(path), **OPTIONS) as llm:
        model = llm.llm_engine.executor.runner.model
        assert type(model).__name__ == source["architectures"][0]
        assert isinstance(model.layers[0].self_attn, LatentAttention)
        tok = llm.get_tokenizer()
        exact = llm.generate(PROMPTS, params)
    ref = AutoTokenizer.from_pretrained(str(hf))
    assert [tok.encode(p) for p in PROMPTS] == [ref.encode(p) for p in PROMPTS]
    assert_greedy_matches(hf, tok, PROMPTS, exact, MAX_NEW)
    joined = write_mla_gguf(hf, gguf_dir / f"tiny-{arch}-kvb.gguf", split_kv_b=False)
    with LLM(model=str(joined), **OPTIONS) as llm:
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)] == [
            o.outputs[0].token_ids for o in exact]


def test_a_deepseek_gguf_missing_half_of_kv_b_is_refused(model_factory, gguf_dir):
    from gguf_fixtures import write_mla_gguf

    path = write_mla_gguf(model_factory("deepseek_v3"), gguf_dir / "tiny-deepseek-half.gguf",
                          drop={"blk.1.attn_v_b.weight"})
    with pytest.raises(WeightError, match=r"kv_b_proj.*split in two tensors.*only one"):
        LLM(model=str(path), **OPTIONS)


# Gemma 2/3 and Phi-3 as llama.cpp lays them out (Gemma norms stored as 1 + w, Phi-3's fused attn_qkv and gate/up
# in ffn_up, LongRoPE factors as tensors). F32 files hold the checkpoint's exact weights, so transformers on the
# source directory is the oracle. query_pre_attn_scalar = head_dim and Gemma 3's default layer pattern (every
# sixth layer global, local RoPE base 10000) are what GGUF metadata implies (llama.cpp's reading).
FAMILIES = {
    "gemma2": dict(query_pre_attn_scalar=16),
    "gemma3": dict(query_pre_attn_scalar=16, num_hidden_layers=6, layer_types=None),
    "phi3": {},
}


@pytest.mark.parametrize("arch", list(FAMILIES))
@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2-slices"])
def test_gemma_and_phi3_gguf_match_the_checkpoint(model_factory, gguf_dir, arch, tp, monkeypatch):
    from hf_reference import assert_greedy_matches
    from shoal.engine.execution.gguf_model import GGUFWeightSource, gguf_config

    src = model_factory(arch, **FAMILIES[arch])
    path = write_gguf(src, gguf_dir / f"{arch}.gguf", "F32")
    config = gguf_config(path)
    assert config.architectures == [f"{arch.capitalize()}ForCausalLM"]
    assert config.sliding_window == {"gemma2": 8, "gemma3": 8, "phi3": 10}[arch]
    if tp == 2:  # the rows a tensor-parallel rank owns of a fused tensor are the rows the checkpoint has there
        from shoal.engine.execution.weights import WeightSource

        ref, gg = WeightSource(src), GGUFWeightSource(path, config)
        name = f"model.layers.1.self_attn.{'qkv_proj' if arch == 'phi3' else 'k_proj'}.weight"
        full = ref.load(name)
        torch.testing.assert_close(gg.load(name, tuple(full.shape), dim=0, start=16, length=16), full[16:32])
        norm = "model.layers.1.post_attention_layernorm.weight"
        torch.testing.assert_close(gg.load(norm), ref.load(norm))  # Gemma: the stored 1 + w, back to w
        return
    with LLM(model=path, **OPTIONS) as llm:
        tok = llm.get_tokenizer()
        outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True,
                                                       logprobs=3))
        assert_greedy_matches(src, tok, PROMPTS, outputs, MAX_NEW, context=(arch,))


def test_a_folder_holding_one_gguf_file_serves_it(hf_llama, gguf_dir, tmp_path):
    """A llama.cpp repository (the model cache stores hf://org/name-GGUF as such a folder: no config.json);
    with several GGUF files the error names them."""
    import shutil

    path = write_gguf(hf_llama, gguf_dir / "tiny-folder.gguf", weight_type="Q8_0")
    repo = tmp_path / "repo"
    repo.mkdir()
    shutil.copyfile(path, repo / path.name)
    (repo / "README.md").write_text("# a GGUF repository\n")
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with LLM(model=str(path), **OPTIONS) as llm:
        want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    with LLM(model=str(repo), **OPTIONS) as llm:
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)] == want
    shutil.copyfile(path, repo / "other.gguf")
    with pytest.raises(WeightError, match=r"2 GGUF files \(other.gguf, tiny-folder.gguf\).*--model DIR/FILE.gguf"):
        LLM(model=str(repo), **OPTIONS)
