"""Bucket sizes: fixed shapes by construction, so recompilation stays bounded (pure functions)."""
from __future__ import annotations

import bisect


def power_of_two_buckets(minimum: int, maximum: int) -> list[int]:
    """minimum, 2*minimum, ... up to and including ``maximum`` (which need not be a power of two)."""
    buckets, b = [], max(1, minimum)
    while b < maximum:
        buckets.append(b)
        b *= 2
    buckets.append(maximum)
    return buckets


def token_buckets(max_num_batched_tokens: int, minimum: int = 16) -> list[int]:
    return power_of_two_buckets(min(minimum, max_num_batched_tokens), max_num_batched_tokens)


def request_buckets(max_num_seqs: int, minimum: int = 1) -> list[int]:
    return power_of_two_buckets(minimum, max_num_seqs)


def step_row_buckets(max_num_seqs: int) -> list[int]:
    """The runner's default row buckets: from 8 (fewer rows cost the same) up to ``max_num_seqs``."""
    return request_buckets(max_num_seqs, minimum=min(8, max_num_seqs))


def step_buckets(max_num_batched_tokens: int, max_num_seqs: int, token_buckets_given: list[int] | None = None,
                 request_buckets_given: list[int] | None = None) -> tuple[list[int], list[int]]:
    """The (token, row) buckets of a runner's steps: those given (sorted; each list must be
    positive and end at its limit, a ValueError naming the option otherwise), else the defaults.
    The one place they are worked out: the options, the runner and the lab all ask here."""
    return (_checked(token_buckets_given, max_num_batched_tokens, "token_buckets")
            or token_buckets(max_num_batched_tokens),
            _checked(request_buckets_given, max_num_seqs, "request_buckets") or step_row_buckets(max_num_seqs))


def _checked(buckets: list[int] | None, largest: int, name: str) -> list[int] | None:
    if buckets is None:
        return None
    buckets = sorted(set(buckets))
    if not buckets or buckets[0] < 1 or buckets[-1] != largest:
        raise ValueError(f"{name}: must be positive and end at {largest} (the step's limit), got {buckets}")
    return buckets


def pick_bucket(n: int, buckets: list[int]) -> int:
    """The smallest bucket >= n."""
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")
    return buckets[i]
