"""Mixture-of-experts: the router, one fused experts layer, and the sparse MLP block the MoE families share.

Routing (`select_experts`): softmax (or sigmoid, where a config says `scoring_func: sigmoid`) over the router
logits (plus the router's bias where it has one: gpt-oss) in float32, top-k, optionally renormalised over the chosen
k (`norm_topk_prob`; Mixtral and gpt-oss always do). DeepSeek's routing (`GroupedRouting`) adds three steps: a
per-expert correction bias added to the scores for the choice only (the weights stay the unbiased scores), the choice
limited to the `topk_group` best of `n_group` expert groups (a group scored by its two best biased scores, or by its
best score without a bias: DeepSeek V2's group_limited_greedy), and the final weights times routed_scaling_factor.

Experts (`fused_experts`): the (token, slot) pairs are grouped by expert and each expert with tokens runs as one
batch — gather, one GEMM for gate and up together (plus their bias), the activation, one GEMM for down (plus its
bias), weighted scatter-add. The activation is SwiGLU, silu(gate) * up, or gpt-oss's clamped variant
(`ExpertActivation`): gate clamped above and up on both sides at `limit`, then (up + 1) * gate * sigmoid(alpha * gate).
Three implementations of the same contract:
  - CPU: a C++ kernel (csrc/cpu_moe.cpp: counting sort and the per-expert loop in C++, GEMMs through at::mm);
  - GPU: a Triton grouped GEMM (moe_triton.py);
  - everywhere else, or when the C++ kernel cannot be built: `fused_experts_torch`, the same grouping in torch.
SHOAL_DISABLE_FUSED_OPS=1 forces the torch path, like the other fused ops.

Parallelism (`FusedMoE`): under tensor parallelism every expert's intermediate dimension is split across the ranks
like a dense MLP's (gate/up by rows, down by columns) and the block ends in one all-reduce. With
--enable-expert-parallel the ranks of the tensor-parallel group hold whole experts instead (a contiguous range
each), and the pairs reach them by one of two exchanges (distributed/expert_exchange.py, chosen by measurement at
start-up): each rank runs the pairs of all tokens routed to its experts and one all-reduce of [tokens, hidden] sums
the partial outputs (as in the tensor-parallel layer), or each rank sends its share of the tokens' pairs to the
experts' owners by all-to-all and gets the outputs back.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from shoal.engine.distributed.parallel_state import divide, get_parallel_state
from shoal.engine.execution.layers import small_gemm
from shoal.engine.execution.layers.activation import SILU, ExpertActivation

logger = logging.getLogger(__name__)

SCORING = ("softmax", "sigmoid")


# ------------------------------------------------------------------------------------------------------- routing


@dataclass(frozen=True)
class GroupedRouting:
    """DeepSeek's routing options (see the module docstring); the defaults route like plain top-k."""

    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    correction_bias: bool = False  # the router has an e_score_correction_bias [E]


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool,
                   scoring_func: str = "softmax", grouping: GroupedRouting | None = None,
                   correction_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, expert ids [T, k] int64) of each token's top_k experts."""
    logits = router_logits.float()
    if scoring_func == "softmax":
        scores = torch.softmax(logits, dim=-1)
    elif scoring_func == "sigmoid":
        scores = torch.sigmoid(logits)
    else:
        raise ValueError(f"MoE scoring_func {scoring_func!r} is not supported (supported: {', '.join(SCORING)})")
    if grouping is None:
        weights, ids = torch.topk(scores, top_k, dim=-1)
        if renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if grouping.n_group > 1:
        T, E = choice.shape
        groups = choice.view(T, grouping.n_group, E // grouping.n_group)
        group_scores = (groups.topk(2, dim=-1)[0].sum(-1) if correction_bias is not None
                        else groups.amax(dim=-1))
        keep = torch.topk(group_scores, grouping.topk_group, dim=-1, sorted=False)[1]
        allowed = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
        choice = choice.masked_fill(~allowed.repeat_interleave(E // grouping.n_group, dim=1), float("-inf"))
    ids = torch.topk(choice, top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * grouping.routed_scaling_factor, ids


# ------------------------------------------------------------------------------------------------------- experts


def fused_experts_torch(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                        topk_ids: torch.Tensor, expert_start: int = 0, b13: torch.Tensor | None = None,
                        b2: torch.Tensor | None = None, activation: ExpertActivation = SILU) -> torch.Tensor:
    """The grouped computation in torch ops: one sort of the pairs, then one batch per expert with tokens."""

    def expert(e: int, xs: torch.Tensor) -> torch.Tensor:
        gate_up = F.linear(xs, w13[e], None if b13 is None else b13[e])
        return F.linear(activation(gate_up), w2[e], None if b2 is None else b2[e])

    return grouped_experts(x, topk_weights, topk_ids, expert_start, w13.shape[0], expert)


def grouped_experts(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, expert_start: int,
                    num_experts: int, expert) -> torch.Tensor:
    """sum over slots of weight * expert(e, tokens routed to e), with expert(e, xs) -> ys run once per local expert
    that received tokens (a Python loop over experts, never over tokens)."""
    T, top_k = topk_ids.shape
    E = num_experts
    local = topk_ids.reshape(-1) - expert_start
    local = torch.where((local >= 0) & (local < E), local, E)  # E: routed to another rank's expert
    order = torch.argsort(local, stable=True)
    counts = torch.bincount(local, minlength=E + 1).tolist()
    weights = topk_weights.reshape(-1).float()
    acc = torch.zeros(T, x.shape[1], dtype=torch.float32, device=x.device)
    start = 0
    for e, n in enumerate(counts[:E]):
        if n:
            slots = order[start:start + n]
            tokens = slots // top_k
            acc.index_add_(0, tokens, expert(e, x[tokens]).float() * weights[slots, None])
        start += n
    return acc.to(x.dtype)


@functools.cache
def load_cpu_kernel() -> tuple[object | None, str, float]:
    """(torch.ops.shoal_cpu_moe or None, why not, seconds spent building/loading)."""
    from shoal.engine.execution.native_build import NativeBuildError, kernel_ops

    start = time.perf_counter()
    if os.environ.get("SHOAL_DISABLE_FUSED_OPS") == "1":
        return None, "disabled by SHOAL_DISABLE_FUSED_OPS=1", 0.0
    try:
        ops = kernel_ops("moe")
    except NativeBuildError as e:  # never fatal: the torch path runs
        logger.warning("%s; using the torch MoE path", e)
        return None, str(e), time.perf_counter() - start
    return ops, "", time.perf_counter() - start


def _triton_usable(x: torch.Tensor) -> bool:
    if x.device.type != "cuda":
        return False
    from shoal.engine.execution.layers import moe_triton

    return moe_triton.triton is not None


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, expert_start: int = 0, b13: torch.Tensor | None = None,
                  b2: torch.Tensor | None = None, activation: ExpertActivation = SILU) -> torch.Tensor:
    """sum over each token's k slots of weight * (down(act(gate(x), up(x))) + b2) for the slots whose expert is one
    of this rank's [expert_start, expert_start + E): x [T, H], w13 [E, 2I, H] (gate rows then up rows), w2 [E, H, I],
    optional biases b13 [E, 2I] and b2 [E, H], topk_weights [T, k] float32, topk_ids [T, k] int64 (global ids).
    Returns [T, H] in x's dtype."""
    args = (x, w13, w2, topk_weights, topk_ids, expert_start, b13, b2, activation)
    if x.device.type == "cpu" and x.dim() == 2 and x.stride(1) == 1:
        ops = load_cpu_kernel()[0]  # None when disabled or not buildable
        if ops is not None:
            return ops.fused_experts(x, w13, w2, topk_weights.float(), topk_ids, expert_start, b13, b2,
                                     activation.kernel_id, activation.alpha, activation.limit)
    elif _triton_usable(x) and os.environ.get("SHOAL_DISABLE_FUSED_OPS") != "1":
        from shoal.engine.execution.layers.moe_triton import fused_experts_triton

        return fused_experts_triton(*args)
    return fused_experts_torch(*args)


class ExpertsFormat:
    """How a FusedMoE layer's experts are stored and run (the experts' counterpart of layers/weight_format.py): one
    object per layer, chosen once the checkpoint is read."""

    kernel: str = ""
    runs_on_parameter = False  # True: runs on the layer's w13/w2 Parameters (which memory counts already)

    def run(self, layer: "FusedMoE", x: torch.Tensor, topk_weights: torch.Tensor,
            topk_ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def nbytes(self) -> int:
        """Bytes held outside the layer's Parameters."""
        return 0


class DenseExperts(ExpertsFormat):
    """The stacked w13/w2 Parameters through fused_experts (C++ on CPU, Triton on CUDA, torch elsewhere)."""

    kernel = "fused experts"
    runs_on_parameter = True

    def run(self, layer, x, topk_weights, topk_ids):
        return fused_experts(x, layer.w13, layer.w2, topk_weights, topk_ids, layer.expert_start, layer.b13,
                             layer.b2 if layer.adds_b2 else None, layer.activation)


DENSE_EXPERTS = DenseExperts()


class AmxBf16Experts(ExpertsFormat):
    """bfloat16 stacks kept once in the AMX tiles' pair layout (layers/amx_gemm.py), run by the C++ kernel's tile
    path (csrc/cpu_moe.cpp, fused_experts_amx) at every batch size; the dense stacks are freed."""

    kernel = "fused experts on AMX tiles"

    def __init__(self, layer: "FusedMoE", ops):
        from shoal.engine.execution.layers import amx_gemm

        self.w13 = amx_gemm.pack(layer.w13.data)
        self.w2 = amx_gemm.pack(layer.w2.data)
        self.ops = ops

    def run(self, layer, x, topk_weights, topk_ids):
        if x.stride(-1) != 1:
            x = x.contiguous()
        a = layer.activation
        return self.ops.fused_experts_amx(x, self.w13, self.w2, topk_weights.float(), topk_ids, layer.expert_start,
                                          layer.b13, layer.b2 if layer.adds_b2 else None, a.kernel_id, a.alpha,
                                          a.limit)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.w13, self.w2))


def plain_experts_format(layer: "FusedMoE") -> ExpertsFormat:
    """The fastest unquantized form of a layer's loaded dense stacks: the AMX tiles' layout where the tier has them
    (bfloat16 on CPU, hidden and local intermediate widths multiples of 32), else the stacks as they are."""
    from shoal.engine.execution.layers import amx_gemm

    w13 = layer.w13
    if (w13.device.type != "cpu" or w13.dtype != torch.bfloat16 or not w13.numel()
            or layer.hidden % amx_gemm.BLOCK_K or layer.inter_local % amx_gemm.BLOCK_K
            or amx_gemm.load_kernel() is None):
        return DENSE_EXPERTS
    ops = load_cpu_kernel()[0]
    if ops is None or not ops.amx_available():
        return DENSE_EXPERTS
    return AmxBf16Experts(layer, ops)


class QuantizedExperts(ExpertsFormat):
    """One (gate_up, down) pair of quantization.QuantizedWeight per local expert (--quantization), run by the grouped
    torch path with the method's own matmul kernel."""

    def __init__(self, pairs: list):
        self.pairs = pairs
        self.kernel = ", ".join(sorted({q.kernel for pair in pairs for q in pair}))

    def run(self, layer, x, topk_weights, topk_ids):
        b13, b2 = layer.b13, layer.b2 if layer.adds_b2 else None

        def expert(e: int, xs: torch.Tensor) -> torch.Tensor:
            gate_up, down = self.pairs[e]
            h = gate_up.matmul(xs, None if b13 is None else b13[e])
            return down.matmul(layer.activation(h), None if b2 is None else b2[e])

        return grouped_experts(x, topk_weights, topk_ids, layer.expert_start, layer.num_local, expert)

    def nbytes(self) -> int:
        return sum(q.nbytes() for pair in self.pairs for q in pair)


class FusedMoE(nn.Module):
    """The experts of one layer, stacked: w13 [E_local, 2 * I_local, H] and w2 [E_local, H, I_local], and with
    bias=True (gpt-oss) b13 [E_local, 2 * I_local] and b2 [E_local, H].

    Tensor parallel: all E experts, each with I / tp of its intermediate features. Expert parallel: E / tp whole
    experts. forward returns this rank's partial sum; the caller all-reduces once (SparseMoeBlock). Under tensor
    parallelism every rank computes part of each expert's down projection, so its bias is added on rank 0 only.
    `format` runs the experts: the dense stacks (DenseExperts), the same in the AMX tiles' layout (AmxBf16Experts),
    one quantized pair per expert (--quantization: QuantizedExperts) or a GGUF file's blocks kept packed
    (quantization/gguf.py's GGUFExperts)."""

    format: ExpertsFormat = DENSE_EXPERTS
    gguf_parts: dict | None = None  # local expert -> (gate, up, down) GGUF blocks, until the formats are chosen

    def __init__(self, num_experts: int, hidden: int, intermediate: int, dtype: torch.dtype, bias: bool = False,
                 activation: ExpertActivation = SILU):
        super().__init__()
        ps = get_parallel_state()
        self.num_experts = num_experts
        self.expert_parallel = ps.expert_parallel and ps.tp_size > 1
        if self.expert_parallel:
            self.num_local = divide(num_experts, ps.tp_size, "number of experts")
            self.expert_start = ps.tp_rank * self.num_local
            self.inter_local, self.inter_start = intermediate, 0
        else:
            self.num_local, self.expert_start = num_experts, 0
            self.inter_local = divide(intermediate, ps.tp_size, "MoE intermediate size")
            self.inter_start = ps.tp_rank * self.inter_local
        self.hidden, self.intermediate = hidden, intermediate
        self.w13 = nn.Parameter(torch.empty(self.num_local, 2 * self.inter_local, hidden, dtype=dtype),
                                requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(self.num_local, hidden, self.inter_local, dtype=dtype),
                               requires_grad=False)
        self.activation = activation
        self.b13 = self.b2 = None
        if bias:
            self.b13 = nn.Parameter(torch.empty(self.num_local, 2 * self.inter_local, dtype=dtype), requires_grad=False)
            self.b2 = nn.Parameter(torch.empty(self.num_local, hidden, dtype=dtype), requires_grad=False)
        self.adds_b2 = self.expert_parallel or ps.tp_rank == 0  # b2 once per token, not once per rank

    def local_experts(self) -> range:
        return range(self.expert_start, self.expert_start + self.num_local)

    def load_expert(self, expert: int, read_gate, read_up, read_down, biases=None) -> None:
        """Copy one expert's slices straight from the checkpoint (Readers as in layers.linear): each tensor is
        read once, only this rank's part of it, into its place in the stack. biases: (gate, up, down) Readers
        when the layer has them."""
        i = expert - self.expert_start
        n, s = self.inter_local, self.inter_start
        if self.b13 is not None:
            gate, up, down = biases
            self.b13.data[i, :n].copy_(gate(0, s, n))
            self.b13.data[i, n:].copy_(up(0, s, n))
            self.b2.data[i].copy_(down(0, 0, self.hidden))
        parts = read_gate(0, s, n), read_up(0, s, n), read_down(1, s, n)
        if not all(isinstance(p, torch.Tensor) for p in parts):  # GGUF blocks kept as read (quantization/gguf.py)
            if self.gguf_parts is None:
                self.gguf_parts = {}
            self.gguf_parts[i] = parts
            return
        self.w13.data[i, :n].copy_(parts[0])
        self.w13.data[i, n:].copy_(parts[1])
        self.w2.data[i].copy_(parts[2])

    def use(self, fmt: ExpertsFormat) -> None:
        """Run the experts on `fmt` from now on; the dense stacks are freed when it does not run on them."""
        self.format = fmt
        if not fmt.runs_on_parameter:
            for p in (self.w13, self.w2):
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)

    def quantize(self, method) -> None:
        """Quantize every local expert with `method` (a quantization.QuantizedWeight class) and free the stacks."""
        self.use(QuantizedExperts([(method.from_dense(self.w13.data[e]), method.from_dense(self.w2.data[e]))
                                   for e in range(self.num_local)]))

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        return self.format.run(self, x, topk_weights, topk_ids)


class SparseMoeBlock(nn.Module):
    """Router + FusedMoE (+ an optional shared expert, gated by sigmoid(x . w) when the config has that gate):
    the MLP of a sparse decoder layer. One all-reduce at the end under tensor/expert parallelism."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, intermediate: int, renormalize: bool,
                 dtype: torch.dtype, scoring_func: str = "softmax", shared_intermediate: int = 0,
                 shared_gate: bool = False, router_bias: bool = False, expert_bias: bool = False,
                 activation: ExpertActivation = SILU, grouping: GroupedRouting | None = None):
        super().__init__()
        from shoal.engine.execution.layers.mlp import GatedMLP

        if top_k > num_experts:
            raise ValueError(f"num_experts_per_tok ({top_k}) exceeds the number of experts ({num_experts})")
        if scoring_func not in SCORING:
            raise ValueError(f"MoE scoring_func {scoring_func!r} is not supported (supported: {', '.join(SCORING)})")
        self.ps = get_parallel_state()
        if grouping is not None and (num_experts % grouping.n_group or grouping.topk_group > grouping.n_group
                                     or top_k > grouping.topk_group * (num_experts // grouping.n_group)):
            raise ValueError(f"n_group {grouping.n_group} / topk_group {grouping.topk_group} cannot route "
                             f"{top_k} of {num_experts} experts (n_group must divide the experts, topk_group be at "
                             "most n_group, and the kept groups hold at least num_experts_per_tok experts)")
        self.top_k, self.renormalize, self.scoring_func = top_k, renormalize, scoring_func
        self.grouping = grouping
        self.correction_bias = (nn.Parameter(torch.zeros(num_experts, dtype=torch.float32), requires_grad=False)
                                if grouping is not None and grouping.correction_bias else None)
        self.gate = nn.Parameter(torch.empty(num_experts, hidden, dtype=dtype), requires_grad=False)  # replicated
        self.gate_bias = (nn.Parameter(torch.empty(num_experts, dtype=dtype), requires_grad=False) if router_bias
                          else None)
        self.experts = FusedMoE(num_experts, hidden, intermediate, dtype, expert_bias, activation)
        self.shared_expert = GatedMLP(hidden, shared_intermediate, dtype) if shared_intermediate else None
        self.shared_expert_gate = (nn.Parameter(torch.empty(1, hidden, dtype=dtype), requires_grad=False)
                                   if shared_gate else None)

    @staticmethod
    def _gate_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """The router's and the shared expert's gate: a few dozen output rows, so at decode sizes oneDNN's call
        costs more than the arithmetic (20 vs 5 us for 8 x 512 -> 32 in bf16 on AMX); the small-M kernel streams
        them on the CPU, F.linear serves the rest."""
        kernel = small_gemm.kernel_for(weight) if small_gemm.serves(x, weight) else None
        return kernel(x, weight, bias) if kernel is not None else F.linear(x, weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = select_experts(self._gate_linear(x, self.gate, self.gate_bias), self.top_k, self.renormalize,
                                      self.scoring_func, self.grouping, self.correction_bias)
        exchange = self.ps.expert_exchange
        if self.experts.expert_parallel and exchange is not None and exchange.use_all_to_all(x.shape[0]):
            return self._all_to_all(x, weights, ids)
        out = self.experts(x, weights, ids)
        if self.shared_expert is not None:
            shared = self.shared_expert.partial(x)  # this rank's share; summed by the all-reduce below
            if self.shared_expert_gate is not None:
                shared = shared * torch.sigmoid(self._gate_linear(x, self.shared_expert_gate))
            out = out + shared
        return self.ps.all_reduce(out)

    def _all_to_all(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Expert parallel with the token exchange of distributed/expert_exchange.py instead of the all-reduce."""
        from shoal.engine.distributed.expert_exchange import all_to_all_experts

        def run(rows: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
            one = torch.ones(rows.shape[0], 1, dtype=torch.float32, device=rows.device)
            return self.experts(rows, one, expert_ids[:, None])

        out = all_to_all_experts(self.ps, x, weights, ids, self.experts.num_local, run)
        if self.shared_expert is not None:  # its weights are split like a dense MLP's: summed over the group
            shared = self.shared_expert.partial(x)
            if self.shared_expert_gate is not None:
                shared = shared * torch.sigmoid(self._gate_linear(x, self.shared_expert_gate))
            out = out + self.ps.all_reduce(shared)
        return out
