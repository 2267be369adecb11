"""Offline outputs, in vLLM's shape: RequestOutput.outputs[i].text / .token_ids / .finish_reason."""
from __future__ import annotations

from dataclasses import dataclass, field

from jaxengine.request import Request


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float | None

    @property
    def time_in_queue(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def ttft(self) -> float | None:
        """Time to first token, from arrival."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def decode_time(self) -> float | None:
        if self.finished_time is None or self.first_token_time is None:
            return None
        return self.finished_time - self.first_token_time


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None          # "stop", "length", "abort", "error"
    stop_reason: int | str | None = None
    logprobs: list[dict[int, float]] | None = None   # per token: top-k {token id: logprob}
    cumulative_logprob: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, float] | None] | None = None
    error: str | None = field(default=None)


def make_request_output(request: Request, prompt: str | None, texts: list[str]) -> RequestOutput:
    outputs = []
    for seq, text in zip(request.seqs, texts):
        logprobs = cumulative = None
        if request.sampling_params.logprobs is not None:
            logprobs = [top for _, top in seq.logprobs]
            cumulative = sum(lp for lp, _ in seq.logprobs)
        outputs.append(CompletionOutput(seq.sample_index, text, seq.output_token_ids, seq.status.finish_reason,
                                        seq.stop_reason, logprobs, cumulative))
    t = request.times
    return RequestOutput(request.request_id, prompt, request.prompt_token_ids, outputs, request.is_finished,
                         RequestMetrics(t.queued, t.first_scheduled, t.first_token, t.finished),
                         num_cached_tokens=request.num_cached_tokens, error=request.status_reason,
                         prompt_logprobs=request.prompt_logprobs)


@dataclass
class BeamSearchSequence:
    """One finished hypothesis (vLLM's shape): ``tokens`` is prompt + output, ``text`` the
    output's text; ``score`` ranks it (cumulative logprob / output tokens ** length_penalty)."""

    tokens: list[int]
    logprobs: list[dict[int, float]]         # per output token: the candidates at that position
    cum_logprob: float
    score: float
    text: str
    finish_reason: str | None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """A prompt's result: its ``beam_width`` best hypotheses, best first (none, with ``error``,
    when the request could not run)."""

    sequences: list[BeamSearchSequence]
    error: str | None = None


def make_beam_search_output(request: Request, texts: list[str]) -> BeamSearchOutput:
    hypotheses = request.beam.finished
    return BeamSearchOutput([
        BeamSearchSequence(list(seq.token_ids), [top for _, top in seq.logprobs], seq.cumulative_logprob, h.score,
                           text, seq.status.finish_reason, seq.stop_reason)
        for seq, h, text in zip(request.seqs, hypotheses, texts)], error=None if hypotheses else request.status_reason)
