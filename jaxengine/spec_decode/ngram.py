"""Prompt lookup (the ``ngram`` method): a sequence's last n tokens, found earlier in its own
prompt or output, propose the tokens that followed them there. No model: it pays where the
output quotes its context (summaries, edits, extraction, code)."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, prompt_lookup_max: int, prompt_lookup_min: int) -> None:
        self.k = num_speculative_tokens
        self.max_n, self.min_n = prompt_lookup_max, prompt_lookup_min

    def propose(self, token_ids: Sequence[int] | np.ndarray, max_tokens: int | None = None) -> list[int]:
        """Up to ``min(k, max_tokens)`` tokens that followed an earlier occurrence of the longest
        suffix of ``token_ids`` (``prompt_lookup_max`` tokens down to ``prompt_lookup_min``) that
        occurs earlier: the latest occurrence that k tokens follow, else the earliest; [] when none
        occurs. ``token_ids`` may be the runner's row of its token buffer: it is searched in place,
        a vector operation per suffix length, not copied into a list."""
        k = self.k if max_tokens is None else min(self.k, max_tokens)
        tokens = np.asarray(token_ids)
        length = tokens.shape[0]
        if k <= 0 or length <= self.min_n:
            return []
        # Where an earlier token equals the last one: the candidate ends of a match (a match must
        # end before the last token, so at least one token follows it).
        ends = np.flatnonzero(tokens[:-1] == tokens[-1])
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            matched = ends[ends >= n - 1]
            for back in range(1, n):                 # the suffix's earlier tokens, from the end
                if not matched.size:
                    break
                matched = matched[tokens[matched - back] == tokens[length - 1 - back]]
            if matched.size:
                # The latest match that k tokens follow; else the earliest (the most follow it: in
                # a repeating run the latest match sits just before the end).
                whole = matched[matched + k < length]
                start = int(whole[-1] if whole.size else matched[0]) + 1
                return tokens[start:start + k].tolist()
        return []
