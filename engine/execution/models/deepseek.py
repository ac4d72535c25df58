"""DeepseekV3ForCausalLM (DeepSeek V3/R1, Kimi K2), DeepseekV2ForCausalLM (DeepSeek V2, V2-Lite) and
Glm4MoeLiteForCausalLM (GLM-4.7-Flash: V3's attention and routing, its dense and sparse layers listed by
mlp_layer_types).

The decoder of models/decoder.py with multi-head latent attention (layers/mla.py: a latent KV cache of
kv_lora_rank + qk_rope_head_dim values per token and layer, weight-absorbed attention) in every layer, and as MLP:
- the first `first_k_dense_replace` layers (GLM: the layers mlp_layer_types calls "dense"): a dense SwiGLU MLP of
  intermediate_size;
- the others: a SparseMoeBlock of n_routed_experts experts of moe_intermediate_size plus shared experts
  (n_shared_experts x moe_intermediate_size, one dense MLP added to every token), routed as the family says:
  - V3: sigmoid scores, e_score_correction_bias for the choice, the topk_group best of n_group groups (each scored
    by its two best biased scores), weights renormalised (norm_topk_prob) and times routed_scaling_factor;
  - V2: softmax scores, topk_method "greedy" or "group_limited_greedy" (groups scored by their best score), no
    renormalisation, times routed_scaling_factor.
Checkpoint names are transformers' (self_attn.{q_a_proj,q_a_layernorm,q_b_proj | q_proj}, kv_a_proj_with_mqa,
kv_a_layernorm, kv_b_proj, o_proj; mlp.gate.weight, mlp.gate.e_score_correction_bias, mlp.experts.{e}.*,
mlp.shared_experts.*).

An inconsistent config is refused at load (`check_mla_config`), naming the field.
"""

from __future__ import annotations

from torch import nn

from shoal.engine.execution.layers.mla import LatentAttention, LatentKVCache
from shoal.engine.execution.layers.mlp import GatedMLP
from shoal.engine.execution.layers.moe import GroupedRouting, SparseMoeBlock
from shoal.engine.execution.layers.rotary import RotaryEmbedding
from shoal.engine.execution.models.decoder import FULL, SLIDING, DecoderLM
from shoal.engine.execution.models.moe import check_silu_experts, load_moe_block

_POSITIVE = ("hidden_size", "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
             "v_head_dim")


def check_mla_config(config) -> None:
    """Refuse a config MLA cannot run, naming the field."""
    arch = (getattr(config, "architectures", None) or ["DeepSeek"])[0]
    for name in _POSITIVE:
        value = getattr(config, name, None)
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{arch}: config field {name} must be a positive integer (got {value!r})")
    if config.qk_rope_head_dim % 2:
        raise ValueError(f"{arch}: config field qk_rope_head_dim must be even, for RoPE's pairs "
                         f"(got {config.qk_rope_head_dim})")
    q_lora = getattr(config, "q_lora_rank", None)
    if q_lora is not None and (not isinstance(q_lora, int) or q_lora < 1):
        raise ValueError(f"{arch}: config field q_lora_rank must be a positive integer or null (got {q_lora!r})")
    experts = getattr(config, "n_routed_experts", None)
    if experts:
        n_group = getattr(config, "n_group", None) or 1
        if experts % n_group:
            raise ValueError(f"{arch}: config field n_group ({n_group}) must divide n_routed_experts ({experts})")


class DeepseekV3ForCausalLM(DecoderLM):
    kv_cache_class = LatentKVCache

    def __init__(self, config, dtype, backend, max_model_len: int, layer_partition=None):
        check_mla_config(config)
        super().__init__(config, dtype, backend, max_model_len, layer_partition)
        self.head_dim = config.kv_lora_rank + config.qk_rope_head_dim  # the width of one cached latent entry

    @classmethod
    def attention_shape(cls, config) -> dict:
        """What the attention backends see: one key "head" of the latent width, the model's query heads."""
        check_mla_config(config)
        return {"head_dim": config.kv_lora_rank + config.qk_rope_head_dim, "num_heads": config.num_attention_heads,
                "num_kv_heads": 1}

    @classmethod
    def default_layer_types(cls, config) -> list[str]:
        return [FULL] * config.num_hidden_layers

    def make_rotaries(self, config, max_model_len: int, dtype) -> dict[str, RotaryEmbedding]:
        shared = RotaryEmbedding(config, config.qk_rope_head_dim, max_model_len, dtype)
        return {SLIDING: shared, FULL: shared}

    def make_attention(self, layer_idx, dtype, backend, rotary, window) -> nn.Module:
        return LatentAttention(self.config, dtype, backend, rotary)

    def is_sparse(self, layer_idx: int) -> bool:
        c = self.config
        return bool(getattr(c, "n_routed_experts", None)) and layer_idx >= (c.first_k_dense_replace or 0)

    def routing(self) -> tuple[str, bool, GroupedRouting]:
        """(scoring function, renormalise, grouped routing) of the sparse layers."""
        c = self.config
        return "sigmoid", bool(c.norm_topk_prob), GroupedRouting(
            c.n_group or 1, c.topk_group or 1, float(c.routed_scaling_factor), correction_bias=True)

    def make_mlp(self, layer_idx: int, dtype) -> nn.Module:
        c = self.config
        if not self.is_sparse(layer_idx):
            return GatedMLP(c.hidden_size, c.intermediate_size, dtype)
        check_silu_experts(c)
        scoring, renormalize, grouping = self.routing()
        return SparseMoeBlock(c.hidden_size, c.n_routed_experts, c.num_experts_per_tok, c.moe_intermediate_size,
                              renormalize=renormalize, dtype=dtype, scoring_func=scoring,
                              shared_intermediate=c.moe_intermediate_size * (c.n_shared_experts or 0),
                              grouping=grouping)

    def load_mlp(self, mlp, src, p: str, layer_idx: int) -> None:
        if not isinstance(mlp, SparseMoeBlock):
            mlp.load(src, p + "mlp.")
            return
        load_moe_block(mlp, src, p + "mlp.", shared_name="shared_experts.")
        if mlp.correction_bias is not None:
            mlp.correction_bias.data.copy_(src.load(p + "mlp.gate.e_score_correction_bias",
                                                    (mlp.correction_bias.shape[0],)))


class DeepseekV2ForCausalLM(DeepseekV3ForCausalLM):
    def routing(self) -> tuple[str, bool, GroupedRouting]:
        c = self.config
        method = getattr(c, "topk_method", "greedy")
        if method not in ("greedy", "group_limited_greedy"):
            raise ValueError(f"DeepseekV2ForCausalLM: config field topk_method {method!r} is not supported "
                             "(supported: greedy, group_limited_greedy)")
        grouped = method == "group_limited_greedy"
        return "softmax", False, GroupedRouting(c.n_group if grouped else 1, c.topk_group if grouped else 1,
                                                float(c.routed_scaling_factor))


class Glm4MoeLiteForCausalLM(DeepseekV3ForCausalLM):
    def __init__(self, config, dtype, backend, max_model_len: int, layer_partition=None):
        types = getattr(config, "mlp_layer_types", None)
        if (not isinstance(types, (list, tuple)) or len(types) != config.num_hidden_layers
                or set(types) - {"dense", "sparse"}):
            raise ValueError(f"Glm4MoeLiteForCausalLM: config field mlp_layer_types must give 'dense' or 'sparse' "
                             f"for each of the {config.num_hidden_layers} layers (got {types!r})")
        super().__init__(config, dtype, backend, max_model_len, layer_partition)

    def is_sparse(self, layer_idx: int) -> bool:
        return self.config.mlp_layer_types[layer_idx] == "sparse"
