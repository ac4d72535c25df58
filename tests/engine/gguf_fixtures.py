"""Tiny GGUF files written with the `gguf` package from a tiny random Hugging Face model.

Weights of the types gguf-py can quantize (F32, F16, BF16, Q8_0, Q4_0, Q4_1) are the model's own weights,
quantized round-to-nearest. gguf-py has no quantizer for the K types (Q4_K, Q5_K, Q6_K), so those tensors are
blocks of seeded random quants with sane scales laid out byte for byte as llama.cpp's block structs: the
oracle (transformers' own GGUF loader) reads the very same bytes, so the comparison stays exact.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

# K-quant block layouts (bytes per 256 weights) and where the fp16 scale fields sit:
# Q4_K: d, dmin (f16) | 12 B packed 6-bit scales/mins | 128 B 4-bit quants
# Q5_K: d, dmin (f16) | 12 B scales/mins | 32 B high bits | 128 B low 4 bits
# Q6_K: 128 B low 4 bits | 64 B high 2 bits | 16 int8 scales | d (f16)
_K_SCALES = {"Q4_K": (3e-4, 3e-4 * 7.5), "Q5_K": (1.5e-4, 1.5e-4 * 15.5), "Q6_K": (7.5e-5, None)}


def _random_k_blocks(rows: int, cols: int, qtype, rng: np.random.Generator) -> np.ndarray:
    from gguf import GGML_QUANT_SIZES

    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    d, dmin = _K_SCALES[qtype.name]
    if qtype.name == "Q6_K":
        raw[..., 208:210] = np.frombuffer(np.float16(d).tobytes(), dtype=np.uint8)
    else:
        raw[..., 0:2] = np.frombuffer(np.float16(d).tobytes(), dtype=np.uint8)
        raw[..., 2:4] = np.frombuffer(np.float16(dmin).tobytes(), dtype=np.uint8)
    return raw.reshape(rows, -1)


def _permute_qk(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter layout for Llama q/k rows (the inverse of what loaders undo)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model_dir: str | Path, out: str | Path, weight_type: str = "F32", embed_type: str | None = None,
               seed: int = 0, name: str = "tiny") -> Path:
    """Convert the tiny HF model in `model_dir` (llama, qwen2, qwen3, mixtral, qwen2_moe, qwen3_moe, gemma2, gemma3
    or phi3) into a GGUF file laid out as llama.cpp's converter does; 2-D weights and expert stacks get `weight_type`
    (the token embedding `embed_type`, default the same), norms stay F32. Mixtral is written as llama.cpp does:
    architecture llama with an expert count, q/k permuted, experts stacked per layer; Qwen MoE as qwen2moe/qwen3moe
    with stacked experts and the shared expert's [1, H] gate as [H] (every layer must be sparse: mlp_only_layers=None)."""
    import gguf
    import torch
    from safetensors.torch import load_file
    from gguf import GGMLQuantizationType as QT

    model_dir, out = Path(model_dir), Path(out)
    cfg = json.loads((model_dir / "config.json").read_text())
    arch = {"gemma3_text": "gemma3", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}.get(cfg["model_type"],
                                                                                         cfg["model_type"])
    experts = cfg.get("num_local_experts", 0) if arch == "mixtral" else 0
    if experts:
        arch = "llama"
    qwen_moe = arch in ("qwen2moe", "qwen3moe")
    if qwen_moe:
        assert not cfg.get("mlp_only_layers") and cfg.get("decoder_sparse_step", 1) == 1, "llama.cpp: all sparse"
        experts = cfg.get("num_experts") or cfg["num_local_experts"]
    tensors = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        tensors.update({k: v.to(torch.float32).numpy() for k, v in load_file(str(f)).items()})
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads

    w = gguf.GGUFWriter(str(out), arch)
    w.add_name(name)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    rope = cfg.get("rope_parameters") or {}
    rope = rope.get("full_attention", rope)  # Gemma 3: the global layers' base (local layers use 10000)
    w.add_rope_freq_base(float(cfg.get("rope_theta") or rope.get("rope_theta", 1e4)))
    partial = cfg.get("partial_rotary_factor") or rope.get("partial_rotary_factor") or 1.0  # Phi-3
    w.add_rope_dimension_count(int(head_dim * partial))
    w.add_vocab_size(cfg["vocab_size"])
    _add_family_metadata(w, arch, cfg, head_dim)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        if qwen_moe:
            w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
            if cfg.get("shared_expert_intermediate_size"):
                w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
        projs = (("mlp.experts.{e}.gate_proj", "ffn_gate_exps"), ("mlp.experts.{e}.up_proj", "ffn_up_exps"),
                 ("mlp.experts.{e}.down_proj", "ffn_down_exps")) if qwen_moe else (
                 ("block_sparse_moe.experts.{e}.w1", "ffn_gate_exps"), ("block_sparse_moe.experts.{e}.w3", "ffn_up_exps"),
                 ("block_sparse_moe.experts.{e}.w2", "ffn_down_exps"))
        for proj, stack in projs:
            for layer_idx in range(cfg["num_hidden_layers"]):
                names = [f"model.layers.{layer_idx}.{proj.format(e=e)}.weight" for e in range(experts)]
                tensors[f"blk.{layer_idx}.{stack}.weight"] = np.stack([tensors.pop(n) for n in names])
    for name in [n for n in tensors if n.endswith("mlp.shared_expert_gate.weight")]:
        tensors[name] = tensors[name].reshape(-1)  # llama.cpp's ffn_gate_inp_shexp is [H]
    _add_tokenizer(w, model_dir, cfg)

    rng = np.random.default_rng(seed)
    gg = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    layer = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
             "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
             "block_sparse_moe.gate": "ffn_gate_inp", "mlp.gate": "ffn_gate_inp",
             "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
             "mlp.shared_expert.down_proj": "ffn_down_shexp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp"}
    layer.update(_FAMILY_LAYER_NAMES.get(arch, {}))
    if arch == "phi3" and "long_factor" in (cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}):
        rope = cfg.get("rope_parameters") or cfg["rope_scaling"]
        w.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], dtype=np.float32))
    for hf_name, arr in tensors.items():
        stem, kind = hf_name.rsplit(".", 1)
        if stem.startswith("blk."):  # already a GGUF name (stacked experts)
            g = stem
        elif stem in gg:
            g = gg[stem]
        else:
            parts = stem.split(".")
            g = f"blk.{parts[2]}.{layer['.'.join(parts[3:])]}"
        if arch == "llama" and kind == "weight" and g.endswith(("attn_q", "attn_k")):
            arr = _permute_qk(arr, heads if g.endswith("attn_q") else kv_heads)
        if arch in ("gemma2", "gemma3") and hf_name.endswith("norm.weight"):
            arr = arr + 1.0  # llama.cpp's Gemma norm multiplies by the stored weight: it stores 1 + w
        qname = embed_type if (embed_type and g == "token_embd") else weight_type
        qtype = QT[qname] if arr.ndim >= 2 and not g.endswith("ffn_gate_inp") else QT.F32  # llama.cpp: routers F32
        _add_tensor(w, f"{g}.{kind}", arr, qtype, rng)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


_FAMILY_LAYER_NAMES = {
    "gemma2": {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
               "post_feedforward_layernorm": "post_ffw_norm"},
    "gemma3": {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
               "post_feedforward_layernorm": "post_ffw_norm", "self_attn.q_norm": "attn_q_norm",
               "self_attn.k_norm": "attn_k_norm"},
    "phi3": {"self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"},
}


def _add_family_metadata(w, arch: str, cfg: dict, head_dim: int) -> None:
    """What llama.cpp's converter writes for Gemma 2/3 and Phi-3 beyond the Llama-shaped keys."""
    import gguf

    if cfg.get("sliding_window"):
        w.add_sliding_window(cfg["sliding_window"])
    if arch in ("gemma2", "gemma3"):
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if cfg.get(key):
                getattr(w, f"add_{key}")(cfg[key])
    if arch == "gemma3":
        rope = cfg.get("rope_parameters") or {}
        full = rope.get("full_attention") or {}
        if full.get("rope_type", "default") != "default":
            w.add_rope_scaling_type(gguf.RopeScalingType(full["rope_type"]))
            w.add_rope_scaling_factor(float(full["factor"]))
    if arch == "phi3":
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        if "original_max_position_embeddings" in rope or "original_max_position_embeddings" in cfg:
            w.add_rope_scaling_orig_ctx_len(rope.get("original_max_position_embeddings")
                                            or cfg["original_max_position_embeddings"])


def _add_tensor(w, name: str, arr: np.ndarray, qtype, rng) -> None:
    from gguf import GGMLQuantizationType as QT
    from gguf import quants

    if qtype == QT.F32:
        w.add_tensor(name, np.ascontiguousarray(arr, dtype=np.float32))
    elif qtype == QT.F16:
        w.add_tensor(name, arr.astype(np.float16))
    elif qtype.name in _K_SCALES and arr.ndim == 3:  # a stack of experts: random blocks per expert
        w.add_tensor(name, np.stack([_random_k_blocks(a.shape[0], a.shape[1], qtype, rng) for a in arr]),
                     raw_dtype=qtype)
    elif qtype.name in _K_SCALES:
        w.add_tensor(name, _random_k_blocks(arr.shape[0], arr.shape[1], qtype, rng), raw_dtype=qtype)
    else:
        w.add_tensor(name, quants.quantize(arr, qtype), raw_dtype=qtype)


def _add_tokenizer(w, model_dir: Path, cfg: dict) -> None:
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {a["content"] for a in tok.get("added_tokens", []) if a.get("special")}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in special else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(cfg.get("bos_token_id", 1))
    w.add_eos_token_id(cfg.get("eos_token_id", 0))
    w.add_pad_token_id(cfg.get("pad_token_id", 0))
    w.add_add_bos_token(False)
    tc = model_dir / "tokenizer_config.json"
    template = json.loads(tc.read_text()).get("chat_template") if tc.exists() else None
    if template is None and (model_dir / "chat_template.jinja").exists():
        template = (model_dir / "chat_template.jinja").read_text()
    if template:
        w.add_chat_template(template)


def write_mla_gguf(model_dir: str | Path, out: str | Path, weight_type: str = "F32", seed: int = 0,
                   split_kv_b: bool = True, drop: set[str] = frozenset()) -> Path:
    """A tiny DeepSeek V2/V3 checkpoint as llama.cpp's converter writes it (architecture deepseek2): MLA as
    multi-query attention over the latent (head_count_kv 1, key_length kv_lora + rope, the per-head sizes as the
    *_mla keys), kv_b_proj split into attn_k_b (each head's key rows, transposed) and attn_v_b (split_kv_b=False:
    one attn_kv_b, as older files have it), experts stacked per layer, the router's correction bias as exp_probs_b,
    the leading dense layers as a count, the router's scoring as expert_gating_func and YaRN's mscale_all_dim as
    0.1 x the log multiplier. Tensors named in `drop` are left out (a damaged file)."""
    import gguf
    import torch
    from safetensors.torch import load_file
    from gguf import GGMLQuantizationType as QT

    model_dir, out = Path(model_dir), Path(out)
    cfg = json.loads((model_dir / "config.json").read_text())
    assert cfg["model_type"] in ("deepseek_v2", "deepseek_v3"), cfg["model_type"]
    tensors = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        tensors.update({k: v.to(torch.float32).numpy() for k, v in load_file(str(f)).items()})
    heads, kv_lora, rope_dim = cfg["num_attention_heads"], cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
    nope, v_dim, layers = cfg["qk_nope_head_dim"], cfg["v_head_dim"], cfg["num_hidden_layers"]

    w = gguf.GGUFWriter(str(out), "deepseek2")
    w.add_name("tiny-deepseek")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(layers)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    rope = cfg.get("rope_parameters") or {}
    w.add_rope_freq_base(float(rope.get("rope_theta", 1e4)))
    w.add_rope_dimension_count(rope_dim)
    if rope.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(float(rope["factor"]))
        w.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
        w.add_rope_scaling_yarn_log_mul(0.1 * float(rope["mscale_all_dim"]))
    w.add_vocab_size(cfg["vocab_size"])
    w.add_leading_dense_block_count(cfg["first_k_dense_replace"])
    if cfg.get("q_lora_rank"):
        w.add_q_lora_rank(cfg["q_lora_rank"])
    w.add_kv_lora_rank(kv_lora)
    w.add_key_length(kv_lora + rope_dim)
    w.add_value_length(kv_lora)
    w.add_key_length_mla(nope + rope_dim)
    w.add_value_length_mla(v_dim)
    w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    w.add_expert_count(cfg["n_routed_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_expert_shared_count(cfg["n_shared_experts"])
    w.add_expert_weights_scale(cfg["routed_scaling_factor"])
    if cfg.get("norm_topk_prob"):
        w.add_expert_weights_norm(True)
    v3 = cfg["model_type"] == "deepseek_v3"
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if v3 else gguf.ExpertGatingFuncType.SOFTMAX)
    if v3 or cfg.get("topk_method") == "group_limited_greedy":
        w.add_expert_group_count(cfg["n_group"])
        w.add_expert_group_used_count(cfg["topk_group"])
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    _add_tokenizer(w, model_dir, cfg)

    for layer_idx in range(cfg["first_k_dense_replace"], layers):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            names = [f"model.layers.{layer_idx}.mlp.experts.{e}.{proj}.weight" for e in range(cfg["n_routed_experts"])]
            tensors[f"blk.{layer_idx}.ffn_{proj[:-5]}_exps.weight"] = np.stack([tensors.pop(n) for n in names])
    layer = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.q_a_proj": "attn_q_a", "self_attn.q_a_layernorm": "attn_q_a_norm",
             "self_attn.q_b_proj": "attn_q_b", "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
             "self_attn.kv_a_layernorm": "attn_kv_a_norm", "self_attn.kv_b_proj": "attn_kv_b",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp", "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
             "mlp.shared_experts.up_proj": "ffn_up_shexp", "mlp.shared_experts.down_proj": "ffn_down_shexp"}
    gg = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    rng = np.random.default_rng(seed)
    for hf_name, arr in tensors.items():
        if hf_name.startswith("blk."):
            g_name = hf_name
        elif hf_name.endswith("mlp.gate.e_score_correction_bias"):
            g_name = f"blk.{hf_name.split('.')[2]}.exp_probs_b.bias"
        else:
            stem, kind = hf_name.rsplit(".", 1)
            parts = stem.split(".")
            g_name = f"{gg[stem]}.{kind}" if stem in gg else f"blk.{parts[2]}.{layer['.'.join(parts[3:])]}.{kind}"
        if split_kv_b and g_name.endswith("attn_kv_b.weight"):
            kv_b = arr.reshape(heads, nope + v_dim, kv_lora)
            blk = g_name.rsplit(".", 2)[0]
            k_b, v_b = np.ascontiguousarray(kv_b[:, :nope].transpose(0, 2, 1)), np.ascontiguousarray(kv_b[:, nope:])
            for part, data in (("attn_k_b", k_b), ("attn_v_b", v_b)):
                if f"{blk}.{part}.weight" not in drop:
                    _add_tensor(w, f"{blk}.{part}.weight", data, _fallback(QT[weight_type], data), rng)
            continue
        if g_name in drop:
            continue
        qtype = QT[weight_type] if arr.ndim >= 2 and "ffn_gate_inp" not in g_name else QT.F32  # routers F32
        _add_tensor(w, g_name, arr, _fallback(qtype, arr), rng)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _fallback(qtype, arr: np.ndarray):
    """F16 for a tensor whose rows are no whole number of `qtype`'s blocks (llama.cpp's quantize falls back too)."""
    from gguf import GGML_QUANT_SIZES
    from gguf import GGMLQuantizationType as QT

    return qtype if arr.shape[-1] % GGML_QUANT_SIZES[qtype][0] == 0 else QT.F16


# ---- the hybrid families (recurrent layers next to attention), as llama.cpp's convert_hf_to_gguf.py writes them

_HYBRID_ARCHES = {"qwen3_next": "qwen3next", "qwen3_5": "qwen35", "qwen3_5_text": "qwen35",
                  "qwen3_5_moe_text": "qwen35moe", "granitemoehybrid": "granitehybrid", "nemotron_h": "nemotron_h",
                  "falcon_h1": "falcon-h1"}
_ATTENTION, _MAMBA = ("attention", "full_attention"), ("mamba", "linear_attention")


def _tile_v_heads(arr: np.ndarray, axis: int, nk: int, r: int, size: int) -> np.ndarray:
    """The converter's grouped -> tiled reorder of Qwen3.5's value heads along `axis` (nk key heads, r value heads
    each, `size` entries per head): [k0v0, k0v1, k1v0, k1v1] -> [k0v0, k1v0, k0v1, k1v1]."""
    arr = np.moveaxis(arr, axis, 0)
    rest = arr.shape[1:]
    arr = arr.reshape(nk, r, size, *rest).swapaxes(0, 1).reshape(nk * r * size, *rest)
    return np.ascontiguousarray(np.moveaxis(arr, 0, axis))


def write_hybrid_gguf(model_dir: str | Path, out: str | Path, weight_type: str = "F32", seed: int = 0,
                      drop: set[str] = frozenset(), legacy_ssm_in: bool = False) -> Path:
    """A tiny Qwen3-Next, Qwen3.5 (dense or MoE), Granite 4 (GraniteMoeHybrid), Nemotron-H or Falcon-H1 checkpoint
    laid out as llama.cpp's converter lays it out (architectures qwen3next, qwen35, qwen35moe, granitehybrid,
    nemotron_h, falcon-h1):
    its tensor names (gguf-py's TensorNameMap, as the converter maps them), metadata and transforms:

    - every family: A_log stored as -exp(A_log), conv1d weights squeezed to [channels, kernel], dt_bias renamed to
      ssm_dt.bias; the ssm.* keys (conv_kernel, state_size, group_count, time_step_rank, inner_size).
    - qwen3next / qwen35*: every norm but the DeltaNet's gated one stored as 1 + w; full_attention_interval; the
      rotary dims as rope.dimension_count. Qwen3-Next's in_proj_qkvz regrouped into attn_qkv (all q | all k | all v)
      and attn_gate (all z); in_proj_ba kept (ssm_ba). Qwen3.5's value heads reordered grouped -> tiled in
      in_proj_qkv's v rows, in_proj_z, in_proj_b/a, A_log, dt_bias, the conv's v channels and out_proj's columns.
      Experts stacked per layer; the shared expert's [1, H] gate as [H].
    - granitehybrid / nemotron_h (the Mamba2 path): A and D as [heads, 1], the gated norm as [groups, inner /
      groups]; attention layers' q/k rows permuted as for Llama; attention layers marked by a per-layer
      head_count_kv (0 elsewhere), Nemotron-H's MLP blocks by a per-layer feed_forward_length; Granite's
      multipliers as attention.scale, embedding_scale, residual_scale, logit_scale, no RoPE (rope.scaling.finetuned
      false, context_length 2^20); its fused expert input_linear split into ffn_gate_exps / ffn_up_exps and
      shared_mlp.input_linear into ffn_gate_shexp / ffn_up_shexp.
    - falcon-h1: the Mamba2 path's transforms, no q/k permutation, and every muP multiplier multiplied into the
      weight it scales (_fold_falcon_multipliers); the pre-MLP norm named ffn_norm without a suffix.

    transformers 5 saves layer types as linear_attention / full_attention where the converter looks for mamba /
    attention (and Nemotron-H's string pattern "M-*"); both spellings mean the same layers here. 2-D weights get
    `weight_type` (F16 where a row is no whole number of its blocks, as llama.cpp's quantize falls back), the
    recurrent, conv, norm and router tensors stay F32. Tensors and metadata keys named in `drop` are left
    out (a damaged file). `legacy_ssm_in`: Qwen3-Next's in_proj_qkvz kept whole as ssm_in, as older converters
    wrote it."""
    import gguf
    import torch
    from safetensors.torch import load_file
    from gguf import GGMLQuantizationType as QT

    model_dir, out = Path(model_dir), Path(out)
    root = json.loads((model_dir / "config.json").read_text())
    cfg = {**root.get("text_config", {}), **{k: v for k, v in root.items() if k != "text_config"}} \
        if "text_config" in root else root
    if "text_config" in root:
        cfg["model_type"] = root["text_config"]["model_type"]
    arch = _HYBRID_ARCHES[cfg["model_type"]]
    tensors = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        for k, v in load_file(str(f)).items():
            if k.startswith(("model.visual.", "mtp.")):
                continue  # the vision tower goes to the mmproj file; MTP layers are skipped
            tensors[k.replace("model.language_model.", "model.")] = v.to(torch.float32).numpy()
    n, h = cfg["num_hidden_layers"] if "num_hidden_layers" in cfg else len(cfg["layers_block_type"]), cfg["hidden_size"]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    gdn, falcon = arch in ("qwen3next", "qwen35", "qwen35moe"), arch == "falcon-h1"
    w = gguf.GGUFWriter(str(out), arch)
    w.add_name("tiny-hybrid")
    w.add_embedding_length(h)
    w.add_block_count(n)
    w.add_head_count(heads)
    w.add_layer_norm_rms_eps(cfg.get("rms_norm_eps") or cfg["layer_norm_epsilon"])
    rope = cfg.get("rope_parameters") or {}
    w.add_rope_freq_base(float(rope.get("rope_theta", cfg.get("rope_theta", 1e4))))
    w.add_vocab_size(cfg["vocab_size"])
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    if gdn:
        nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
        dk, dv, r = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"], nv // nk
        head_dim = cfg.get("head_dim") or h // heads
        w.add_context_length(cfg["max_position_embeddings"])
        w.add_head_count_kv(kv_heads)
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        if cfg.get("intermediate_size"):
            w.add_feed_forward_length(cfg["intermediate_size"])
        w.add_ssm_conv_kernel(cfg["linear_conv_kernel_dim"])
        w.add_ssm_state_size(dk)
        w.add_ssm_group_count(nk)
        w.add_ssm_time_step_rank(nv)
        w.add_ssm_inner_size(dv * nv)
        types = cfg["layer_types"]
        interval = next(i + 1 for i, t in enumerate(types) if t == "full_attention")
        assert all((t == "full_attention") == ((i + 1) % interval == 0) for i, t in enumerate(types))
        w.add_full_attention_interval(interval)
        w.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor",
                                                           cfg.get("partial_rotary_factor", 0.25))))
        if cfg.get("num_experts"):
            w.add_expert_count(cfg["num_experts"])
            w.add_expert_used_count(cfg["num_experts_per_tok"])
            w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
            w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
            assert not cfg.get("mlp_only_layers") and cfg.get("decoder_sparse_step", 1) == 1, "llama.cpp: all sparse"
    elif falcon:  # Mamba2Model's keys, then FalconH1Model's overrides
        inner, groups, d_state = cfg["mamba_d_ssm"], cfg["mamba_n_groups"], cfg["mamba_d_state"]
        ssm = attn = list(range(n))
        w.add_context_length(cfg["max_position_embeddings"])
        w.add_feed_forward_length(cfg["intermediate_size"])
        w.add_head_count_kv(kv_heads)
        w.add_key_length(cfg.get("head_dim") or h // heads)
        w.add_value_length(cfg.get("head_dim") or h // heads)
        w.add_ssm_conv_kernel(cfg["mamba_d_conv"])
        w.add_ssm_inner_size(inner)
        w.add_ssm_state_size(d_state)
        w.add_ssm_time_step_rank(inner // cfg["mamba_d_head"])
        w.add_ssm_group_count(groups)
        assert not cfg.get("mamba_norm_before_gate"), "llama.cpp's Mamba2 layer gates, then normalises"
    else:
        nemotron = arch == "nemotron_h"
        types = cfg["layers_block_type"] if nemotron else cfg["layer_types"]
        attn = [i for i, t in enumerate(types) if t in _ATTENTION]
        ssm = [i for i, t in enumerate(types) if t in _MAMBA]
        mlp = [i for i, t in enumerate(types) if t == "mlp"]
        pre = "" if nemotron else "mamba_"
        m_heads = cfg["mamba_num_heads"] if nemotron else cfg["mamba_n_heads"]
        d_head = cfg["mamba_head_dim"] if nemotron else cfg["mamba_d_head"]
        groups = cfg["n_groups"] if nemotron else cfg["mamba_n_groups"]
        inner = m_heads * d_head if nemotron else cfg["mamba_expand"] * h
        w.add_context_length(2 ** 20)  # no RoPE
        w.add_head_count_kv([kv_heads if i in attn else 0 for i in range(n)])
        w.add_rope_dimension_count(h // heads)
        w.add_rope_scaling_finetuned(False)
        w.add_ssm_conv_kernel(cfg["conv_kernel"] if nemotron else cfg["mamba_d_conv"])
        w.add_ssm_state_size(cfg["ssm_state_size"] if nemotron else cfg[pre + "d_state"])
        w.add_ssm_group_count(groups)
        w.add_ssm_inner_size(inner)
        w.add_ssm_time_step_rank(m_heads)
        if nemotron:
            w.add_key_length(cfg["head_dim"])
            w.add_value_length(cfg["head_dim"])
            w.add_feed_forward_length([cfg["intermediate_size"] if i in mlp else 0 for i in range(n)])
        else:
            w.add_feed_forward_length(cfg["intermediate_size"])
            w.add_attention_scale(cfg["attention_multiplier"])
            w.add_embedding_scale(cfg["embedding_multiplier"])
            w.add_residual_scale(cfg["residual_multiplier"])
            w.add_logit_scale(cfg["logits_scaling"])
            if cfg.get("num_local_experts"):
                w.add_expert_count(cfg["num_local_experts"])
                w.add_expert_used_count(cfg["num_experts_per_tok"])
            w.add_expert_shared_feed_forward_length(cfg["shared_intermediate_size"])
        inter, shared, experts = cfg.get("intermediate_size"), cfg.get("shared_intermediate_size"), \
            cfg.get("num_local_experts", 0)
        for i in range(n):  # Granite's fused MLP inputs, split as GraniteMoeModel.modify_tensors splits them
            p = f"model.layers.{i}."
            if p + "block_sparse_moe.input_linear.weight" in tensors:
                gate, up = np.split(tensors.pop(p + "block_sparse_moe.input_linear.weight"), [inter], axis=-2)
                tensors[f"blk.{i}.ffn_gate_exps.weight"], tensors[f"blk.{i}.ffn_up_exps.weight"] = gate, up
            if p + "shared_mlp.input_linear.weight" in tensors:
                gate, up = np.split(tensors.pop(p + "shared_mlp.input_linear.weight"), [shared], axis=-2)
                sx = "_shexp" if experts else ""
                tensors[f"blk.{i}.ffn_gate{sx}.weight"], tensors[f"blk.{i}.ffn_up{sx}.weight"] = gate, up
                if not experts:
                    tensors[f"blk.{i}.ffn_down.weight"] = tensors.pop(p + "shared_mlp.output_linear.weight")
    experts = cfg.get("num_experts") if gdn else 0
    for i in range(n if experts else 0):  # Qwen MoE: one stack per projection
        for proj in ("gate_proj", "up_proj", "down_proj"):
            names = [f"model.layers.{i}.mlp.experts.{e}.{proj}.weight" for e in range(experts)]
            tensors[f"blk.{i}.ffn_{proj[:-5]}_exps.weight"] = np.stack([tensors.pop(x) for x in names])
    _add_tokenizer(w, model_dir, cfg)

    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH[{"qwen3next": "QWEN3NEXT", "qwen35": "QWEN35",
                                                         "qwen35moe": "QWEN35MOE", "granitehybrid": "GRANITE_HYBRID",
                                                         "nemotron_h": "NEMOTRON_H", "falcon-h1": "FALCON_H1"}[arch]], n)
    rng = np.random.default_rng(seed)
    for name, arr in tensors.items():
        if name.endswith(".dt_bias"):
            name = name[:-len(".dt_bias")] + ".dt_proj.bias"
        if name.startswith("blk."):
            g = name
        else:
            g = name_map.get_name(name, try_suffixes=(".weight", ".bias"))
            assert g is not None, f"gguf-py has no GGUF name for {name}"
        layer = int(name.split(".")[2]) if ".layers." in name else None
        if gdn:
            if "linear_attn." in name and arch != "qwen3next" and r > 1:  # Qwen3.5: value heads grouped -> tiled
                if ".in_proj_qkv." in name:
                    arr = np.concatenate([arr[:2 * nk * dk], _tile_v_heads(arr[2 * nk * dk:], 0, nk, r, dv)])
                elif ".in_proj_z." in name:
                    arr = _tile_v_heads(arr, 0, nk, r, dv)
                elif ".in_proj_b." in name or ".in_proj_a." in name or name.endswith((".A_log", ".dt_proj.bias")):
                    arr = _tile_v_heads(arr, 0, nk, r, 1)
                elif ".conv1d." in name:
                    arr = np.concatenate([arr[:2 * nk * dk], _tile_v_heads(arr[2 * nk * dk:], 0, nk, r, dv)])
                elif ".out_proj." in name:
                    arr = _tile_v_heads(arr, 1, nk, r, dv)
            if name.endswith(".A_log"):
                arr = -np.exp(arr)
            elif ".conv1d." in name:
                arr = arr.squeeze()
            elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
                arr = arr + 1.0
            if name.endswith("in_proj_qkvz.weight") and legacy_ssm_in:
                g = f"blk.{layer}.ssm_in.weight"
            elif name.endswith("in_proj_qkvz.weight"):  # [q, k, v, z] per key head -> attn_qkv (q|k|v) + attn_gate
                per = arr.reshape(nk, 2 * dk + 2 * r * dv, h)
                q, k, v, z = np.split(per, [dk, 2 * dk, 2 * dk + r * dv], axis=1)
                for gname, part in ((f"blk.{layer}.attn_qkv.weight",
                                     np.concatenate([x.reshape(-1, h) for x in (q, k, v)])),
                                    (f"blk.{layer}.attn_gate.weight", z.reshape(-1, h))):
                    if gname not in drop:
                        _add_tensor(w, gname, part, _fallback(QT[weight_type], part), rng)
                continue
            if name.endswith("mlp.shared_expert_gate.weight"):
                arr = arr.reshape(-1)
        else:
            if layer in ssm:
                if ".conv1d.weight" in name:
                    arr = arr.squeeze()
                elif name.endswith((".A_log", ".D")):
                    arr = arr.reshape(-1, 1)
                elif name.endswith("mixer.norm.weight") or name.endswith("mamba.norm.weight"):
                    arr = arr.reshape(groups, -1)
                if name.endswith(".A_log"):
                    arr = -np.exp(arr)
            if falcon:
                arr = _fold_falcon_multipliers(arr, name, cfg)
            elif layer in attn and name.endswith(("q_proj.weight", "q_proj.bias")):
                arr = _permute_qk(arr, heads)
            elif layer in attn and name.endswith(("k_proj.weight", "k_proj.bias")):
                arr = _permute_qk(arr, kv_heads)
        if g in drop:
            continue
        stem = g.split(".")[2] if g.startswith("blk.") else g.split(".")[0]
        f32 = arr.ndim < 2 or stem in ("ffn_gate_inp", "ssm_conv1d", "ssm_norm", "ssm_a", "ssm_d")
        qtype = QT.F32 if f32 else QT[weight_type]
        _add_tensor(w, g, arr, _fallback(qtype, arr), rng)
    for shard in w.kv_data:  # metadata keys named in `drop` are left out too
        for key in drop:
            shard.pop(key, None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _fold_falcon_multipliers(arr: np.ndarray, name: str, cfg: dict) -> np.ndarray:
    """FalconH1Model.modify_tensors: every muP multiplier multiplied into the weight it scales (in its order of
    checks: a name matching several takes the first)."""
    if "down_proj" in name:
        return arr * cfg["mlp_multipliers"][1]
    if "gate_proj" in name:
        return arr * cfg["mlp_multipliers"][0]
    if "k_proj" in name:
        return arr * cfg["key_multiplier"] * cfg["attention_in_multiplier"]
    if "q_proj" in name or "v_proj" in name:
        return arr * cfg["attention_in_multiplier"]
    if "o_proj" in name:
        return arr * cfg["attention_out_multiplier"]
    if "out_proj" in name:
        return arr * cfg["ssm_out_multiplier"]
    if "in_proj" in name:
        arr = arr * cfg["ssm_in_multiplier"]
        inner, gs = cfg["mamba_d_ssm"], cfg["mamba_n_groups"] * cfg["mamba_d_state"]
        bounds = [0, inner, 2 * inner, 2 * inner + gs, 2 * inner + 2 * gs, arr.shape[0]]
        for m, a, b in zip(cfg["ssm_multipliers"], bounds, bounds[1:]):  # z, x, B, C, dt rows
            arr[a:b] *= m
        return arr
    if "lm_head" in name:
        return arr * cfg["lm_head_multiplier"]
    if "embed_tokens" in name:
        return arr * cfg["embedding_multiplier"]
    return arr
