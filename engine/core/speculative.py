"""Speculative decoding's proposals: n-gram prompt lookup (vLLM's "ngram" method).

A decoding sequence whose recent tokens already occurred earlier in its prompt or output (code being edited, a
passage being quoted or summarised) is likely to continue as it did then. The proposer finds the latest earlier
occurrence of the sequence's last n tokens (n from prompt_lookup_max down to prompt_lookup_min) and proposes the
tokens that followed it. The engine schedules them after the sequence's last token, the model scores all of them
in one forward pass, and the sampler keeps the longest prefix the target model agrees with (sampling.py,
`SamplingRow.draft`) plus one token of its own, so every step still yields at least one token.
"""

from __future__ import annotations

import numpy as np

from shoal.engine.config import SpeculativeConfig


class NgramProposer:
    def __init__(self, config: SpeculativeConfig):
        self.k = config.num_speculative_tokens
        self.n_max = config.prompt_lookup_max
        self.n_min = config.prompt_lookup_min

    def propose(self, token_ids: list[int], limit: int) -> list[int]:
        """At most min(k, limit) tokens that followed the latest earlier occurrence of token_ids' longest
        matching suffix; [] when no suffix of prompt_lookup_min..max tokens occurred before."""
        k = min(self.k, limit)
        if k <= 0 or len(token_ids) <= self.n_min:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.n_max, len(tokens) - 1), self.n_min - 1, -1):
            # Windows over tokens[:-1]: a match starting at i is followed by at least one token, tokens[i + n].
            windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
            hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return token_ids[start:start + k]
        return []
