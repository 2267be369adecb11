"""Workloads for the simulator: when requests arrive, how long their prompts and outputs are,
which prefixes they share, their priorities and ``n``.

A ``Workload`` is a seeded recipe; ``requests()`` turns it into a list of ``SimRequest``. Its
arrivals are the bench tool's (``bench.serve.arrival_gaps``): the same rate, burstiness and seed
give the same send times as a measured ``python -m jaxengine.bench serve`` run, and its prompt
and output lengths use the same ``LengthSpec`` strings (``128``, ``32:512``, ``lognormal:128``).
A recorded run replays too: ``from_bench_result`` (a ``serve`` result's per-request records) or
``from_jsonl`` (one ``{"arrival_s", "prompt_len" or "prompt_token_ids", "output_len",
"priority", "n", "adapter"}`` per line).
"""
from __future__ import annotations

import json
import math
import random
from dataclasses import asdict, dataclass
from pathlib import Path

from jaxengine.bench.datasets import LengthSpec, random_token_ids


@dataclass(frozen=True)
class SimRequest:
    arrival_s: float
    prompt_token_ids: tuple[int, ...]
    output_len: int
    priority: int = 0
    n: int = 1
    adapter: int | None = None      # its LoRA adapter (1, 2, ...; None: the base model)


@dataclass(frozen=True)
class Workload:
    """``request_rate`` in requests/s (inf: all at time 0); ``burstiness`` the gamma shape of the
    gaps (1: Poisson). ``shared_prefix_len`` tokens open every prompt, drawn from
    ``num_prefixes`` distinct prefixes (the prompt lengths are the rest). ``priorities``:
    ``{priority: weight}``. ``num_adapters``: each request runs with one of that many LoRA adapters,
    drawn uniformly (0: the base model; the simulation needs ``enable_lora``)."""

    num_requests: int = 200
    request_rate: float = math.inf
    burstiness: float = 1.0
    input_len: str = "128"
    output_len: str = "128"
    shared_prefix_len: int = 0
    num_prefixes: int = 1
    priorities: dict[int, float] | None = None
    n: int = 1
    num_adapters: int = 0
    vocab_size: int = 32000
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("input_len", "output_len"):
            LengthSpec.parse(getattr(self, name))          # a bad spec fails here, naming the field
        if self.num_requests < 1:
            raise ValueError(f"num_requests: must be >= 1, got {self.num_requests}")
        if not self.request_rate > 0:
            raise ValueError(f"request_rate: must be > 0 (inf: all at once), got {self.request_rate}")
        if self.n < 1 or self.num_prefixes < 1 or self.shared_prefix_len < 0 or self.num_adapters < 0:
            raise ValueError("n, num_prefixes: must be >= 1; shared_prefix_len, num_adapters: must be >= 0")

    def requests(self, max_model_len: int = 1 << 30) -> list[SimRequest]:
        """The requests, arrival order; lengths cut so each fits ``max_model_len``."""
        from jaxengine.bench.serve import arrival_gaps

        gaps = arrival_gaps(self.num_requests, self.request_rate, self.burstiness, self.seed)
        rng = random.Random(self.seed)
        prefixes = [_ids(rng, self.shared_prefix_len, self.vocab_size) for _ in range(self.num_prefixes)]
        in_spec, out_spec = LengthSpec.parse(self.input_len), LengthSpec.parse(self.output_len)
        weights = self.priorities or {0: 1.0}
        requests, t = [], 0.0
        for gap in gaps:
            prefix = prefixes[rng.randrange(self.num_prefixes)]
            n_in = in_spec.sample(rng, max(max_model_len - 1 - len(prefix), 1))
            n_out = out_spec.sample(rng, max(max_model_len - len(prefix) - n_in, 1))
            priority = rng.choices(list(weights), list(weights.values()))[0]
            ids = tuple(prefix + _ids(rng, n_in, self.vocab_size))
            adapter = rng.randint(1, self.num_adapters) if self.num_adapters else None   # (no draw without)
            requests.append(SimRequest(t, ids, n_out, priority, self.n, adapter))
            t += gap
        return requests

    def to_dict(self) -> dict:
        d = asdict(self)
        d["request_rate"] = None if math.isinf(self.request_rate) else self.request_rate
        return d


def _ids(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    return random_token_ids(rng, n, vocab_size, low=1)


def from_bench_result(path: str | Path, vocab_size: int = 32000, seed: int = 0) -> list[SimRequest]:
    """The requests of a measured ``bench serve`` result, at the times they were sent, with the
    prompt and output token counts the server reported (prompts as random ids: a result does not
    keep the text, so shared prefixes are not replayed)."""
    result = json.loads(Path(path).read_text())
    records = [r for r in result.get("requests") or () if r.get("ok") and r.get("prompt_tokens")]
    if not records:
        raise ValueError(f"{path}: no completed requests with prompt token counts to replay")
    rng = random.Random(seed)
    return [SimRequest(r["start_s"], tuple(_ids(rng, r["prompt_tokens"], vocab_size)), r["output_tokens"])
            for r in sorted(records, key=lambda r: r["start_s"])]


def from_jsonl(path: str | Path, vocab_size: int = 32000, seed: int = 0) -> list[SimRequest]:
    """A request trace: one JSON object per line (see the module docstring)."""
    rng = random.Random(seed)
    requests = []
    for i, line in enumerate(Path(path).read_text().splitlines()):
        if not line.strip():
            continue
        r = json.loads(line)
        try:
            ids = r.get("prompt_token_ids") or _ids(rng, int(r["prompt_len"]), vocab_size)
            adapter = r.get("adapter")
            requests.append(SimRequest(float(r["arrival_s"]), tuple(ids), int(r["output_len"]),
                                       int(r.get("priority", 0)), int(r.get("n", 1)),
                                       None if adapter is None else int(adapter)))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path}: line {i + 1}: needs arrival_s, prompt_len or prompt_token_ids, "
                             f"output_len ({e})") from None
    return sorted(requests, key=lambda r: r.arrival_s)
