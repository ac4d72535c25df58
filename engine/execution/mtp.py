"""Speculative MTP (vLLM's "mtp" method): a DeepSeek V3 checkpoint's own multi-token-prediction layer
(models/deepseek_mtp.py) proposes the next tokens from the target's hidden states, on the executor's side like the
draft model (execution/drafter.py: core/ sees only DraftRequests and DraftProposals, with the same bookkeeping).

Where its state lives, and why there:
  - the target's hidden states: the target writes each row's last hidden state (before the final norm) at the
    row's KV slot into one [KV slots, hidden] tensor beside its cache (ModelRunner.keep_hidden; decode graphs
    capture the write too). A position's hidden state depends on the same tokens as its KV, so it is valid exactly
    where the KV is: after a prefix-cache hit, a preemption or a rejected proposal nothing needs tracking, and
    nothing outlives the blocks (freed with the sequence: nothing to leak on abort). It costs hidden_size values
    per token of the pool (counted into the KV budget; for DeepSeek V3 7168 against 61 x 576 latents, +20%), and
    only with this method.
  - the MTP layer's latent KV cache: a cache of its own in the same block ids (as the draft model's), not an extra
    layer of the target's pool: the target's forward is left as it is, and the MTP stream lags the target by one
    position (its entry i needs token i+1), which a layer inside the target's step could not compute.

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
from shoal.engine.execution.layers.mla import LatentKVCache
from shoal.engine.execution.runner import ModelRunner, attention_metadata
from shoal.engine.execution.sampling import choose_proposals

logger = logging.getLogger(__name__)


def check_mtp_target(hf_config, model_dir) -> int:
    """Refuse a target without an MTP layer to run; its num_nextn_predict_layers otherwise. Read from config.json
    itself: transformers' DeepseekV3Config defaults the field (as num_mtp_layers) to 1 where the file has none."""
    arch = (getattr(hf_config, "architectures", None) or ["?"])[0]
    if arch != "DeepseekV3ForCausalLM":
        raise ValueError(f"speculative method 'mtp' is built for DeepseekV3ForCausalLM checkpoints only, not {arch} "
                         "(Qwen3-Next's MTP would need its recurrent state rolled back); use 'ngram' or a draft "
                         "'model'")
    raw = json.loads((Path(model_dir) / "config.json").read_text())
    layers = raw.get("num_nextn_predict_layers", raw.get("num_mtp_layers"))
    if not isinstance(layers, int) or layers < 1:
        raise ValueError(f"speculative method 'mtp': config field num_nextn_predict_layers is {layers!r} in the "
                         "target's config.json; the checkpoint has no multi-token-prediction layer")
    return layers


def load_mtp_module(target: ModelRunner, model_dir, quantization: str | None):
    """The checkpoint's MTP layer beside the target's model, on its device and dtype."""
    from shoal.engine.execution.model_loader import choose_formats, weight_source
    from shoal.engine.execution.models.deepseek_mtp import REQUIRED, DeepseekMTP, mtp_prefix

    src = weight_source(model_dir, target.hf_config, target.device)
    try:
        prefix = mtp_prefix(src, target.hf_config)
        missing = [prefix + n for n in REQUIRED if not src.has(prefix + n)]
        if missing:
            raise ValueError(f"speculative method 'mtp': config field num_nextn_predict_layers is "
                             f"{target.hf_config.num_nextn_predict_layers}, but the checkpoint has no MTP layer "
                             f"weights (missing: {', '.join(missing)})")
        with torch.device(target.device):
            module = DeepseekMTP(target.model, src, target.dtype, target.backend)
        module.load_weights(src)
    finally:
        src.close()
    module.eval()
    choose_formats(module, gguf_packed=False, quantization=quantization)
    return module


class MTPDrafter:
    """The MTP layer, its latent KV cache, and its rounds per step (the DraftHost's drafter)."""

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
        self.kv_cache: LatentKVCache | None = None
        self.block_size = 0
        own = [n for n, m in (("embed_tokens", self.module.own_embed), ("shared_head.head", self.module.own_head)) if m]
        logger.info("speculative MTP: %d proposals a step from %s (own %s; the target's otherwise), the target keeping "
                    "its last hidden state per KV slot", self.k, self.module.prefix.rstrip("."),
                    ", ".join(own) or "none")

    def bytes_per_block(self, block_size: int) -> int:
        """The MTP layer's latent entries and the target's kept hidden states of one block."""
        m = self.target.model
        latent = LatentKVCache.bytes_per_token_head(m.head_dim, self.target.dtype, self.kv_cache_dtype)
        return (latent + m.config.hidden_size * self.target.dtype.itemsize) * block_size

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.kv_cache = LatentKVCache.allocate(num_blocks, block_size, 1, self.target.model.head_dim,
                                               self.target.dtype, self.target.device, self.kv_cache_dtype)

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
