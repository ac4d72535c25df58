"""GptOssForCausalLM (gpt-oss): the MoE decoder of models/decoder.py with OpenAI's choices.

- Attention: q/k/v/o with biases, attention sinks (one learned logit per head in every softmax denominator;
  attention backends with `supports_sinks`), layers alternating between a sliding window and the full context
  (config.layer_types), YaRN RoPE (layers/rotary.py through transformers' own parameters).
- MLP: every layer a SparseMoeBlock whose router has a bias (top-k of the logits, softmax over those k: the same
  weights as softmax, top-k, renormalise) and whose experts have biases on both projections and gpt-oss's clamped
  SwiGLU: gate clamped above and up on both sides at swiglu_limit, then (up + 1) * gate * sigmoid(swiglu_alpha * gate).
- Checkpoints as transformers writes them: per layer one tensor per expert projection for all experts,
  mlp.experts.gate_up_proj [experts, hidden, 2 * intermediate] with gate and up interleaved along its last
  dimension (gate at even columns), down_proj [experts, intermediate, hidden], their biases, mlp.router.weight/bias
  and self_attn.sinks; or the same experts in MXFP4 (`*_blocks`/`*_scales`, as OpenAI publishes gpt-oss),
  dequantized expert by expert on load (quantization/prequantized.py). Each expert is read once, only this rank's
  part kept, and de-interleaved into the fused layer's [gate rows | up rows] layout.
"""

from __future__ import annotations

import torch
from torch import nn

from shoal.engine.execution.layers.activation import ExpertActivation
from shoal.engine.execution.layers.moe import SparseMoeBlock
from shoal.engine.execution.models.decoder import DecoderLM


def _tensor_reader(t: torch.Tensor):
    """A Reader (layers.linear) over a tensor already in memory."""
    return lambda dim, start, length: t.narrow(dim, start, length)


class GptOssForCausalLM(DecoderLM):
    uses_sinks = True

    def attention_options(self, layer_idx: int) -> dict:
        return dict(super().attention_options(layer_idx), sinks=True)

    def make_mlp(self, layer_idx: int, dtype) -> nn.Module:
        c = self.config
        activation = ExpertActivation("swiglu_clamped", float(getattr(c, "swiglu_alpha", 1.702)),
                                      float(getattr(c, "swiglu_limit", 7.0)))
        return SparseMoeBlock(c.hidden_size, c.num_local_experts, c.num_experts_per_tok, c.intermediate_size,
                              renormalize=True, dtype=dtype, router_bias=True, expert_bias=True, activation=activation)

    def load_mlp(self, block: SparseMoeBlock, src, p: str, layer_idx: int) -> None:
        m, experts = p + "mlp.", block.experts
        E, H, I = experts.num_experts, experts.hidden, experts.intermediate
        block.gate.data.copy_(src.load(m + "router.weight", (E, H)))
        block.gate_bias.data.copy_(src.load(m + "router.bias", (E,)))
        x = m + "experts."
        for e in experts.local_experts():
            one = dict(dim=0, start=e, length=1)
            gate_up = src.load(x + "gate_up_proj", (E, H, 2 * I), **one)[0].t()  # [2I, H], gate and up interleaved
            down = src.load(x + "down_proj", (E, I, H), **one)[0].t()  # [H, I]
            gate_up_bias = src.load(x + "gate_up_proj_bias", (E, 2 * I), **one)[0]
            down_bias = src.load(x + "down_proj_bias", (E, H), **one)[0]
            experts.load_expert(e, _tensor_reader(gate_up[0::2]), _tensor_reader(gate_up[1::2]), _tensor_reader(down),
                                (_tensor_reader(gate_up_bias[0::2]), _tensor_reader(gate_up_bias[1::2]),
                                 _tensor_reader(down_bias)))
