"""Prompt lookup (the ``ngram`` method): a sequence's last n tokens, found earlier in its own
prompt or output, propose the tokens that followed them there. No model: it pays where the
output quotes its context (summaries, edits, extraction, code)."""
from __future__ import annotations


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, prompt_lookup_max: int, prompt_lookup_min: int) -> None:
        self.k = num_speculative_tokens
        self.max_n, self.min_n = prompt_lookup_max, prompt_lookup_min

    def propose(self, token_ids: list[int], max_tokens: int | None = None) -> list[int]:
        """Up to ``min(k, max_tokens)`` tokens that followed an earlier occurrence of the longest
        suffix of ``token_ids`` (``prompt_lookup_max`` tokens down to ``prompt_lookup_min``) that
        occurs earlier: the latest occurrence that k tokens follow, else the earliest; [] when none
        occurs."""
        k = self.k if max_tokens is None else min(self.k, max_tokens)
        length = len(token_ids)
        if k <= 0 or length <= self.min_n:
            return []
        last = token_ids[-1]
        # Where an earlier token equals the last one: the candidate ends of a match (a match must
        # end before the last token, so at least one token follows it).
        ends = [i for i, token in enumerate(token_ids[:-1]) if token == last]
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            suffix = token_ids[length - n:]
            matched = [e for e in ends if e >= n - 1 and token_ids[e - n + 1:e + 1] == suffix]
            if matched:
                # The latest match that k tokens follow; else the earliest (the most follow it: in
                # a repeating run the latest match sits just before the end).
                whole = [e for e in matched if e + k < length]
                start = (whole[-1] if whole else matched[0]) + 1
                return token_ids[start:start + k]
        return []
