"""Multi-LoRA serving on the execution side: PEFT adapter directories, per-layer adapter slots, and the gathered
low-rank update that lets one batch mix adapters and the base model.

An adapter is a PEFT directory: adapter_config.json (r, lora_alpha, use_rslora, target_modules, rank_pattern,
alpha_pattern) and adapter_model.safetensors with `...layers.{i}.{self_attn|mlp}.{name}.lora_{A,B}.weight`
(A [r, in], B [out, r]). Its update to a linear layer is y += scale * (x @ A^T) @ B^T with scale = alpha / r
(alpha / sqrt(r) under rslora).

Each wrapped linear layer (the fused qkv_proj and gate_up_proj, o_proj, down_proj) holds `max_loras` slots:
A [S, parts*R, in] and B [S, parts*R, out] (B transposed, scale folded in, zero-padded to the max rank R). A fused
projection stacks its parts (q, k, v or gate, up) along the rank axis with each part's B writing only its own
output columns, so q/k/v adapters of any subset and rank run as one update. Tensor parallelism slices like the
base layer: column-parallel layers keep A whole and slice B by output; row-parallel layers slice A by input and
keep B whole, and the layer's existing all-reduce sums the partial updates (sum_k x_k A_k^T B^T = x A^T B^T).

The batch's token -> slot map (-1: base model) is set once per step (LoRAState; under decode capture a static
buffer the buckets share); `lora_apply_` adds every token's update grouped by slot: a C++ kernel on CPU
(csrc/cpu_lora.cpp: tokens grouped per slot, a shrink and an expand per group that read only each slot's rank
rows and each part's output columns), a Triton kernel on CUDA (layers/lora_triton.py, each token gathers its own
adapter's A and B), and a masked dense torch form otherwise (one GEMM pair over all slots, no loop).
"""

from __future__ import annotations

import functools
import json
import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

# PEFT module name -> (the engine's fused layer, part index within it)
TARGETS = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2), "o_proj": ("o_proj", 0),
           "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1), "down_proj": ("down_proj", 0)}
LAYER_PARTS = {"qkv_proj": 3, "o_proj": 1, "gate_up_proj": 2, "down_proj": 1}
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


class LoRAError(ValueError):
    """An adapter that cannot be served (missing files, unsupported options, rank too high, wrong base shape)."""


@dataclass
class AdapterInfo:
    path: str
    rank: int  # the largest rank over its modules
    targets: list[str]  # PEFT module names it adapts


def _base_shapes(hf_config) -> dict[str, tuple[int, int]]:
    """(out, in) of each PEFT target in the base model."""
    h = hf_config.hidden_size
    nh, nkv = hf_config.num_attention_heads, getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
    hd = getattr(hf_config, "head_dim", None) or h // nh
    inter = getattr(hf_config, "intermediate_size", None)
    return {"q_proj": (nh * hd, h), "k_proj": (nkv * hd, h), "v_proj": (nkv * hd, h), "o_proj": (h, nh * hd),
            "gate_proj": (inter, h), "up_proj": (inter, h), "down_proj": (h, inter)}


def _read_config(path: Path) -> dict:
    cfg_file = path / "adapter_config.json"
    if not path.is_dir():
        raise LoRAError(f"LoRA adapter path {str(path)!r} is not a directory")
    if not cfg_file.is_file():
        raise LoRAError(f"LoRA adapter {str(path)!r} has no adapter_config.json")
    try:
        cfg = json.loads(cfg_file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise LoRAError(f"LoRA adapter {str(path)!r}: adapter_config.json is unreadable: {e}") from None
    if cfg.get("peft_type", "LORA") != "LORA":
        raise LoRAError(f"LoRA adapter {str(path)!r}: peft_type {cfg.get('peft_type')!r} is not LORA")
    for key, why in (("use_dora", "DoRA"), ("modules_to_save", "modules_to_save (full-weight modules)"),
                     ("fan_in_fan_out", "fan_in_fan_out (Conv1D layouts)")):
        if cfg.get(key):
            raise LoRAError(f"LoRA adapter {str(path)!r}: {why} is not supported")
    if cfg.get("bias", "none") != "none":
        raise LoRAError(f"LoRA adapter {str(path)!r}: bias={cfg['bias']!r} is not supported (only 'none')")
    return cfg


def _weights_file(path: Path) -> Path:
    f = path / "adapter_model.safetensors"
    if not f.is_file():
        raise LoRAError(f"LoRA adapter {str(path)!r} has no adapter_model.safetensors")
    return f


def inspect_adapter(path: str, hf_config, max_rank: int) -> AdapterInfo:
    """Validate an adapter against the base model from its config and the safetensors header (no tensor data)."""
    from safetensors import safe_open

    p = Path(path)
    _read_config(p)
    shapes = _base_shapes(hf_config)
    layers = hf_config.num_hidden_layers
    rank, targets = 0, set()
    try:
        with safe_open(str(_weights_file(p)), framework="pt") as f:
            pairs: dict[tuple[int, str], dict[str, list[int]]] = {}
            for key in f.keys():
                m = _KEY.search(key)
                if m is None:
                    raise LoRAError(f"LoRA adapter {path!r}: tensor {key!r} is not a supported LoRA weight "
                                    f"(targets: {', '.join(TARGETS)})")
                layer, name, ab = int(m[1]), m[2], m[3]
                if name not in TARGETS:
                    raise LoRAError(f"LoRA adapter {path!r}: target module {name!r} is not supported "
                                    f"(supported: {', '.join(TARGETS)})")
                if layer >= layers:
                    raise LoRAError(f"LoRA adapter {path!r}: layer {layer} does not exist (the base model has "
                                    f"{layers})")
                pairs.setdefault((layer, name), {})[ab] = list(f.get_slice(key).get_shape())
    except LoRAError:
        raise
    except Exception as e:  # a truncated or foreign file
        raise LoRAError(f"LoRA adapter {path!r}: adapter_model.safetensors is unreadable: {e}") from None
    if not pairs:
        raise LoRAError(f"LoRA adapter {path!r} holds no LoRA weights")
    for (layer, name), ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise LoRAError(f"LoRA adapter {path!r}: layer {layer} {name} lacks lora_{'A' if 'A' not in ab else 'B'}")
        out, inp = shapes[name]
        r = ab["A"][0]
        if ab["A"] != [r, inp] or ab["B"] != [out, r]:
            raise LoRAError(f"LoRA adapter {path!r} does not fit the base model: layer {layer} {name} has lora_A "
                            f"{ab['A']} and lora_B {ab['B']}, the base layer needs [r, {inp}] and [{out}, r]")
        rank = max(rank, r)
        targets.add(name)
    if rank > max_rank:
        raise LoRAError(f"LoRA adapter {path!r} has rank {rank}, above --max-lora-rank {max_rank}")
    return AdapterInfo(path, rank, sorted(targets))


def _scale(cfg: dict, module_key: str, r: int) -> float:
    """PEFT's scaling: alpha / r (alpha / sqrt(r) with use_rslora); rank_pattern / alpha_pattern by key suffix."""
    alpha = cfg.get("lora_alpha", 8)
    for pattern, a in (cfg.get("alpha_pattern") or {}).items():
        if re.search(rf"(^|\.){re.escape(pattern)}$", module_key) or re.fullmatch(pattern, module_key):
            alpha = a
    return alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r


def read_adapter(path: str, hf_config, max_rank: int) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """{(layer, PEFT module): (A [r, in], scale * B [out, r])} in float32, after inspect_adapter's checks."""
    from safetensors.torch import load_file

    inspect_adapter(path, hf_config, max_rank)
    cfg = _read_config(Path(path))
    tensors = load_file(str(_weights_file(Path(path))))
    out: dict[tuple[int, str], list] = {}
    for key, t in tensors.items():
        m = _KEY.search(key)
        out.setdefault((int(m[1]), m[2]), [None, None])["AB".index(m[3])] = t.float()
    result = {}
    for (layer, name), (a, b) in out.items():
        module_key = f"model.layers.{layer}.{'mlp' if name in ('gate_proj', 'up_proj', 'down_proj') else 'self_attn'}.{name}"
        result[(layer, name)] = (a, b * _scale(cfg, module_key, a.shape[0]))
    return result


# ------------------------------------------------------------------------------------------------ the kernel

@functools.cache
def _cpu_kernel():
    from shoal.engine.execution.native_build import NativeBuildError, kernel_ops

    try:
        return kernel_ops("lora").lora_apply_
    except NativeBuildError as e:
        logger.warning("%s; LoRA uses the masked torch form", e)
        return None


def lora_apply_reference(y: torch.Tensor, x: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                         slots: torch.Tensor) -> None:
    """y += per token (x @ A[s]^T) @ B[s] (s = slots[t]; -1 adds nothing), as one GEMM pair over all slots: each
    token's low-rank activations of the other slots are zeroed by a mask."""
    S, R, n_in = A.shape
    h = x @ A.reshape(S * R, n_in).t()  # [T, S*R]
    mask = (slots.unsqueeze(1) == torch.arange(S, device=slots.device)).to(h.dtype)  # [T, S]
    h = (h.view(-1, S, R) * mask.unsqueeze(2)).view(-1, S * R)
    y.addmm_(h, B.reshape(S * R, B.shape[2]))


def lora_apply_(y: torch.Tensor, x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, slots: torch.Tensor,
                ranks: torch.Tensor | None = None, part_cols: torch.Tensor | None = None) -> None:
    """y += per token (x @ A[slots[t]]^T) @ B[slots[t]]: the C++ kernel on CPU, Triton on CUDA, else the masked
    torch form. ranks [S, P] and part_cols [P + 1] (see csrc/cpu_lora.cpp) let the CPU kernel skip the zero
    padding of A and B; every form is exact without them."""
    if x.device.type == "cpu":
        kernel = _cpu_kernel()
        if kernel is not None:
            if ranks is None:
                ranks = torch.full((A.shape[0], 1), A.shape[1], dtype=torch.int64)
            if part_cols is None:
                part_cols = torch.tensor([0, y.shape[1]], dtype=torch.int64)
            kernel(y, x.contiguous(), A, B, slots, ranks, part_cols)
            return
    elif x.device.type == "cuda":
        from shoal.engine.execution.layers.lora_triton import lora_apply_triton, triton

        if triton is not None:
            lora_apply_triton(y, x, A, B, slots)
            return
    lora_apply_reference(y, x, A, B, slots)


# ------------------------------------------------------------------------------------------ slots per layer

class LoRAState:
    """The current step's token -> slot map, shared by every wrapped layer of a runner."""

    def __init__(self):
        self.slots: torch.Tensor | None = None  # [T] int64; None when no token of the step uses an adapter
        # Decode capture (graph_capture.py): one static map for every batch-size bucket (bucket b reads its first b
        # rows), so a captured graph's LoRA kernels read each replay's map from the same memory.
        self.static_slots: torch.Tensor | None = None


class LoRASlots:
    """One linear layer's adapter slots; PackedMatmul.matmul calls add_to after its base product."""

    def __init__(self, state: LoRAState, layer, kind: str, max_loras: int, max_rank: int, dtype, device):
        self.state, self.layer, self.kind, self.R = state, layer, kind, max_rank
        out_local, in_local = layer.weight_shape
        parts = LAYER_PARTS[kind]
        self.A = torch.zeros(max_loras, parts * max_rank, in_local, dtype=dtype, device=device)
        self.B = torch.zeros(max_loras, parts * max_rank, out_local, dtype=dtype, device=device)
        # What the CPU kernel reads: each slot's rank per part (0: part not adapted) and each part's output columns.
        self.ranks = torch.zeros(max_loras, parts, dtype=torch.int64)
        self.part_cols = torch.tensor([0] + self._part_ends(out_local), dtype=torch.int64)
        self.kernel = _cpu_kernel() if torch.device(device).type == "cpu" else None  # built once, at start

    def _part_ends(self, out_local: int) -> list[int]:
        layer = self.layer
        if self.kind == "qkv_proj":
            return [dst + n for dst, _, n in layer._ranges()]
        if self.kind == "gate_up_proj":
            return [sum(layer.locals[:i + 1]) for i in range(len(layer.locals))]
        return [out_local]

    def add_to(self, x: torch.Tensor, y: torch.Tensor) -> None:
        slots = self.state.slots
        if slots is None:
            return
        x, y = x.view(-1, x.shape[-1]), y.view(-1, y.shape[-1])
        if self.kernel is not None and x.stride(1) == 1:  # the hot path: straight to the C++ op
            self.kernel(y, x, self.A, self.B, slots, self.ranks, self.part_cols)
        else:
            lora_apply_(y, x, self.A, self.B, slots, self.ranks, self.part_cols)

    def shard(self, part: int, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """This rank's (A rows, B^T rows, output offset) of one part's full A [r, in] and scaled B [out, r]."""
        layer = self.layer
        if self.kind == "qkv_proj":
            dst, src, n = layer._ranges()[part]
            return a, b[src:src + n].t(), dst
        if self.kind == "gate_up_proj":
            n = layer.locals[part]
            return a, b[layer.tp_rank * n:(layer.tp_rank + 1) * n].t(), sum(layer.locals[:part])
        in_local = layer.in_local  # row-parallel: A by input, B whole
        return a[:, layer.ps.tp_rank * in_local:(layer.ps.tp_rank + 1) * in_local], b.t(), 0

    def set_slot(self, slot: int, parts: list[tuple[int, torch.Tensor, torch.Tensor, int] | None]) -> None:
        """Fill `slot` from this layer's sharded parts [(part, A, B^T, out offset)] (empty: clear it)."""
        self.A[slot].zero_()
        self.B[slot].zero_()
        self.ranks[slot].zero_()
        for part, a, bt, off in parts:
            r = a.shape[0]
            self.ranks[slot, part] = r
            rows = slice(part * self.R, part * self.R + r)
            self.A[slot, rows].copy_(a)
            self.B[slot, rows, off:off + bt.shape[1]].copy_(bt)


class LoRAManager:
    """A runner's adapters: the resident ones (sharded, on the host) and the max_loras device slots."""

    def __init__(self, model, hf_config, max_loras: int, max_rank: int, dtype, device):
        from shoal.engine.execution.layers.linear import PackedMatmul

        self.hf_config, self.max_rank, self.max_loras = hf_config, max_rank, max_loras
        self.state = LoRAState()
        self.layers: dict[tuple[int, str], LoRASlots] = {}
        start = getattr(model, "start_layer", 0)
        for name, module in model.named_modules():
            m = re.search(r"layers\.(\d+)\.(?:\w+\.)*(qkv_proj|o_proj|gate_up_proj|down_proj)$", name)
            if m and isinstance(module, PackedMatmul):
                slots = LoRASlots(self.state, module, m[2], max_loras, max_rank, dtype, device)
                module.lora = slots
                self.layers[(start + int(m[1]), m[2])] = slots
        if not self.layers:
            raise LoRAError(f"{type(model).__name__} has no layers LoRA adapters can target")
        self.adapters: dict[int, dict[tuple[int, str], list]] = {}  # adapter id -> its shards per wrapped layer
        self.slot_ids: list[int | None] = [None] * max_loras

    def add(self, adapter_id: int, path: str) -> None:
        weights = read_adapter(path, self.hf_config, self.max_rank)
        shards: dict[tuple[int, str], list] = {}
        for (layer, name), (a, b) in weights.items():
            kind, part = TARGETS[name]
            slots = self.layers.get((layer, kind))
            if slots is None:  # a layer of another pipeline stage
                continue
            shards.setdefault((layer, kind), []).append((part, *slots.shard(part, a, b)))
        self.adapters[adapter_id] = shards

    def remove(self, adapter_id: int) -> None:
        self.adapters.pop(adapter_id, None)
        for s, held in enumerate(self.slot_ids):
            if held == adapter_id:
                self.slot_ids[s] = None

    def prepare(self, slot_ids: list[int | None] | None, token_slots: torch.Tensor | None) -> None:
        """Before a step: fill the slots whose adapter changed, and publish the step's token -> slot map."""
        self._fill_slots(slot_ids)
        self.state.slots = token_slots

    def enable_capture(self, max_tokens: int, device) -> None:
        """Give decode capture its static token -> slot map (graph_capture.DecodeGraphs allocates it once)."""
        self.state.static_slots = torch.full((max_tokens,), -1, dtype=torch.int64, device=device)

    def prepare_padded(self, slot_ids: list[int | None] | None, token_slots: torch.Tensor | None, bucket: int,
                       captured: bool) -> None:
        """Before a padded decode step of `bucket` rows: the step's map (padding rows: -1, the base model) goes into
        the static map. A captured graph always runs the LoRA update from it (a step without adapters adds
        nothing); an eager bucket skips the update when no token uses an adapter, like an uncaptured step."""
        self._fill_slots(slot_ids)
        static = self.state.static_slots
        n = 0 if token_slots is None else token_slots.shape[0]
        if n:
            static[:n].copy_(token_slots, non_blocking=True)
        static[n:bucket].fill_(-1)
        self.state.slots = static[:bucket] if captured or n else None

    def _fill_slots(self, slot_ids: list[int | None] | None) -> None:
        if slot_ids is not None:
            for s, adapter_id in enumerate(slot_ids):
                if adapter_id is None or adapter_id == self.slot_ids[s]:
                    continue
                shards = self.adapters[adapter_id]
                for key, slots in self.layers.items():
                    slots.set_slot(s, shards.get(key, []))
                self.slot_ids[s] = adapter_id
