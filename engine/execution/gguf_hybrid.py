"""llama.cpp's GGUF layout of the hybrid families, read back as the Hugging Face checkpoint Shoal's models load.

Architectures: qwen3next (Qwen3-Next), qwen35 / qwen35moe (Qwen3.5 dense / MoE), granitehybrid (Granite 4,
GraniteMoeHybrid), nemotron_h (Nemotron-H) and falcon-h1 (Falcon-H1). `hybrid_config` builds the config from the metadata; `HybridLayout`
says, for every tensor a Shoal model reads, which GGUF tensor holds it and how llama.cpp's converter changed it:

- which layers are recurrent: qwen3next/qwen35 from `attention.recurrent_layers` or `full_attention_interval`
  (every n-th layer attends); granitehybrid from the per-layer `attention.head_count_kv` (0 = Mamba2); nemotron_h from
  that and the per-layer `feed_forward_length` (neither = Mamba2, kv heads = attention, ffn = MLP); falcon-h1 runs
  both in every layer.
- the recurrent sizes from ssm.*: conv_kernel, state_size (key head size), group_count (key heads / B-C groups),
  time_step_rank (value / Mamba heads) and inner_size (value heads x their size).
- A_log is stored as A = -exp(A_log) (Mamba2: one column, [heads, 1]), D as [heads, 1], conv1d weights squeezed to
  [channels, kernel], dt_bias as `ssm_dt.bias`, the Mamba2 gated norm as [groups, inner / groups].
- Qwen3-Next / Qwen3.5: every RMSNorm but the DeltaNet's gated one is stored as 1 + w. Qwen3-Next's in_proj_qkvz
  (rows grouped by key head: q, k, v, z) is written as attn_qkv (all q, all k, all v) plus attn_gate (all z); older
  files keep it whole as ssm_in. Qwen3.5 orders the value heads "tiled" (value head i of key head j at i x key heads
  + j) instead of grouped by key head (j x heads per key + i) in in_proj_qkv's value rows, in_proj_z, in_proj_b/a
  (ssm_beta/ssm_alpha), A_log, dt_bias, the conv's value channels and out_proj's columns; each is put back.
- Granite / Nemotron-H: attention q/k rows are permuted as for Llama (the loader's generic unpermute), Granite's
  fused expert input_linear is split into ffn_gate_exps / ffn_up_exps, and its shared_mlp.input_linear into
  ffn_gate_shexp / ffn_up_shexp (ffn_gate / ffn_up without experts).
- Falcon-H1: every muP multiplier is multiplied into the weight it scales (embedding, LM head, q/k/v/o, in_proj's
  z/x/B/C/dt rows, out_proj, the MLP's gate and down projection), so the config has them all at 1; llama.cpp's
  Mamba2 layer gates before its norm (mamba_norm_before_gate false), and the norm is there when ssm_norm is.

A tensor made of rows of stored tensors (in_proj_qkvz, Qwen3.5's head-reordered projections, Granite's fused MLP
inputs) is a `View`: its rows are gathered from the stored ones (GGUF quantizes each row on its own), so quantized
rows stay packed and a tensor-parallel rank reads its rows only. Small tensors (A, D, conv, norms) are computed whole.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from shoal.engine.execution.weights import WeightError

# general.architecture -> (transformers model_type, architectures entry, q/k rows permuted by llama.cpp)
HYBRID_ARCHITECTURES = {
    "qwen3next": ("qwen3_next", "Qwen3NextForCausalLM", False),
    "qwen35": ("qwen3_5_text", "Qwen3_5ForCausalLM", False),
    "qwen35moe": ("qwen3_5_moe_text", "Qwen3_5MoeForCausalLM", False),
    "granitehybrid": ("granitemoehybrid", "GraniteMoeHybridForCausalLM", True),
    "nemotron_h": ("nemotron_h", "NemotronHForCausalLM", True),
    "falcon-h1": ("falcon_h1", "FalconH1ForCausalLM", False),
}
_GDN = ("qwen3next", "qwen35", "qwen35moe")  # Gated DeltaNet families
_MAMBA = ("granitehybrid", "nemotron_h")  # Mamba2 or attention per layer


def _metadata(reader, arch: str, path):
    from shoal.engine.execution.gguf_reader import field_value as _field

    def get(key: str, default=None):
        return _field(reader, f"{arch}.{key}", default)

    def need(key: str):
        value = get(key)
        if value is None:
            raise WeightError(f"{path}: GGUF metadata {arch}.{key} is missing")
        return value

    return get, need


def _per_layer(value, n: int, key: str, arch: str, path) -> list[int]:
    """A per-layer metadata value (llama.cpp writes an array where layers differ, else one number)."""
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise WeightError(f"{path}: GGUF metadata {arch}.{key} has {len(value)} entries for {n} layers")
        return [int(v) for v in value]
    return [int(value)] * n


def hybrid_config(reader, arch: str, path, names: set[str]) -> dict:
    """The transformers config entries of a hybrid GGUF file (architectures included)."""
    model_type, hf_arch, _ = HYBRID_ARCHITECTURES[arch]
    get, need = _metadata(reader, arch, path)
    n = int(need("block_count"))
    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    kv = _per_layer(need("attention.head_count_kv") if arch in _MAMBA else get("attention.head_count_kv", heads),
                    n, "attention.head_count_kv", arch, path)
    conv, state, groups = int(need("ssm.conv_kernel")), int(need("ssm.state_size")), int(need("ssm.group_count"))
    rank, inner = int(need("ssm.time_step_rank")), int(need("ssm.inner_size"))
    if rank <= 0 or inner % rank:
        raise WeightError(f"{path}: GGUF metadata {arch}.ssm.inner_size ({inner}) is not a whole number of "
                          f"{arch}.ssm.time_step_rank ({rank}) heads")
    eps = get("attention.layer_norm_rms_epsilon", get("attention.layer_norm_epsilon"))
    if eps is None:
        raise WeightError(f"{path}: GGUF metadata {arch}.attention.layer_norm_rms_epsilon is missing")
    kw = dict(architectures=[hf_arch], hidden_size=hidden, num_hidden_layers=n, num_attention_heads=heads,
              num_key_value_heads=max(kv) or heads, rms_norm_eps=float(eps),
              max_position_embeddings=min(int(get("context_length", 4096)), 1 << 20),
              rope_theta=float(get("rope.freq_base", 10000.0)), tie_word_embeddings="output.weight" not in names)
    head_dim = get("attention.key_length")
    if arch in _GDN:
        head_dim = int(head_dim or hidden // heads)
        recurrent = get("attention.recurrent_layers")
        if recurrent is None:
            every = int(get("full_attention_interval", 4))
            recurrent = [(i + 1) % every != 0 for i in range(n)]
        elif len(recurrent) != n:
            raise WeightError(f"{path}: GGUF metadata {arch}.attention.recurrent_layers has {len(recurrent)} entries "
                              f"for {n} layers")
        rot = int(get("rope.dimension_count", head_dim // 4))
        kw.update(head_dim=head_dim, partial_rotary_factor=rot / head_dim,
                  layer_types=["linear_attention" if r else "full_attention" for r in recurrent],
                  linear_conv_kernel_dim=conv, linear_key_head_dim=state, linear_num_key_heads=groups,
                  linear_num_value_heads=rank, linear_value_head_dim=inner // rank, hidden_act="silu")
        if arch == "qwen35":
            kw["intermediate_size"] = int(need("feed_forward_length"))
        else:  # llama.cpp: every layer sparse, top-k renormalised, a shared expert gated by sigmoid
            experts, used = int(need("expert_count")), int(need("expert_used_count"))
            ffn = int(get("feed_forward_length", 0) or 0)
            # llama.cpp's fallbacks: an expert is feed_forward_length / used wide, the shared one feed_forward_length
            expert = int(get("expert_feed_forward_length", 0) or 0) or (ffn // used if ffn else None)
            shared = int(get("expert_shared_feed_forward_length", 0) or 0) or ffn or None
            for key, value in (("expert_feed_forward_length", expert), ("expert_shared_feed_forward_length", shared)):
                if not value:
                    raise WeightError(f"{path}: GGUF metadata {arch}.{key} is missing (and so is "
                                      f"{arch}.feed_forward_length)")
            kw.update(num_experts=experts, num_experts_per_tok=used, moe_intermediate_size=expert,
                      shared_expert_intermediate_size=shared, intermediate_size=ffn or expert,
                      decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)
        return kw
    heads_dim = inner // rank
    if arch == "granitehybrid":
        if inner % hidden:
            raise WeightError(f"{path}: GGUF metadata {arch}.ssm.inner_size ({inner}) is not a multiple of "
                              f"{arch}.embedding_length ({hidden})")
        experts = int(get("expert_count", 0) or 0)
        kw.update(layer_types=["attention" if k else "mamba" for k in kv], mamba_n_heads=rank, mamba_d_head=heads_dim,
                  mamba_n_groups=groups, mamba_d_state=state, mamba_d_conv=conv, mamba_expand=inner // hidden,
                  mamba_conv_bias=_any(names, "ssm_conv1d.bias"), mamba_proj_bias=_any(names, "ssm_in.bias"),
                  attention_bias=_any(names, "attn_q.bias"), hidden_act="silu",
                  position_embedding_type="rope" if get("rope.scaling.finetuned", False) else "nope",
                  attention_multiplier=float(get("attention.scale", 1.0)),
                  embedding_multiplier=float(get("embedding_scale", 1.0)),
                  residual_multiplier=float(get("residual_scale", 1.0)), logits_scaling=float(get("logit_scale", 1.0)),
                  num_local_experts=experts, num_experts_per_tok=int(get("expert_used_count", 0) or 0),
                  intermediate_size=int(need("feed_forward_length")))
        # without experts the shared MLP is filed as the layer's FFN (its width is feed_forward_length)
        kw["shared_intermediate_size"] = int(need("expert_shared_feed_forward_length") if experts
                                             else need("feed_forward_length"))
        if head_dim:
            kw["head_dim"] = int(head_dim)
        return kw
    if arch == "falcon-h1":  # attention and Mamba2 in every layer; the converter folds every muP multiplier in
        kw.update(head_dim=int(head_dim or hidden // heads), intermediate_size=int(need("feed_forward_length")),
                  mamba_d_ssm=inner, mamba_n_heads=rank, mamba_d_head=heads_dim, mamba_n_groups=groups,
                  mamba_d_state=state, mamba_d_conv=conv, mamba_expand=max(1, inner // hidden),
                  mamba_conv_bias=_any(names, "ssm_conv1d.bias"), mamba_proj_bias=False,
                  mamba_rms_norm=_any(names, "ssm_norm.weight"), mamba_norm_before_gate=False,  # llama.cpp's order
                  attention_bias=False, mlp_bias=False, projectors_bias=False, hidden_act="silu",
                  embedding_multiplier=1.0, lm_head_multiplier=1.0, attention_in_multiplier=1.0,
                  attention_out_multiplier=1.0, key_multiplier=1.0, ssm_in_multiplier=1.0, ssm_out_multiplier=1.0,
                  ssm_multipliers=[1.0] * 5, mlp_multipliers=[1.0, 1.0])
        return kw
    # nemotron_h
    ffn = _per_layer(need("feed_forward_length"), n, "feed_forward_length", arch, path)
    if get("expert_count"):
        raise WeightError(f"{path}: a Nemotron-H file with experts ({arch}.expert_count; Nemotron 3's 'moe' blocks) "
                          "is not supported: the fused MoE layer runs gated experts only")
    types = ["attention" if k else "mlp" if f else "mamba" for k, f in zip(kv, ffn)]
    kw.update(layers_block_type=types, head_dim=int(head_dim or hidden // heads), intermediate_size=max(ffn) or 1,
              mamba_num_heads=rank, mamba_head_dim=heads_dim, n_groups=groups, ssm_state_size=state, conv_kernel=conv,
              expand=max(1, inner // hidden), use_conv_bias=_any(names, "ssm_conv1d.bias"),
              use_bias=_any(names, "ssm_in.bias"), mlp_bias=_any(names, "ffn_up.bias"), attention_bias=False,
              layer_norm_epsilon=float(eps), mamba_hidden_act="silu", mlp_hidden_act="relu2")
    return kw


def _any(names: set[str], suffix: str) -> bool:
    return any(n.startswith("blk.") and n.endswith("." + suffix) for n in names)


@dataclass
class View:
    """A Hugging Face tensor made from stored ones: `rows(start, n)` gives its rows [start, start + n) along dim 0
    in float32; `packed(start, n)`, where it can, the same rows as stored blocks (uint8 rows, type, columns)."""

    shape: tuple[int, ...]
    rows: Callable[[int, int], torch.Tensor]
    packed: Callable[[int, int], tuple | None] | None = None


@dataclass
class HybridLayout:
    """Hugging Face name -> stored GGUF tensor name (`plain`), or a View (`views`); `shifted`: names whose stored
    values are 1 + w."""

    plain: dict[str, str] = field(default_factory=dict)
    views: dict[str, View] = field(default_factory=dict)
    shifted: set[str] = field(default_factory=set)


class _Reads:
    """Dequantized reads of the file's tensors by GGUF name; a missing one is named in the error."""

    def __init__(self, tensors: dict, path):
        self.tensors, self.path = tensors, path

    def get(self, name: str, why: str):
        t = self.tensors.get(name)
        if t is None:
            raise WeightError(f"{self.path}: tensor {name!r} is missing from the GGUF file (it holds {why})")
        return t

    def full(self, name: str, why: str) -> torch.Tensor:
        return self.rows(name, None, why)

    def rows(self, name: str, idx, why: str) -> torch.Tensor:
        from gguf import quants

        t = self.get(name, why)
        dims = tuple(int(d) for d in reversed(t.shape))
        data = t.data if idx is None else t.data[idx]
        w = quants.dequantize(np.ascontiguousarray(data), t.tensor_type)
        shape = dims if idx is None else (len(idx), *dims[1:])
        return torch.from_numpy(np.require(w, np.float32, ["C", "W"])).reshape(shape)


def _gather_view(reads: _Reads, parts: list[tuple[str, np.ndarray]], cols: int, why: str,
                 col_groups: tuple[np.ndarray, int] | None = None) -> View:
    """The rows parts[0][1] of tensor parts[0][0], then parts[1]'s, ... (a part may appear several times, for rows
    interleaved from several tensors); `col_groups` (order, size): the columns taken in groups of `size`, group
    order[g] at place g."""
    which = np.concatenate([np.full(len(r), i) for i, (_, r) in enumerate(parts)])
    rows = np.concatenate([np.asarray(r, dtype=np.int64) for _, r in parts])
    col_index = None
    if col_groups is not None:
        order, size = col_groups
        col_index = torch.from_numpy((order[:, None] * size + np.arange(size)[None]).reshape(-1))

    def runs(start: int, n: int):
        w, r = which[start:start + n], rows[start:start + n]
        cut = np.flatnonzero(np.diff(w)) + 1
        for a, b in zip(np.r_[0, cut], np.r_[cut, len(w)]):
            yield parts[int(w[a])][0], r[a:b]

    def dense(start: int, n: int) -> torch.Tensor:
        out = torch.cat([reads.rows(name, idx, why) for name, idx in runs(start, n)])
        return out if col_index is None else out[:, col_index]

    def packed(start: int, n: int):
        from gguf import GGML_QUANT_SIZES

        from shoal.engine.execution.quantization.gguf import PACKED_TYPES

        pieces, qtype = [], None
        for name, idx in runs(start, n):
            t = reads.get(name, why)
            if t.tensor_type.name not in PACKED_TYPES or len(t.shape) != 2 or qtype not in (None, t.tensor_type.name):
                return None
            qtype = t.tensor_type.name
            pieces.append(np.asarray(t.data[idx]))
        data = np.concatenate(pieces)
        if col_index is not None:
            block, size = GGML_QUANT_SIZES[reads.get(parts[0][0], why).tensor_type]
            order, group = col_groups
            if group % block:
                return None  # the column groups cut through quantization blocks: dequantized instead
            width = group // block * size
            data = data.reshape(len(data), -1, width)[:, order].reshape(len(data), -1)
        return np.ascontiguousarray(data), qtype, cols

    return View((len(rows), cols), dense, packed)


def _computed(shape: tuple[int, ...], make: Callable[[], torch.Tensor]) -> View:
    def rows(start: int, n: int) -> torch.Tensor:
        w = make()
        if tuple(w.shape) != tuple(shape):
            raise WeightError(f"a stored tensor gives shape {list(w.shape)} where {list(shape)} is expected")
        return w.narrow(0, start, n)

    return View(shape, rows)


def _untile(nk: int, r: int, size: int) -> np.ndarray:
    """Stored rows (value heads tiled: head i of key head j at i * nk + j, `size` rows each) in grouped order (head
    j * r + i), as row indices into the stored tensor."""
    heads = np.arange(nk * r)
    j, i = heads // r, heads % r
    return ((i * nk + j)[:, None] * size + np.arange(size)[None]).reshape(-1)


def hybrid_layout(arch: str, config, tensors: dict, path) -> HybridLayout:
    """Where each tensor of the Shoal model for `config` is in a file of architecture `arch` (tensors: GGUF name ->
    tensor)."""
    reads, out = _Reads(tensors, path), HybridLayout()
    if arch in _GDN:
        _gdn_layout(arch, config, reads, out)
    elif arch == "falcon-h1":
        _falcon_layout(config, reads, out)
    else:
        _mamba_layout(arch, config, reads, out)
    return out


def _gdn_layout(arch: str, c, reads: _Reads, out: HybridLayout) -> None:
    h = c.hidden_size
    nk, nv, dk, dv = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
    r, kd, vd = nv // nk, nk * dk, nv * dv
    plain = out.plain
    plain.update({"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                  "lm_head.weight": "output.weight"})
    out.shifted.add("model.norm.weight")
    for i, kind in enumerate(c.layer_types):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        for hf, gg in (("input_layernorm", "attn_norm"), ("post_attention_layernorm", "post_attention_norm")):
            plain[f"{p}{hf}.weight"] = f"{b}{gg}.weight"
            out.shifted.add(f"{p}{hf}.weight")
        if kind == "full_attention":
            for hf, gg in (("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v"), ("o_proj", "attn_output"),
                           ("q_norm", "attn_q_norm"), ("k_norm", "attn_k_norm")):
                plain[f"{p}self_attn.{hf}.weight"] = f"{b}{gg}.weight"
            out.shifted.update({f"{p}self_attn.q_norm.weight", f"{p}self_attn.k_norm.weight"})
        else:
            a = p + "linear_attn."
            _gdn_mixer(arch, a, b, i, (h, nk, nv, dk, dv, r, kd, vd), c.linear_conv_kernel_dim, reads, out)
        if arch == "qwen35":
            for proj in ("gate", "up", "down"):
                plain[f"{p}mlp.{proj}_proj.weight"] = f"{b}ffn_{proj}.weight"
        else:  # experts come from the stacks (the loader's qwen MoE table); the router and shared expert here
            plain[f"{p}mlp.gate.weight"] = f"{b}ffn_gate_inp.weight"
            plain[f"{p}mlp.shared_expert_gate.weight"] = f"{b}ffn_gate_inp_shexp.weight"
            for proj in ("gate", "up", "down"):
                plain[f"{p}mlp.shared_expert.{proj}_proj.weight"] = f"{b}ffn_{proj}_shexp.weight"


def _gdn_mixer(arch, a: str, b: str, i: int, dims, kernel: int, reads: _Reads, out: HybridLayout) -> None:
    h, nk, nv, dk, dv, r, kd, vd = dims
    plain, views = out.plain, out.views
    why = lambda name: f"{a}{name} of layer {i}"  # noqa: E731
    conv_rows = np.arange(2 * kd + vd)
    head_order = np.arange(nv)
    if arch == "qwen3next":
        if f"{b}attn_qkv.weight" in reads.tensors or f"{b}ssm_in.weight" not in reads.tensors:
            # in_proj_qkvz's rows, per key head j: q_j, k_j, v_j (from attn_qkv), z_j (from attn_gate)
            parts = []
            for j in range(nk):
                parts += [(f"{b}attn_qkv.weight", np.r_[j * dk:(j + 1) * dk, kd + j * dk:kd + (j + 1) * dk,
                                                         2 * kd + j * r * dv:2 * kd + (j + 1) * r * dv]),
                          (f"{b}attn_gate.weight", np.arange(j * r * dv, (j + 1) * r * dv))]
            views[a + "in_proj_qkvz.weight"] = _gather_view(reads, parts, h, why("in_proj_qkvz.weight"))
        else:  # older files: in_proj_qkvz as the checkpoint has it
            plain[a + "in_proj_qkvz.weight"] = f"{b}ssm_in.weight"
        plain[a + "in_proj_ba.weight"] = f"{b}ssm_ba.weight"
        plain[a + "out_proj.weight"] = f"{b}ssm_out.weight"
    else:  # qwen35: the value heads tiled; gathered back into groups
        v_rows = _untile(nk, r, dv)
        conv_rows = np.r_[np.arange(2 * kd), 2 * kd + v_rows]
        head_order = _untile(nk, r, 1)
        views[a + "in_proj_qkv.weight"] = _gather_view(reads, [(f"{b}attn_qkv.weight", conv_rows)], h,
                                                       why("in_proj_qkv.weight"))
        views[a + "in_proj_z.weight"] = _gather_view(reads, [(f"{b}attn_gate.weight", v_rows)], h,
                                                     why("in_proj_z.weight"))
        for hf, gg in (("in_proj_b", "ssm_beta"), ("in_proj_a", "ssm_alpha")):
            views[f"{a}{hf}.weight"] = _gather_view(reads, [(f"{b}{gg}.weight", head_order)], h, why(f"{hf}.weight"))
        views[a + "out_proj.weight"] = _gather_view(reads, [(f"{b}ssm_out.weight", np.arange(h))], vd,
                                                    why("out_proj.weight"), col_groups=(head_order, dv))
    conv_name, a_name, dt_name = f"{b}ssm_conv1d.weight", f"{b}ssm_a", f"{b}ssm_dt.bias"
    views[a + "conv1d.weight"] = _computed((2 * kd + vd, 1, kernel), lambda: reads.full(
        conv_name, why("conv1d.weight"))[torch.from_numpy(conv_rows)][:, None])
    order = torch.from_numpy(head_order)
    views[a + "A_log"] = _computed((nv,), lambda: torch.log(-reads.full(a_name, why("A_log")).reshape(-1))[order])
    views[a + "dt_bias"] = _computed((nv,), lambda: reads.full(dt_name, why("dt_bias")).reshape(-1)[order])
    plain[a + "norm.weight"] = f"{b}ssm_norm.weight"


def _mamba_layout(arch: str, c, reads: _Reads, out: HybridLayout) -> None:
    plain = out.plain
    nemotron = arch == "nemotron_h"
    if nemotron:
        types, pre = c.layers_block_type, "backbone."
        heads, head_dim, groups, d_state = c.mamba_num_heads, c.mamba_head_dim, c.n_groups, c.ssm_state_size
        kernel = c.conv_kernel
        plain.update({"backbone.embeddings.weight": "token_embd.weight", "backbone.norm_f.weight": "output_norm.weight",
                      "lm_head.weight": "output.weight"})
    else:
        types, pre = c.layer_types, "model."
        heads, head_dim, groups, d_state = c.mamba_n_heads, c.mamba_d_head, c.mamba_n_groups, c.mamba_d_state
        kernel = c.mamba_d_conv
        plain.update({"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                      "lm_head.weight": "output.weight"})
    inner = heads * head_dim
    conv_dim = inner + 2 * groups * d_state
    for i, kind in enumerate(types):
        p, b = f"{pre}layers.{i}.", f"blk.{i}."
        why = lambda name, i=i: f"{name} of layer {i}"  # noqa: E731
        if nemotron:
            plain[p + "norm.weight"] = b + "attn_norm.weight"
            m = p + "mixer."
        else:
            plain[p + "input_layernorm.weight"] = b + "attn_norm.weight"
            plain[p + "post_attention_layernorm.weight"] = b + "ffn_norm.weight"
            m = p + ("self_attn." if kind in ("attention", "full_attention") else "mamba.")
        if kind in ("attention", "full_attention"):
            for hf, gg in (("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v"), ("o_proj", "attn_output")):
                for kind_ in ("weight", "bias"):
                    plain[f"{m}{hf}.{kind_}"] = f"{b}{gg}.{kind_}"
        elif kind == "mlp":
            for hf, gg in (("up_proj", "ffn_up"), ("down_proj", "ffn_down")):
                for kind_ in ("weight", "bias"):
                    plain[f"{m}{hf}.{kind_}"] = f"{b}{gg}.{kind_}"
        else:
            _mamba_mixer(m, b, (heads, inner, conv_dim, kernel), why, reads, out)
        if not nemotron:
            _granite_mlp(c, p, b, reads, out)


def _mamba_mixer(m: str, b: str, dims, why, reads: _Reads, out: HybridLayout) -> None:
    """A Mamba2 mixer under `m` from layer `b`'s ssm_* tensors (A as -exp(A_log) and D as [heads, 1], the conv
    squeezed, the gated norm as [groups, inner / groups])."""
    heads, inner, conv_dim, kernel = dims
    plain, views = out.plain, out.views
    for kind_ in ("weight", "bias"):
        plain[f"{m}in_proj.{kind_}"] = f"{b}ssm_in.{kind_}"
        plain[f"{m}out_proj.{kind_}"] = f"{b}ssm_out.{kind_}"
    plain[m + "conv1d.bias"] = b + "ssm_conv1d.bias"
    plain[m + "dt_bias"] = b + "ssm_dt.bias"
    names = {"conv": b + "ssm_conv1d.weight", "A": b + "ssm_a", "D": b + "ssm_d", "norm": b + "ssm_norm.weight"}
    views[m + "conv1d.weight"] = _computed((conv_dim, 1, kernel), lambda: reads.full(
        names["conv"], why("conv1d.weight"))[:, None])
    views[m + "A_log"] = _computed((heads,), lambda: torch.log(-reads.full(names["A"], why("A_log")).reshape(-1)))
    views[m + "D"] = _computed((heads,), lambda: reads.full(names["D"], why("D")).reshape(-1))
    views[m + "norm.weight"] = _computed((inner,), lambda: reads.full(names["norm"], why("norm.weight")).reshape(-1))


def _falcon_layout(c, reads: _Reads, out: HybridLayout) -> None:
    """Falcon-H1: attention and Mamba2 on each layer's input norm, then the gated MLP on ffn_norm (which llama.cpp
    names without a .weight suffix)."""
    plain = out.plain
    plain.update({"model.embed_tokens.weight": "token_embd.weight", "model.final_layernorm.weight": "output_norm.weight",
                  "lm_head.weight": "output.weight"})
    heads, inner = c.mamba_n_heads, c.mamba_d_ssm
    dims = (heads, inner, inner + 2 * c.mamba_n_groups * c.mamba_d_state, c.mamba_d_conv)
    for i in range(c.num_hidden_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        plain[p + "input_layernorm.weight"] = b + "attn_norm.weight"
        suffixed = b + "ffn_norm.weight" in reads.tensors  # (written without the suffix; accepted with it)
        plain[p + "pre_ff_layernorm.weight"] = b + "ffn_norm.weight" if suffixed else b + "ffn_norm"
        for hf, gg in (("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v"), ("o_proj", "attn_output")):
            plain[f"{p}self_attn.{hf}.weight"] = f"{b}{gg}.weight"
        for proj in ("gate", "up", "down"):
            plain[f"{p}feed_forward.{proj}_proj.weight"] = f"{b}ffn_{proj}.weight"
        _mamba_mixer(p + "mamba.", b, dims, lambda name, i=i: f"{name} of layer {i}", reads, out)


def _granite_mlp(c, p: str, b: str, reads: _Reads, out: HybridLayout) -> None:
    h, s = c.hidden_size, c.shared_intermediate_size
    sh = "shexp" if c.num_local_experts else ""
    gate, up, down = (f"{b}ffn_{x}{'_' + sh if sh else ''}.weight" for x in ("gate", "up", "down"))
    out.views[p + "shared_mlp.input_linear.weight"] = _gather_view(
        reads, [(gate, np.arange(s)), (up, np.arange(s))], h, "shared_mlp.input_linear.weight")
    out.plain[p + "shared_mlp.output_linear.weight"] = down
    if not c.num_local_experts:
        return
    e, inter, m = c.num_local_experts, c.intermediate_size, p + "block_sparse_moe."
    out.plain[m + "router.layer.weight"] = b + "ffn_gate_inp.weight"
    out.plain[m + "output_linear.weight"] = b + "ffn_down_exps.weight"
    names = (b + "ffn_gate_exps.weight", b + "ffn_up_exps.weight")

    def experts(start: int, n: int) -> torch.Tensor:  # expert e's input_linear: its gate rows, then its up rows
        g, u = (reads.rows(name, np.arange(start, start + n), "block_sparse_moe.input_linear.weight")
                for name in names)
        return torch.cat([g, u], dim=1)

    out.views[m + "input_linear.weight"] = View((e, 2 * inter, h), experts)
