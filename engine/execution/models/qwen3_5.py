"""Qwen3.5 (Qwen3_5ForCausalLM, dense; Qwen3_5MoeForCausalLM) and the text decoder of its vision-language
checkpoints (Qwen3_5ForConditionalGeneration, Qwen3_5MoeForConditionalGeneration: how the releases ship).

Qwen3-Next's decoder (models/qwen3_next.py: Gated DeltaNet layers 3:1 with gated attention, zero-centred norms,
partial RoPE) with these differences:
- The Gated DeltaNet input projections are kept apart in the checkpoint, each in head order: in_proj_qkv (every
  query row, then key, then value), in_proj_z, in_proj_b, in_proj_a. Here one merged column-parallel matmul computes
  all six parts, a rank's heads of each.
- Dense models: every MLP a SwiGLU of intermediate_size. MoE models: every layer sparse, the top-k weights always
  renormalised (the router has no norm_topk_prob switch), a shared expert gated by sigmoid(shared_expert_gate . x);
  experts stacked (experts.gate_up_proj, experts.down_proj: how the releases store them) or one tensor per expert
  (how transformers saves them), both read by models/moe.py.
- RoPE is multimodal (rope_parameters.mrope_section): text positions are equal across its three sections, so for
  text it is the plain partial RoPE.
- A vision-language checkpoint keeps the decoder under model.language_model. (models/__init__.py serves its
  text_config), the vision tower under model.visual. (qwen3_5_vl.py runs it; a checkpoint without its image
  processor is served text only: an image content part is refused, server/protocol.py); the MTP head (mtp.) is
  never read.
"""

from __future__ import annotations

import torch

from shoal.engine.execution.layers.gated_delta_net import GatedDeltaNet
from shoal.engine.execution.layers.linear import MergedColumnParallelLinear
from shoal.engine.execution.models.base import fused_readers, reader
from shoal.engine.execution.models.qwen3_next import Qwen3NextForCausalLM


class SplitProjectionGatedDeltaNet(GatedDeltaNet):
    """Gated DeltaNet reading Qwen3.5's separate input projections."""

    def make_in_proj(self, dtype: torch.dtype) -> None:
        kd, vd = self.nk * self.dk, self.nv * self.dv
        self.in_proj = MergedColumnParallelLinear(self.hidden, [kd, kd, vd, vd, self.nv, self.nv], False, dtype)

    def load_in_proj(self, src, p: str) -> None:
        h, kd, vd, nv = self.hidden, self.nk * self.dk, self.nv * self.dv, self.nv
        self.in_proj.load(fused_readers(src, p + "in_proj_qkv.weight", [kd, kd, vd], h)
                          + [reader(src, p + "in_proj_z.weight", (vd, h)), reader(src, p + "in_proj_b.weight", (nv, h)),
                             reader(src, p + "in_proj_a.weight", (nv, h))])

    def _split(self, h: torch.Tensor):
        nv, vd = self.nv_local, self.nv_local * self.dv
        mixed, z, b, a = self.in_proj(h).split([self.channels, vd, nv, nv], dim=-1)
        return mixed, z.reshape(h.shape[0], nv, self.dv), b, a


class Qwen3_5ForCausalLM(Qwen3NextForCausalLM):
    family = "Qwen3.5"
    linear_mixer_cls = SplitProjectionGatedDeltaNet
    always_renormalize = True
    prefixes = ("model.language_model.", "model.", "")
