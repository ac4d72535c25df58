"""Mixture-of-experts families: MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM, OlmoeForCausalLM.

The decoder of models/decoder.py with a SparseMoeBlock (layers/moe.py) as the MLP of its sparse layers:
- Mixtral: softmax router, top-k renormalised; experts w1 (gate), w3 (up), w2 (down) under block_sparse_moe.
- Qwen2-MoE: QKV bias; a shared expert added to every token's routed output, scaled by sigmoid(shared_expert_gate
  . x); layers are sparse where (i + 1) % decoder_sparse_step == 0 and i is not in mlp_only_layers, dense
  (intermediate_size) elsewhere.
- Qwen3-MoE: per-head q/k RMSNorm, norm_topk_prob, the same sparse/dense layer rule, no shared expert.
- OLMoE: q/k RMSNorm over the whole projection, optional clip_qkv, norm_topk_prob.
Each expert's three tensors are read from the checkpoint once, only this rank's part, into the stacked weights.
"""

from __future__ import annotations

from torch import nn

from shoal.engine.execution.layers.moe import SparseMoeBlock
from shoal.engine.execution.models.base import reader, tensor_reader
from shoal.engine.execution.models.decoder import DecoderLM, hidden_activation

_EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")


def check_silu_experts(config) -> None:
    """The fused experts run SwiGLU only."""
    if hidden_activation(config) not in ("silu", "swish"):
        raise ValueError(f"{config.architectures}: expert activation {hidden_activation(config)!r} is not supported "
                         "(the fused MoE layer runs silu)")


def load_moe_block(block: SparseMoeBlock, src, m: str, expert_names=_EXPERT_NAMES,
                   shared_name: str = "shared_expert.", router_name: str = "gate.") -> None:
    """A sparse block's tensors under the prefix m ('...mlp.'): the router's weight [E, H] (`router_name`: Jamba's is
    router.), experts.{e}.<names>, and the shared expert (with its gate) when the block has one (under
    `shared_name`: DeepSeek's is shared_experts.)."""
    experts = block.experts
    h, inter, n = experts.hidden, experts.intermediate, experts.num_experts
    block.gate.data.copy_(src.load(m + router_name + "weight", (n, h)))
    gate, up, down = expert_names
    stacked = src.has(m + "experts.gate_up_proj")  # transformers 5's layout, as Qwen3.5's releases ship it
    for e in experts.local_experts():
        if stacked:  # gate_up_proj [E, 2 * inter, H] (gate rows first), down_proj [E, H, inter]: one expert read whole
            both = src.load(m + "experts.gate_up_proj", (n, 2 * inter, h), dim=0, start=e, length=1)[0]
            experts.load_expert(e, tensor_reader(both[:inter]), tensor_reader(both[inter:]), tensor_reader(
                src.load(m + "experts.down_proj", (n, h, inter), dim=0, start=e, length=1)[0]))
            continue
        p = f"{m}experts.{e}."
        experts.load_expert(e, reader(src, f"{p}{gate}.weight", (inter, h)), reader(src, f"{p}{up}.weight", (inter, h)),
                            reader(src, f"{p}{down}.weight", (h, inter)))
    if block.shared_expert is not None:
        block.shared_expert.load(src, m + shared_name)
    if block.shared_expert_gate is not None:
        block.shared_expert_gate.data.copy_(src.load(m + "shared_expert_gate.weight", (1, h)))


class _SparseDecoderLM(DecoderLM):
    """Sparse layers by the Qwen-MoE rule (every layer when the config has neither field); renormalisation from
    norm_topk_prob."""

    expert_size_field = "moe_intermediate_size"  # the config field holding each expert's intermediate size
    always_renormalize = False  # the top-k weights renormalised whatever norm_topk_prob says (Qwen3.5's router)

    def is_sparse(self, layer_idx: int) -> bool:
        c = self.config
        step = getattr(c, "decoder_sparse_step", 1) or 1
        return (layer_idx not in (getattr(c, "mlp_only_layers", None) or []) and getattr(c, "num_experts", 0) > 0
                and (layer_idx + 1) % step == 0)

    def moe_block(self, dtype, **shared) -> SparseMoeBlock:
        c = self.config
        check_silu_experts(c)
        return SparseMoeBlock(c.hidden_size, c.num_experts, c.num_experts_per_tok,
                              getattr(c, self.expert_size_field),
                              renormalize=self.always_renormalize or bool(getattr(c, "norm_topk_prob", False)),
                              dtype=dtype, scoring_func=getattr(c, "scoring_func", "softmax"), **shared)

    def make_mlp(self, layer_idx: int, dtype) -> nn.Module:
        if self.is_sparse(layer_idx):
            return self.moe_block(dtype)
        return super().make_mlp(layer_idx, dtype)

    def load_mlp(self, mlp, src, p: str, layer_idx: int) -> None:
        if isinstance(mlp, SparseMoeBlock):
            load_moe_block(mlp, src, p + "mlp.")
        else:
            mlp.load(src, p + "mlp.")


class MixtralForCausalLM(DecoderLM):
    def make_mlp(self, layer_idx: int, dtype) -> nn.Module:
        c = self.config
        check_silu_experts(c)
        return SparseMoeBlock(c.hidden_size, c.num_local_experts, c.num_experts_per_tok, c.intermediate_size,
                              renormalize=True, dtype=dtype)

    def load_mlp(self, mlp, src, p: str, layer_idx: int) -> None:
        load_moe_block(mlp, src, p + "block_sparse_moe.", expert_names=("w1", "w3", "w2"))


class Qwen2MoeForCausalLM(_SparseDecoderLM):
    def attention_options(self, layer_idx: int) -> dict:
        return dict(super().attention_options(layer_idx), qkv_bias=bool(getattr(self.config, "qkv_bias", True)))

    def moe_block(self, dtype, **shared) -> SparseMoeBlock:
        c = self.config
        return super().moe_block(dtype, shared_intermediate=c.shared_expert_intermediate_size, shared_gate=True)


class Qwen3MoeForCausalLM(_SparseDecoderLM):
    qk_norm = "head"


class OlmoeForCausalLM(_SparseDecoderLM):
    qk_norm = "full"
    expert_size_field = "intermediate_size"
