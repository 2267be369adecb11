"""Beam search for one sequence group: the search's decisions, one step at a time
(``BeamSearch``), and their application to the group's sequences (``take_candidates``,
``decide``, ``apply_step``, ``hypothesis_seqs``). No KV blocks here: the scheduler gives a
forked beam its blocks and frees the dropped ones.

Each step every live beam brings its top ``2 x beam_width`` candidates (token, log-probability)
from the sampler. Over all beams the ``2 x beam_width`` best by cumulative log-probability are
ranked; the best ``beam_width`` that do not stop continue; of the first ``beam_width`` ranks,
those that stop (a stop token, the length limit, a stop string) become finished hypotheses,
scored ``cumulative logprob / generated tokens ** length_penalty``, of which the
``beam_width`` best are kept. The search ends by ``early_stopping``'s rule, when nothing
continues, or at the length limit. This is transformers' beam search, so the two agree token
for token.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

# numpy is imported inside the functions that use it: importing jaxengine stays light.
from jaxengine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from jaxengine.request import Request, RequestStatus, Sequence
from jaxengine.sampling_params import BeamSearchParams

# (token id, log-probability): one beam's candidates for its next token, most likely first.
Candidates = list[tuple[int, float]]
StopCheck = Callable[[list[int]], str | None]      # output tokens -> the stop string in their text, or None


@dataclass(frozen=True)
class Continuation:
    """A ranked candidate: beam ``beam`` extended by ``token``."""

    beam: int
    token: int
    logprob: float
    cumulative_logprob: float
    top: dict[int, float]             # the beam's candidates at this position (for logprobs)


@dataclass
class Hypothesis:
    """A finished beam: its output tokens (the stop token included), per-token log-probabilities
    and the candidates at each position, its cumulative log-probability and its score."""

    token_ids: list[int]
    logprobs: list[tuple[float, dict[int, float]]]
    cumulative_logprob: float
    score: float
    status: RequestStatus
    stop_reason: int | str | None = None


@dataclass
class BeamStep:
    continuations: list[Continuation]      # the next beams, best first
    done: bool                             # the search is over: ``finished`` holds the result


@dataclass
class BeamSearch:
    """One group's search state."""

    params: BeamSearchParams
    max_tokens: int                        # max_tokens, capped by the model's context length
    stop_token_ids: frozenset[int]         # EOS (unless ignore_eos) and stop_token_ids
    stop_check: StopCheck | None = None    # for stop strings; set by the door that has the tokenizer
    finished: list[Hypothesis] = field(default_factory=list)     # best first, at most beam_width
    improvable: bool = True                # may a running beam still beat the worst finished one?
    num_generated: int = 0                 # tokens every running beam has generated
    candidates: dict[int, Candidates] = field(default_factory=dict)   # by sequence id, until the step

    @property
    def width(self) -> int:
        return self.params.beam_width

    def step(self, beams: list[tuple[list[int], list, float]], candidates: list[Candidates]) -> BeamStep:
        """``beams``: per live beam (output tokens, per-token logprobs, cumulative logprob), in
        rank order; ``candidates``: each beam's top candidates. Records the hypotheses that
        finish and returns the beams that continue."""
        k = self.width
        ranked = self._rank(beams, candidates)
        stops = [self._stop(beams[c.beam][0], c.token) for c in ranked]
        continuing = [c for c, stop in zip(ranked, stops) if stop is None][:k]
        if self.improvable and not self._full_and_early():
            for rank, (c, stop) in enumerate(zip(ranked, stops)):
                if rank < k and stop is not None:
                    self._add_hypothesis(beams[c.beam], c, stop)
        self.num_generated += 1
        if self.improvable and continuing:
            self.improvable = self._best_running_score(continuing[0]) > self._worst_finished_score()
        done = not continuing or not self.improvable or self._full_and_early()
        return BeamStep(continuing, done)

    def end_running(self, beams: list[tuple[list[int], list, float]]) -> None:
        """The search is cut short (the group outgrew the KV pool): its running beams finish by
        length, as they would at max_tokens, and compete with the finished hypotheses."""
        import numpy as np
        for output, logprobs, cumulative in beams:
            score = _f32(cumulative / np.float32(len(output) ** self.params.length_penalty))
            self._keep(Hypothesis(list(output), list(logprobs), cumulative, score, RequestStatus.FINISHED_LENGTH))

    def _rank(self, beams, candidates: list[Candidates]) -> list[Continuation]:
        """The 2 x width best continuations over all beams by cumulative logprob (ties: earlier
        beam, then the beam's own order)."""
        import numpy as np
        scored = []
        for b, ((_, _, cumulative), cands) in enumerate(zip(beams, candidates)):
            top = dict(cands)
            for rank, (token, logprob) in enumerate(cands):
                if logprob == -math.inf:
                    continue                    # masked out (a grammar, min_tokens): never a continuation
                scored.append((-_f32(cumulative + np.float32(logprob)), b, rank, token, logprob, top))
        scored.sort(key=lambda s: s[:3])
        return [Continuation(b, token, logprob, -neg, top) for neg, b, _, token, logprob, top in scored[:2 * self.width]]

    def _stop(self, output: list[int], token: int) -> tuple[RequestStatus, int | str | None] | None:
        if token in self.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED, token
        if self.num_generated + 1 >= self.max_tokens:
            return RequestStatus.FINISHED_LENGTH, None
        if self.stop_check is not None and (matched := self.stop_check([*output, token])) is not None:
            return RequestStatus.FINISHED_STOPPED, matched
        return None

    def _add_hypothesis(self, beam, c: Continuation, stop) -> None:
        import numpy as np
        output, logprobs, _ = beam
        score = _f32(c.cumulative_logprob / np.float32((self.num_generated + 1) ** self.params.length_penalty))
        self._keep(Hypothesis([*output, c.token], [*logprobs, (c.logprob, c.top)], c.cumulative_logprob, score, *stop))

    def _keep(self, hypothesis: Hypothesis) -> None:
        self.finished.append(hypothesis)
        self.finished.sort(key=lambda h: -h.score)          # stable: an earlier one wins a tie
        del self.finished[self.width:]

    def _full_and_early(self) -> bool:
        return self.params.early_stopping is True and len(self.finished) == self.width

    def _best_running_score(self, best: Continuation) -> float:
        """The best running beam's score at the length transformers' heuristic assumes."""
        import numpy as np
        p = self.params
        length = self.max_tokens if p.early_stopping == "never" and p.length_penalty > 0 else self.num_generated
        return _f32(best.cumulative_logprob / np.float32(length ** p.length_penalty))

    def _worst_finished_score(self) -> float:
        return min(h.score for h in self.finished) if len(self.finished) == self.width else -math.inf


def _f32(x) -> float:
    """Scores in float32, as transformers keeps them: the same near-ties break the same way."""
    import numpy as np
    return float(np.float32(x))


# ---------------------------------------------------------------- applied to a group's sequences
def take_candidates(out: SchedulerOutput, result: ModelRunnerOutput) -> list[Request]:
    """Each running beam row that sampled leaves its candidates (the sampler's top-k) with its
    group's search; returns the groups all of whose live beams now have theirs."""
    groups = {}
    logprobs = result.logprobs or [None] * len(result.sampled_token_ids)
    for seq, tokens, row in zip(out.scheduled_seqs, result.sampled_token_ids, logprobs):
        group = seq.request
        if group.beam is not None and tokens and seq.status is RequestStatus.RUNNING:
            group.beam.candidates[seq.seq_id] = list(row[0][1].items())
            groups[group.request_id] = group
    return [g for g in groups.values() if g.status is RequestStatus.RUNNING
            and all(s.seq_id in g.beam.candidates for s in g.live_seqs)]


def decide(group: Request) -> BeamStep:
    """One step of the group's search over its live beams, taking their candidates."""
    search, beams = group.beam, group.live_seqs
    return search.step([(s.output_token_ids, s.logprobs, s.cumulative_logprob) for s in beams],
                       [search.candidates.pop(s.seq_id) for s in beams])


def apply_step(group: Request, step: BeamStep, fork_seq: Callable[[Sequence, int], Sequence],
               intake: Callable[..., object]) -> list[Sequence]:
    """The step applied to the group's sequences: a beam continued once extends in place, one
    continued several ways forks (``fork_seq(parent, sample_index)`` makes a child sharing its
    blocks, the partial last one copied on write); they take their tokens through the
    scheduler's ``intake(beams, tokens, searched=True)``. Returns the beams not continued, for
    the caller to free."""
    beams = group.live_seqs
    parents_taken: set[int] = set()
    next_beams = []
    for c in step.continuations:            # forks first: a child copies its parent as it is
        parent = beams[c.beam]
        if c.beam in parents_taken:
            child = fork_seq(parent, len(group.seqs) + len(next_beams))
            child.logprobs = list(parent.logprobs)
            child.grammar = parent.grammar.copy() if parent.grammar is not None else None
            next_beams.append((child, c))
        else:
            parents_taken.add(c.beam)
            next_beams.append((parent, c))
    dropped = [seq for b, seq in enumerate(beams) if b not in parents_taken]
    intake([seq for seq, _ in next_beams], [[c.token] for _, c in next_beams], searched=True)
    for seq, c in next_beams:
        seq.logprobs.append((c.logprob, c.top))
        seq.cumulative_logprob = c.cumulative_logprob
        seq.is_new = True                  # the runner learns the chosen token with the sequence
    group.seqs = [seq for seq, _ in next_beams]
    return dropped


def hypothesis_seqs(group: Request) -> list[Sequence]:
    """The search's hypotheses as the group's (finished, blockless) sequences, best first."""
    seqs = []
    for rank, h in enumerate(group.beam.finished):
        seq = Sequence(group, [*group.prompt_token_ids, *h.token_ids], rank)
        seq.status, seq.stop_reason = h.status, h.stop_reason
        seq.logprobs, seq.cumulative_logprob = h.logprobs, h.cumulative_logprob
        seqs.append(seq)
    return seqs
