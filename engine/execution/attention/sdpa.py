"""The always-available backend: torch scaled_dot_product_attention over keys/values gathered by block table.

Once per step it builds, for the whole batch, the cache slot of every (sequence, key position) and a padded
[B, max_query_len] view of the queries with a causal mask (plus the ALiBi bias when the model uses it, and a
sliding-window mask per distinct window). Every layer then runs one batched SDPA call: no Python loop over
sequences. Soft-capped scores (Gemma 2) and attention sinks (gpt-oss) are computed with explicit matmuls
(base.explicit_attention), since SDPA has neither. An fp8
cache's gathered blocks are dequantized (values times their row scales) to the queries' dtype first.

Bidirectional images (meta.image_spans, Gemma 3): a query inside an image also sees every key of the same image,
later ones included (transformers' OR(causal, same image block)); a sliding window still bounds it (AND window).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shoal.engine.execution.attention.base import (AttentionBackend, AttentionMetadata, dequantize_fp8,
                                                  explicit_attention)


class SdpaBackend(AttentionBackend):
    name = "sdpa"
    supports_alibi = True
    supports_fp8_kv = True
    supports_sinks = True

    def _plan(self, meta: AttentionMetadata, block_size: int, device: torch.device) -> dict:
        plan = meta.scratch.get("sdpa")
        if plan is not None:
            return plan
        B, max_q = meta.num_seqs, meta.max_query_len
        blocks = meta.block_tables.to(device=device, dtype=torch.long)  # [B, nblk]
        L = blocks.shape[1] * block_size
        q_lens = torch.tensor(meta.query_lens_list, device=device)
        seq_lens = meta.seq_lens.to(device=device, dtype=torch.long)
        ctx_lens = seq_lens - q_lens
        key_pos = torch.arange(L, device=device)
        key_valid = key_pos.unsqueeze(0) < seq_lens.unsqueeze(1)  # [B, L]
        decode = meta.is_decode_only and not meta.image_spans
        if decode:
            allowed = key_valid.view(B, 1, 1, L)
            q_rows = valid_flat = None
            q_pos = (seq_lens - 1).unsqueeze(1)  # [B, 1]
        else:
            j = torch.arange(max_q, device=device)
            q_valid = j.unsqueeze(0) < q_lens.unsqueeze(1)  # [B, max_q]
            q_rows = meta.query_start_loc[:-1].to(device=device, dtype=torch.long).unsqueeze(1) + j
            q_rows = torch.where(q_valid, q_rows, torch.zeros_like(q_rows))
            q_pos = ctx_lens.unsqueeze(1) + j  # absolute position of each padded query row
            allowed = (key_pos.view(1, 1, L) <= q_pos.unsqueeze(2)) & key_valid.unsqueeze(1)  # [B, max_q, L]
            for b, start, end in meta.image_spans or ():  # an image's queries see all of that image's keys
                inside_q = (q_pos[b] >= start) & (q_pos[b] < end) & q_valid[b]
                inside_k = (key_pos >= start) & (key_pos < end) & key_valid[b]
                allowed[b] |= inside_q.unsqueeze(1) & inside_k.unsqueeze(0)
            # Padding query rows attend to key 0 so softmax stays finite; their outputs are dropped.
            allowed = (allowed | (~q_valid).unsqueeze(2) & (key_pos == 0).view(1, 1, L)).unsqueeze(1)
            valid_flat = q_valid.flatten().nonzero().squeeze(1)
        plan = {
            "blocks": blocks,
            "q_rows": q_rows,
            "valid_flat": valid_flat,
            "mask": allowed,  # [B, 1, max_q, L]
            "key_pos": key_pos,
            "q_pos": q_pos,  # [B, max_q] absolute position of each (padded) query row
            "causal_only": B == 1 and int(ctx_lens[0]) == 0 and L == max_q and not meta.image_spans,
        }
        meta.scratch["sdpa"] = plan
        return plan

    @staticmethod
    def _window_mask(plan: dict, meta: AttentionMetadata, window: int) -> torch.Tensor:
        """The step's mask narrowed to each query's last `window` keys (cached per window for the step)."""
        key = ("sdpa-window", window)
        mask = meta.scratch.get(key)
        if mask is None:
            inside = plan["key_pos"].view(1, 1, -1) > plan["q_pos"].unsqueeze(2) - window  # [B, max_q, L]
            key_ok = plan["mask"] & inside.unsqueeze(1)
            # A padding query row keeps key 0 (its output is dropped) so its softmax stays finite.
            mask = key_ok | (~key_ok.any(-1, keepdim=True) & (plan["key_pos"] == 0).view(1, 1, 1, -1))
            meta.scratch[key] = mask
        return mask

    def forward(self, q, k_cache, v_cache, meta, scale, alibi_slopes=None, k_scale=None, v_scale=None,
                sliding_window=None, softcap=None, sinks=None):
        T, H, D = q.shape
        nb, bs, kvh, _ = k_cache.shape
        plan = self._plan(meta, bs, q.device)
        B = meta.num_seqs
        # Gather whole blocks (contiguous chunks), not single slots: far fewer, larger copies.
        k, v = k_cache[plan["blocks"]], v_cache[plan["blocks"]]
        if k_scale is not None:
            k = dequantize_fp8(k, k_scale[plan["blocks"]], q.dtype)
            v = dequantize_fp8(v, v_scale[plan["blocks"]], q.dtype)
        k = k.view(B, -1, kvh, D).transpose(1, 2)  # [B, kvh, L, D]
        v = v.view(B, -1, kvh, D).transpose(1, 2)
        if plan["q_rows"] is None:
            qp = q.view(B, 1, H, D).transpose(1, 2)  # decode: one query per sequence, already in order
        else:
            qp = q[plan["q_rows"]].transpose(1, 2)  # [B, H, max_q, D]
        gqa = kvh != H
        if alibi_slopes is None and softcap is None and sinks is None and plan["causal_only"] and not (
                sliding_window and sliding_window < k.shape[2]):
            out = F.scaled_dot_product_attention(qp, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        elif softcap is not None or sinks is not None:
            mask = plan["mask"] if not sliding_window else self._window_mask(plan, meta, sliding_window)
            out = explicit_attention(qp, k, v, mask, scale, softcap, sinks)
        else:
            if alibi_slopes is None:
                mask = plan["mask"] if not sliding_window else self._window_mask(plan, meta, sliding_window)
            else:
                key = ("alibi", id(alibi_slopes), q.dtype)
                mask = meta.scratch.get(key)
                if mask is None:
                    bias = alibi_slopes.to(q.device).view(1, H, 1, 1) * plan["key_pos"].view(1, 1, 1, -1).float()
                    mask = bias.masked_fill(~plan["mask"], float("-inf")).to(q.dtype)
                    meta.scratch[key] = mask
            out = F.scaled_dot_product_attention(qp, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
        out = out.transpose(1, 2).reshape(-1, H, D)
        if plan["valid_flat"] is None or out.shape[0] == T:
            return out
        return out.index_select(0, plan["valid_flat"])
