"""Verification of draft tokens that a proposer chose outright (n-gram; a greedy draft).

The target samples every position of a speculative row as it would sample that position
without speculation: the same logits processing and the same per-request stream (seed, sample
index, output position). Position j's token ``x_j`` is drawn from the target's distribution p_j
given the prefix through draft token j - 1. For a proposal that puts all its mass on ``d_j``,
rejection sampling accepts ``d_j`` with probability min(1, p_j(d_j) / 1) = p_j(d_j) and on
rejection draws from the residual p_j without ``d_j``: exactly "accept iff x_j == d_j, else emit
x_j". So the output is the target's: greedy rows token for token, and sampled rows too (each
output position draws with the stream it would have used), not only in distribution."""
from __future__ import annotations

from collections.abc import Mapping, Sequence


def accepted_tokens(draft: list[int], sampled: list[int]) -> list[int]:
    """The row's output: the drafts its samples confirm, then the first sample that differs (or,
    all confirmed, the bonus sample after the last draft). ``sampled`` has len(draft) + 1 tokens."""
    n = 0
    while n < len(draft) and sampled[n] == draft[n]:
        n += 1
    return sampled[:n + 1]


def verify_drafts(seq_ids: Sequence[int], drafts: Mapping[int, list[int]],
                  sampled: list[list[int]]) -> list[list[int]]:
    """Each row's output tokens (rows in ``seq_ids``' order): a row whose sequence has a draft
    keeps ``accepted_tokens`` of its samples."""
    return [accepted_tokens(drafts[seq_id], row) if seq_id in drafts else row
            for seq_id, row in zip(seq_ids, sampled)]
