"""The simulator: a workload through the real ``Engine``, ``Scheduler`` and ``KVCacheManager`` on a
simulated clock. The runner computes nothing: it moves the clock by the profile's time for the
step's shape and samples a fixed token (lengths come from the workload: every request generates
exactly its ``output_len`` tokens per sequence). Requests enter the engine when the clock passes
their arrival (plus the profile's ``request_overhead_s``); each request's tokens stream at the end
of the steps that sample them, which gives the bench tool's figures (TTFT, ITL, TPOT, e2e,
goodput, throughput over time) and the step trace (KV usage, queues, preemptions, swaps).
"""
from __future__ import annotations

from types import SimpleNamespace

import dataclasses
import math
import random
import time
from dataclasses import dataclass, field

from jaxengine.config import EngineConfig
from jaxengine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from jaxengine.engine import Engine
from jaxengine.engine_args import EngineArgs
from jaxengine.costmodel.profile import CostProfile, StepShape
from jaxengine.costmodel.roofline import RooflineProfile
from jaxengine.lab.workload import SimRequest, Workload
from jaxengine.lora_request import LoRARequest
from jaxengine.sampling_params import SamplingParams
from jaxengine.spec_decode.gate import expected_accepted

TOKEN = 1                   # what every row samples (never an end of sequence: the engine has none)
EMPTY_STEP_S = 1e-4         # an empty step still takes the host a moment (and time must move)

Profile = CostProfile | RooflineProfile


class SimClock:
    """The simulated time in seconds; the engine's clock and timer both read it."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class SimRunner:
    """A runner whose steps take the profile's time: it advances ``clock`` and samples ``TOKEN``.
    ``noise``: draw each step's measured/predicted ratio from the profile's spread (seeded).
    Speculative decoding: a row's draft tokens are accepted one after the other with probability
    ``acceptance`` each (the geometric model the engine's gate uses; ``fit_acceptance`` fits it to
    a trace), seeded. Every row the scheduler asks drafts of gets its whole draft, ``TOKEN`` each."""

    def __init__(self, profile: Profile, buckets: list[int], row_buckets: list[int], clock: SimClock, *,
                 noise: bool = True, seed: int = 0, acceptance: float = 0.0) -> None:
        self.profile, self.buckets, self.row_buckets, self.clock = profile, buckets, row_buckets, clock
        self._rng = random.Random(seed) if noise and getattr(profile, "noise", None) else None
        self.acceptance = acceptance
        self._accept_rng = random.Random(seed + 1)
        self.outputs: list[SchedulerOutput] = []         # every step, when ``record`` is on
        self.record = False
        self.last_sampled: list[list[int]] = []         # the latest step's tokens per row

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        if self.record:
            self.outputs.append(out)
        self.clock.now += self.step_seconds(out)
        if not out.draft_token_ids:
            self.last_sampled = [[TOKEN] * k for k in out.num_samples]
        else:
            self.last_sampled = [[TOKEN] * (self._accepted(len(out.draft_token_ids[seq_id])) + 1)
                                 if seq_id in out.draft_token_ids else [TOKEN] * k
                                 for seq_id, k in zip(out.seq_ids, out.num_samples)]
        return ModelRunnerOutput(self.last_sampled,
                                 draft_token_ids={seq_id: [TOKEN] * n for seq_id, n in out.propose.items()})

    @property
    def token_buckets(self) -> list[int]:
        """As the model runner's (the engine's speculation gate prices drafts by them)."""
        return self.buckets

    @property
    def request_buckets(self) -> list[int]:
        """As the model runner's (the autopilot's cost model pads rows by them)."""
        return self.row_buckets

    def _accepted(self, num_draft: int) -> int:
        n = 0
        while n < num_draft and self._accept_rng.random() < self.acceptance:
            n += 1
        return n

    def step_seconds(self, out: SchedulerOutput) -> float:
        shape = StepShape.of_output(out)
        if shape.num_tokens == 0:
            return EMPTY_STEP_S
        seconds = self.profile.step_seconds(*shape.bucketed(self.buckets, self.row_buckets))
        if self._rng is not None:
            seconds *= self.profile.noise_ratio(self._rng.random())
        return seconds


def engine_config(profile: Profile, args: EngineArgs) -> EngineConfig:
    """The engine configuration the options give on the profiled machine: the KV pool holds as
    many tokens as the profile's did (``num_kv_blocks`` overrides), the host pool likewise, and
    its layer groups slide as the profiled model's did."""
    pool_tokens = profile.num_gpu_blocks * profile.block_size
    num_gpu_blocks = args.num_kv_blocks or max(pool_tokens // args.block_size, 2)
    num_cpu_blocks = profile.num_cpu_blocks * profile.block_size // args.block_size
    return args.engine_config(num_gpu_blocks, num_cpu_blocks, args.max_model_len or profile.max_model_len,
                              getattr(profile, "group_windows", (None,)))


@dataclass
class RequestTimeline:
    """One simulated request as a client would see it (seconds from the start)."""

    arrival_s: float
    prompt_tokens: int
    output_tokens: int = 0
    chunk_times_s: list[float] = field(default_factory=list)
    finish_s: float | None = None
    error: str | None = None


@dataclass
class SimResult:
    """A simulation's figures. ``metrics``: the bench tool's serve report (latency percentiles in
    ms, throughputs, goodput, throughput over time, every request); ``trace``: the step records;
    ``outputs``: every ``SchedulerOutput`` when asked for (``record_outputs=True``)."""

    metrics: dict
    trace: list[dict]
    config: dict
    wall_s: float
    num_steps: int
    outputs: list[SchedulerOutput] | None = None

    def to_dict(self) -> dict:
        """A bench-style result (``"mode": "serve"``, ``"simulated": true``): ``bench.plots``
        draws it like a measured run."""
        return {"mode": "serve", "simulated": True, "config": self.config, "sim_wall_s": self.wall_s,
                "num_steps": self.num_steps, **self.metrics, "trace": self.trace}

    def summary(self) -> dict:
        """One flat row: the figures to compare runs by (a dataframe row)."""
        m = self.metrics
        row = {"requests": m["completed"], "failed": m["failed"], "duration_s": m["duration_s"],
               "req_per_s": m["request_throughput"], "out_tok_per_s": m["output_throughput"]}
        for key in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
            row[f"{key[:-3]}_p50_ms"] = m[key]["median"]
            row[f"{key[:-3]}_p99_ms"] = m[key]["p99"]
        if "goodput" in m:
            row["goodput"] = m["goodput"]
        row.update(preemptions=m["num_preemptions"], swapped_blocks=m["num_swapped_blocks"],
                   kv_usage_max=m["kv_usage_max"])
        return row

    def plot(self, out_dir) -> list:
        """The bench tool's figures (latency CDFs, throughput over time, budget, KV and queues)."""
        from jaxengine.bench.plots import plot_result

        return plot_result(self.to_dict(), out_dir)


def simulate(workload: Workload | list[SimRequest], profile: Profile, *, slos: dict[str, float] | None = None,
             noise: bool = True, seed: int = 0, record_outputs: bool = False, max_steps: int = 10_000_000,
             acceptance: float = 0.0, **engine_options) -> SimResult:
    """Run ``workload`` through the engine on ``profile``'s clock. ``engine_options``: ``EngineArgs``
    fields (``max_num_batched_tokens=1024``, ``scheduling_policy=MyPolicy``, ...); ``slos``: goodput
    thresholds in ms (``ttft_ms``, ``itl_ms``, ``tpot_ms``, ``e2e_ms``); ``acceptance``: with a
    ``speculative_config``, each draft token's probability of acceptance (``fit_acceptance``)."""
    started = time.perf_counter()
    args = EngineArgs.from_kwargs(**engine_options)
    config = engine_config(profile, args)
    requests = workload.requests(config.scheduler.max_model_len) if isinstance(workload, Workload) else workload
    clock = SimClock()
    runner = SimRunner(profile, *args.step_buckets(), clock, noise=noise, seed=seed, acceptance=acceptance)
    runner.record = record_outputs
    runner.lora = None if config.lora is None else SimAdapters()
    engine = Engine(config, runner, clock=clock, timer=clock, trace=True)
    if config.autopilot is not None:
        from jaxengine.autopilot import attach_autopilot     # lazily: the autopilot imports the lab

        attach_autopilot(engine, profile)
    timelines = _run(engine, clock, requests, getattr(profile, "request_overhead_s", 0.0), max_steps)
    metrics = _metrics(timelines, engine.traces, slos)
    options = {k: v if isinstance(v, (int, float, str, bool, type(None), list, dict)) else repr(v)
               for k, v in dataclasses.asdict(args).items() if k in engine_options}
    cfg = {"engine_options": options, "num_gpu_blocks": config.cache.num_gpu_blocks,
           **({"acceptance": acceptance} if args.speculative_config else {}),
           "num_requests": len(requests), "slo": slos or {}, "profile": getattr(profile, "kind", "measured"),
           **({"workload": workload.to_dict()} if isinstance(workload, Workload) else {})}
    return SimResult(metrics, [dataclasses.asdict(t) for t in engine.traces], cfg, time.perf_counter() - started,
                     engine.num_steps, runner.outputs if record_outputs else None)


def _run(engine: Engine, clock: SimClock, requests: list[SimRequest], overhead_s: float,
         max_steps: int) -> list[RequestTimeline]:
    """Step until every request has finished; -> each request's timeline (workload order)."""
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival_s)
    timelines = [RequestTimeline(r.arrival_s, len(r.prompt_token_ids)) for r in requests]
    next_i = 0
    for _ in range(max_steps):
        while next_i < len(order) and requests[order[next_i]].arrival_s + overhead_s <= clock.now:
            i, r = order[next_i], requests[order[next_i]]
            if engine.overload_retry_after(r.prompt_token_ids) is None:
                _add(engine, str(i), r, overhead_s)
            else:                                       # the server would answer 503
                timelines[i].error = "overloaded"
            next_i += 1
        if not engine.has_unfinished_requests():
            if next_i == len(order):
                return timelines
            clock.now = max(clock.now, requests[order[next_i]].arrival_s + overhead_s)
            continue
        finished = engine.step()
        _stream(engine.last_output, engine.runner.last_sampled, timelines, clock.now)
        for request in finished:
            t = timelines[int(request.request_id)]
            t.finish_s = clock.now
            if request.status.finish_reason in ("error", "abort"):
                t.error = request.status_reason or request.status.name.lower()
    raise RuntimeError(f"simulation: requests still unfinished after {max_steps} steps")


def _add(engine: Engine, request_id: str, r: SimRequest, overhead_s: float) -> None:
    params = SamplingParams(max_tokens=r.output_len, ignore_eos=True, n=r.n, temperature=1.0 if r.n > 1 else 0.0)
    lora = None if r.adapter is None else LoRARequest(f"adapter-{r.adapter}", r.adapter, "simulated")
    engine.add_request(request_id, list(r.prompt_token_ids), params, priority=r.priority,
                       arrival_time=r.arrival_s + overhead_s, lora_request=lora)


class SimAdapters:
    """The simulator's LoRA adapters: identities without weights. What it simulates is the
    scheduler's limit of ``max_loras`` adapters at once; the profile has no cost for the deltas."""

    @staticmethod
    def register(request: LoRARequest) -> SimpleNamespace:
        return SimpleNamespace(digest=f"simulated-{request.lora_int_id}")


def _stream(out: SchedulerOutput, sampled: list[list[int]], timelines: list[RequestTimeline], now: float) -> None:
    """The requests that sampled in this step get one chunk each (at ``now``) with their tokens
    (a row with a draft: its accepted drafts and one more; a stop at max_tokens cuts them)."""
    seen = set()
    for seq, tokens in zip(out.scheduled_seqs, sampled):
        if not tokens:
            continue
        i = int(seq.request.request_id)
        t = timelines[i]
        if seq.seq_id in out.draft_token_ids:
            t.output_tokens = sum(s.num_output_tokens for s in seq.request.seqs)
        else:
            t.output_tokens += len(tokens)
        if i not in seen:
            seen.add(i)
            t.chunk_times_s.append(now)


def _metrics(timelines: list[RequestTimeline], traces, slos: dict[str, float] | None) -> dict:
    from jaxengine.bench.serve import RequestResult, summarise

    results = []
    for t in timelines:
        r = RequestResult(prompt_tokens=t.prompt_tokens, output_tokens=t.output_tokens, start_s=t.arrival_s,
                          chunk_times_s=t.chunk_times_s, error=t.error)
        if r.error is None and t.chunk_times_s:
            r.ttft_s = t.chunk_times_s[0] - t.arrival_s
            r.e2e_s = t.chunk_times_s[-1] - t.arrival_s
        elif r.error is None:
            r.error = "no tokens"
        results.append(r)
    end = max((t.chunk_times_s[-1] for t in timelines if t.chunk_times_s), default=0.0)
    start = min((t.arrival_s for t in timelines), default=0.0)
    metrics = summarise(results, max(end - start, 1e-9), slos)
    usage = [t.kv_usage for t in traces] or [0.0]
    metrics.update(num_preemptions=sum(t.num_preemptions for t in traces),
                   num_swapped_blocks=sum(t.num_blocks_swapped_out for t in traces),
                   kv_usage_mean=sum(usage) / len(usage), kv_usage_max=max(usage),
                   num_waiting_max=max((t.num_waiting for t in traces), default=0))
    return metrics


def fit_acceptance(records) -> float:
    """Each draft token's probability of acceptance, fitted to a step trace (``StepTrace`` records
    or their dicts): the ``alpha`` whose geometric model gives the trace's mean accepted tokens per
    draft at its mean draft length (bisection). 0 when the trace has no draft."""
    def get(r, name):
        return r.get(name, 0) if isinstance(r, dict) else getattr(r, name)

    drafts = sum(get(r, "num_drafts") for r in records)
    if not drafts:
        return 0.0
    length = sum(get(r, "num_draft_tokens") for r in records) / drafts
    mean = sum(get(r, "num_accepted_tokens") for r in records) / drafts
    low, high = 0.0, 1.0
    for _ in range(50):
        alpha = (low + high) / 2
        whole, part = int(length), length - int(length)
        expected = expected_accepted(alpha, whole) + part * alpha ** (whole + 1)
        low, high = (alpha, high) if expected < mean else (low, alpha)
    return round((low + high) / 2, 4)


def goodput(result: SimResult) -> float:
    """Requests/s that met every SLO (the result's ``goodput``; its request rate without SLOs)."""
    m = result.metrics
    return m["goodput"] if "goodput" in m else m["request_throughput"]


def slo_attainment(result: SimResult) -> float:
    """The share of requests that met every SLO."""
    m = result.metrics
    done = m["num_requests"]
    return round(goodput(result) * m["duration_s"]) / done if done else math.nan
