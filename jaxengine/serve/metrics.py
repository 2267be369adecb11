"""Prometheus metrics for the server (prometheus-client), named like vLLM's under ``jaxengine:``.

Each server owns a ``CollectorRegistry`` (so several servers can live in one process, as in
tests). The engine thread feeds it through the ``AsyncEngine`` observer calls, which feed the
live dashboard's rolling window too (``EngineMetrics.dashboard``). Under data
parallelism the usual metrics are the totals over the replicas, and ``jaxengine:replica_*``
gauges (label ``replica``) give each replica's share.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

from jaxengine.engine import Engine
from jaxengine.parallel.data_parallel import DataParallelEngine
from jaxengine.request import Request
from jaxengine.serve.dashboard import DashboardCollector

disable_created_metrics()      # no *_created series next to each counter (as vLLM)

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                   40.0, 80.0, 160.0)
TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


# The autopilot's gauges (jaxengine:<name>): the StepTrace field each shows, and its help.
AUTOPILOT_GAUGES = {
    "autopilot_budget_tokens": ("autopilot_budget", "The autopilot's token budget for the latest step."),
    "autopilot_max_num_seqs": ("autopilot_max_num_seqs", "The autopilot's admission limit (sequences), latest step."),
    "autopilot_prefill_chunk_tokens": ("autopilot_prefill_chunk", "Most tokens one prompt could get in the latest "
                                       "step (0: the configured limit)."),
    "autopilot_partial_prefills": ("autopilot_partial_prefills", "Prompts that could be part-way through at once "
                                   "in the latest step (0: the configured limit)."),
    "autopilot_predicted_step_seconds": ("predicted_step_s", "The latest step's predicted time (median, corrected "
                                         "online)."),
    "autopilot_cost_correction": ("cost_correction", "Measured / profiled step time: the online correction of the "
                                  "cost profile."),
    "autopilot_predicted_queue_seconds": ("predicted_queue_s", "A new request's predicted wait for its first token."),
}


class EngineMetrics:
    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        labels, r = ["model_name"], self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"jaxengine:{name}", doc, labels, registry=r).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"jaxengine:{name}", doc, labels, registry=r).labels(model_name)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(f"jaxengine:{name}", doc, labels, buckets=buckets, registry=r).labels(model_name)

        self.num_running = gauge("num_requests_running", "Requests running on the device.")
        self.num_waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.num_swapped = gauge("num_requests_swapped", "Request groups swapped out to host memory.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = full).")
        self.kv_tokens = gauge("kv_cache_tokens", "Tokens the KV cache holds (one replica's pool).")
        self.kv_tokens_per_gib = gauge("kv_cache_tokens_per_gib", "Tokens one GiB of a device's memory holds in the "
                                       "KV cache (latent attention's compressed cache holds many more).")
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens served from the prefix cache.")
        self.preemptions = counter("num_preemptions", "Request groups preempted (recompute or swap).")
        self.swap_fallbacks = counter("num_swap_fallbacks",
                                      "Preemptions that recomputed because the host swap pool was full.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated (all requests).")
        self.success = Counter("jaxengine:request_success", "Finished requests by finish reason.",
                               ["model_name", "finished_reason"], registry=r)
        self.model_name = model_name
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.", LATENCY_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between a request's token deliveries.",
                             LATENCY_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.", LATENCY_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Arrival to first scheduled.", LATENCY_BUCKETS)
        self.step_tokens = histogram("iteration_tokens_total", "Tokens computed per engine step.", TOKEN_BUCKETS)
        self.expert_tokens = Counter("jaxengine:expert_tokens", "Tokens routed to each expert of a mixture of "
                                     "experts, summed over its layers (a hot expert stands out).",
                                     ["model_name", "expert"], registry=r)
        # Speculative decoding, vLLM's spec_decode names (acceptance rate = accepted / draft tokens).
        self.spec_drafts = counter("spec_decode_num_drafts", "Rows that carried draft tokens (speculative decoding).")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens verified.")
        self.spec_accepted_tokens = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.spec_accepted_per_pos = Counter(
            "jaxengine:spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted at each draft position.",
            ["model_name", "position"], registry=r)
        self.overloaded = counter("num_requests_overloaded", "New requests the autopilot turned away (503): "
                                  "predicted to miss their time-to-first-token target by a margin.")
        # The autopilot's choices and cost model (0 without it): the StepTrace fields of the latest step.
        self.autopilot = {field: gauge(name, doc) for name, (field, doc) in AUTOPILOT_GAUGES.items()}
        self.kernel_check_ok = Gauge("jaxengine:kernel_check_ok", "The start-up kernel check: 1 where a kernel "
                                     "matched the plain-jnp path, 0 where it failed and the plain-jnp path serves "
                                     "instead (no series: not run).", ["model_name", "kernel", "name"], registry=r)
        self._seen_queries = self._seen_hits = 0
        self.replicas = ReplicaMetrics(model_name, r)
        self.dashboard = DashboardCollector()

    def set_kernel_check(self, check) -> None:
        """``check``: the LLM's ``kernel_check`` (``runner.kernel_check.KernelCheck``)."""
        for result in check.results:
            self.kernel_check_ok.labels(self.model_name, result.kernel, result.name).set(int(result.ok))

    # ---- observer calls (engine thread) ----
    def on_step(self, engine: Engine | DataParallelEngine) -> None:
        self.dashboard.on_step(engine)
        trace = engine.last_trace
        self.preemptions.inc(trace.num_preemptions)
        self.swap_fallbacks.inc(trace.num_swap_fallbacks)
        if tokens := trace.num_decode_tokens + trace.num_prefill_tokens:
            self.step_tokens.observe(tokens)
        for expert, count in enumerate(trace.expert_tokens):
            self.expert_tokens.labels(self.model_name, str(expert)).inc(count)
        if trace.autopilot_budget:
            for field, gauge in self.autopilot.items():
                gauge.set(getattr(trace, field))
        if trace.num_draft_tokens:
            self.spec_draft_tokens.inc(trace.num_draft_tokens)
            self.spec_accepted_tokens.inc(trace.num_accepted_tokens)
            self.spec_drafts.inc(trace.num_drafts)
            for position, count in enumerate(trace.accepted_per_position):
                self.spec_accepted_per_pos.labels(self.model_name, str(position)).inc(count)
        self._set_state(engine)

    def on_tokens(self, request: Request, num_tokens: int, itl: float | None) -> None:
        self.dashboard.on_tokens(request, num_tokens, itl)
        self.generation_tokens.inc(num_tokens)
        if itl is not None:
            self.itl.observe(itl)

    def on_finish(self, request: Request) -> None:
        self.dashboard.on_finish(request)
        t = request.times
        self.success.labels(self.model_name, request.status.finish_reason).inc()
        self.prompt_tokens.inc(request.num_prompt_tokens)
        if t.first_token is not None:
            self.ttft.observe(t.first_token - t.queued)
        if t.first_scheduled is not None:
            self.queue_time.observe(t.first_scheduled - t.queued)
        if t.finished is not None:
            self.e2e.observe(t.finished - t.queued)

    def on_overload(self) -> None:
        self.dashboard.on_overload()
        self.overloaded.inc()

    def on_abort(self) -> None:
        self.success.labels(self.model_name, "abort").inc()

    def on_idle(self, engine: Engine | DataParallelEngine) -> None:
        """Gauges after requests left while the engine had no step to run (aborts)."""
        self.dashboard.on_idle(engine)
        self._set_state(engine)

    def _set_state(self, engine: Engine | DataParallelEngine) -> None:
        stats = engine.stats()
        self.num_running.set(stats.num_running)
        self.num_waiting.set(stats.num_waiting)
        self.num_swapped.set(stats.num_swapped)
        self.kv_usage.set(stats.kv_usage)
        self.prefix_queries.inc(stats.prefix_cache_queries - self._seen_queries)
        self.prefix_hits.inc(stats.prefix_cache_hits - self._seen_hits)
        self._seen_queries, self._seen_hits = stats.prefix_cache_queries, stats.prefix_cache_hits
        if isinstance(engine, DataParallelEngine):
            self.replicas.update(engine)


class ReplicaMetrics:
    """Per-replica gauges of a data-parallel engine (label ``replica``: 0, 1, ...); the engine's
    metrics without the label are the totals over its replicas."""

    def __init__(self, model_name: str, registry: CollectorRegistry) -> None:
        labels = ["model_name", "replica"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"jaxengine:replica_{name}", doc, labels, registry=registry)

        self.model_name = model_name
        self.num_running = gauge("num_requests_running", "Requests running on the replica's devices.")
        self.num_waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled on the replica.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of the replica's KV cache blocks in use.")
        self.routed = Counter("jaxengine:replica_requests_routed", "Requests the router sent to the replica.",
                              labels, registry=registry)
        self._seen_routed: list[int] = []

    def update(self, engine: DataParallelEngine) -> None:
        self._seen_routed += [0] * (len(engine.replicas) - len(self._seen_routed))
        for i, replica in enumerate(engine.replicas):
            stats, labels = replica.stats(), (self.model_name, str(i))
            self.num_running.labels(*labels).set(stats.num_running)
            self.num_waiting.labels(*labels).set(stats.num_waiting)
            self.kv_usage.labels(*labels).set(stats.kv_usage)
            self.routed.labels(*labels).inc(engine.num_routed[i] - self._seen_routed[i])
            self._seen_routed[i] = engine.num_routed[i]
