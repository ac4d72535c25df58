"""The batched sampler the engine runs every step (its parameters, SamplingParams, are in shoal.engine.contracts).

The sampler is stateless: each call gets the step's logits and one `SamplingRow` per running sequence (its
parameters, prompt and output token ids, and its private `torch.Generator` when the request is seeded). Work is
vectorised over the batch. Sampling is by inverse CDF with one uniform per row: unseeded rows share one batch
draw, a seeded row draws its single value from its own generator (the only per-row loop on the hot path), so a
seeded request is reproducible whatever its batch-mates are. Every transformation is row-wise, and which code
path a row takes depends on that row alone.

On CPU, top-k/top-p work on each row's best `num_candidates` tokens (a partial selection) when those decide the
truncation, with a full sort (numpy's, several times faster than torch's on CPU) for the rows they do not.

Order of operations (vLLM's): penalties (repetition over prompt+output, frequency/presence over output) ->
min_tokens (EOS and stop_token_ids masked until enough tokens exist) -> greedy rows take the argmax ->
temperature -> top_k -> top_p -> min_p -> sample. Reported log-probabilities are those of the raw model
distribution (log_softmax of the unprocessed logits), like vLLM's default.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

from shoal.engine.contracts import DraftRequest, SamplingParams


def _argmax(x: torch.Tensor) -> torch.Tensor:
    """Index of the first maximum per row. On CPU a C++ kernel (csrc/cpu_fused_ops.cpp: ~30 us for 32 rows of
    32k logits against ~0.8 ms for torch's max(dim), itself ~3x faster than its argmax there)."""
    if x.device.type != "cpu":
        return x.argmax(dim=-1)
    if x.dim() == 2 and x.dtype == torch.float32 and x.stride(-1) == 1 and x.shape[-1]:
        from shoal.engine.execution.layers.fused import load_kernels

        ops = load_kernels()[0]
        if ops is not None:
            return ops.argmax_rows(x)
    return x.max(dim=-1).indices


def _logsumexp(x: torch.Tensor) -> torch.Tensor:
    """logsumexp over the last dim of finite logits (faster than torch.logsumexp on CPU)."""
    m = x.amax(dim=-1, keepdim=True)
    return (x - m).exp_().sum(dim=-1).log_() + m.squeeze(-1)


def _sort_desc(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows sorted descending, with indices. numpy's argsort is several times faster than torch.sort on CPU."""
    if z.device.type == "cpu":
        import numpy as np

        ids = torch.from_numpy(np.argsort(-z.numpy(), axis=-1))
        return z.gather(1, ids), ids
    return z.sort(dim=-1, descending=True)


def _plain_greedy(row: "SamplingRow") -> bool:
    """Greedy with nothing that changes the logits first (penalties, min_tokens, a grammar's bitmask), no known
    target token (a scoring row) and no log-probs to report."""
    p = row.params
    return (p.is_greedy and p.logprobs is None and not p.uses_penalties
            and row.token_bitmask is None and row.target is None
            and not (p.min_tokens and len(row.output_token_ids) < p.min_tokens))


def make_generator(seed: int, index: int = 0, device: torch.device | str = "cpu") -> torch.Generator:
    """The private generator of a seeded sequence.

    Completion `index` of a request with n > 1 gets a distinct stream (index 0 uses `seed` itself, so n=1 is
    reproducible from the seed alone). Create it on the device the logits live on.
    """
    g = torch.Generator(device=device)
    s = seed if index == 0 else (seed * 1_000_003 + index * 0x9E3779B1) & 0x7FFF_FFFF_FFFF_FFFF
    g.manual_seed(s & 0xFFFF_FFFF_FFFF_FFFF)
    return g


@dataclass
class SamplingRow:
    """One running sequence as the sampler sees it."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None = None  # set by the engine when params.seed is not None; kept across steps
    uniform: float | None = None  # this step's U[0,1) drawn ahead from `generator` (see for_remote)
    # Grammar-constrained rows: the allowed tokens as a packed bitmask (int32 [ceil(vocab/32)], bit t%32 of word
    # t//32 set = token t allowed), filled by the row's grammar matcher.
    token_bitmask: torch.Tensor | None = None
    # Scoring rows (prompt logprobs): the row's "sample" is this known next prompt token; only its logprob and
    # the top-`params.prompt_logprobs` alternatives are computed.
    target: int | None = None
    # Speculative decoding: the token proposed for this position. The row's token is then the model's verdict on
    # it: greedy rows take the argmax as always (equal to the draft when the model agrees); sampled rows run
    # rejection sampling, so the token is distributed exactly as the target's p whatever proposed it: the draft is
    # kept with probability min(1, p(draft) / q(draft)), else the token is drawn from max(0, p - q) renormalised,
    # where q is the distribution the draft was drawn from: `draft_probs` ([vocab] float32, a draft model's), or,
    # when None, a point mass on the draft (n-gram proposals: kept with probability p(draft), else drawn from p
    # without it). The draft survives iff the row's token equals it.
    draft: int | None = None
    draft_probs: torch.Tensor | None = None

    def for_remote(self) -> "SamplingRow":
        """A picklable copy for a sampler in another process (the last pipeline stage): the seeded draw is made
        here, from this row's own generator, exactly as the local sampler would; token histories travel only
        when penalties or min_tokens read them; a grammar travels as this step's bitmask only."""
        p = self.params
        uniform = self.uniform
        if self.generator is not None and not p.is_greedy:
            uniform = float(torch.rand(1, generator=self.generator, device=self.generator.device))
        if p.structured_outputs is not None:  # the compiled grammar stays on rank 0 (and does not pickle)
            p = copy.copy(p)
            p.structured_outputs = None
        return SamplingRow(
            params=p,
            prompt_token_ids=list(self.prompt_token_ids) if p.repetition_penalty != 1.0 else [],
            output_token_ids=list(self.output_token_ids) if (p.uses_penalties or p.min_tokens) else [],
            uniform=uniform, token_bitmask=self.token_bitmask, target=self.target, draft=self.draft,
            draft_probs=self.draft_probs,
        )


@dataclass
class SamplerOutput:
    token_ids: list[int]  # one per row
    # log-prob of the sampled token under the raw model distribution; None for rows whose params.logprobs is None
    logprobs: list[float | None]
    # per row: the top-N (token, logprob) of the raw distribution, best first, when params.logprobs is not None
    # (an empty list for logprobs=0), else None
    top_logprobs: list[list[tuple[int, float]] | None]
    # per row: 1-based rank of the sampled token in the raw distribution when params.logprobs is not None
    ranks: list[int | None] = field(default_factory=list)


def _apply_token_bitmask(x: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None) -> None:
    """In place: -inf at every token whose bit is clear in its row's packed int32 bitmask [R, ceil(V/32)].

    One vectorised unpack for all constrained rows (no per-row or per-token Python loop)."""
    V = x.shape[1]
    bits = torch.tensor([1 << k for k in range(31)] + [-(1 << 31)], dtype=torch.int32, device=x.device)
    allowed = (bitmask.unsqueeze(-1) & bits) != 0  # [R, W, 32]
    allowed = allowed.flatten(1)[:, :V]
    if allowed.shape[1] < V:  # a bitmask narrower than the logits: the extra (padding) columns are banned
        allowed = torch.nn.functional.pad(allowed, (0, V - allowed.shape[1]), value=False)
    if rows is None:
        x.masked_fill_(~allowed, float("-inf"))
    else:
        x[rows] = x[rows].masked_fill(~allowed, float("-inf"))


class Sampler:
    def __init__(self, vocab_size: int, eos_token_ids: set[int] | list[int] | int | None = None):
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        self.vocab_size = vocab_size
        if eos_token_ids is None:
            eos_token_ids = set()
        elif isinstance(eos_token_ids, int):
            eos_token_ids = {eos_token_ids}
        self.eos_token_ids = sorted(set(eos_token_ids))
        # CPU only: truncation (top-k/top-p) works on each row's best `num_candidates` tokens when they decide it.
        self.num_candidates = 128

    # ------------------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        B = len(rows)
        if logits.dim() != 2 or logits.shape[0] != B:
            raise ValueError(f"logits must be [num_rows={B}, vocab], got {tuple(logits.shape)}")
        if B == 0:
            return SamplerOutput([], [], [], [])
        V = min(self.vocab_size, logits.shape[1])
        if all(_plain_greedy(r) for r in rows):
            # Fast path (the common greedy batch): the argmax is all there is to do.
            tokens = _argmax(logits[:, :V]).tolist()
            return SamplerOutput(tokens, [None] * B, [None] * B, [None] * B)
        raw = logits[:, :V]
        if raw.dtype != torch.float32:
            raw = raw.float()
        device = raw.device
        params = [r.params for r in rows]

        x = self._process(raw, rows, V)

        # ---- choose tokens --------------------------------------------------------------------------------
        greedy = [p.is_greedy or r.target is not None for p, r in zip(params, rows)]
        if all(greedy):
            tokens = _argmax(x)
        else:
            tokens = self._sample(x, rows, greedy, V)
        score_rows = [i for i, r in enumerate(rows) if r.target is not None]
        if score_rows:
            tokens[torch.tensor(score_rows, device=device)] = torch.tensor(
                [rows[i].target for i in score_rows], device=device, dtype=tokens.dtype)

        # ---- log-probs of the raw distribution ----------------------------------------------------------------
        # Only rows that asked for logprobs pay for them (a full pass over the vocabulary per row).
        num_lp = [p.prompt_logprobs if r.target is not None else p.logprobs for p, r in zip(params, rows)]
        lp_rows = [i for i, k in enumerate(num_lp) if k is not None]
        top_out: list[list[tuple[int, float]] | None] = [None] * B
        ranks_out: list[int | None] = [None] * B
        sampled_out: list[float | None] = [None] * B
        token_list = tokens.tolist()
        if lp_rows:
            idx = torch.tensor(lp_rows, device=device) if len(lp_rows) < B else None
            sub_raw = raw if idx is None else raw.index_select(0, idx)
            sub_lse = _logsumexp(sub_raw)
            sub_tok_logit = sub_raw.gather(1, (tokens if idx is None else tokens.index_select(0, idx)).unsqueeze(1)
                                           ).squeeze(1)
            for i, lp in zip(lp_rows, (sub_tok_logit - sub_lse).tolist()):
                sampled_out[i] = lp
            ranks = ((sub_raw > sub_tok_logit.unsqueeze(1)).sum(dim=-1) + 1).tolist()
            kmax = max(num_lp[i] for i in lp_rows)
            if kmax > 0:
                vals, ids = sub_raw.topk(min(kmax, V), dim=-1)
                vals = (vals - sub_lse.unsqueeze(1)).tolist()
                ids = ids.tolist()
            for j, i in enumerate(lp_rows):
                k = num_lp[i]
                top_out[i] = [(ids[j][m], vals[j][m]) for m in range(min(k, V))] if k else []
                ranks_out[i] = ranks[j]
        return SamplerOutput(token_list, sampled_out, top_out, ranks_out)

    # ------------------------------------------------------------------------------------------------------
    def process_logits(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Penalties and min_tokens masking applied to logits[:, :vocab_size] (float32); a new tensor."""
        V = min(self.vocab_size, logits.shape[1])
        raw = logits[:, :V].float()
        x = self._process(raw, rows, V)
        return x.clone() if x is raw else x

    def _process(self, raw: torch.Tensor, rows: list[SamplingRow], V: int) -> torch.Tensor:
        """Grammar bitmasks, penalties, then min_tokens; returns `raw` itself when nothing applies (never
        modifies it)."""
        device = raw.device
        params = [r.params for r in rows]
        x = raw
        masked = [i for i, r in enumerate(rows) if r.token_bitmask is not None]
        if masked:
            x = x.clone()
            _apply_token_bitmask(x, torch.stack([rows[i].token_bitmask for i in masked]).to(device),
                                 None if len(masked) == len(rows) else torch.tensor(masked, device=device))
        pen_rows = [i for i, p in enumerate(params) if p.uses_penalties]
        if pen_rows:
            x = x.clone()
            self._apply_penalties(x, rows, pen_rows, V)
        mask_rows: list[int] = []
        mask_toks: list[int] = []
        for i, r in enumerate(rows):
            p = r.params
            if p.min_tokens and len(r.output_token_ids) < p.min_tokens:
                # vLLM: the ids that would stop the sequence; with ignore_eos, EOS does not stop it, so stays
                banned = set(p.stop_token_ids) if p.ignore_eos else set(self.eos_token_ids).union(p.stop_token_ids)
                for t in banned:
                    if t < V:
                        mask_rows.append(i)
                        mask_toks.append(t)
        if mask_rows:
            if x is raw:
                x = x.clone()
            x[torch.tensor(mask_rows, device=device), torch.tensor(mask_toks, device=device)] = float("-inf")

        return x

    def _apply_penalties(self, x: torch.Tensor, rows: list[SamplingRow], pen_rows: list[int], V: int) -> None:
        """In place on x: repetition over prompt+output (HF/vLLM), then frequency/presence over output (OpenAI).

        Index operations on the touched (row, token) pairs only, no [B, V] temporaries.
        """
        device = x.device
        rep_r: list[int] = []
        rep_t: list[int] = []
        rep_v: list[float] = []
        fr_r: list[int] = []
        fr_t: list[int] = []
        fr_v: list[float] = []
        pr_r: list[int] = []
        pr_t: list[int] = []
        pr_v: list[float] = []
        for i in pen_rows:
            r = rows[i]
            p = r.params
            if p.repetition_penalty != 1.0:
                toks = set(r.prompt_token_ids)
                toks.update(r.output_token_ids)
                rep_t.extend(toks)
                rep_r.extend([i] * len(toks))
                rep_v.extend([p.repetition_penalty] * len(toks))
            if p.frequency_penalty != 0.0 and r.output_token_ids:
                n = len(r.output_token_ids)
                fr_t.extend(r.output_token_ids)
                fr_r.extend([i] * n)
                fr_v.extend([-p.frequency_penalty] * n)
            if p.presence_penalty != 0.0 and r.output_token_ids:
                toks = set(r.output_token_ids)
                pr_t.extend(toks)
                pr_r.extend([i] * len(toks))
                pr_v.extend([-p.presence_penalty] * len(toks))

        def idx(rr: list[int], tt: list[int], vv: list[float]):
            r = torch.tensor(rr, device=device)
            t = torch.tensor(tt, device=device)
            v = torch.tensor(vv, device=device, dtype=x.dtype)
            keep = t < V
            if not bool(keep.all()):
                r, t, v = r[keep], t[keep], v[keep]
            return r, t, v

        if rep_t:
            r, t, pen = idx(rep_r, rep_t, rep_v)
            vals = x[r, t]
            x[r, t] = torch.where(vals > 0, vals / pen, vals * pen)
        if fr_t or pr_t:
            r, t, v = idx(fr_r + pr_r, fr_t + pr_t, fr_v + pr_v)
            x.index_put_((r, t), v, accumulate=True)

    @classmethod
    def _draw(cls, probs: torch.Tensor, u: torch.Tensor, draft_col: torch.Tensor | None,
              draft_q: torch.Tensor | None = None) -> torch.Tensor:
        """Column drawn per row from unnormalised weights; where draft_col >= 0, the proposed column is verified
        first (rejection sampling): kept when u < a = min(1, p(draft) / q(draft)), else a draw from the residual
        max(0, p - q), using the same uniform rescaled to [0, 1) (given u >= a, (u - a) / (1 - a) is uniform
        again). q is draft_q (per row, over the same columns; rows without a proposal ignore it) or, when None, a
        point mass on the proposal (a = p(draft), the residual p without it). Altogether the result is
        distributed exactly as the weights."""
        if draft_col is None:
            return cls._inverse_cdf(probs, u)
        has = draft_col >= 0
        col = draft_col.clamp_min(0).unsqueeze(1)
        total = probs.sum(dim=-1, keepdim=True)
        p = probs / total
        p_draft = p.gather(1, col).squeeze(1)
        if draft_q is None:
            q_draft = torch.ones_like(p_draft)
            rest = probs.scatter(1, col, 0.0)
        else:
            q_draft = draft_q.gather(1, col).squeeze(1)
            rest = (p - draft_q).clamp_min_(0.0)
        accept = torch.where(has, torch.minimum(p_draft / q_draft.clamp_min(1e-30), torch.ones_like(p_draft)),
                             torch.zeros_like(p_draft))
        rest = torch.where(has.unsqueeze(1), rest, probs)
        keep = has & ((u < accept) | (rest.sum(dim=-1) <= 0))
        u2 = torch.where(has, ((u - accept) / (1 - accept).clamp_min(1e-30)).clamp(0.0, 1.0), u)
        return torch.where(keep, col.squeeze(1), cls._inverse_cdf(rest, u2))

    @staticmethod
    def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """One draw per row from unnormalised non-negative weights; a zero-weight column is never chosen."""
        cum = probs.cumsum(dim=-1)
        total = cum[:, -1:]
        target = torch.minimum(u.unsqueeze(1) * total, torch.nextafter(total, torch.zeros_like(total)))
        idx = torch.searchsorted(cum, target, right=True)
        return idx.clamp_max_(probs.shape[1] - 1).squeeze(1)

    def _uniforms(self, rows: list[SamplingRow], rand_rows: list[int], device: torch.device) -> torch.Tensor:
        """One U[0,1) per sampled row; a seeded row draws exactly one value from its own generator per step."""
        u = torch.rand(len(rand_rows), device=device)
        pos: list[int] = []
        vals: list[torch.Tensor] = []
        for j, i in enumerate(rand_rows):
            row = rows[i]
            if row.uniform is not None:
                pos.append(j)
                vals.append(torch.tensor([row.uniform], device=device))
            elif row.generator is not None:
                pos.append(j)
                vals.append(torch.rand(1, generator=row.generator, device=row.generator.device).to(device))
        if pos:
            u.index_copy_(0, torch.tensor(pos, device=device), torch.cat(vals))
        return u

    def _sample(self, x: torch.Tensor, rows: list[SamplingRow], greedy: list[bool], V: int) -> torch.Tensor:
        device = x.device
        params = [r.params for r in rows]
        rand_rows = [i for i, g in enumerate(greedy) if not g]
        n = len(rand_rows)
        all_random = n == len(rows)
        z = x if all_random else x.index_select(0, torch.tensor(rand_rows, device=device))
        rp = [params[i] for i in rand_rows]
        temps = [p.temperature for p in rp]
        if any(t != 1.0 for t in temps):
            z = z / torch.tensor(temps, device=device, dtype=z.dtype).unsqueeze(1)
        top_k = [p.top_k if 0 < p.top_k < V else 0 for p in rp]
        top_p = [p.top_p for p in rp]
        min_p = [p.min_p for p in rp]
        u = self._uniforms(rows, rand_rows, device)
        drafts = draft_q = None
        if any(rows[i].draft is not None for i in rand_rows):
            drafts = torch.tensor([-1 if rows[i].draft is None else rows[i].draft for i in rand_rows], device=device)
            if any(rows[i].draft_probs is not None for i in rand_rows):
                # A draft model's distributions; a row without one (or without a proposal) is a point mass.
                draft_q = torch.zeros(n, V, device=device)
                for j, i in enumerate(rand_rows):
                    q, d = rows[i].draft_probs, rows[i].draft
                    if q is not None:
                        draft_q[j] = q[:V].to(device)
                    elif d is not None:
                        draft_q[j, d] = 1.0

        out = torch.empty(n, dtype=torch.long, device=device)
        trunc = [j for j in range(n) if top_k[j] or top_p[j] < 1.0]
        plain = [j for j in range(n) if not (top_k[j] or top_p[j] < 1.0)]
        if plain:
            pi = None if len(plain) == n else torch.tensor(plain, device=device)
            zp = z if pi is None else z.index_select(0, pi)
            probs = zp.softmax(dim=-1)
            mp = [min_p[j] for j in plain]
            if any(mp):
                thr = probs.amax(dim=-1, keepdim=True) * torch.tensor(mp, device=device, dtype=probs.dtype).unsqueeze(1)
                probs = probs.masked_fill(probs < thr, 0.0)
            tok = self._draw(probs, u if pi is None else u.index_select(0, pi),
                             None if drafts is None else drafts if pi is None else drafts.index_select(0, pi),
                             None if draft_q is None else draft_q if pi is None else draft_q.index_select(0, pi))
            if pi is None:
                out = tok
            else:
                out.index_copy_(0, pi, tok)
        if trunc:
            # Candidates: on CPU with a large vocabulary, top-K by partial selection usually holds the whole
            # nucleus; rows whose truncation the candidates cannot decide fall back to a full sort. Which path a
            # row takes depends on that row alone, so seeded rows stay batch-independent.
            K = self.num_candidates if device.type == "cpu" and V > 2 * self.num_candidates else V
            every = len(trunc) == n
            ti = None if every else torch.tensor(trunc, device=device)
            zt = z if every else z.index_select(0, ti)
            ut = u if every else u.index_select(0, ti)
            tk = [top_k[j] for j in trunc]
            tp = [top_p[j] for j in trunc]
            tm = [min_p[j] for j in trunc]
            dt = None if drafts is None else drafts if every else drafts.index_select(0, ti)
            qt = None if draft_q is None else draft_q if every else draft_q.index_select(0, ti)
            tok, resolved = self._truncated(zt, K, tk, tp, tm, ut, dt, qt)
            if resolved is not None and not bool(resolved.all()):
                bad = torch.nonzero(~resolved).squeeze(1)
                bl = bad.tolist()
                tok2, _ = self._truncated(zt.index_select(0, bad), V, [tk[b] for b in bl], [tp[b] for b in bl],
                                          [tm[b] for b in bl], ut.index_select(0, bad),
                                          None if dt is None else dt.index_select(0, bad),
                                          None if qt is None else qt.index_select(0, bad))
                tok = tok.index_copy(0, bad, tok2)
            if every:
                out = tok
            else:
                out.index_copy_(0, ti, tok)
        if all_random:
            return out
        tokens = _argmax(x)
        tokens.index_copy_(0, torch.tensor(rand_rows, device=device), out)
        return tokens

    def _truncated(self, z: torch.Tensor, K: int, top_k: list[int], top_p: list[float], min_p: list[float],
                   u: torch.Tensor, drafts: torch.Tensor | None = None, draft_q: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """top-k -> top-p -> min-p -> sample in the space of the K best tokens of each row (sorted, descending).

        Returns the sampled token ids and, when K < V, which rows the candidates decided (None when K == V).
        """
        device = z.device
        V = z.shape[1]
        if K >= V:
            vals, ids = _sort_desc(z)
            K = V
        else:
            vals, ids = z.topk(K, dim=-1)
        pos = torch.arange(K, device=device).unsqueeze(0)
        has_k = [0 < k <= K for k in top_k]
        if any(has_k):
            kt = torch.tensor([k if h else K for k, h in zip(top_k, has_k)], device=device).unsqueeze(1)
            vals = vals.masked_fill(pos >= kt, float("-inf"))
        # Normaliser: the kept top-k mass for top-k rows, the whole row otherwise.
        lse = _logsumexp(z) if K < V else _logsumexp(vals)
        if K < V and any(has_k):
            lse = torch.where(torch.tensor(has_k, device=device), _logsumexp(vals), lse)
        probs = (vals - lse.unsqueeze(1)).exp()
        resolved = None
        if any(p < 1.0 for p in top_p):
            cum = probs.cumsum(dim=-1)
            tpt = torch.tensor([p if p < 1.0 else 2.0 for p in top_p], device=device, dtype=probs.dtype).unsqueeze(1)
            # Drop a token when the mass strictly before it already reaches top_p; the best token always stays.
            drop = (cum - probs) >= tpt
            drop[:, 0] = False
            probs = probs.masked_fill(drop, 0.0)
            if K < V:
                resolved = torch.tensor(has_k, device=device) | (cum[:, -1] >= tpt.squeeze(1))
        if K < V:
            need_k = torch.tensor([0 < k <= K or p < 1.0 for k, p in zip(top_k, top_p)], device=device)
            big_k = torch.tensor([k > K for k in top_k], device=device)
            base = need_k & ~big_k
            resolved = base if resolved is None else (resolved & ~big_k)
        if any(m > 0.0 for m in min_p):
            mp = torch.tensor(min_p, device=device, dtype=probs.dtype).unsqueeze(1)
            probs = probs.masked_fill(probs < probs[:, :1] * mp, 0.0)
        draft_col = q_cand = None
        if drafts is not None:  # the proposal's place among the candidates; -1: not one of them (probability 0)
            match = ids == drafts.unsqueeze(1)
            outside = ~match.any(dim=-1)
            draft_col = torch.where(~outside, match.to(torch.uint8).argmax(dim=-1), torch.full_like(drafts, -1))
            if draft_q is not None:
                # q over the candidates (the residual max(0, p - q) is 0 elsewhere, where p is). A proposal outside
                # them has p = 0 and is rejected: verify it as a column of p = 0 with its own q, so the residual
                # is the same max(0, p - q) over the candidates.
                q_cand = draft_q.gather(1, ids)
                draft_col = torch.where(outside & (drafts >= 0), torch.full_like(drafts, -2), draft_col)
        if q_cand is not None and bool((draft_col == -2).any()):
            probs = torch.cat([probs, torch.zeros_like(probs[:, :1])], dim=1)  # a column of p = 0 ...
            q_out = draft_q.gather(1, drafts.clamp_min(0).unsqueeze(1))  # ... holding the proposal's q
            q_cand = torch.cat([q_cand, q_out], dim=1)
            draft_col = torch.where(draft_col == -2, torch.full_like(draft_col, probs.shape[1] - 1), draft_col)
            ids = torch.cat([ids, drafts.clamp_min(0).unsqueeze(1)], dim=1)
        idx = self._draw(probs, u, draft_col, q_cand)
        return ids.gather(1, idx.unsqueeze(1)).squeeze(1), resolved


def choose_proposals(logits: torch.Tensor, requests: list[DraftRequest]) -> tuple[list[int], list[torch.Tensor | None]]:
    """Each request's proposal from its draft logits (a draft model's or the MTP layer's): the argmax for greedy
    requests, else a draw from the softmax at the request's temperature (returned with it, for the target's
    rejection sampling)."""
    tokens = logits.argmax(dim=-1).tolist()
    probs: list[torch.Tensor | None] = [None] * len(requests)
    for i, r in enumerate(requests):
        if r.params.is_greedy:
            continue
        q = (logits[i] / r.params.temperature).softmax(dim=-1)
        tokens[i] = int(torch.multinomial(q, 1, generator=r.generator))
        probs[i] = q
    return tokens, probs
