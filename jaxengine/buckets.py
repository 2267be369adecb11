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


# A step of at least this many tokens pads its rows to at least this many: there a step's cost
# hardly depends on its rows, and the floor keeps the compiled pairs few. Below it tokens and rows
# pad alike (a decode of 3 sequences runs as 4 tokens in 4 rows).
ROW_FLOOR = 8


def token_buckets(max_num_batched_tokens: int, minimum: int = 1) -> list[int]:
    """From one token: on a CPU a step's matmuls cost about in proportion to its tokens, so a
    decode of one sequence padded to 16 tokens ran at about 60% of the speed (BENCHMARKS.md)."""
    return power_of_two_buckets(min(minimum, max_num_batched_tokens), max_num_batched_tokens)


def request_buckets(max_num_seqs: int, minimum: int = 1) -> list[int]:
    return power_of_two_buckets(minimum, max_num_seqs)


def step_row_buckets(max_num_seqs: int) -> list[int]:
    """The runner's default row buckets: powers of two up to ``max_num_seqs`` (those below
    ``ROW_FLOOR`` serve only steps of as few tokens)."""
    return request_buckets(max_num_seqs)


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


def step_bucket(num_tokens: int, num_rows: int, token_buckets: list[int], row_buckets: list[int]) -> tuple[int, int]:
    """The (token bucket, row bucket) a step of ``num_tokens`` tokens and ``num_rows`` rows
    (sample rows counted) pads to. Tokens pad to at least the rows, so a row bucket is no wider
    than its token bucket when the buckets allow; rows pad to at least ``ROW_FLOOR`` or the
    token bucket, whichever is smaller."""
    tokens = pick_bucket(min(max(num_tokens, num_rows, 1), token_buckets[-1]), token_buckets)
    rows = pick_bucket(min(max(num_rows, min(tokens, ROW_FLOOR), 1), row_buckets[-1]), row_buckets)
    return tokens, rows


def reachable_pairs(token_buckets: list[int], row_buckets: list[int], max_tokens: int | None = None,
                    max_rows: int | None = None) -> list[tuple[int, int]]:
    """Every pair ``step_bucket`` gives a step of at most ``max_tokens`` tokens and ``max_rows``
    rows (default: the largest buckets), sorted. ``step_bucket`` only changes where a count
    crosses a bucket, so the bucket sizes, the limits and 1 as counts reach every pair."""
    max_tokens, max_rows = max_tokens or token_buckets[-1], max_rows or row_buckets[-1]
    counts = sorted({1, max_tokens, max_rows, *token_buckets, *row_buckets})
    return sorted({step_bucket(n, m, token_buckets, row_buckets)
                   for n in counts if n <= max_tokens for m in counts if m <= max_rows})
