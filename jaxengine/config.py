"""Engine configuration: small frozen dataclasses, shrinkable with ``dataclasses.replace``.

Every field is validated on construction; an invalid value raises ``ValueError`` naming it.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

PREEMPTION_MODES = ("auto", "recompute", "swap")
SPECULATIVE_METHODS = ("ngram", "draft_model", "eagle3", "mtp")
MODEL_PROPOSERS = ("draft_model", "eagle3", "mtp")     # the methods that run a model of their own on the device
CHECKPOINT_PROPOSERS = ("draft_model", "eagle3")        # those whose model is a checkpoint of its own
DRAFT_SAMPLING = ("greedy", "sampled")
OVERLOAD_POLICIES = ("reject", "queue")


def _require(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{name}: {message}")


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache.

    ``num_gpu_blocks`` counts the whole device pool, including block 0, the null block that
    padding points to and that is never handed out. ``num_cpu_blocks`` is the host pool that
    swapped-out sequence groups live in (0 disables swapping: preemption then recomputes).
    ``watermark`` is the fraction of the device pool kept free when admitting new requests, so
    running requests can grow without being preempted at once.

    ``group_windows``: the model's layer groups (``ModelConfig.kv_groups``), one block table each
    from the one pool, each group's sliding window or None (full attention). A sequence holds a
    windowed group's blocks only while its window can reach them.

    ``num_state_slots``: for a model with recurrent layers, the device's slots of their state (a
    fixed-size state per sequence, whatever its length), slot 0 the null slot padding rows point
    to; each running sequence holds one. ``num_cpu_state_slots``: the host's, for swapped groups.
    0: the model has none. ``state_snapshot_interval``: with prefix caching, a step keeps the state
    at every multiple of this many tokens it computes (a multiple of ``block_size``) in a free
    slot, under the hash of the blocks before it: a later prompt sharing those blocks resumes from
    it. 0: no snapshots.
    """

    block_size: int = 16
    num_gpu_blocks: int = 1024
    num_cpu_blocks: int = 0
    watermark: float = 0.01
    enable_prefix_caching: bool = True
    group_windows: tuple[int | None, ...] = (None,)
    num_state_slots: int = 0
    num_cpu_state_slots: int = 0
    state_snapshot_interval: int = 0

    def __post_init__(self) -> None:
        _require(self.block_size >= 1, "block_size", f"must be >= 1, got {self.block_size}")
        _require(self.num_gpu_blocks >= 2, "num_gpu_blocks",
                 f"must be >= 2 (block 0 is the null block), got {self.num_gpu_blocks}")
        _require(self.num_cpu_blocks >= 0, "num_cpu_blocks", f"must be >= 0, got {self.num_cpu_blocks}")
        _require(0.0 <= self.watermark < 1.0, "watermark", f"must be in [0, 1), got {self.watermark}")
        _require(len(self.group_windows) >= 1 and all(w is None or w >= 1 for w in self.group_windows),
                 "group_windows", f"must name each layer group's window (None or >= 1), got {self.group_windows}")
        _require(self.num_state_slots != 1 and self.num_state_slots >= 0, "num_state_slots",
                 f"must be 0 (no recurrent layers) or >= 2 (slot 0 is the null slot), got {self.num_state_slots}")
        _require(self.num_cpu_state_slots >= 0, "num_cpu_state_slots", f"must be >= 0, got {self.num_cpu_state_slots}")
        _require(self.state_snapshot_interval >= 0 and self.state_snapshot_interval % self.block_size == 0,
                 "state_snapshot_interval", f"must be a multiple of block_size ({self.block_size}), "
                 f"got {self.state_snapshot_interval}")

    @property
    def watermark_blocks(self) -> int:
        return int(self.watermark * self.num_gpu_blocks)


@dataclass(frozen=True)
class SchedulerConfig:
    """The scheduler's budget and policies (names follow vLLM's).

    ``long_prefill_token_threshold`` caps the tokens one request's prefill gets in a step
    (0: no cap). ``max_num_partial_prefills`` bounds how many requests may be part-way through
    their prefill at once. ``delay_factor`` holds a new prompt back until the oldest waiting
    request has waited ``delay_factor`` x the latency of the last step that ran prompts.
    ``policy`` orders the waiting queue: a built-in's name, ``"module:Class"``, a
    ``SchedulingPolicy`` subclass or an instance. The config only carries the spec (printable,
    picklable to other processes): ``core/policy.py`` names the built-ins and resolves a spec,
    and each ``Scheduler`` makes its own policy from it, so no two share state.
    """

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    max_num_partial_prefills: int = 1
    policy: object = "fcfs"
    preemption_mode: str = "auto"
    delay_factor: float = 0.0

    def __post_init__(self) -> None:
        _require(self.max_num_seqs >= 1, "max_num_seqs", f"must be >= 1, got {self.max_num_seqs}")
        _require(self.max_num_batched_tokens >= self.max_num_seqs, "max_num_batched_tokens",
                 f"must be >= max_num_seqs ({self.max_num_seqs}) so every running sequence can "
                 f"decode in one step, got {self.max_num_batched_tokens}")
        _require(self.max_model_len >= 1, "max_model_len", f"must be >= 1, got {self.max_model_len}")
        _require(self.long_prefill_token_threshold >= 0, "long_prefill_token_threshold",
                 f"must be >= 0, got {self.long_prefill_token_threshold}")
        _require(self.max_num_partial_prefills >= 1, "max_num_partial_prefills",
                 f"must be >= 1, got {self.max_num_partial_prefills}")
        _require(self.preemption_mode in PREEMPTION_MODES, "preemption_mode",
                 f"must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}")
        _require(self.delay_factor >= 0.0, "delay_factor", f"must be >= 0, got {self.delay_factor}")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's ``speculative_config`` names). ``ngram``: prompt lookup, on the
    host, in the request's own tokens: the latest earlier occurrence of its last n tokens (n from
    ``prompt_lookup_max`` down to ``prompt_lookup_min``) proposes the ``num_speculative_tokens``
    that followed it. ``draft_model``: ``model``, a smaller checkpoint with the model's vocabulary,
    proposes them greedily on the device from its own KV cache (``spec_decode/drafter.py``); ``eagle3``:
    ``model``, an EAGLE-3 head checkpoint trained for the model, proposes them greedily from the
    model's own hidden states (``spec_decode/eagle_drafter.py``); ``mtp``: the model's own multi-token
    prediction layer (DeepSeek-V3's ``num_nextn_predict_layers``, ``models/mtp.py``), from its
    checkpoint, drafting as an EAGLE-3 head does. The target
    model verifies every proposal in the next step, so outputs are the target's own
    (``spec_decode/verify.py``)."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    model: str | None = None
    # How a model proposer drafts for a request that samples: "greedy" (its most likely tokens:
    # outputs stay the seeded stream's own, token for token) or "sampled" (drawn from its
    # distribution at the request's temperature and accepted with probability min(1, p/q):
    # more drafts kept, outputs distributed as the model's but not the same draws).
    draft_sampling: str = "greedy"

    def __post_init__(self) -> None:
        _require(self.method in SPECULATIVE_METHODS, "speculative_config.method",
                 f"must be one of {list(SPECULATIVE_METHODS)}, got {self.method!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_min"):
            value = getattr(self, name)
            _require(isinstance(value, int) and not isinstance(value, bool) and value >= 1,
                     f"speculative_config.{name}", f"must be an integer >= 1, got {value!r}")
        _require(isinstance(self.prompt_lookup_max, int) and self.prompt_lookup_max >= self.prompt_lookup_min,
                 "speculative_config.prompt_lookup_max",
                 f"must be an integer >= prompt_lookup_min ({self.prompt_lookup_min}), got {self.prompt_lookup_max!r}")
        _require(self.draft_sampling in DRAFT_SAMPLING, "speculative_config.draft_sampling",
                 f"must be one of {list(DRAFT_SAMPLING)}, got {self.draft_sampling!r}")
        _require(self.draft_sampling == "greedy" or self.method in MODEL_PROPOSERS,
                 "speculative_config.draft_sampling", f"'sampled' is for methods {' and '.join(MODEL_PROPOSERS)} "
                 f"(the n-gram proposer picks its tokens outright)")
        if self.method in CHECKPOINT_PROPOSERS:
            _require(bool(self.model), "speculative_config.model", f"the draft model's checkpoint is required with "
                     f"method {self.method}")
        else:
            _require(self.model is None, "speculative_config.model",
                     f"only for methods {' and '.join(CHECKPOINT_PROPOSERS)}, not {self.method!r} (mtp reads the "
                     f"model's own checkpoint)")

    @classmethod
    def from_dict(cls, spec: "dict | SpeculativeConfig | None") -> "SpeculativeConfig | None":
        """``--speculative-config``'s JSON object (or ``LLM(speculative_config={...})``): unknown keys
        are errors naming them."""
        if spec is None or isinstance(spec, cls):
            return spec
        _require(isinstance(spec, dict), "speculative_config", f"must be a JSON object, got {spec!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(spec) - known)
        _require(not unknown, "speculative_config", f"unknown key(s) {unknown}; known: {sorted(known)}")
        return cls(**spec)


@dataclass(frozen=True)
class AutopilotConfig:
    """Latency targets that the autopilot (``jaxengine/autopilot``) steers each step's scheduling
    knobs to: time to first token ``ttft_s`` and inter-token latency ``itl_s`` (seconds; None: no
    target), each at the ``percentile``-th percentile. ``overload_policy``: when a new request's
    predicted time to first token misses its target by a margin even at the best setting,
    ``reject`` it (the server answers 503 with Retry-After) or ``queue`` it anyway.
    ``cost_profile``: the scheduler lab's profile JSON the step times are predicted from (None:
    a short calibration at start-up)."""

    ttft_s: float | None = None
    itl_s: float | None = None
    percentile: float = 99.0
    overload_policy: str = "reject"
    cost_profile: str | None = None

    def __post_init__(self) -> None:
        _require(self.ttft_s is not None or self.itl_s is not None, "autopilot",
                 "needs a latency target: slo_ttft_ms and/or slo_itl_ms")
        for name in ("ttft_s", "itl_s"):
            value = getattr(self, name)
            _require(value is None or value > 0, name, f"must be > 0 seconds, got {value}")
        _require(0 < self.percentile <= 100, "slo_percentile", f"must be in (0, 100], got {self.percentile}")
        _require(self.overload_policy in OVERLOAD_POLICIES, "overload_policy",
                 f"must be one of {list(OVERLOAD_POLICIES)}, got {self.overload_policy!r}")


@dataclass(frozen=True)
class LoRAConfig:
    """LoRA adapters (vLLM's names): ``max_loras`` adapters on the device at once (the scheduler
    runs at most that many distinct ones per step), each of rank up to ``max_lora_rank``;
    ``max_cpu_loras`` adapters kept in host memory (least recently used out), so an adapter
    that left the device comes back without reading the disk."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None        # None: max_loras

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            _require(isinstance(value, int) and not isinstance(value, bool) and value >= 1, name,
                     f"must be an integer >= 1, got {value!r}")
        cpu = self.max_cpu_loras
        _require(cpu is None or (isinstance(cpu, int) and not isinstance(cpu, bool) and cpu >= self.max_loras),
                 "max_cpu_loras", f"must be an integer >= max_loras ({self.max_loras}), got {cpu!r}")

    @property
    def num_cpu_loras(self) -> int:
        return self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras


@dataclass(frozen=True)
class RunnerConfig:
    """How the steps run, as ``EngineArgs`` resolves it: the (token, row) bucket sizes the runner
    compiles (empty: the defaults for the scheduler's limits, ``EngineConfig.step_buckets``),
    when it compiles them, whether a step is launched before the previous one's tokens are back,
    the dtypes of the model and of its KV cache (names; None: not resolved, a config built by
    hand), and each engine replica's step trace file."""

    token_buckets: tuple[int, ...] = ()
    request_buckets: tuple[int, ...] = ()
    compile_mode: str = "eager"
    async_scheduling: bool = False
    dtype: str | None = None
    kv_dtype: str | None = None
    trace_files: tuple[str | None, ...] = ()

    def trace_file(self, replica: int) -> str | None:
        return self.trace_files[replica] if replica < len(self.trace_files) else None


@dataclass(frozen=True)
class EngineConfig:
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig | None = None
    autopilot: AutopilotConfig | None = None
    lora: LoRAConfig | None = None          # None: no adapters served
    runner: RunnerConfig = field(default_factory=RunnerConfig)

    def step_buckets(self) -> tuple[list[int], list[int]]:
        """The (token, row) buckets the steps pad to: the resolved ones, else the defaults for
        the scheduler's limits."""
        from jaxengine.buckets import step_buckets

        sc, rc = self.scheduler, self.runner
        return step_buckets(sc.max_num_batched_tokens, sc.max_num_seqs, list(rc.token_buckets) or None,
                            list(rc.request_buckets) or None)

    def replace(self, **changes) -> "EngineConfig":
        """Return a copy with fields of the sub-configs replaced, e.g. ``replace(block_size=4)``."""
        cache_fields = {f.name for f in dataclasses.fields(CacheConfig)}
        sched_fields = {f.name for f in dataclasses.fields(SchedulerConfig)}
        unknown = set(changes) - cache_fields - sched_fields
        _require(not unknown, "EngineConfig", f"unknown option(s) {sorted(unknown)}")
        cache = dataclasses.replace(self.cache, **{k: v for k, v in changes.items() if k in cache_fields})
        sched = dataclasses.replace(self.scheduler, **{k: v for k, v in changes.items() if k in sched_fields})
        runner = self.runner
        if {"max_num_batched_tokens", "max_num_seqs"} & set(changes):      # the buckets end at the limits
            runner = dataclasses.replace(runner, token_buckets=(), request_buckets=())
        return EngineConfig(cache=cache, scheduler=sched, speculative=self.speculative, autopilot=self.autopilot,
                            lora=self.lora, runner=runner)
