"""Per-request sampling parameters (vLLM's names). Invalid values raise ValueError naming the field."""
from __future__ import annotations

import math
import numbers
import reprlib
from collections.abc import Mapping
from dataclasses import dataclass, field

MAX_LOGPROBS = 20   # top-k logprobs the sampler computes for every row
MAX_LOGIT_BIAS = 64  # logit_bias entries per request
MAX_BIAS = 100.0     # |logit_bias value| (OpenAI's documented range)
MAX_TOP_K = (1 << 31) - 1    # the runner holds top_k as a 32-bit integer
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
            if (not isinstance(self.choice, list | tuple) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
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
        # Types first, each a ValueError naming the field (a bool is no integer here, and a
        # number must be finite): a wrong one would otherwise fail inside an engine step.
        for name in ("n", "top_k", "min_tokens"):
            _integer(self, name)
        for name in ("best_of", "seed", "max_tokens", "logprobs", "prompt_logprobs"):
            _integer(self, name, optional=True)
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
                     "logprobs_temperature"):
            _number(self, name)
        _flags(self, "include_stop_str_in_output", "ignore_eos", "skip_special_tokens")
        _stops(self)
        self.logit_bias = _logit_bias(self.logit_bias)
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
        check(-1 <= self.top_k <= MAX_TOP_K, "top_k", f"must be -1, 0 or a positive integer (at most {MAX_TOP_K})")
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
        check(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        check(self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
              "structured_outputs", "must be StructuredOutputsParams")

    def _check_best_of(self, check) -> None:
        if self.best_of is None:
            return
        check(self.best_of >= 1, "best_of", "must be None or an integer >= 1")
        check(self.best_of >= self.n, "best_of", f"must be >= n ({self.n})")
        check(self.best_of <= self.n, "best_of", f"above n ({self.n}) is not supported: every sample is returned")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _is_integer(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _integer(params, name: str, optional: bool = False) -> None:
    """The field as a plain int; a bool, a float or anything else is a ValueError naming it."""
    value = getattr(params, name)
    if value is None and optional:
        return
    if not _is_integer(value):
        raise ValueError(f"{name}: must be {'None or ' if optional else ''}an integer, got {reprlib.repr(value)}")
    setattr(params, name, int(value))


def _finite(value) -> float | None:
    """A real number (no bool) as a finite float, else None."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        return None
    try:
        value = float(value)
    except OverflowError:            # an int beyond any float
        return None
    return value if math.isfinite(value) else None


def _number(params, name: str) -> None:
    value = getattr(params, name)
    if (number := _finite(value)) is None:
        real = isinstance(value, numbers.Real) and not isinstance(value, bool)
        raise ValueError(f"{name}: must be a {'finite number' if real else 'number'}, got {reprlib.repr(value)}")
    setattr(params, name, number)


def _flags(params, *names: str) -> None:
    for name in names:
        if not isinstance(value := getattr(params, name), bool):
            raise ValueError(f"{name}: must be True or False, got {reprlib.repr(value)}")


def _stops(params) -> None:
    """``stop`` (a string or a list of them) and ``stop_token_ids`` (None: none) as lists."""
    stop = [params.stop] if isinstance(params.stop, str) else params.stop
    if not (stop is None or isinstance(stop, (list, tuple))):
        raise ValueError(f"stop: must be a string or a list of strings, got {reprlib.repr(stop)}")
    params.stop = list(stop or [])
    ids = params.stop_token_ids
    if not (ids is None or isinstance(ids, (list, tuple))) or not all(_is_integer(t) and t >= 0 for t in ids or []):
        raise ValueError(f"stop_token_ids: must be non-negative integers, got {reprlib.repr(ids)}")
    params.stop_token_ids = [int(t) for t in ids or []]


def _logit_bias(bias) -> dict[int, float] | None:
    """{token id: bias in [-MAX_BIAS, MAX_BIAS]} as plain ints and floats."""
    if bias is None:
        return None
    if not isinstance(bias, Mapping):
        raise ValueError(f"logit_bias: must map token ids to biases, got {reprlib.repr(bias)}")
    if len(bias) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias: must hold at most {MAX_LOGIT_BIAS} entries, got {len(bias)}")
    if bad := [t for t in bias if not (_is_integer(t) and t >= 0)]:
        raise ValueError(f"logit_bias: keys must be token ids (non-negative integers), got {reprlib.repr(bad)}")
    if bad := [v for v in bias.values() if (f := _finite(v)) is None or abs(f) > MAX_BIAS]:
        raise ValueError(f"logit_bias: biases must be numbers in [-{MAX_BIAS:g}, {MAX_BIAS:g}], "
                         f"got {reprlib.repr(bad)}")
    return {int(t): float(v) for t, v in bias.items()}


MAX_BEAM_WIDTH = MAX_LOGPROBS // 2      # each beam's 2 x width candidates come from the sampler's top-k
MAX_LENGTH_PENALTY = 10.0   # |length_penalty|: far past any useful value; a huge one overflows length ** length_penalty


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
    min_tokens: int = 0            # no beam ends on a stop token before this many tokens

    def __post_init__(self) -> None:
        def check(ok: bool, name: str, message: str) -> None:
            if not ok:
                raise ValueError(f"{name}: {message}, got {getattr(self, name)!r}")

        check(_is_integer(self.beam_width) and 1 <= self.beam_width <= MAX_BEAM_WIDTH, "beam_width",
              f"must be an integer in [1, {MAX_BEAM_WIDTH}]")
        check(_is_integer(self.max_tokens) and self.max_tokens >= 1, "max_tokens", "must be an integer >= 1")
        self.beam_width, self.max_tokens = int(self.beam_width), int(self.max_tokens)
        check(_is_integer(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens, "min_tokens",
              f"must be an integer in [0, max_tokens ({self.max_tokens})]")
        _number(self, "temperature")
        _number(self, "length_penalty")
        check(abs(self.length_penalty) <= MAX_LENGTH_PENALTY, "length_penalty",
              f"must be in [-{MAX_LENGTH_PENALTY:g}, {MAX_LENGTH_PENALTY:g}]")
        check(self.temperature >= 0.0, "temperature", "must be >= 0")
        check(isinstance(self.early_stopping, bool) or self.early_stopping == "never", "early_stopping",
              "must be True, False or 'never'")
        _flags(self, "ignore_eos", "include_stop_str_in_output", "skip_special_tokens")
        _stops(self)
        check(self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
              "structured_outputs", "must be StructuredOutputsParams")
        check(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")

    def sampling_params(self) -> SamplingParams:
        """What each beam's row asks of the sampler: its top 2 x beam_width candidates with their
        log-probabilities (the sampled token itself is not used), and the stop conditions."""
        return SamplingParams(n=self.beam_width, temperature=0.0, max_tokens=self.max_tokens,
                              min_tokens=self.min_tokens, logprobs_temperature=self.temperature if self.temperature > 0 else 1.0,
                              ignore_eos=self.ignore_eos, logprobs=2 * self.beam_width, stop=self.stop,
                              stop_token_ids=self.stop_token_ids,
                              include_stop_str_in_output=self.include_stop_str_in_output,
                              skip_special_tokens=self.skip_special_tokens, structured_outputs=self.structured_outputs)
