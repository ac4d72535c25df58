"""GGUF files of the hybrid families (Qwen3-Next, Qwen3.5 dense and MoE, Granite 4 = GraniteMoeHybrid, Nemotron-H,
Falcon-H1) in llama.cpp's layout: tests/engine/gguf_fixtures.py's write_hybrid_gguf writes the tiny Hugging Face model as
llama.cpp's converter does (its tensor names, metadata and every transform: A_log as -exp(A_log), squeezed conv1d
weights, (1 + w) norms, Qwen3-Next's in_proj_qkvz regrouped into attn_qkv + attn_gate, Qwen3.5's value heads
tiled, Llama-permuted q/k, Granite's split expert and shared-MLP inputs, per-layer head counts marking the layers,
Falcon-H1's multipliers multiplied into its weights).

An F32 file holds the checkpoint's exact weights: every tensor read back equals the checkpoint's, and greedy output
from the file equals Shoal's from the directory and transformers' generate. A Q8_0 file runs on the packed kernels
and stays within its rounding of that; a file missing a tensor or a metadata key is refused naming it."""

from __future__ import annotations

import json

import pytest
import torch

from gguf_fixtures import write_hybrid_gguf
from shoal.engine import LLM, SamplingParams
from shoal.engine.execution.weights import WeightError

pytestmark = pytest.mark.numerics

PROMPTS = ["Hello world! The quick brown", "Once upon a time there was a little shoal of fish"]
MAX_NEW = 6
OPTIONS = dict(dtype="float32", max_model_len=128, block_size=4, max_num_seqs=4, kv_cache_memory=32 * 2**20)
# llama.cpp's Qwen3-Next and Qwen3.5-MoE files make every layer sparse.
FAMILIES = {"qwen3_next": dict(mlp_only_layers=None), "qwen3_5": {}, "qwen3_5_moe": {}, "granitemoehybrid": {},
            "nemotron_h": {},
            # llama.cpp's Mamba2 layer gates, then normalises (the tiny preset normalises first)
            "falcon_h1": dict(mamba_norm_before_gate=False)}
# Falcon-H1's muP multipliers, which the converter multiplies into the weights (the file's config has them at 1)
MULTIPLIERS = ("embedding_multiplier", "lm_head_multiplier", "attention_in_multiplier", "attention_out_multiplier",
               "key_multiplier", "ssm_in_multiplier", "ssm_out_multiplier", "ssm_multipliers", "mlp_multipliers")
FOLDED = ("in_proj", "out_proj", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "down_proj", "embed_tokens",
          "lm_head")
ARCH = {"qwen3_next": "Qwen3NextForCausalLM", "qwen3_5": "Qwen3_5ForCausalLM", "qwen3_5_moe": "Qwen3_5MoeForCausalLM",
        "granitemoehybrid": "GraniteMoeHybridForCausalLM", "nemotron_h": "NemotronHForCausalLM",
        "falcon_h1": "FalconH1ForCausalLM"}


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("gguf-hybrid")


def _params():
    return SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=3)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_hybrid_gguf_matches_the_checkpoint_and_transformers(model_factory, gguf_dir, family, monkeypatch):
    from hf_reference import assert_greedy_matches

    from shoal.engine.execution.gguf_model import GGUFWeightSource, gguf_config
    from shoal.engine.execution.weights import WeightSource

    monkeypatch.setenv("SHOAL_GGUF_DEQUANTIZE", "1")  # the form transformers computes in exactly
    hf = model_factory(family, **FAMILIES[family])
    path = write_hybrid_gguf(hf, gguf_dir / f"{family}-f32.gguf")
    config = gguf_config(path)
    assert config.architectures == [ARCH[family]]
    source = json.loads((hf / "config.json").read_text())
    source = source.get("text_config", source)
    for key, value in source.items():  # the metadata gives back the checkpoint's config
        if key in ("layer_types", "layers_block_type", "linear_num_key_heads", "linear_num_value_heads",
                   "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim", "mamba_n_heads",
                   "mamba_d_head", "mamba_n_groups", "mamba_d_state", "mamba_d_conv", "mamba_num_heads",
                   "mamba_head_dim", "n_groups", "ssm_state_size", "conv_kernel", "num_experts", "num_local_experts",
                   "moe_intermediate_size", "shared_expert_intermediate_size", "shared_intermediate_size",
                   "num_key_value_heads", "head_dim", "embedding_multiplier", "residual_multiplier",
                   "logits_scaling", "position_embedding_type", "mamba_conv_bias", "use_conv_bias", "hidden_size",
                   "mamba_d_ssm", "mamba_rms_norm") and not (family == "falcon_h1" and key in MULTIPLIERS):
            assert getattr(config, key) == pytest.approx(value), key
    if family == "falcon_h1":
        for key in MULTIPLIERS:
            assert getattr(config, key) == pytest.approx([1.0] * len(source[key]) if isinstance(source[key], list)
                                                         else 1.0), key
    # Every tensor the model reads is the checkpoint's: each of llama.cpp's transforms undone (exactly, but for the
    # float32 rounding of log(exp(A_log)) and of (1 + w) - 1).
    ref, gg = WeightSource(hf), GGUFWeightSource(path, config)
    checked = 0
    for name in sorted(ref.names()):
        if name.startswith(("model.visual.", "mtp.")):
            continue
        ours = name.replace("model.language_model.", "model.")
        assert gg.has(ours), name
        if family == "falcon_h1" and any(x in name for x in FOLDED):
            continue  # carries a multiplier now (the greedy comparison below holds the result to transformers')
        torch.testing.assert_close(gg.load(ours), ref.load(name).float(), rtol=1e-6, atol=1e-6, msg=name)
        checked += 1
    assert checked > 20
    for name, view in gg._views.items():  # a tensor-parallel rank's rows / columns of a view are the checkpoint's
        full = gg.load(name)
        for dim in range(min(2, full.dim())):
            half = full.shape[dim] // 2
            torch.testing.assert_close(gg.load(name, dim=dim, start=half, length=full.shape[dim] - half),
                                       full.narrow(dim, half, full.shape[dim] - half), rtol=0, atol=0, msg=name)
    with LLM(model=str(path), **OPTIONS) as llm:
        model = llm.llm_engine.executor.runner.model
        assert type(model).__name__ == ARCH[family].replace("Qwen3_5Moe", "Qwen3_5")
        tok = llm.get_tokenizer()
        from_file = llm.generate(PROMPTS, _params())
        llm.llm_engine.state_pool.check_all_free()
    with LLM(model=str(hf), **OPTIONS) as llm:
        from_dir = llm.generate(PROMPTS, _params())
    assert [o.outputs[0].token_ids for o in from_file] == [o.outputs[0].token_ids for o in from_dir]
    assert_greedy_matches(hf, tok, PROMPTS, from_file, MAX_NEW, context=(family,))


def _with_weights_of(src, config, hf, out):
    """A copy of the checkpoint `hf` whose tensors are the ones `src` (a GGUF source) reads back: what transformers
    runs as the file's model (with the file's multipliers: Falcon-H1's at 1, its weights carry them)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(hf, out)
    checkpoint = json.loads((out / "config.json").read_text())
    for key in MULTIPLIERS:
        if key in checkpoint:
            checkpoint[key] = getattr(config, key)
    (out / "config.json").write_text(json.dumps(checkpoint))
    for f in out.glob("*.safetensors"):
        tensors = load_file(f)
        for name in tensors:
            ours = name.replace("model.language_model.", "model.")
            if src.has(ours):
                tensors[name] = src.load(ours).reshape(tensors[name].shape).to(tensors[name].dtype)
        save_file(tensors, f, metadata={"format": "pt"})
    return out


def _near_tie_or_same(packed_out, dense_out, tol: float) -> None:
    """Logprobs within tol and the same greedy token at every step, until a step where the dense model's top two
    are within 2 tol (a near tie either side may win; past it nothing more is compared): test_gguf_packed's rule."""
    for a, b in zip(packed_out, dense_out):
        steps = zip(a.outputs[0].token_ids, b.outputs[0].token_ids, a.outputs[0].logprobs, b.outputs[0].logprobs)
        for ta, tb, la, lb in steps:
            for tid in set(la) & set(lb):
                assert la[tid].logprob == pytest.approx(lb[tid].logprob, abs=tol)
            first, second = sorted((v.logprob for v in lb.values()), reverse=True)[:2]
            if first - second <= 2 * tol:
                break
            assert ta == tb


@pytest.mark.parametrize("family", list(FAMILIES))
def test_q8_0_hybrid_gguf_equals_transformers_on_its_weights_and_runs_packed(model_factory, gguf_dir, family,
                                                                               monkeypatch, caplog, tmp_path):
    """A Q8_0 file read dequantized gives transformers' greedy tokens and logprobs when transformers runs the file's
    own weights (the checkpoint with every tensor the file holds, dequantized, in place). Served packed, its 2-D
    projections stay in their blocks, the layers built from rows of several stored tensors included (Qwen3-Next's
    in_proj_qkvz from attn_qkv + attn_gate, Qwen3.5's in_proj from head-reordered rows of attn_qkv, attn_gate,
    ssm_beta, ssm_alpha), each view's blocks exactly its dequantized rows, and the output stays within the packed
    kernels' 16-bit activation rounding of the dequantized one (0.09 nats at most measured on these sensitive
    random hybrids; a wrong row is nats off). Against the F32 file itself Q8_0's rounding moves their first-step
    logprobs by up to 1.4 nats (a router near-tie in Qwen3-Next flips an expert): too loose a bound to test."""
    from hf_reference import assert_greedy_matches

    from shoal.engine.execution.gguf_model import GGUFWeightSource, gguf_config
    from shoal.engine.execution.quantization.gguf import GGUFWeight

    hf = model_factory(family, **FAMILIES[family])
    q8 = write_hybrid_gguf(hf, gguf_dir / f"{family}-q8.gguf", weight_type="Q8_0")
    config = gguf_config(q8)
    dense, packed_src = GGUFWeightSource(q8, config), GGUFWeightSource(q8, config, packed=True)
    for name in dense._views:  # a view's packed rows are exactly its dequantized rows
        blocks = packed_src.load_packed(name, dense.shape(name), dim=0, start=0, length=dense.shape(name)[0])
        if blocks is not None:
            torch.testing.assert_close(blocks.dequantize().float(), dense.load(name), rtol=0, atol=0, msg=name)
    ref = _with_weights_of(dense, config, hf, tmp_path / "checkpoint-with-the-files-weights")
    monkeypatch.setenv("SHOAL_GGUF_DEQUANTIZE", "1")
    with LLM(model=str(q8), **OPTIONS) as llm:
        tok = llm.get_tokenizer()
        dequantized = llm.generate(PROMPTS, _params())
    assert_greedy_matches(ref, tok, PROMPTS, dequantized, MAX_NEW, context=(family,))

    monkeypatch.setenv("SHOAL_GGUF_DEQUANTIZE", "0")
    caplog.set_level("INFO", logger="shoal.engine.execution.gguf_model")
    with LLM(model=str(q8), **OPTIONS) as llm:
        model = llm.llm_engine.executor.runner.model
        packed = {n for n, m in model.named_modules() if isinstance(getattr(m, "format", None), GGUFWeight)}
        served = llm.generate(PROMPTS, _params())
    assert "Q8_0 kept packed" in caplog.text
    # layer 0's recurrent mixer (kept as `self_attn`): Qwen3-Next's and Qwen3.5's input projections are views;
    # the Mamba2 output projections are stored tensors
    mixer = {"qwen3_next": "in_proj_qkvz", "qwen3_5": "in_proj", "qwen3_5_moe": "in_proj",
             "granitemoehybrid": "out_proj", "nemotron_h": "out_proj", "falcon_h1": "mamba.out_proj"}[family]
    assert any(n.endswith("layers.0.self_attn." + mixer) for n in packed), sorted(packed)
    _near_tie_or_same(served, dequantized, tol=0.15)


def test_an_older_qwen3_next_file_with_ssm_in_reads_the_same(model_factory, gguf_dir):
    """Older converters kept in_proj_qkvz whole (ssm_in, the checkpoint's row order; llama.cpp still reads it): the
    same tensor as the newer files' attn_qkv + attn_gate give, the only tensor the two layouts differ in."""
    from shoal.engine.execution.gguf_model import GGUFWeightSource, gguf_config
    from shoal.engine.execution.weights import WeightSource

    hf = model_factory("qwen3_next", **FAMILIES["qwen3_next"])
    old, new = (write_hybrid_gguf(hf, gguf_dir / f"qwen3_next-{kind}.gguf", legacy_ssm_in=kind == "ssm_in")
                for kind in ("ssm_in", "attn_qkv"))
    old_src, new_src = GGUFWeightSource(old, gguf_config(old)), GGUFWeightSource(new, gguf_config(new))
    assert "model.layers.0.linear_attn.in_proj_qkvz.weight" in old_src._tensors  # stored, not a view
    for layer in range(3):
        name = f"model.layers.{layer}.linear_attn.in_proj_qkvz.weight"
        want = WeightSource(hf).load(name)
        torch.testing.assert_close(old_src.load(name), want, rtol=0, atol=0)
        torch.testing.assert_close(new_src.load(name), want, rtol=0, atol=0)


@pytest.mark.parametrize("family,dropped", [
    ("qwen3_next", "blk.0.attn_gate.weight"),  # half of in_proj_qkvz
    ("qwen3_next", "blk.3.attn_k.weight"),
    ("qwen3_5", "blk.1.ssm_a"),
    ("granitemoehybrid", "blk.0.ffn_up_exps.weight"),  # half of the fused expert input
    ("nemotron_h", "blk.4.ssm_conv1d.weight"),
    ("nemotron_h", "nemotron_h.ssm.state_size"),
    ("granitemoehybrid", "granitehybrid.attention.head_count_kv"),
    ("falcon_h1", "blk.1.ffn_norm"),  # llama.cpp's name has no .weight
])
def test_a_hybrid_gguf_missing_a_tensor_or_key_is_refused_naming_it(model_factory, gguf_dir, family, dropped):
    hf = model_factory(family, **FAMILIES[family])
    path = write_hybrid_gguf(hf, gguf_dir / f"{family}-without-{dropped}.gguf", drop={dropped})
    what = "tensor" if dropped.startswith("blk.") else "GGUF metadata"
    with pytest.raises(WeightError, match=rf"{what} '?{dropped.replace('.', '[.]')}'? is missing"):
        LLM(model=str(path), **OPTIONS)
