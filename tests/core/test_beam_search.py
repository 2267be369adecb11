"""Beam search's step logic on hand-made candidates (exact values), and its parameters' errors."""
import pytest

from jaxengine.core.beam_search import BeamSearch
from jaxengine.request import RequestStatus
from jaxengine.sampling_params import BeamSearchParams

EOS = 0


def search(width=2, max_tokens=3, **params) -> BeamSearch:
    return BeamSearch(BeamSearchParams(beam_width=width, max_tokens=max_tokens, **params), max_tokens,
                      frozenset({EOS}))


def test_first_step_ranks_continues_and_finishes_from_the_leader():
    s = search()
    step = s.step([([], [], 0.0)], [[(5, -0.25), (EOS, -0.5), (7, -1.0), (9, -2.0)]])
    assert [(c.beam, c.token, c.cumulative_logprob) for c in step.continuations] == [(0, 5, -0.25), (0, 7, -1.0)]
    assert [(h.token_ids, h.score, h.status) for h in s.finished] == [([EOS], -0.5, RequestStatus.FINISHED_STOPPED)]
    assert (s.num_generated, s.improvable, step.done) == (1, True, False)


def test_the_best_continuations_come_from_any_beam_and_the_length_limit_finishes_the_top_ranks():
    s = search(max_tokens=2, length_penalty=1.0)
    s.step([([], [], 0.0)], [[(5, -0.25), (7, -1.0), (8, -3.0), (9, -4.0)]])
    step = s.step([([5], [], -0.25), ([7], [], -1.0)],
                  [[(1, -2.0), (2, -2.5), (3, -3.0), (4, -3.5)], [(1, -0.5), (2, -0.75), (3, -5.0), (4, -6.0)]])
    # ranked: 7+1 (-1.5), 7+2 (-1.75), 5+1 (-2.25), 5+2 (-2.75): every one reaches max_tokens
    assert step.continuations == [] and step.done
    assert [(h.token_ids, h.score, h.status) for h in s.finished] == [
        ([7, 1], -0.75, RequestStatus.FINISHED_LENGTH), ([7, 2], -0.875, RequestStatus.FINISHED_LENGTH)]


def test_early_stopping_true_ends_once_width_hypotheses_finished():
    s = search(max_tokens=10, early_stopping=True)
    step = s.step([([], [], 0.0)], [[(EOS, -0.1), (5, -0.2), (6, -0.3), (7, -0.4)]])
    assert not step.done and len(s.finished) == 1
    step = s.step([([5], [], -0.2), ([6], [], -0.3)],
                  [[(EOS, -0.1), (8, -0.2), (9, -3.0), (10, -4.0)], [(11, -0.1), (12, -2.0), (13, -3.0), (14, -5.0)]])
    # ranked: 5+EOS (-0.3), 5+8 (-0.4), 6+11 (-0.4), ...: the first is rank 0 and finishes
    assert [h.token_ids for h in s.finished] == [[EOS], [5, EOS]] and step.done


def test_heuristic_stops_when_no_running_beam_can_beat_the_worst_finished():
    s = search(max_tokens=10, length_penalty=0.0)
    s.step([([], [], 0.0)], [[(EOS, -0.1), (EOS + 1, -0.2), (5, -3.0), (6, -4.0)]])
    step = s.step([([1], [], -0.2), ([5], [], -3.0)],
                  [[(EOS, -0.1), (8, -5.0), (9, -6.0), (10, -7.0)], [(11, -0.1), (12, -2.0), (13, -3.0), (14, -5.0)]])
    # finished: [EOS] at -0.1 and [1, EOS] at -0.3; the best running beam (-3.1) cannot beat -0.3
    assert [(h.token_ids, h.score) for h in s.finished] == [([EOS], pytest.approx(-0.1)),
                                                          ([1, EOS], pytest.approx(-0.3))]
    assert not s.improvable and step.done


@pytest.mark.parametrize("field, value, message", [
    ("beam_width", 0, "beam_width: must be an integer in [1, 10], got 0"),
    ("beam_width", 11, "beam_width: must be an integer in [1, 10], got 11"),
    ("max_tokens", 0, "max_tokens: must be an integer >= 1, got 0"),
    ("temperature", -1.0, "temperature: must be >= 0, got -1.0"),
    ("early_stopping", "sometimes", "early_stopping: must be True, False or 'never', got 'sometimes'"),
    ("length_penalty", "long", "length_penalty: must be a number, got 'long'"),
    ("stop_token_ids", [-1], "stop_token_ids: must be non-negative integers, got [-1]"),
])
def test_bad_parameters_are_named(field, value, message):
    with pytest.raises(ValueError) as info:
        BeamSearchParams(**{"beam_width": 2, "max_tokens": 4, field: value})
    assert str(info.value) == message


def test_a_beam_group_that_outgrows_the_pool_ends_by_length_with_its_running_beams():
    from tests.helpers import Harness
    from jaxengine.request import Request

    h = Harness(block_size=2, num_gpu_blocks=9)            # 8 usable blocks: 16 tokens in all
    h.runner.vocab_size = 40
    request = Request("b", [1, 2, 3, 4], BeamSearchParams(beam_width=2, max_tokens=50, ignore_eos=True))
    h.scheduler.add_request(request)
    h.run()
    assert request.status is RequestStatus.FINISHED_LENGTH
    assert "needs more KV cache than the whole pool" in request.status_reason
    assert [s.status.finish_reason for s in request.seqs] == ["length", "length"]
    assert [len(s.token_ids) for s in request.seqs] == [s.num_prompt_tokens + len(s.logprobs) for s in request.seqs]
    scores = [hyp.score for hyp in request.beam.finished]
    assert scores == sorted(scores, reverse=True) and len(scores) == 2
    assert h.kv.num_free_blocks == h.kv.num_usable_blocks and not h.scheduler.has_unfinished_requests()
