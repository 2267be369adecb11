"""What a step costs by (``StepShape``), the one input of both kinds of profile (measured
``CostProfile``, datasheet ``RooflineProfile``), and the JSON writer both use."""
from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple


class StepShape(NamedTuple):
    """What one step costs by."""

    num_tokens: int
    num_rows: int
    max_context: int            # longest context a row attends to (tokens before it + its new ones)
    sum_context: int            # attended contexts summed
    attention_work: int = 0     # sum over rows of new tokens x mean attended context (roofline only)
    num_swapped_blocks: int = 0
    row_bucket: int = 0         # the rows as the runner pads them (0: not known, the rows are taken)
    num_prefill_tokens: int = 0

    @classmethod
    def of_output(cls, out) -> "StepShape":
        """The shape of a ``SchedulerOutput``."""
        contexts = [c + n for c, n in zip(out.num_computed_tokens, out.num_scheduled_tokens)]
        work = sum(n * (c - (n - 1) / 2) for c, n in zip(contexts, out.num_scheduled_tokens))
        return cls(sum(out.num_scheduled_tokens), max(len(contexts), sum(out.num_samples)), max(contexts, default=0),
                   sum(contexts), int(work), len(out.blocks_to_swap_in) + len(out.blocks_to_swap_out),
                   num_prefill_tokens=out.num_prefill_tokens)

    @classmethod
    def of_trace(cls, record) -> "StepShape":
        """The shape of a ``StepTrace`` (or its dict)."""
        get = record.get if isinstance(record, dict) else lambda k, d=0: getattr(record, k, d)
        return cls(get("num_prefill_tokens") + get("num_decode_tokens"), get("num_rows"), get("max_context_len", 0),
                   get("num_context_tokens", 0), 0, get("num_blocks_swapped_in") + get("num_blocks_swapped_out"),
                   num_prefill_tokens=get("num_prefill_tokens"))

    def bucketed(self, token_buckets: list[int], request_buckets: list[int]) -> tuple["StepShape", int]:
        """(this step with the row bucket the runner pads it to, its token bucket)."""
        from jaxengine.buckets import step_bucket

        tokens, rows = step_bucket(self.num_tokens, self.num_rows, token_buckets, request_buckets)
        return self._replace(row_bucket=rows), tokens

    def features(self, routed_pairs_per_token: int = 0) -> tuple[float, ...]:
        """The cost model's inputs (``profile.FEATURES``); ``routed_pairs_per_token``: a mixture of
        experts' token-expert pairs per token (its experts run on the real tokens, not the padding)."""
        return (1.0, float(self.num_prefill_tokens > 0), self.row_bucket or self.num_rows, self.max_context,
                self.sum_context, float(self.num_tokens * routed_pairs_per_token))


def write_json(d: dict, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(d, indent=1) + "\n")
    return path
