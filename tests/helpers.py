"""Small factories for host-side tests: a scheduler with a tiny pool and a simulated KV runner."""
from __future__ import annotations

import dataclasses

from jaxengine.config import EngineConfig
from jaxengine.engine import Engine
from jaxengine.core.scheduler_output import SchedulerOutput
from jaxengine.request import Request
from jaxengine.testing.fake_runner import HashRunner
from jaxengine.sampling_params import SamplingParams

SMALL = dict(block_size=4, num_gpu_blocks=64, num_cpu_blocks=0, watermark=0.0,
             max_num_batched_tokens=64, max_num_seqs=8, max_model_len=256,
             enable_prefix_caching=False)


class Clock:
    """A hand-driven clock."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class Harness:
    """A scheduler plus the KV-simulating runner, stepped by hand."""

    def __init__(self, clock: Clock | None = None, async_scheduling: bool = False, speculative=None, lora=None,
                 **overrides) -> None:
        self.config = dataclasses.replace(EngineConfig().replace(**{**SMALL, **overrides}), speculative=speculative,
                                          lora=lora)
        cache = self.config.cache
        self.clock = clock or Clock()
        self.runner = HashRunner(cache.num_gpu_blocks, cache.num_cpu_blocks, cache.block_size,
                                 speculative=speculative, group_windows=cache.group_windows,
                                 num_state_slots=cache.num_state_slots)
        self.engine = Engine(self.config, self.runner, clock=self.clock, async_scheduling=async_scheduling)
        self.scheduler = self.engine.scheduler
        self.kv = self.scheduler.kv
        self.requests: dict[str, Request] = {}
        self.last: SchedulerOutput | None = None

    def add(self, request_id: str, prompt: int | list[int], max_tokens: int = 8, n: int = 1,
            priority: int = 0, arrival: float | None = None, cache_salt: str | None = None,
            **params) -> Request:
        tokens = prompt if isinstance(prompt, list) else [100 + i for i in range(prompt)]
        request = Request(request_id, tokens, SamplingParams(max_tokens=max_tokens, n=n, ignore_eos=True, **params),
                          arrival_time=self.clock() if arrival is None else arrival, priority=priority,
                          cache_salt=cache_salt)
        self.requests[request_id] = request
        self.scheduler.add_request(request)
        return request

    def step(self) -> dict[str, int]:
        """One engine step; returns {request_id: tokens scheduled} (summed over a group's rows)
        of the latest schedule() (with async scheduling: the step launched ahead)."""
        self.finished = self.engine.step()
        self.last = self.engine.last_output
        return scheduled_by_request(self.last)

    def run(self, max_steps: int = 10_000) -> None:
        for _ in range(max_steps):
            if not self.scheduler.has_unfinished_requests():
                return
            self.step()
        raise AssertionError("requests still unfinished")

    def outputs(self) -> dict[str, list[list[int]]]:
        return {rid: [s.output_token_ids for s in r.seqs] for rid, r in self.requests.items()}


def scheduled_by_request(out: SchedulerOutput) -> dict[str, int]:
    rows: dict[str, int] = {}
    for seq, n in zip(out.scheduled_seqs, out.num_scheduled_tokens):
        rid = seq.request.request_id
        rows[rid] = rows.get(rid, 0) + n
    return rows


def every_draft_goes(llm):
    """Override a speculating engine's gate: each row's whole proposal goes (for tests of the
    outputs, not of the gate's choice)."""
    gate = llm.engine.scheduler.gate
    gate.plan = lambda tokens, rows, proposals, limit=None: [min(n, gate.k) for n, _ in proposals]
    return llm
