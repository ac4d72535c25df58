"""Serve a single GGUF file (llama.cpp's format): config, tokenizer and weights all come from the file.

- `is_gguf(path)`: a file that starts with the GGUF magic.
- `gguf_config(path)`: a transformers config built from the GGUF metadata (llama, mistral, qwen2, qwen3, gemma2,
  gemma3, phi3, qwen2moe, qwen3moe and deepseek2 families, and Mixtral, which llama.cpp files as llama with
  `llama.expert_count`; the hybrids qwen3next, qwen35, qwen35moe, granitehybrid and nemotron_h through
  gguf_hybrid.py, which also says where each of their tensors is and how llama.cpp's converter changed it).
- `load_gguf_tokenizer(path)`: transformers' GGUF tokenizer conversion (vocabulary, merges, special tokens and the
  chat template stored in the metadata).
- `GGUFWeightSource`: the `WeightSource` interface over the file's tensors, under Hugging Face names. Every tensor
  type the `gguf` package can dequantize loads (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K, ...); quantized
  tensors of the types the packed kernels run (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K; quantization/gguf.py: C++ on CPU,
  Triton on CUDA) stay in their blocks (`load_packed`); other types, and every type under SHOAL_GGUF_DEQUANTIZE=1,
  are dequantized on load into the compute dtype (the log says which). A tensor-parallel
  rank reads only the rows it owns (GGUF quantizes each row on its own, so a row range is a byte range).

llama.cpp's converter permutes the rows of Llama's q/k projections (interleaved rotary halves); they are put
back in Hugging Face order per head, which is why a rank's q/k slice must start on a head boundary. It stores
Gemma's RMSNorm weights as 1 + w (its norm multiplies by the weight alone), so 1 is taken off again here, and keeps
Phi-3's fused attn_qkv and gate/up (as ffn_up) tensors fused, as the Hugging Face checkpoint does. What GGUF
metadata does not carry follows llama.cpp: Gemma scales queries by head_dim^-0.5 (query_pre_attn_scalar =
head_dim), Gemma 3's local layers use RoPE base 10000 and every sliding_window_pattern-th layer (default 6) is
global.

Mixture-of-experts files (Mixtral, filed as llama; qwen2moe; qwen3moe) stack each layer's experts in one tensor per
projection (`ffn_gate_exps`, `ffn_up_exps`, `ffn_down_exps`: [experts, rows, cols]); each expert is exposed under its
Hugging Face name and reads only its own rows of the stack (quantization blocks never span experts), so a rank loads
its experts' bytes and nothing more, packed or dequantized like any other weight. llama.cpp's Qwen MoE files make
every layer sparse and renormalise the top-k weights for Qwen3-MoE only, and so does the config built here.

deepseek2 (DeepSeek V2/V3, Kimi K2) keeps the checkpoint's rows as they are (their rotary dims stay interleaved, as
rope_interleave says), but writes MLA as multi-query attention over the latent (`_mla_config` reads the per-head
sizes back) and splits kv_b_proj in two for its absorbed attention, which the source joins again (`_joined_kv_b`).
"""

from __future__ import annotations

import functools
import logging
import os
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from shoal.engine.execution.gguf_hybrid import HYBRID_ARCHITECTURES, hybrid_config, hybrid_layout
from shoal.engine.execution.gguf_reader import field_value as _field
from shoal.engine.execution.weights import WeightError

logger = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"

# general.architecture -> (transformers model_type, architectures entry, q/k rows permuted by llama.cpp)
ARCHITECTURES = {
    "llama": ("llama", "LlamaForCausalLM", True),
    "mistral": ("mistral", "MistralForCausalLM", True),
    "qwen2": ("qwen2", "Qwen2ForCausalLM", False),
    "qwen3": ("qwen3", "Qwen3ForCausalLM", False),
    "gemma2": ("gemma2", "Gemma2ForCausalLM", False),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM", False),
    "phi3": ("phi3", "Phi3ForCausalLM", False),
    "qwen2moe": ("qwen2_moe", "Qwen2MoeForCausalLM", False),
    "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM", False),
    # DeepSeek V2/V3, Kimi K2 (MLA): V3 when the experts are gated by sigmoid, else V2 (see _architecture)
    "deepseek2": ("deepseek_v3", "DeepseekV3ForCausalLM", False),
    # recurrent + attention hybrids (Qwen3-Next, Qwen3.5, Granite 4, Nemotron-H): gguf_hybrid.py
    **HYBRID_ARCHITECTURES,
}
_GEMMA = ("gemma2", "gemma3")

# GGUF tensor names -> Hugging Face names (the llama family; other families need their own table).
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
}
# Mixtral's router and stacked experts (the Hugging Face names of expert e: experts.{e}.w1/w3/w2).
_MOE_NAMES = {"ffn_gate_inp": "block_sparse_moe.gate"}
_EXPERT_STACKS = {"ffn_gate_exps": "block_sparse_moe.experts.{e}.w1", "ffn_up_exps": "block_sparse_moe.experts.{e}.w3",
                  "ffn_down_exps": "block_sparse_moe.experts.{e}.w2"}
# Qwen2-MoE / Qwen3-MoE: router, experts and (Qwen2-MoE) the shared expert and its gate, under `mlp.`.
_QWEN_MOE_NAMES = {"ffn_gate_inp": "mlp.gate", "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
                   "ffn_up_shexp": "mlp.shared_expert.up_proj", "ffn_down_shexp": "mlp.shared_expert.down_proj",
                   "ffn_gate_inp_shexp": "mlp.shared_expert_gate"}
_QWEN_EXPERT_STACKS = {"ffn_gate_exps": "mlp.experts.{e}.gate_proj", "ffn_up_exps": "mlp.experts.{e}.up_proj",
                       "ffn_down_exps": "mlp.experts.{e}.down_proj"}

# Families whose layers name tensors differently (the rest of _LAYER_NAMES applies to them too).
_ARCH_LAYER_NAMES = {
    "gemma2": {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm"},
    "gemma3": {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm", "attn_q_norm": "self_attn.q_norm",
               "attn_k_norm": "self_attn.k_norm"},
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    "qwen2moe": _QWEN_MOE_NAMES,
    "qwen3moe": _QWEN_MOE_NAMES,
    "deepseek2": {"attn_q_a": "self_attn.q_a_proj", "attn_q_a_norm": "self_attn.q_a_layernorm",
                  "attn_q_b": "self_attn.q_b_proj", "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
                  "attn_kv_a_norm": "self_attn.kv_a_layernorm", "attn_kv_b": "self_attn.kv_b_proj",
                  "ffn_gate_inp": "mlp.gate", "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
                  "ffn_up_shexp": "mlp.shared_experts.up_proj", "ffn_down_shexp": "mlp.shared_experts.down_proj"},
}
# Architectures whose config transformers' GGUF loader cannot read (AutoTokenizer reads the config first): their
# tokenizer is built from the file's vocabulary by the generic fast tokenizer, as transformers' converter does.
_TOKENIZER_ONLY = {"deepseek2", *HYBRID_ARCHITECTURES}
# llama.cpp's gating function ids (deepseek2.expert_gating_func)
_GATING_SOFTMAX, _GATING_SIGMOID = 1, 2


def is_gguf(path: str | os.PathLike) -> bool:
    p = Path(path)
    if not p.is_file():
        return False
    try:
        with open(p, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


@functools.lru_cache(maxsize=4)
def _open(path: str, mtime_ns: int):
    """One parsed file per process: config, tokenizer check and weights all read it."""
    from shoal.engine.execution.gguf_reader import GGUFFile, GGUFFormatError

    try:
        return GGUFFile(path)
    except GGUFFormatError as e:
        raise WeightError(f"{path}: not a readable GGUF file ({e})") from None


def open_gguf(path: str | os.PathLike):
    p = Path(path).resolve()
    return _open(str(p), p.stat().st_mtime_ns)


def _architecture(reader, path) -> tuple[str, str, str, bool]:
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        supported = ", ".join(sorted(ARCHITECTURES))
        raise WeightError(f"{path}: GGUF architecture {arch!r} is not supported (supported: {supported})")
    model_type, hf_arch, permuted = ARCHITECTURES[arch]
    name = str(_field(reader, "general.name", "") or "").lower()
    if arch == "llama" and int(_field(reader, "llama.expert_count", 0) or 0) > 0:  # Mixtral is filed under llama
        model_type, hf_arch = "mixtral", "MixtralForCausalLM"
    elif arch == "llama" and "mistral" in name:  # llama.cpp files Mistral under llama
        model_type, hf_arch = "mistral", "MistralForCausalLM"
    elif arch == "deepseek2" and int(_field(reader, "deepseek2.expert_gating_func", _GATING_SOFTMAX)) != \
            _GATING_SIGMOID:  # V2's softmax router (llama.cpp's default when the key is absent)
        model_type, hf_arch = "deepseek_v2", "DeepseekV2ForCausalLM"
    return arch, model_type, hf_arch, permuted


def gguf_config(path: str | os.PathLike):
    """A transformers PretrainedConfig from the GGUF metadata."""
    reader = open_gguf(path)
    arch, model_type, hf_arch, _ = _architecture(reader, path)
    names = {t.name for t in reader.tensors}
    if "token_embd.weight" not in names:
        raise WeightError(f"{path}: tensor token_embd.weight is missing")
    if arch in HYBRID_ARCHITECTURES:
        embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
        kw = hybrid_config(reader, arch, path, names)
        kw["vocab_size"] = int(_field(reader, f"{arch}.vocab_size") or int(embd.shape[-1]))
        return _finish_config(reader, model_type, kw)

    def need(key: str):
        value = _field(reader, f"{arch}.{key}")
        if value is None:
            raise WeightError(f"{path}: GGUF metadata {arch}.{key} is missing")
        return value

    heads = int(need("attention.head_count"))
    hidden = int(need("embedding_length"))
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    vocab = _field(reader, f"{arch}.vocab_size") or int(embd.shape[-1])
    kw = dict(
        architectures=[hf_arch],
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_hidden_layers=int(need("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        max_position_embeddings=int(_field(reader, f"{arch}.context_length", 2048)),
        rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        tie_word_embeddings="output.weight" not in names,
        hidden_act="silu",
    )
    head_dim = _field(reader, f"{arch}.attention.key_length") or _field(reader, f"{arch}.rope.dimension_count")
    if head_dim and model_type not in ("qwen2", "qwen2_moe"):
        kw["head_dim"] = int(head_dim)
    if model_type == "llama":
        kw["attention_bias"] = "blk.0.attn_q.bias" in names
    if model_type in ("mistral", "mixtral"):
        kw["sliding_window"] = None
    if model_type == "mixtral":
        kw["num_local_experts"] = int(need("expert_count"))
        kw["num_experts_per_tok"] = int(need("expert_used_count"))
    if model_type in ("qwen2_moe", "qwen3_moe"):  # llama.cpp: every layer sparse; top-k renormalised in Qwen3 only
        kw.update(num_experts=int(need("expert_count")), num_experts_per_tok=int(need("expert_used_count")),
                  moe_intermediate_size=int(need("expert_feed_forward_length")), decoder_sparse_step=1,
                  mlp_only_layers=[], norm_topk_prob=model_type == "qwen3_moe")
        if model_type == "qwen2_moe":
            kw["shared_expert_intermediate_size"] = int(_field(reader, f"{arch}.expert_shared_feed_forward_length", 0)
                                                        or 0)
            kw["qkv_bias"] = "blk.0.attn_q.bias" in names
    if model_type in ("qwen3", "qwen3_moe"):
        kw["attention_bias"] = "blk.0.attn_q.bias" in names
    if arch in _GEMMA or arch == "phi3":
        kw.update(_family_config(reader, arch, kw, path))
    if arch == "deepseek2":
        kw.update(_mla_config(reader, arch, kw, path))
    return _finish_config(reader, model_type, kw)


def _finish_config(reader, model_type: str, kw: dict):
    """The special token ids, then the config itself."""
    from transformers import AutoConfig

    for key, attr in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                      ("padding_token_id", "pad_token_id")):
        value = _field(reader, f"tokenizer.ggml.{key}")
        if value is not None:
            kw[attr] = int(value)
    config = AutoConfig.for_model(model_type, **kw)
    config.dtype = torch.bfloat16  # GGUF weights are mostly quantized: compute in bf16 unless --dtype says
    return config


def _family_config(reader, arch: str, kw: dict, path) -> dict:
    """The config entries of Gemma 2/3 and Phi-3 beyond the Llama-shaped ones gguf_config fills in."""
    def get(key: str, default=None):
        return _field(reader, f"{arch}.{key}", default)

    # Not rope.dimension_count: Phi-3 may rotate only part of each head.
    head_dim = int(get("attention.key_length") or kw["hidden_size"] // kw["num_attention_heads"])
    window = get("attention.sliding_window")
    out: dict = {"head_dim": head_dim, "sliding_window": int(window) if window else None}
    if arch in _GEMMA:
        out.update(query_pre_attn_scalar=head_dim, hidden_activation="gelu_pytorch_tanh",
                   hidden_act="gelu_pytorch_tanh")
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            value = get(key)
            out[key] = float(value) if value else None
        if arch == "gemma3":
            pattern = get("attention.sliding_window_pattern", 6)
            n = kw["num_hidden_layers"]
            if isinstance(pattern, (list, tuple)):  # one flag per layer: True = sliding
                types = ["sliding_attention" if bool(p) else "full_attention" for p in pattern]
            else:
                types = ["full_attention" if (i + 1) % int(pattern) == 0 else "sliding_attention" for i in range(n)]
            out.update(layer_types=types, rope_local_base_freq=float(get("rope.freq_base_swa", 10000.0)))
            scaling, factor = get("rope.scaling.type"), get("rope.scaling.factor")
            if scaling and scaling != "none" and factor:
                out["rope_scaling"] = {"rope_type": str(scaling), "factor": float(factor)}
        return out
    # phi3: partial rotary from the rotary dimension count; LongRoPE factors are tensors of the file.
    rot = get("rope.dimension_count")
    if rot and int(rot) != head_dim:
        out["partial_rotary_factor"] = int(rot) / head_dim
    names = {t.name: t for t in reader.tensors}
    long_t, short_t = names.get("rope_factors_long.weight"), names.get("rope_factors_short.weight")
    if long_t is not None and short_t is not None:
        original = get("rope.scaling.original_context_length")
        if not original:
            raise WeightError(f"{path}: LongRoPE factors without {arch}.rope.scaling.original_context_length")
        out["original_max_position_embeddings"] = int(original)
        out["rope_scaling"] = {"rope_type": "longrope", "long_factor": [float(x) for x in long_t.data],
                               "short_factor": [float(x) for x in short_t.data]}
        attn_factor = get("rope.scaling.attn_factor")
        if attn_factor:
            out["rope_scaling"]["attention_factor"] = float(attn_factor)
        if "partial_rotary_factor" in out:  # transformers sizes the factors by the rotary dimension
            out["rope_scaling"]["partial_rotary_factor"] = out["partial_rotary_factor"]
    out["tie_word_embeddings"] = "output.weight" not in names
    return out


def _mla_config(reader, arch: str, kw: dict, path) -> dict:
    """DeepSeek V2/V3's config from llama.cpp's deepseek2 metadata. Its converter writes MLA as multi-query attention
    over the latent: head_count_kv 1, key_length kv_lora_rank + rope dims and value_length kv_lora_rank, the
    per-head sizes as key_length_mla / value_length_mla (older files: head_count_kv = heads and the per-head sizes
    as key_length / value_length); the leading dense layers as a count, and the router by its gating function."""
    def get(key: str, default=None):
        return _field(reader, f"{arch}.{key}", default)

    def need(key: str):
        value = get(key)
        if value is None:
            raise WeightError(f"{path}: GGUF metadata {arch}.{key} is missing")
        return value

    rope = int(need("rope.dimension_count"))
    kv_lora = int(need("attention.kv_lora_rank"))
    if get("attention.key_length_mla") is not None:
        qk_head, v_head = int(get("attention.key_length_mla")), int(need("attention.value_length_mla"))
    else:
        qk_head, v_head = int(need("attention.key_length")), int(need("attention.value_length"))
    if qk_head <= rope:
        raise WeightError(f"{path}: GGUF metadata gives a query/key head of {qk_head} values, no more than its "
                          f"{rope} rotary ones")
    q_lora = get("attention.q_lora_rank")
    out = dict(num_key_value_heads=kw["num_attention_heads"], kv_lora_rank=kv_lora, qk_rope_head_dim=rope,
               qk_nope_head_dim=qk_head - rope, v_head_dim=v_head, head_dim=rope,
               q_lora_rank=int(q_lora) if q_lora else None, rope_interleave=True,
               first_k_dense_replace=int(get("leading_dense_block_count", 0) or 0),
               n_routed_experts=int(need("expert_count")), num_experts_per_tok=int(need("expert_used_count")),
               moe_intermediate_size=int(need("expert_feed_forward_length")),
               n_shared_experts=int(get("expert_shared_count", 0) or 0),
               routed_scaling_factor=float(get("expert_weights_scale", 1.0) or 1.0),
               norm_topk_prob=bool(get("expert_weights_norm", False)),
               n_group=int(get("expert_group_count", 1) or 1), topk_group=int(get("expert_group_used_count", 1) or 1))
    if out["n_group"] > 1 and kw["architectures"] == ["DeepseekV2ForCausalLM"]:
        out["topk_method"] = "group_limited_greedy"
    params = {"rope_type": "default", "rope_theta": kw["rope_theta"]}
    if get("rope.scaling.type") == "yarn":
        # llama.cpp keeps 0.1 * mscale_all_dim as the YaRN log multiplier and takes mscale equal to it (as
        # DeepSeek's configs have it), so the attention factor is 1 and the softmax scale carries mscale^2.
        mscale = float(get("rope.scaling.yarn_log_multiplier", 0.0) or 0.0) / 0.1
        params.update(rope_type="yarn", factor=float(need("rope.scaling.factor")),
                      original_max_position_embeddings=int(need("rope.scaling.original_context_length")),
                      beta_fast=float(get("rope.scaling.yarn_beta_fast", 32.0)),
                      beta_slow=float(get("rope.scaling.yarn_beta_slow", 1.0)),
                      mscale=mscale, mscale_all_dim=mscale)
    out["rope_parameters"] = params
    return out


def _tokenizer_cache_dir() -> Path:
    from shoal.engine.tools.demo_model import cache_root

    return cache_root() / "gguf-tokenizers"


def load_gguf_tokenizer(path: str | os.PathLike, **kwargs):
    """The tokenizer (and chat template) stored in the GGUF metadata, through transformers' converter.

    The conversion (a second parse of the metadata inside transformers, then building the BPE) takes seconds, so
    its result is saved once under $SHOAL_CACHE/gguf-tokenizers/, keyed by the metadata's digest and the
    transformers version, and later starts (another replica on the cache volume, a restart) load that in a
    fraction of a second. A cache that cannot be written costs only the time."""
    import transformers
    from transformers import AutoTokenizer

    p = Path(path).resolve()
    reader = open_gguf(p)
    if "tokenizer.ggml.tokens" not in reader.fields:  # (not decoded: the cached path never needs the vocabulary)
        raise WeightError(f"{p}: the GGUF file has no tokenizer; pass --tokenizer DIR")
    cached = _tokenizer_cache_dir() / f"v2-{reader.metadata_digest()[:32]}-transformers-{transformers.__version__}"
    if (cached / "tokenizer.json").is_file():
        try:
            return AutoTokenizer.from_pretrained(str(cached), local_files_only=True, **kwargs)
        except Exception as e:  # noqa: BLE001 - a damaged entry: convert again below and replace it
            logger.warning("the cached tokenizer %s cannot be loaded (%s: %s); converting the GGUF's again",
                           cached, type(e).__name__, e)
    try:
        import gguf  # noqa: F401  (transformers' converter reads the vocabulary with it)
    except ImportError:
        raise WeightError(f"{p}: converting a GGUF file's tokenizer needs the 'gguf' package (pip install gguf)") \
            from None
    loader = AutoTokenizer
    if _field(reader, "general.architecture") in _TOKENIZER_ONLY:
        from transformers import PreTrainedTokenizerFast as loader
    tok = loader.from_pretrained(str(p.parent), gguf_file=p.name, local_files_only=True, **kwargs)
    _save_converted(tok, cached)
    return tok


def _save_converted(tok, cached: Path) -> None:
    import shutil
    import tempfile

    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=cached.parent))
    except OSError as e:
        logger.info("the converted GGUF tokenizer is not cached (%s); the next start converts it again", e)
        return
    try:
        tok.save_pretrained(str(tmp))
        why = _round_trip_differs(tok, tmp)
        if why:  # some conversions do not survive save_pretrained (a Gemma vocabulary loses its unk token)
            logger.info("the converted GGUF tokenizer is not cached: %s", why)
            return
        shutil.rmtree(cached, ignore_errors=True)
        os.replace(tmp, cached)  # whole or absent: a reader never sees a half-written entry
    except OSError as e:  # a full volume, or another replica renaming its copy into place first
        logger.info("the converted GGUF tokenizer is not cached (%s)", e)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


_PROBE = ["Hello world! The quick brown fox", "  two  spaces\nÜnïcödé 🐟 日本語\t", "<s></s><unk><|im_end|>x"]


def _round_trip_differs(tok, saved: Path) -> str | None:
    """Why the saved copy is not the same tokenizer (None when it is): loaded back and compared on its vocabulary,
    special tokens, chat template and the encodings of a few texts."""
    from transformers import AutoTokenizer

    try:
        back = AutoTokenizer.from_pretrained(str(saved), local_files_only=True)
        same = (len(back) == len(tok) and back.get_vocab() == tok.get_vocab()
                and back.all_special_tokens == tok.all_special_tokens
                and getattr(back, "chat_template", None) == getattr(tok, "chat_template", None)
                and all(back.encode(t) == tok.encode(t) for t in _PROBE)
                and all(back.decode(tok.encode(t)) == tok.decode(tok.encode(t)) for t in _PROBE))
    except Exception as e:  # noqa: BLE001 - whatever the reload raises, the copy is unusable
        return f"loading it back fails ({type(e).__name__}: {e})"
    return None if same else "loaded back, it tokenizes differently"


class GGUFWeightSource:
    """WeightSource over one GGUF file: Hugging Face tensor names, dequantized float32 slices, or (with
    `packed=True`, see load_packed) the Q8_0/Q4_0/Q4_1/Q4_K/Q6_K rows as stored, for the packed kernels."""

    def __init__(self, path: str | os.PathLike, hf_config, packed: bool = False):
        self.model_dir = Path(path)  # named like WeightSource's for error messages
        self.packed = packed
        reader = open_gguf(path)
        arch, _, _, self._permuted = _architecture(reader, path)
        self._layer_names = {**_LAYER_NAMES, **_ARCH_LAYER_NAMES.get(arch, {})}
        stacks = _QWEN_EXPERT_STACKS if arch in ("qwen2moe", "qwen3moe", "deepseek2", "qwen3next",
                                                 "qwen35moe") else _EXPERT_STACKS
        self._norm_offset = arch in _GEMMA  # llama.cpp stores Gemma's (1 + w) norm weights with the 1 added
        self._heads = {"self_attn.q_proj": hf_config.num_attention_heads,
                       "self_attn.k_proj": hf_config.num_key_value_heads,
                       "mixer.q_proj": hf_config.num_attention_heads,  # Nemotron-H's attention blocks
                       "mixer.k_proj": hf_config.num_key_value_heads}
        self._tensors = {}  # Hugging Face name -> GGUF tensor
        self._expert = {}  # Hugging Face name of one expert -> its index in the stacked GGUF tensor
        self._kv_b: dict[str, dict[str, object]] = {}  # MLA's kv_b_proj, split by llama.cpp: name -> {k, v}
        self._views = {}  # Hugging Face name -> gguf_hybrid.View (made from rows of stored tensors)
        self._shifted: set[str] = set()  # names whose stored values are 1 + w
        self._missing: dict[str, str] = {}  # Hugging Face name -> the GGUF tensor that should hold it
        if arch in HYBRID_ARCHITECTURES:
            self._hybrid(arch, hf_config, reader, stacks, path)
        for t in [] if arch in HYBRID_ARCHITECTURES else reader.tensors:
            stem = t.name.rpartition(".")[0].split(".")
            if arch == "deepseek2" and len(stem) == 3 and stem[0] == "blk":
                if stem[2] in ("attn_k_b", "attn_v_b"):
                    self._kv_b.setdefault(f"model.layers.{stem[1]}.self_attn.kv_b_proj.weight", {})[stem[2][5]] = t
                    continue
                if stem[2] == "exp_probs_b":  # the router's correction bias (llama.cpp files it as a bias)
                    self._tensors[f"model.layers.{stem[1]}.mlp.gate.e_score_correction_bias"] = t
                    continue
            if len(stem) == 3 and stem[0] == "blk" and stem[2] in stacks and t.name.endswith(".weight"):
                for e in range(int(t.shape[-1])):  # GGUF lists dimensions innermost first: experts last
                    name = f"model.layers.{stem[1]}.{stacks[stem[2]].format(e=e)}.weight"
                    self._tensors[name], self._expert[name] = t, e
                continue
            hf = self._hf_name(t.name)
            if hf is not None:
                self._tensors[hf] = t
        for name, parts in self._kv_b.items():
            if set(parts) != {"k", "v"}:
                raise WeightError(f"{self.model_dir}: {name!r} is split in two tensors (attn_k_b, attn_v_b) and "
                                  f"only one is in the file")
        self.used: set[str] = set()
        types = Counter(t.tensor_type.name for t in {id(t): t for t in self._tensors.values()}.values())
        quantized = sorted(k for k in types if k not in ("F32", "F16", "BF16"))
        from shoal.engine.execution.quantization.gguf import PACKED_TYPES

        kept = [k for k in quantized if packed and k in PACKED_TYPES]
        rest = [k for k in quantized if k not in kept]
        how = [f"{'/'.join(kept)} kept packed"] if kept else []
        if rest:
            how.append(f"{'/'.join(rest)} dequantized on load")
        logger.info("GGUF %s: tensor types %s; %s", self.model_dir.name,
                    ", ".join(f"{k} x{v}" for k, v in sorted(types.items())),
                    "; ".join(how) if how else "no quantized tensors")

    def _hybrid(self, arch: str, hf_config, reader, stacks: dict, path) -> None:
        """Names of a hybrid family's file (gguf_hybrid.py): the stored tensors, the views and the stacked experts."""
        by_name = {t.name: t for t in reader.tensors}
        layout = hybrid_layout(arch, hf_config, by_name, path)
        for hf, gg in layout.plain.items():
            if gg in by_name:
                self._tensors[hf] = by_name[gg]
            else:
                self._missing[hf] = gg
        self._views, self._shifted = layout.views, layout.shifted
        if arch not in ("qwen3next", "qwen35moe"):
            return
        for i in range(hf_config.num_hidden_layers):
            for stack, hf in stacks.items():
                t = by_name.get(f"blk.{i}.{stack}.weight")
                for e in range(hf_config.num_experts):
                    name = f"model.layers.{i}.{hf.format(e=e)}.weight"
                    if t is None:
                        self._missing[name] = f"blk.{i}.{stack}.weight"
                    else:
                        self._tensors[name], self._expert[name] = t, e

    def _hf_name(self, name: str) -> str | None:
        stem, _, kind = name.rpartition(".")
        if kind not in ("weight", "bias"):
            return None
        if stem in _GLOBAL_NAMES:
            return f"{_GLOBAL_NAMES[stem]}.{kind}"
        parts = stem.split(".")
        if len(parts) == 3 and parts[0] == "blk" and parts[2] in self._layer_names:
            return f"model.layers.{parts[1]}.{self._layer_names[parts[2]]}.{kind}"
        if len(parts) == 3 and parts[0] == "blk" and parts[2] in _MOE_NAMES:
            return f"model.layers.{parts[1]}.{_MOE_NAMES[parts[2]]}.{kind}"
        return None

    def names(self) -> set[str]:
        return set(self._tensors) | set(self._kv_b) | set(self._views)

    def has(self, name: str) -> bool:
        return name in self._tensors or name in self._kv_b or name in self._views

    def _joined_kv_b(self, name: str) -> torch.Tensor:
        """kv_b_proj [heads x (qk_nope + v), kv_lora] from llama.cpp's k_b [heads, kv_lora, qk_nope] (transposed
        for its absorbed attention) and v_b [heads, v, kv_lora]: each head's key rows, then its value rows."""
        from gguf import quants

        def full(t) -> torch.Tensor:
            w = quants.dequantize(np.ascontiguousarray(t.data), t.tensor_type)
            return torch.from_numpy(np.require(w, np.float32, ["C", "W"])).reshape(
                tuple(int(d) for d in reversed(t.shape)))

        self.used.add(name)
        k, v = full(self._kv_b[name]["k"]), full(self._kv_b[name]["v"])
        if k.dim() != 3 or v.dim() != 3 or k.shape[0] != v.shape[0] or k.shape[1] != v.shape[2]:
            raise WeightError(f"{self.model_dir}: {name!r}: attn_k_b {list(k.shape)} and attn_v_b {list(v.shape)} "
                              f"are not [heads, kv_lora, qk_nope] and [heads, v, kv_lora]")
        return torch.cat([k.transpose(1, 2), v], dim=1).reshape(-1, k.shape[1])

    def _tensor(self, name: str):
        if name in self._missing:
            raise WeightError(f"{self.model_dir}: tensor {self._missing[name]!r} is missing from the GGUF file (it "
                              f"holds {name})")
        if name not in self._tensors:
            raise WeightError(f"{self.model_dir}: tensor {name!r} is missing from the GGUF file")
        self.used.add(name)
        return self._tensors[name]

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self._kv_b:
            heads, _, nope = reversed(self._kv_b[name]["k"].shape)
            _, v, kv_lora = reversed(self._kv_b[name]["v"].shape)
            return int(heads) * (int(nope) + int(v)), int(kv_lora)
        if name in self._views:
            return tuple(self._views[name].shape)
        dims = tuple(int(d) for d in reversed(self._tensor(name).shape))  # GGUF lists dimensions innermost first
        if len(dims) == 1 and name.endswith("shared_expert_gate.weight"):  # llama.cpp keeps the [1, H] gate as [H]
            return 1, dims[0]
        return dims[1:] if name in self._expert else dims

    def load(self, name: str, expected_shape: tuple[int, ...] | None = None,
             dim: int | None = None, start: int = 0, length: int | None = None) -> torch.Tensor:
        from gguf import quants

        if name in self._kv_b:
            w = self._joined_kv_b(name)
            if expected_shape is not None and tuple(w.shape) != tuple(expected_shape):
                raise WeightError(f"{self.model_dir}: tensor {name!r} has shape {list(w.shape)} but the config "
                                  f"implies {list(expected_shape)}")
            return w if dim is None else w.narrow(dim, start, w.shape[dim] - start if length is None else length)
        if name in self._views:
            return self._load_view(name, expected_shape, dim, start, length)
        t = self._tensor(name)
        full = self.shape(name)
        if expected_shape is not None and full != tuple(expected_shape):
            raise WeightError(f"{self.model_dir}: tensor {name!r} has shape {list(full)} but the config implies "
                              f"{list(expected_shape)}")
        if dim is not None and length is None:
            length = full[dim] - start
        data = t.data[self._expert[name]] if name in self._expert else t.data  # one expert of a stack: its rows
        rows, cols = dim == 0 and len(full) == 2, dim == 1 and len(full) == 2
        if rows:  # a row range is a byte range: dequantize only this rank's rows
            data = data[start:start + length]
        elif cols:  # whole quantization blocks of every row, when the column range falls on block boundaries
            cols = self._column_bytes(data, t.tensor_type, start, length)
            if cols:
                data = data[:, cols[0]:cols[1]]
        try:
            w = quants.dequantize(np.ascontiguousarray(data), t.tensor_type)
        except NotImplementedError:
            raise WeightError(f"{self.model_dir}: tensor {name!r} has type {t.tensor_type.name}, which the gguf "
                              f"package cannot dequantize") from None
        w = torch.from_numpy(np.require(w, np.float32, ["C", "W"]))
        w = w.reshape(length, *full[1:]) if rows else w.reshape(full[0], length) if cols else w.reshape(full)
        proj = ".".join(name.split(".")[-3:-1])
        if self._permuted and proj in self._heads:
            w = self._unpermute(w, full[0] // self._heads[proj], name, start if rows else 0)
        if dim is not None and not rows and not cols:
            w = w.narrow(dim, start, length)
        if name in self._shifted or (self._norm_offset and name.endswith("norm.weight")):
            w = w - 1.0
        return w

    def _check_view(self, name: str, expected_shape) -> tuple[int, ...]:
        full = tuple(self._views[name].shape)
        if expected_shape is not None and full != tuple(expected_shape):
            raise WeightError(f"{self.model_dir}: tensor {name!r} has shape {list(full)} but the config implies "
                              f"{list(expected_shape)}")
        self.used.add(name)
        return full

    def _load_view(self, name: str, expected_shape, dim, start: int, length) -> torch.Tensor:
        view, full = self._views[name], self._check_view(name, expected_shape)
        if dim is not None and length is None:
            length = full[dim] - start
        if dim == 0:
            return view.rows(start, length)
        w = view.rows(0, full[0])
        return w if dim is None else w.narrow(dim, start, length)

    def _packed_view(self, name: str, expected_shape, dim, start: int, length):
        from shoal.engine.execution.quantization.gguf import GGUFPacked

        view, full = self._views[name], self._check_view(name, expected_shape)
        if view.packed is None or len(full) != 2:
            return None
        if dim is not None and length is None:
            length = full[dim] - start
        got = view.packed(start, length) if dim == 0 else view.packed(0, full[0])
        if got is None:
            return None
        data, qtype, cols = got
        if dim == 1:
            from gguf import GGMLQuantizationType

            span = self._column_bytes(data, GGMLQuantizationType[qtype], start, length)
            if span is None:
                return None  # the range cuts through blocks: dequantized instead
            data, cols = data[:, span[0]:span[1]], length
        return GGUFPacked(torch.from_numpy(np.array(data, order="C")), qtype, cols)

    def load_packed(self, name: str, expected_shape: tuple[int, ...] | None = None,
                    dim: int | None = None, start: int = 0, length: int | None = None):
        """The slice `load` would return, as a GGUFPacked (the stored blocks, no dequantization) when this source
        is packed and the tensor is a 2-D Q8_0/Q4_0/Q4_1/Q4_K/Q6_K weight (one expert of a stack included); None
        otherwise (use `load`). A row range is a byte range; a column range must start and end on block
        boundaries."""
        from shoal.engine.execution.quantization.gguf import PACKED_TYPES, GGUFPacked

        if self.packed and name in self._views:
            return self._packed_view(name, expected_shape, dim, start, length)
        if not self.packed or name not in self._tensors:
            return None
        t = self._tensors[name]
        full = self.shape(name)
        if len(full) != 2 or t.tensor_type.name not in PACKED_TYPES:
            return None
        self.used.add(name)
        if expected_shape is not None and full != tuple(expected_shape):
            raise WeightError(f"{self.model_dir}: tensor {name!r} has shape {list(full)} but the config implies "
                              f"{list(expected_shape)}")
        if dim is not None and length is None:
            length = full[dim] - start
        data = np.asarray(t.data[self._expert[name]] if name in self._expert else t.data).reshape(full[0], -1)
        cols = full[1]
        if dim == 0:
            data = data[start:start + length]
        elif dim == 1:
            span = self._column_bytes(data, t.tensor_type, start, length)
            if span is None:
                block = PACKED_TYPES[t.tensor_type.name][1]
                raise WeightError(
                    f"{self.model_dir}: {name!r} ({t.tensor_type.name}) would be split at columns [{start}, "
                    f"{start + length}), inside its blocks of {block}: a packed GGUF weight splits between "
                    f"ranks only at multiples of {block} input features (choose another tensor-parallel size, "
                    f"or set SHOAL_GGUF_DEQUANTIZE=1)")
            data, cols = data[:, span[0]:span[1]], length
        w = torch.from_numpy(np.array(data, order="C"))  # a copy: the file's mapping is read-only
        proj = ".".join(name.split(".")[-3:-1])
        if self._permuted and proj in self._heads:  # whole byte rows move, exactly like float rows
            w = self._unpermute(w, full[0] // self._heads[proj], name, start if dim == 0 else 0)
        return GGUFPacked(w, t.tensor_type.name, cols)

    @staticmethod
    def _column_bytes(data: np.ndarray, qtype, start: int, length: int) -> tuple[int, int] | None:
        """The [first, last) positions in a row of `data` that hold columns [start, start+length), or None when
        the range cuts through a quantization block."""
        from gguf import GGML_QUANT_SIZES

        block, size = GGML_QUANT_SIZES[qtype]
        if data.dtype != np.uint8:  # F32/F16 arrays are indexed by element
            block, size = 1, 1
        if start % block or length % block:
            return None
        return start // block * size, (start + length) // block * size

    def _unpermute(self, w: torch.Tensor, head_dim: int, name: str, start: int) -> torch.Tensor:
        """Undo llama.cpp's per-head row interleave of q/k (rows [h, d/2, 2] back to [h, 2, d/2])."""
        if start % head_dim or w.shape[0] % head_dim:
            raise WeightError(f"{self.model_dir}: {name!r} can only be split on attention-head boundaries")
        heads = w.shape[0] // head_dim
        rest = tuple(w.shape[1:])
        return w.reshape(heads, head_dim // 2, 2, *rest).transpose(1, 2).reshape(w.shape).contiguous()

    def close(self) -> None:
        """Loading is over: unmap the file. Every weight is a copy by now (packed blocks too), and the mapping's
        pages, all touched while reading, would otherwise stay resident next to them: twice the file's size."""
        self._tensors.clear()
        self._expert.clear()
        _open.cache_clear()
