"""Speculative MTP (vLLM's "mtp" method): the checkpoint's own multi-token-prediction layer (DeepSeek V3's,
models/deepseek_mtp.py; Qwen3-Next's and Qwen3.5's, models/qwen3_next_mtp.py) proposes the next tokens from the
target's hidden states, on the executor's side like the draft model (execution/drafter.py: core/ sees only
DraftRequests and DraftProposals, with the same bookkeeping). On the hybrids (Qwen3-Next, Qwen3.5) the target's
recurrent state is backed up before each verification and restored when a proposal is rejected
(core/scheduler.accept_draft), as for every speculative method.

Where its state lives, and why there:
  - the target's hidden states: the target writes each row's final hidden state (after the final norm) at the
    row's KV slot into one [KV slots, hidden] tensor beside its cache (ModelRunner.keep_hidden; decode graphs
    capture the write too). A position's hidden state depends on the same tokens as its KV, so it is valid exactly
    where the KV is: after a prefix-cache hit, a preemption or a rejected proposal nothing needs tracking, and
    nothing outlives the blocks (freed with the sequence: nothing to leak on abort). It costs hidden_size values
    per token of the pool (counted into the KV budget; for DeepSeek V3 7168 against 61 x 576 latents, +20%), and
    only with this method.
  - the MTP layer's KV cache (DeepSeek's latent one, Qwen3-Next's plain paged K/V): a cache of its own in the same
    block ids (as the draft model's), not an extra layer of the target's pool: the target's forward is left as it
    is, and the MTP stream lags the target by one position (its entry i needs token i+1), which a layer inside the
    target's step could not compute.

A request's `num_computed` counts the MTP positions computed from the target's own hidden states. A proposal first
catches up on positions num_computed .. T-2 (T the sequence's tokens; entry i reads token i+1 and the target's hidden
state at i), whose last output gives the first proposal, then feeds each proposal with the layer's own output as
the hidden state, at positions T-1, T, ... in the slots the scheduler allocated for this step's proposals. Those
entries are never counted (num_computed stays T-1): the target's real hidden states overwrite them next time. The
MTP entries of a prefix-cache hit are recomputed from position 0 (as the draft model's; an entry at a block's last
position depends on the next block's first token), from the hidden states the cached blocks kept.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from shoal.engine.contracts import DraftProposal, DraftRequest, StepInputs
from shoal.engine.execution.runner import ModelRunner, attention_metadata
from shoal.engine.execution.sampling import choose_proposals

logger = logging.getLogger(__name__)


# The architectures whose MTP layer is built here: (module, config.json field counting the MTP layers).
QWEN3_NEXT = ("qwen3_next_mtp", "num_nextn_predict_layers")
QWEN3_5 = ("qwen3_next_mtp", "mtp_num_hidden_layers")
MTP_LAYERS = {
    "DeepseekV3ForCausalLM": ("deepseek_mtp", "num_nextn_predict_layers"),
    "Qwen3NextForCausalLM": QWEN3_NEXT,
    "Qwen3_5ForCausalLM": QWEN3_5, "Qwen3_5MoeForCausalLM": QWEN3_5,
    "Qwen3_5ForConditionalGeneration": QWEN3_5, "Qwen3_5MoeForConditionalGeneration": QWEN3_5,
}


def check_mtp_target(hf_config, model_dir) -> int:
    """Refuse a target without an MTP layer to run; its MTP layer count otherwise. Read from config.json itself
    (a vision-language checkpoint's text_config): transformers' DeepseekV3Config defaults the field (as
    num_mtp_layers) to 1 where the file has none."""
    arch = (getattr(hf_config, "architectures", None) or ["?"])[0]
    if arch not in MTP_LAYERS:
        raise ValueError(f"speculative method 'mtp' runs the MTP layers of {', '.join(sorted(MTP_LAYERS))} "
                         f"checkpoints, not {arch}; use 'ngram' or a draft 'model'")
    field = MTP_LAYERS[arch][1]
    raw = json.loads((Path(model_dir) / "config.json").read_text())
    layers = raw.get(field, raw.get("text_config", {}).get(field, raw.get("num_mtp_layers")))
    if not isinstance(layers, int) or layers < 1:
        raise ValueError(f"speculative method 'mtp': config field {field} is {layers!r} in the target's "
                         "config.json; the checkpoint has no multi-token-prediction layer")
    return layers


def load_mtp_module(target: ModelRunner, model_dir, quantization: str | None):
    """The checkpoint's MTP layer beside the target's model, on its device and dtype."""
    import importlib

    from shoal.engine.execution.model_loader import choose_formats, weight_source

    arch = target.hf_config.architectures[0]
    name, field = MTP_LAYERS[arch]
    kind = importlib.import_module(f"shoal.engine.execution.models.{name}")
    src = weight_source(model_dir, target.hf_config, target.device)
    try:
        prefix = kind.mtp_prefix(src, target.model.config)
        missing = [prefix + n for n in kind.REQUIRED if not src.has(prefix + n)]
        if missing:
            layers = check_mtp_target(target.hf_config, model_dir)
            raise ValueError(f"speculative method 'mtp': config field {field} is {layers}, but the checkpoint has no "
                             f"MTP layer weights (missing: {', '.join(missing)})")
        with torch.device(target.device):
            module = kind.MTP(target.model, src, target.dtype, target.backend)
        module.load_weights(src)
    finally:
        src.close()
    module.eval()
    choose_formats(module, gguf_packed=False, quantization=quantization)
    return module


class MTPDrafter:
    """The MTP layer, its KV cache, and its rounds per step (the DraftHost's drafter)."""

    padding_blocks = 0  # runs every step eagerly (the target's padding block holds the padding rows' hidden states)

    def __init__(self, target: ModelRunner, config, vocab_size: int, num_speculative_tokens: int,
                 max_num_batched_tokens: int):
        self.target = target
        self.k = num_speculative_tokens
        self.budget = max_num_batched_tokens
        self.vocab_size = vocab_size
        self.kv_cache_dtype = config.kv_cache_dtype
        self.module = load_mtp_module(target, target._load_args[0], config.quantization)
        target.keep_hidden = True  # before allocate_kv_cache, which then gives the target its hidden-state slots
        self.kv_cache = None
        self.block_size = 0
        own = [n for n, m in (("embed_tokens", self.module.own_embed), ("shared_head.head", self.module.own_head)) if m]
        logger.info("speculative MTP: %d proposals a step from %s (own %s; the target's otherwise), the target keeping "
                    "its last hidden state per KV slot", self.k, self.module.prefix.rstrip("."),
                    ", ".join(own) or "none")

    def bytes_per_block(self, block_size: int) -> int:
        """The MTP layer's KV entries and the target's kept hidden states of one block."""
        dtype = self.target.dtype
        entry = self.module.cache_bytes_per_token(dtype, self.kv_cache_dtype)
        return (entry + self.target.model.config.hidden_size * dtype.itemsize) * block_size

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.kv_cache = self.module.allocate_cache(num_blocks, block_size, self.target.dtype, self.target.device,
                                                   self.kv_cache_dtype)

    def free_kv_cache(self) -> None:
        self.kv_cache = None

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest]) -> list[DraftProposal]:
        """Each request's num_draft proposals (module docstring): round 0 catches up to position T-2 (in chunks
        within the token budget), rounds 1.. feed the previous proposal with the layer's own output."""
        tokens: list[list[int]] = [[] for _ in requests]
        probs: list[list[torch.Tensor | None]] = [[] for _ in requests]
        last: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # request -> (logits, layer output) of its last row
        # Entry T-2 at least: its output gives the first proposal.
        pending = [(i, min(r.num_computed, len(r.token_ids) - 2)) for i, r in enumerate(requests)]
        while pending:
            items, budget, rest = [], self.budget, []
            for i, start in pending:
                end = len(requests[i].token_ids) - 1  # entries start .. end-1
                n = min(end - start, max(budget, 1))
                items.append((i, start, requests[i].token_ids[start + 1:start + n + 1], None))
                budget -= n
                if start + n < end:
                    rest.append((i, start + n))
            for (i, start, chunk, _), out in zip(items, self._forward(requests, items)):
                if start + len(chunk) == len(requests[i].token_ids) - 1:
                    last[i] = out
            pending = rest
        active = list(range(len(requests)))
        for _ in range(self.k):
            rows = torch.stack([last[i][0] for i in active])
            for i, token, q in zip(active, *choose_proposals(rows, [requests[i] for i in active])):
                tokens[i].append(token)
                probs[i].append(q)
            active = [i for i in active if len(tokens[i]) < requests[i].num_draft]
            if not active:
                break
            # The proposal at the position after the last entry, with that entry's output as its hidden state.
            items = [(i, len(requests[i].token_ids) + len(tokens[i]) - 2, [tokens[i][-1]], last[i][1])
                     for i in active]
            for (i, *_), out in zip(items, self._forward(requests, items)):
                last[i] = out
        return [DraftProposal(t, q, len(r.token_ids) - 1) for t, q, r in zip(tokens, probs, requests)]

    def _forward(self, requests: list[DraftRequest], items) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(logits [vocab], layer output [H]) of the last row of each (request index, first position, input tokens,
        hidden state or None: the target's kept ones at those positions) item, its entries written into the
        request's blocks."""
        bs, device = self.block_size, self.target.device
        tokens, positions, slots, query_start, seq_lens, tables, hidden = [], [], [], [0], [], [], []
        width = max(len(requests[i].block_ids) for i, _, _, _ in items)
        for i, start, chunk, prev in items:
            block_ids = requests[i].block_ids
            span = range(start, start + len(chunk))
            row_slots = [block_ids[p // bs] * bs + p % bs for p in span]
            tokens.extend(chunk)
            positions.extend(span)
            slots.extend(row_slots)
            query_start.append(len(tokens))
            seq_lens.append(start + len(chunk))
            tables.append(block_ids + [0] * (width - len(block_ids)))
            hidden.append(prev.unsqueeze(0) if prev is not None else
                          self.target.model.hidden_sink.index_select(0, torch.tensor(row_slots, device=device)))
        inputs = StepInputs(
            input_ids=torch.tensor(tokens, dtype=torch.int64), positions=torch.tensor(positions, dtype=torch.int64),
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            query_start_loc=torch.tensor(query_start, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=torch.tensor(tables, dtype=torch.int32),
            logits_indices=torch.tensor(query_start[1:], dtype=torch.int64) - 1,
            query_lens=[len(c) for _, _, c, _ in items], seq_lens_list=seq_lens).to(device)
        out = self.module(inputs.input_ids, inputs.positions, torch.cat(hidden), self.kv_cache,
                          attention_metadata(inputs))
        out = out.index_select(0, inputs.logits_indices)
        logits = self.module.compute_logits(out)[:, :self.vocab_size]
        return list(zip(logits, out))
