"""When speculation pays: each step's draft lengths (or none) from a measured cost model.

A step computes its whole padded token bucket, so what a draft costs is the step time of the
bucket it moves the step to, and what it buys is the draft tokens expected to be accepted. The
gate keeps both measured while the engine serves:

- the step time of each token bucket, from the engine's own steps that ran no prompt tokens
  (decodes and verifications), an exponential moving average so it follows the machine; a bucket
  not measured yet takes the time of the largest measured one below it (optimistic: a step
  there measures it, and a bucket that does not pay is then avoided);
- the acceptance, as a geometric model: each draft token is accepted with probability ``alpha``
  given the ones before it were (accepted tokens over accepted tokens plus rejections), for the
  engine as a whole and for each sequence (its own drafts, starting from the engine's figure:
  a request that quotes its prompt accepts more than one that writes freely).

Each step it plans every row's draft length: row r's i-th draft token is worth ``alpha_r^i``
expected tokens, so the tokens go in order of worth, and the plan stops at the number of draft
tokens that maximises the expected output tokens per second, ``(rows + worth of the tokens
taken) / t(bucket(tokens + tokens taken))``, against speculation off. At a small batch the bucket
hardly moves and speculation pays; at a large one the drafts push the step into a dearer bucket
than their accepted tokens are worth, and it is switched off. The longest planned draft and the
predicted gain go into the step's trace (``StepTrace.speculative_k``, ``speculation_gain``)."""
from __future__ import annotations

import bisect

EMA = 0.2                 # weight of a new measurement
PRIOR_ALPHA = 0.6         # acceptance before any draft was verified
MIN_TRIALS = 16           # draft tokens tried before the measured acceptance replaces the prior
ROW_PRIOR = 4.0           # a sequence's acceptance starts as this many trials at the engine's


class SpeculationGate:
    def __init__(self, num_speculative_tokens: int, token_buckets: list[int]) -> None:
        self.k = num_speculative_tokens
        self.buckets = sorted(token_buckets)
        self.step_s: dict[int, float] = {}     # token bucket -> measured seconds of a step without prompts
        self.accepted = 0.0
        self.trials = 0.0
        self.last_k = self.k                   # the latest choice, and its predicted gain (the trace's)
        self.last_gain = 0.0

    @property
    def alpha(self) -> float:
        if self.trials < MIN_TRIALS:
            return PRIOR_ALPHA
        return self.accepted / self.trials

    def bucket(self, num_tokens: int) -> int:
        i = bisect.bisect_left(self.buckets, num_tokens)
        return self.buckets[min(i, len(self.buckets) - 1)]

    def observe(self, num_tokens: int, step_s: float, ran_prompts: bool, accepted: int, trials: int) -> None:
        """A step's measured time (``num_tokens`` scheduled) and its drafts' outcome: ``accepted``
        draft tokens out of ``trials`` (accepted ones plus one per row that rejected one)."""
        if not ran_prompts and num_tokens:
            b = self.bucket(num_tokens)
            old = self.step_s.get(b)
            self.step_s[b] = step_s if old is None else (1 - EMA) * old + EMA * step_s
        if trials:                           # decayed, so the rate follows the workload
            self.accepted = (1 - EMA / 4) * self.accepted + accepted
            self.trials = (1 - EMA / 4) * self.trials + trials

    def seconds(self, num_tokens: int) -> float | None:
        """The step time of ``num_tokens``'s bucket: measured; else the largest measured bucket's
        below it (a draft into a bucket not yet measured is tried); else the smallest measured
        bucket's above it scaled down by the bucket sizes (a step without drafts priced low, so
        it runs and is measured). None: nothing measured yet."""
        b = self.bucket(num_tokens)
        if b in self.step_s:
            return self.step_s[b]
        below = [size for size in self.step_s if size < b]
        if below:
            return self.step_s[max(below)]
        above = [size for size in self.step_s if size > b]
        return self.step_s[min(above)] * b / min(above) if above else None

    def row_alpha(self, accepted: float, trials: float) -> float:
        """A sequence's acceptance from its own drafts' outcome, starting from the engine's."""
        return (accepted + ROW_PRIOR * self.alpha) / (trials + ROW_PRIOR)

    def plan(self, num_tokens: int, num_rows: int, proposals: list[tuple[int, float]],
             max_draft_tokens: int | None = None) -> list[int]:
        """Each proposal's draft length this step (0: none). ``num_tokens`` are already
        scheduled (``num_rows`` of them decodes); ``proposals`` are the rows' (proposed length,
        acceptance); at most ``max_draft_tokens`` draft tokens in all can go (the budget and rows
        left)."""
        lengths = [0] * len(proposals)
        if not proposals:
            self.last_k, self.last_gain = 0, 0.0
            return lengths
        worth = sorted(((alpha ** i, r) for r, (n, alpha) in enumerate(proposals)
                        for i in range(1, min(n, self.k) + 1)), key=lambda item: -item[0])
        if max_draft_tokens is not None:
            worth = worth[:max(0, max_draft_tokens)]
        rows = max(num_rows, 1)
        base = self.seconds(num_tokens)
        by_bucket: dict[int, float | None] = {}        # a bucket's time, looked up once per plan
        expected, best, taken = float(rows), 1.0, 0
        for j, (value, _) in enumerate(worth, 1):
            expected += value
            b = self.bucket(num_tokens + j)
            if b not in by_bucket:
                by_bucket[b] = self.seconds(b)
            t = by_bucket[b]
            # Nothing measured there yet: the tokens alone (a step there measures it).
            gain = expected / rows if base is None or t is None else (expected / t) / (rows / base)
            if gain > best:
                best, taken = gain, j
        for _, r in worth[:taken]:
            lengths[r] += 1
        self.last_k, self.last_gain = max(lengths), round(best, 3)
        return lengths


def expected_accepted(alpha: float, n: int) -> float:
    """Draft tokens accepted on average out of ``n``, each accepted with probability ``alpha``
    once those before it were: alpha + alpha^2 + ... + alpha^n."""
    return n if alpha >= 1 else alpha * (1 - alpha ** n) / (1 - alpha)
