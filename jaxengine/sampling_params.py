"""Per-request sampling parameters (vLLM's names). Invalid values raise ValueError naming the field."""
from __future__ import annotations

from dataclasses import dataclass, field

MAX_LOGPROBS = 20   # top-k logprobs the sampler computes for every row
MAX_LOGIT_BIAS = 64  # logit_bias entries per request


@dataclass
class SamplingParams:
    n: int = 1
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
        check(self.temperature >= 0.0, "temperature", "must be >= 0")
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
        bias = self.logit_bias or {}
        check(len(bias) <= MAX_LOGIT_BIAS and all(isinstance(t, int) and t >= 0 for t in bias), "logit_bias",
              f"must map at most {MAX_LOGIT_BIAS} non-negative token ids to biases")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
