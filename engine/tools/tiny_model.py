"""Tiny random-weight models made offline with transformers.

They prove the machinery (loading, paging, batching, serving), not language quality. Tests build one per
architecture; `shoal-engine serve` with no --model builds the default one once into a local cache directory.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

# A small corpus for the byte-level BPE: English prose plus some multi-byte text so that characters split
# across tokens are exercised by every model made here.
_CORPUS = [
    "The quick brown fox jumps over the lazy dog. A paged cache keeps keys and values in fixed-size blocks.",
    "Continuous batching lets requests join and leave the running batch at every step of the engine loop.",
    "Kubernetes runs pods on nodes; an operator reconciles custom resources into deployments and services.",
    "Hello world! How are you today? I am fine, thank you. What is the capital of France? Paris is lovely.",
    "Once upon a time there was a little shoal of fish that swam together in the warm and quiet sea.",
    "def add(a, b):\n    return a + b\n\nfor i in range(10):\n    print(i * i)\n",
    "Ünïcödé text: naïve café, über straße, 東京は日本の首都です。 Emoji: 🐟🐠🐡 ✓ → ∑ π ≈ 3.14159",
    "numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000 and punctuation: ; : , . ! ? ' \" ( ) [ ] { } < > / \\ | @ # $ % ^ & *",
]

CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

SPECIAL_TOKENS = ["<|endoftext|>", "<|bos|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]


def make_tokenizer(path: str | os.PathLike, vocab_size: int = 384, chat_template: bool = True):
    """Train a byte-level BPE on the embedded corpus and save it as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        bos_token="<|bos|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS[2:],
    )
    if chat_template:
        fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))
    return fast


_MOE_CONFIGS = {
    "mixtral": ("MixtralConfig", dict(intermediate_size=96, num_local_experts=4)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(intermediate_size=112, moe_intermediate_size=48, num_experts=4,
                                         shared_expert_intermediate_size=80, mlp_only_layers=[1],
                                         norm_topk_prob=False)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(intermediate_size=112, moe_intermediate_size=48, num_experts=4,
                                         decoder_sparse_step=1, mlp_only_layers=[2], norm_topk_prob=True,
                                         head_dim=24)),
    "olmoe": ("OlmoeConfig", dict(intermediate_size=48, num_experts=4, norm_topk_prob=False, clip_qkv=4.0)),
    # Sliding (8 tokens) and full layers alternating, attention sinks, 4 biased experts of width 32 (MXFP4 blocks
    # need multiples of 32), a SwiGLU limit low enough to clamp, YaRN scaling 8x over an original 64 positions.
    "gpt_oss": ("GptOssConfig", dict(intermediate_size=32, num_local_experts=4, head_dim=16, sliding_window=8,
                                     swiglu_limit=2.0, max_position_embeddings=512,
                                     rope_parameters={"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0,
                                                      "beta_slow": 1.0, "truncate": False, "rope_theta": 150000.0,
                                                      "original_max_position_embeddings": 64})),
}
MOE_ARCHS = list(_MOE_CONFIGS)

# Latent attention (MLA) with a q low-rank projection (V3) or without (V2-Lite), decoupled RoPE dims scaled by YaRN
# with mscale_all_dim (the softmax scale changes too), v_head_dim != qk head dim; layer 0 dense, then 8 experts in 4
# groups (2 kept), top-2, plus one shared expert.
_MLA_COMMON = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
                   num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
                   kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12, n_group=4, topk_group=2,
                   num_experts_per_tok=2, first_k_dense_replace=1, max_position_embeddings=512, rms_norm_eps=1e-5,
                   tie_word_embeddings=False,
                   rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
                                    "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707,
                                    "rope_theta": 10000.0})
_MLA_CONFIGS = {
    "deepseek_v3": ("DeepseekV3Config", dict(q_lora_rank=48, routed_scaling_factor=2.5, norm_topk_prob=True)),
    "deepseek_v2": ("DeepseekV2Config", dict(q_lora_rank=None, routed_scaling_factor=1.5,
                                             topk_method="group_limited_greedy")),
    # GLM-4.7-Flash: V3's layers, the dense ones named by mlp_layer_types (here not only the first).
    "glm4_moe_lite": ("Glm4MoeLiteConfig", dict(q_lora_rank=48, routed_scaling_factor=1.8, norm_topk_prob=True,
                                                mlp_layer_types=["sparse", "dense", "sparse"])),
}
MLA_ARCHS = list(_MLA_CONFIGS)


def _vision_language(config_cls):
    """A config class taking the decoder's fields and wrapping them as a vision-language model's text_config, with a
    one-block vision tower."""
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                  num_position_embeddings=16)
    return lambda **text: config_cls(text_config=text, vision_config=vision,
                                     tie_word_embeddings=text["tie_word_embeddings"])


def _config(arch: str, vocab_size: int, **overrides):
    import transformers as tf

    common = dict(vocab_size=vocab_size, bos_token_id=1, eos_token_id=0, pad_token_id=0)
    if arch in ("llama", "mistral", "qwen2"):
        cls = {"llama": tf.LlamaConfig, "mistral": tf.MistralConfig, "qwen2": tf.Qwen2Config}[arch]
        kw = dict(
            hidden_size=96, intermediate_size=160, num_hidden_layers=3, num_attention_heads=6,
            num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=arch == "qwen2",
            rms_norm_eps=1e-5,
        )
        if arch == "mistral":
            kw["sliding_window"] = None
    elif arch in _MOE_CONFIGS or arch == "qwen3":
        # Several layers, grouped-query attention, 4 experts with top-2 routing; each family's own switches set
        # so that every code path runs (dense layers between sparse ones, shared expert, q/k norms, clipping).
        base = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                    max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=False)
        if arch == "qwen3":
            cls, kw = tf.Qwen3Config, dict(base, intermediate_size=112, head_dim=24)
        else:
            name, extra = _MOE_CONFIGS[arch]
            cls, kw = getattr(tf, name), dict(base, num_experts_per_tok=2, **extra)
    elif arch == "qwen3_next":
        # Gated DeltaNet layers 3:1 with gated full attention (partial rotary), 4 experts top-2 with a shared
        # expert, one dense layer; 2 key heads feeding 4 value heads (grouped value attention).
        cls = tf.Qwen3NextConfig
        kw = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  intermediate_size=96, moe_intermediate_size=48, shared_expert_intermediate_size=40, num_experts=4,
                  num_experts_per_tok=2, mlp_only_layers=[1], linear_num_key_heads=2, linear_num_value_heads=4,
                  linear_key_head_dim=16, linear_value_head_dim=24, linear_conv_kernel_dim=4,
                  max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False)
    elif arch in ("qwen3_5", "qwen3_5_moe"):
        # Qwen3-Next's layout with the Gated DeltaNet projections apart: dense (as the releases ship it, a
        # vision-language checkpoint around the decoder, the tower tiny; the LM head tied, as in the small releases)
        # or 4 experts top-2 with a shared expert.
        kw = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=24,
                  linear_conv_kernel_dim=4, max_position_embeddings=512, rms_norm_eps=1e-6,
                  tie_word_embeddings=arch == "qwen3_5")
        if arch == "qwen3_5":
            cls, kw = _vision_language(tf.Qwen3_5Config), dict(kw, intermediate_size=96)
        else:
            cls, kw = tf.Qwen3_5MoeTextConfig, dict(kw, moe_intermediate_size=48, shared_expert_intermediate_size=40,
                                                    num_experts=4, num_experts_per_tok=2)
    elif arch == "granitemoehybrid":
        # Granite 4's layout scaled down: Mamba2 layers around one attention layer without RoPE (the releases'
        # "nope"), 8 Mamba heads in 2 groups, 4 experts top-2 plus the shared MLP, every multiplier away from 1.
        cls = tf.GraniteMoeHybridConfig
        kw = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=48, shared_intermediate_size=40, num_local_experts=4, num_experts_per_tok=2,
                  layer_types=["mamba", "mamba", "attention", "mamba"], mamba_n_heads=8, mamba_d_head=16,
                  mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=16,
                  embedding_multiplier=2.0, attention_multiplier=0.2, residual_multiplier=0.5, logits_scaling=3.0,
                  position_embedding_type="nope", max_position_embeddings=512, rms_norm_eps=1e-6,
                  tie_word_embeddings=False)
    elif arch == "nemotron_h":
        # Nemotron-H's single-mixer blocks scaled down: Mamba2, squared-ReLU MLP and one attention block (no RoPE),
        # 8 Mamba heads in 2 groups.
        cls = tf.NemotronHConfig
        kw = dict(hidden_size=64, layers_block_type=["mamba", "mlp", "attention", "mlp", "mamba", "mlp"],
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96, mamba_num_heads=8,
                  mamba_head_dim=16, n_groups=2, ssm_state_size=16, conv_kernel=4, expand=2, chunk_size=16,
                  max_position_embeddings=512, tie_word_embeddings=False)
    elif arch == "falcon_h1":
        # Falcon-H1's parallel attention + Mamba2 layers scaled down (6 Mamba heads of 16 = mamba_d_ssm 96, 2 groups,
        # the norm before the gate), every muP multiplier away from 1.
        cls = tf.FalconH1Config
        kw = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=96, mamba_d_ssm=96, mamba_n_heads=6, mamba_d_head=16, mamba_n_groups=2,
                  mamba_d_state=16, mamba_d_conv=4, mamba_chunk_size=16, mamba_rms_norm=True,
                  lm_head_multiplier=0.5, embedding_multiplier=2.0, mlp_multipliers=[0.8, 1.2], key_multiplier=0.7,
                  attention_in_multiplier=1.1, attention_out_multiplier=0.9, ssm_in_multiplier=0.8,
                  ssm_out_multiplier=1.2, ssm_multipliers=[0.5, 1.5, 0.9, 1.1, 1.3], max_position_embeddings=512,
                  rms_norm_eps=1e-5, tie_word_embeddings=False)
    elif arch == "jamba":
        # Jamba's layout scaled down: Mamba (v1) layers around one attention layer (no positions) in every four;
        # experts top-2, unrenormalised, on every other layer (two Mamba layers), dense MLPs between; a low-rank
        # time step (dt_rank 8 of hidden 64) and the inner RMSNorms on it, B and C.
        cls = tf.JambaConfig
        kw = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=96, num_experts=4, num_experts_per_tok=2, attn_layer_period=4,
                  attn_layer_offset=2, expert_layer_period=2, expert_layer_offset=1, mamba_d_state=16,
                  mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=8, mamba_conv_bias=True, mamba_proj_bias=False,
                  max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False)
    elif arch in _MLA_CONFIGS:
        name, extra = _MLA_CONFIGS[arch]
        cls, kw = getattr(tf, name), dict(_MLA_COMMON, **extra)
        if "mlp_layer_types" in extra:
            del kw["first_k_dense_replace"]
    elif arch == "gemma2":
        # Alternating sliding (8 tokens) and global layers, both soft-caps low enough to bite on random weights.
        cls = tf.Gemma2Config
        kw = dict(
            hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, query_pre_attn_scalar=24, sliding_window=8, attn_logit_softcapping=5.0,
            final_logit_softcapping=10.0, max_position_embeddings=512, rms_norm_eps=1e-6,
        )
    elif arch == "gemma3":
        # Local layers (window 8, rope_local_base_freq) around one global layer with linear RoPE scaling.
        cls = tf.Gemma3TextConfig
        kw = dict(
            hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, query_pre_attn_scalar=24, sliding_window=8, max_position_embeddings=512, rms_norm_eps=1e-6,
            layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
            rope_theta=100000.0, rope_local_base_freq=10000.0, rope_scaling={"rope_type": "linear", "factor": 2.0},
        )
    elif arch == "phi3":
        # Every layer windowed (10 tokens), half of each head rotated, LongRoPE within its original length (short
        # factors, attention factor sqrt(1 + ln 2 / ln 512) from max/original = 2).
        cls = tf.Phi3Config
        kw = dict(
            hidden_size=96, intermediate_size=160, num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2,
            sliding_window=10, partial_rotary_factor=0.5, max_position_embeddings=1024,
            original_max_position_embeddings=512, tie_word_embeddings=False, rms_norm_eps=1e-5,
            rope_scaling={"type": "longrope", "short_factor": [1.0, 1.3, 1.7, 2.5],
                          "long_factor": [1.5, 2.5, 4.0, 7.0]},
        )
    elif arch == "bloom":
        cls = tf.BloomConfig
        kw = dict(hidden_size=80, n_layer=3, n_head=5)
    elif arch == "gpt2":
        cls = tf.GPT2Config
        kw = dict(n_embd=72, n_layer=3, n_head=4, n_positions=512)
    else:
        raise ValueError(f"no tiny config for architecture {arch!r}")
    kw.update(common)
    kw.update(overrides)
    return cls(**kw)


def make_model(
    path: str | os.PathLike,
    arch: str = "llama",
    seed: int = 0,
    dtype: str = "float32",
    max_shard_size: str | None = None,
    tokenizer: bool = True,
    **config_overrides,
) -> Path:
    """Write a random-weight Hugging Face model directory (config, safetensors, tokenizer) to `path`."""
    import torch
    import transformers as tf

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    vocab = config_overrides.pop("vocab_size", 384)
    config = _config(arch, vocab, **config_overrides)
    torch.manual_seed(seed)
    auto = tf.AutoModelForImageTextToText if hasattr(config, "vision_config") else tf.AutoModelForCausalLM
    model = auto.from_config(config, dtype=getattr(torch, dtype))
    _widen_random_init(model)
    kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(path), safe_serialization=True, **kw)
    if tokenizer:
        make_tokenizer(path, vocab_size=min(vocab, 384))
    return path


def _widen_random_init(model) -> None:
    """Random init in transformers is small; widen it so greedy decoding is not a constant token."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.15)
            elif "bias" in name:
                p.normal_(0.0, 0.02)
            if (".mamba." in name or ".mixer." in name) and name.endswith((".D", ".dt_bias")):  # per-head values differ
                p.normal_(1.0 if name.endswith(".D") else 0.0, 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek V3's routing bias: nonzero, so it matters
                b.normal_(0.0, 0.1)


def make_bert_model(path: str | os.PathLike, seed: int = 0, sentence_transformers: bool = True,
                    **config_overrides) -> Path:
    """A random-weight BertModel directory shaped like sentence-transformers' all-MiniLM (smaller): WordPiece
    tokenizer adding [CLS]/[SEP], and with `sentence_transformers` its modules.json (Transformer -> mean Pooling ->
    Normalize) and 1_Pooling/config.json."""
    import json

    import torch
    import transformers as tf

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    words = sorted({w for text in _CORPUS for w in text.lower().split()})
    chars = sorted({ch for text in _CORPUS for ch in text.lower() if not ch.isspace()})
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + chars + ["##" + ch for ch in chars] + words
    vocab = list(dict.fromkeys(vocab))
    (path / "vocab.txt").write_text("\n".join(vocab) + "\n")
    tf.BertTokenizerFast(vocab={t: i for i, t in enumerate(vocab)}, do_lower_case=True).save_pretrained(str(path))
    kw = dict(vocab_size=len(vocab), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
              intermediate_size=128, max_position_embeddings=128, type_vocab_size=2, hidden_act="gelu")
    kw.update(config_overrides)
    config = tf.BertConfig(**kw)
    torch.manual_seed(seed)
    model = tf.BertModel(config, add_pooling_layer=False)
    _widen_random_init(model)
    model.save_pretrained(str(path), safe_serialization=True)
    if sentence_transformers:
        (path / "modules.json").write_text(json.dumps([
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
            {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
        (path / "1_Pooling").mkdir(exist_ok=True)
        (path / "1_Pooling" / "config.json").write_text(json.dumps({
            "word_embedding_dimension": kw["hidden_size"], "pooling_mode_cls_token": False,
            "pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": False,
            "pooling_mode_mean_sqrt_len_tokens": False}))
    return path


def default_model_dir() -> Path:
    """The demo model's cache directory: $SHOAL_CACHE or ~/.cache/shoal, then demo-llama."""
    from shoal.engine.tools.demo_model import cache_root

    return cache_root() / "demo-llama"


def ensure_demo_model() -> Path:
    """Build the demo model once (deterministic seed) and return its directory."""
    path = default_model_dir()
    marker = path / "shoal-demo.json"
    if not marker.exists():
        make_model(path, arch="llama", seed=1234, hidden_size=128, intermediate_size=256,
                   num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)
        marker.write_text(json.dumps({"seed": 1234, "arch": "llama"}))
    return path


IMAGE_TOKEN = "<image>"


def make_llava_model(path: str | os.PathLike, seed: int = 0, image_size: int = 56, patch_size: int = 14,
                     vision: str = "clip", text: dict | None = None, tower: dict | None = None) -> Path:
    """A random-weight LLaVA directory (LlavaForConditionalGeneration: a CLIP or SigLIP vision tower, the projector
    and the tiny Llama decoder) with its processor: the tiny tokenizer plus the <image> token, and the tower's image
    processor at `image_size` pixels. Each image is (image_size // patch_size) ** 2 tokens (CLIP's CLS feature is
    dropped, the "default" feature selection; SigLIP has none, "full"). `text` and `tower` override the decoder's
    and the vision tower's config (a benchmark's real shape)."""
    import torch
    import transformers as tf

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer(path)
    tok.add_tokens([IMAGE_TOKEN], special_tokens=True)
    image_token_id = tok.convert_tokens_to_ids(IMAGE_TOKEN)
    text_overrides = dict(text or {})
    text = _config("llama", text_overrides.pop("vocab_size", -(-len(tok) // 16) * 16), **text_overrides)
    tower = {**dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2),
             **(tower or {}), "image_size": image_size, "patch_size": patch_size}
    if vision == "clip":
        vision_config, strategy, extra = tf.CLIPVisionConfig(projection_dim=32, **tower), "default", 1
        images = tf.CLIPImageProcessor(size={"shortest_edge": image_size},
                                       crop_size={"height": image_size, "width": image_size})
    elif vision == "siglip":
        vision_config, strategy, extra = tf.SiglipVisionConfig(**tower), "full", 0
        images = tf.SiglipImageProcessor(size={"height": image_size, "width": image_size})
    else:
        raise ValueError(f"vision must be clip or siglip, got {vision!r}")
    config = tf.LlavaConfig(text_config=text, vision_config=vision_config, image_token_id=image_token_id,
                            vision_feature_layer=-2, vision_feature_select_strategy=strategy,
                            image_seq_length=(image_size // patch_size) ** 2, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = tf.LlavaForConditionalGeneration(config)
    _widen_random_init(model)
    model.save_pretrained(str(path), safe_serialization=True)
    tf.LlavaProcessor(image_processor=images, tokenizer=tok, patch_size=patch_size, num_additional_image_tokens=extra,
                      vision_feature_select_strategy=strategy, image_token=IMAGE_TOKEN,
                      chat_template=CHAT_TEMPLATE).save_pretrained(str(path))
    return path


QWEN_VL_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]


def _save_qwen_vl(path: str | os.PathLike, seed: int, make_config, model_cls: str, patch: int,
                  max_pixels: int) -> Path:
    """A random-weight Qwen vision-language directory: `make_config(vocab_size, tokens)` (tokens: the vision token
    ids as the wrapper config's keyword arguments) gives the config of transformers' `model_cls`, saved with the tiny
    tokenizer plus Qwen's vision tokens and Qwen2VLImageProcessor at `patch` (merge 2: an image is smart-resized to
    multiples of 2 * patch pixels, each such square one token; at most `max_pixels`)."""
    import torch
    import transformers as tf

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer(path)
    tok.add_tokens(QWEN_VL_TOKENS, special_tokens=True)
    ids = {t: tok.convert_tokens_to_ids(t) for t in QWEN_VL_TOKENS}
    tokens = dict(image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                  vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    config = make_config(-(-len(tok) // 16) * 16, tokens)
    torch.manual_seed(seed)
    model = getattr(tf, model_cls)(config)
    _widen_random_init(model)
    model.save_pretrained(str(path), safe_serialization=True)
    # The image processor and the tokenizer saved as a checkpoint keeps them (preprocessor_config.json, tokenizer
    # files): Qwen's processors themselves cannot be built without torchvision (their video processor needs it).
    side = 2 * patch
    images = tf.Qwen2VLImageProcessorPil(size={"shortest_edge": side * side, "longest_edge": max_pixels},
                                         patch_size=patch, merge_size=2, temporal_patch_size=2)
    images.save_pretrained(str(path))
    tok.save_pretrained(str(path))
    return path


_QWEN_VL_TEXT = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                     rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=0, pad_token_id=0)


def make_qwen2_5_vl_model(path: str | os.PathLike, seed: int = 0, text: dict | None = None,
                          tower: dict | None = None, max_pixels: int = 112 * 112, qwen2: bool = False) -> Path:
    """A random-weight Qwen2.5-VL directory (Qwen2_5_VLForConditionalGeneration: its windowed ViT with the 2x2 patch
    merger, M-RoPE over a small Qwen2 decoder) with its processor: the tiny tokenizer plus Qwen's vision tokens, and
    Qwen2VLImageProcessor (patch 14, merge 2: an image is smart-resized to multiples of 28 pixels, each 28x28 one
    token; at most `max_pixels`). `text` and `tower` override the decoder's and the vision tower's config. qwen2:
    a Qwen2-VL instead (Qwen2VLForConditionalGeneration: its full-attention ViT)."""
    import transformers as tf

    def make_config(vocab_size: int, tokens: dict):
        txt = {**_QWEN_VL_TEXT, **dict(vocab_size=vocab_size, intermediate_size=128, num_hidden_layers=2,
               rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}),
               **(text or {})}
        if qwen2:  # Qwen2-VL's tower: embed_dim wide, hidden_size = the decoder's width
            vision = {**dict(depth=2, embed_dim=32, mlp_ratio=2, num_heads=2, patch_size=14, spatial_merge_size=2,
                             temporal_patch_size=2), **(tower or {}), "hidden_size": txt["hidden_size"]}
        else:  # two blocks: one windowed (56-pixel windows: 2x2 patches, one merged token), one full
            vision = {**dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=14,
                             spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1]),
                      **(tower or {}), "out_hidden_size": txt["hidden_size"]}
        cls = tf.Qwen2VLConfig if qwen2 else tf.Qwen2_5_VLConfig
        return cls(text_config=txt, vision_config=vision, tie_word_embeddings=False, **tokens)

    model_cls = "Qwen2VLForConditionalGeneration" if qwen2 else "Qwen2_5_VLForConditionalGeneration"
    return _save_qwen_vl(path, seed, make_config, model_cls, 14, max_pixels)


def make_qwen3_vl_model(path: str | os.PathLike, seed: int = 0, text: dict | None = None,
                        tower: dict | None = None, max_pixels: int = 128 * 128) -> Path:
    """A random-weight Qwen3-VL directory (Qwen3VLForConditionalGeneration: its ViT with resampled position
    embeddings, the 2x2 merger and deepstack mergers after both blocks, interleaved M-RoPE over a small Qwen3 decoder)
    with the tiny tokenizer plus Qwen's vision tokens and Qwen2VLImageProcessor at patch 16 (each 32x32 pixels one
    token, at most `max_pixels`)."""
    import transformers as tf

    def make_config(vocab_size: int, tokens: dict):
        txt = {**_QWEN_VL_TEXT, **dict(vocab_size=vocab_size, intermediate_size=128, num_hidden_layers=3, head_dim=16,
               rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "mrope_interleaved": True,
                                "rope_theta": 10000.0}),
               **(text or {})}
        vision = {**_QWEN3_VL_TOWER, "deepstack_visual_indexes": [0, 1], **(tower or {}),
                  "out_hidden_size": txt["hidden_size"]}
        return tf.Qwen3VLConfig(text_config=txt, vision_config=vision, tie_word_embeddings=False, **tokens)

    return _save_qwen_vl(path, seed, make_config, "Qwen3VLForConditionalGeneration", 16, max_pixels)


_QWEN3_VL_TOWER = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16, spatial_merge_size=2,
                       temporal_patch_size=2, num_position_embeddings=16)


def make_qwen3_5_vl_model(path: str | os.PathLike, seed: int = 0, moe: bool = False, text: dict | None = None,
                          max_pixels: int = 128 * 128) -> Path:
    """A random-weight Qwen3.5 vision-language directory (Qwen3_5ForConditionalGeneration; moe:
    Qwen3_5MoeForConditionalGeneration, 4 experts top-2 with a shared expert): Qwen3-VL's two-block ViT without
    deepstack over Qwen3.5's hybrid decoder (Gated DeltaNet layers 3:1 with gated attention, its interleaved M-RoPE
    partial: 12 of 16 head dimensions rotated, mrope_section [2, 2, 2]), images as make_qwen3_vl_model's."""
    import transformers as tf

    def make_config(vocab_size: int, tokens: dict):
        txt = {**_QWEN_VL_TEXT, **dict(vocab_size=vocab_size, num_hidden_layers=4, head_dim=16,
               linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=24,
               linear_conv_kernel_dim=4, rope_parameters={
                   "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                   "mrope_section": [2, 2, 2], "mrope_interleaved": True})}
        txt.update(dict(moe_intermediate_size=48, shared_expert_intermediate_size=40, num_experts=4,
                        num_experts_per_tok=2) if moe else dict(intermediate_size=96))
        txt.update(text or {})
        vision = {**_QWEN3_VL_TOWER, "out_hidden_size": txt["hidden_size"]}
        cls = tf.Qwen3_5MoeConfig if moe else tf.Qwen3_5Config
        return cls(text_config=txt, vision_config=vision, tie_word_embeddings=False, **tokens)

    model_cls = "Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"
    return _save_qwen_vl(path, seed, make_config, model_cls, 16, max_pixels)


GEMMA3_IMAGE_TOKENS = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                       "image_token": "<image_soft_token>"}


def make_gemma3_vl_model(path: str | os.PathLike, seed: int = 0, image_size: int = 32, patch_size: int = 4,
                         mm_tokens_per_image: int = 16, text: dict | None = None) -> Path:
    """A random-weight Gemma 3 vision-language directory (Gemma3ForConditionalGeneration: a two-layer SigLIP tower,
    the multi-modal projector pooling its (image_size / patch_size)^2 patches to mm_tokens_per_image, and the tiny
    Gemma 3 decoder: sliding (window 8) and global layers) with its Gemma3Processor: the tiny tokenizer plus Gemma's
    <start_of_image>, <end_of_image> and <image_soft_token>, and the PIL Gemma3ImageProcessor at image_size pixels."""
    import torch
    import transformers as tf

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer(path)
    tok.add_tokens(list(GEMMA3_IMAGE_TOKENS.values()), special_tokens=True)
    tok = tf.PreTrainedTokenizerFast(tokenizer_object=tok.backend_tokenizer, eos_token="<|endoftext|>",
                                     bos_token="<|bos|>", pad_token="<|endoftext|>",
                                     extra_special_tokens=GEMMA3_IMAGE_TOKENS)
    tok.chat_template = CHAT_TEMPLATE
    ids = {k: tok.convert_tokens_to_ids(t) for k, t in GEMMA3_IMAGE_TOKENS.items()}
    text = dict(text or {})
    text_config = _config("gemma3", text.pop("vocab_size", len(tok)), **text).to_dict()
    tower = tf.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                  image_size=image_size, patch_size=patch_size)
    config = tf.Gemma3Config(text_config=text_config, vision_config=tower, mm_tokens_per_image=mm_tokens_per_image,
                             boi_token_index=ids["boi_token"], eoi_token_index=ids["eoi_token"],
                             image_token_index=ids["image_token"], tie_word_embeddings=True)
    torch.manual_seed(seed)
    model = tf.Gemma3ForConditionalGeneration(config)
    _widen_random_init(model)
    model.save_pretrained(str(path), safe_serialization=True)
    images = tf.Gemma3ImageProcessorPil(size={"height": image_size, "width": image_size})
    tf.Gemma3Processor(image_processor=images, tokenizer=tok, image_seq_length=mm_tokens_per_image,
                       chat_template=CHAT_TEMPLATE).save_pretrained(str(path))
    return path
