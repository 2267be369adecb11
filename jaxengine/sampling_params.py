"""Per-request sampling parameters (vLLM's names). Invalid values raise ValueError naming the field."""
from __future__ import annotations

from dataclasses import dataclass, field

MAX_LOGPROBS = 20   # top-k logprobs the sampler computes for every row
MAX_LOGIT_BIAS = 64  # logit_bias entries per request
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")
THINKING_MODES = (None, "starts", "optional")      # StructuredOutputsParams.thinking


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Constrained decoding (vLLM's names); exactly one kind: ``json`` (a JSON schema, as a dict
    or its text), ``regex``, ``choice`` (the output is one of these strings), ``grammar`` (Lark
    or GBNF/EBNF), or ``json_object=True`` (any JSON object). ``field`` is the request field
    that errors name (the server sets ``response_format``, ``guided_json``, ``tools``, ...).
    ``thinking``: a reasoning model's output thinks first, unconstrained, up to ``</think>``, and
    the constraint holds for the answer after it: ``"starts"`` (the chat template opened the
    thinking, DeepSeek-R1 style) or ``"optional"`` (the output may open with ``<think>``, Qwen3
    style); None: the constraint holds from the first token."""

    json: dict | str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    field: str = "structured_outputs"
    thinking: str | None = None

    def __post_init__(self) -> None:
        given = [k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"{self.field}: exactly one of {', '.join(STRUCTURED_KINDS)} must be given, got "
                             f"{given or 'none'}")
        if self.choice is not None:
            if not self.choice or not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError(f"{self.field}: choice must be a non-empty list of non-empty strings")
            object.__setattr__(self, "choice", tuple(self.choice))
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value):
                raise ValueError(f"{self.field}: {name} must be a non-empty string")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError(f"{self.field}: json must be a JSON schema (an object or its text)")
        if self.thinking not in THINKING_MODES:
            raise ValueError(f"{self.field}: thinking must be one of {THINKING_MODES}, got {self.thinking!r}")

    @property
    def kind(self) -> str:
        return next(k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False))

    def key(self) -> tuple:
        """Equal for equal constraints (the compiled-grammar cache's key)."""
        import json as json_module

        value = getattr(self, self.kind)
        return (self.kind, json_module.dumps(value, sort_keys=True) if isinstance(value, dict) else value,
                self.thinking)


@dataclass
class SamplingParams:
    n: int = 1
    # vLLM's name: draw best_of samples, return the n best. This engine returns every sample it
    # draws, so best_of (None: n) must equal n; fewer than n could not fill the n answers.
    best_of: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                       # 0 or -1: no top-k
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16          # None: up to the model's context length
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # Logprobs are of log_softmax(logits / logprobs_temperature): 1 is the model's distribution
    # (beam search scores its candidates at its temperature).
    logprobs_temperature: float = 1.0
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._validate()

    def _validate(self) -> None:
        def check(ok: bool, name: str, message: str) -> None:
            if not ok:
                raise ValueError(f"{name}: {message}, got {getattr(self, name)!r}")

        check(isinstance(self.n, int) and self.n >= 1, "n", "must be an integer >= 1")
        self._check_best_of(check)
        check(self.temperature >= 0.0, "temperature", "must be >= 0")
        check(self.logprobs_temperature > 0.0, "logprobs_temperature", "must be > 0")
        check(0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]")
        check(isinstance(self.top_k, int) and self.top_k >= -1, "top_k", "must be -1, 0 or a positive integer")
        check(0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]")
        check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]")
        check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]")
        check(self.repetition_penalty > 0.0, "repetition_penalty", "must be > 0")
        check(self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
              "max_tokens", "must be None or an integer >= 1")
        check(isinstance(self.min_tokens, int) and self.min_tokens >= 0, "min_tokens", "must be an integer >= 0")
        check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
              f"must be <= max_tokens ({self.max_tokens})")
        check(self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS, "logprobs",
              f"must be None or in [0, {MAX_LOGPROBS}]")
        check(self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS, "prompt_logprobs",
              f"must be None or in [0, {MAX_LOGPROBS}]")
        check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
              "must be non-negative integers")
        check(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        check(self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
              "structured_outputs", "must be StructuredOutputsParams")
        bias = self.logit_bias or {}
        check(len(bias) <= MAX_LOGIT_BIAS and all(isinstance(t, int) and t >= 0 for t in bias), "logit_bias",
              f"must map at most {MAX_LOGIT_BIAS} non-negative token ids to biases")

    def _check_best_of(self, check) -> None:
        if self.best_of is None:
            return
        check(isinstance(self.best_of, int) and not isinstance(self.best_of, bool) and self.best_of >= 1, "best_of",
              "must be None or an integer >= 1")
        check(self.best_of >= self.n, "best_of", f"must be >= n ({self.n})")
        check(self.best_of <= self.n, "best_of", f"above n ({self.n}) is not supported: every sample is returned")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


MAX_BEAM_WIDTH = MAX_LOGPROBS // 2      # each beam's 2 x width candidates come from the sampler's top-k


@dataclass
class BeamSearchParams:
    """Beam search (vLLM's names): ``beam_width`` hypotheses kept each step by cumulative
    log-probability; the ``beam_width`` best finished ones are returned, best first, ranked by
    ``cumulative logprob / generated tokens ** length_penalty``.

    ``early_stopping`` (transformers' rule): True stops once ``beam_width`` hypotheses have
    finished; False stops when the best running beam, scored at its current length, cannot beat
    the worst finished one; "never" scores it at ``max_tokens`` when ``length_penalty`` > 0.
    ``temperature`` > 0 scores candidates with ``log_softmax(logits / temperature)``."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None     # every beam follows the constraint

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])

        def check(ok: bool, name: str, message: str) -> None:
            if not ok:
                raise ValueError(f"{name}: {message}, got {getattr(self, name)!r}")

        check(isinstance(self.beam_width, int) and not isinstance(self.beam_width, bool)
              and 1 <= self.beam_width <= MAX_BEAM_WIDTH, "beam_width", f"must be an integer in [1, {MAX_BEAM_WIDTH}]")
        check(isinstance(self.max_tokens, int) and not isinstance(self.max_tokens, bool) and self.max_tokens >= 1,
              "max_tokens", "must be an integer >= 1")
        check(self.temperature >= 0.0, "temperature", "must be >= 0")
        check(isinstance(self.length_penalty, (int, float)) and not isinstance(self.length_penalty, bool),
              "length_penalty", "must be a number")
        check(isinstance(self.early_stopping, bool) or self.early_stopping == "never", "early_stopping",
              "must be True, False or 'never'")
        check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
              "must be non-negative integers")
        check(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")

    def sampling_params(self) -> SamplingParams:
        """What each beam's row asks of the sampler: its top 2 x beam_width candidates with their
        log-probabilities (the sampled token itself is not used), and the stop conditions."""
        return SamplingParams(n=self.beam_width, temperature=0.0, max_tokens=self.max_tokens,
                              logprobs_temperature=self.temperature if self.temperature > 0 else 1.0,
                              ignore_eos=self.ignore_eos, logprobs=2 * self.beam_width, stop=self.stop,
                              stop_token_ids=self.stop_token_ids,
                              include_stop_str_in_output=self.include_stop_str_in_output,
                              skip_special_tokens=self.skip_special_tokens, structured_outputs=self.structured_outputs)
