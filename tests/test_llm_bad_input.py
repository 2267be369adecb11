"""Bad input harms nothing in the offline door: any SamplingParams value is either refused with a
ValueError (at construction, or by ``generate`` before anything is queued) or served; a request
that fails inside a step raises to its caller, its blocks are freed, and the engine goes on; a
per-prompt list of the wrong length is refused before anything is queued."""
import math

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from jaxengine.lora_request import LoRARequest
from jaxengine.sampling_params import BeamSearchParams, SamplingParams, StructuredOutputsParams

VOCAB = 258                     # the chat checkpoint's byte tokenizer (EOS 256)
PROMPT = "a normal prompt"
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=4, temperature=1.0, seed=11, ignore_eos=True)
INJECTED = "injected step failure"


@pytest.fixture(scope="module")
def llm(chat_checkpoint):
    from jaxengine.llm import LLM

    return LLM(chat_checkpoint, max_num_batched_tokens=32, token_buckets=[16, 32], request_buckets=[8],
               max_num_seqs=8, block_size=4, max_model_len=32, num_kv_blocks=48, progress=False,
               compile_mode="eager")


@pytest.fixture(scope="module")
def reference(llm):
    """The tokens of a normal greedy and a normal seeded request on the engine as it starts."""
    return tokens(llm, PROMPT)


def tokens(llm, prompt=PROMPT) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate([prompt, prompt], [GREEDY, SEEDED], use_tqdm=False)]


def assert_idle_and_unharmed(llm) -> None:
    engine = llm.engine
    kv = engine.scheduler.kv
    assert not engine.has_unfinished_requests() and not engine.scheduler.requests
    assert kv.pool.num_free_blocks == kv.num_usable_blocks


# ---- any value of any field: refused with ValueError, or served ----
ANY = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 300), st.sampled_from([1 << 31, 1 << 63, 1 << 64, -(1 << 63)]),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=3),
    st.lists(st.one_of(st.integers(-2, 300), st.text(max_size=2)), max_size=3),
    st.dictionaries(st.one_of(st.integers(-2, 300), st.text(max_size=2)),
                    st.one_of(st.floats(-150, 150), st.floats(allow_nan=True), st.booleans()), max_size=3))
PROBABILITY = st.floats(0, 1)
TOKEN_ID = st.integers(0, VOCAB - 1) | st.integers(VOCAB, VOCAB + 2)
# Values each field takes in normal use (a few of them beyond what this engine serves: n above
# max_num_seqs, token ids beyond the vocabulary); max_tokens and min_tokens stay small so that
# each example runs a few steps.
PLAUSIBLE = {
    "n": st.integers(1, 3) | st.just(9), "best_of": st.none() | st.integers(1, 3), "temperature": st.floats(0, 2),
    "top_p": PROBABILITY, "top_k": st.integers(-1, 300), "min_p": PROBABILITY, "seed": st.integers(-(1 << 63), 1 << 64),
    "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2), "repetition_penalty": st.floats(0, 3),
    "logit_bias": st.dictionaries(TOKEN_ID, st.floats(-100, 100), max_size=4),
    "stop": st.text(max_size=2) | st.lists(st.text(min_size=1, max_size=2), max_size=2),
    "stop_token_ids": st.lists(TOKEN_ID, max_size=3),
    "include_stop_str_in_output": st.booleans(), "ignore_eos": st.booleans(), "skip_special_tokens": st.booleans(),
    "max_tokens": st.none() | st.integers(1, 5), "min_tokens": st.integers(0, 4),
    "logprobs": st.none() | st.integers(0, 20), "prompt_logprobs": st.none() | st.integers(0, 20),
    "logprobs_temperature": st.floats(0, 3),
    "structured_outputs": st.just(StructuredOutputsParams(regex="[ab]{1,3}")),
}
SMALL_MAX_TOKENS = st.none() | st.integers(-2, 5) | st.booleans() | st.floats(allow_nan=True) | st.text(max_size=2)


@st.composite
def field_values(draw) -> dict:
    """A few fields, of which at most two take any value and the others a plausible one."""
    names = draw(st.lists(st.sampled_from(sorted(PLAUSIBLE)), unique=True, max_size=5))
    wild = draw(st.sets(st.sampled_from(names), max_size=2)) if names else set()
    values = {name: draw(PLAUSIBLE[name] if name not in wild else SMALL_MAX_TOKENS if name == "max_tokens" else ANY)
              for name in names}
    values.setdefault("max_tokens", 4)
    return values


@settings(max_examples=60, deadline=None, database=None, derandomize=True)
@given(values=field_values())
def test_any_field_value_is_refused_up_front_or_served(llm, reference, values):
    try:
        params = SamplingParams(**values)
    except ValueError as error:
        assert str(error).split(":")[0] in values       # names a field that was given
        event("refused by SamplingParams")
        return
    try:
        [out] = llm.generate(PROMPT, params, use_tqdm=False)
    except ValueError as error:
        assert str(error).split(":")[0] in values       # refused before anything was queued
        event("refused by generate")
    else:
        event("served")
        assert len(out.outputs) == params.n
        for sample in out.outputs:
            assert all(0 <= t < VOCAB for t in sample.token_ids)
            assert len(sample.token_ids) <= (params.max_tokens or 32)
            assert params.logprobs is None or len(sample.logprobs) == len(sample.token_ids)
    assert_idle_and_unharmed(llm)
    assert tokens(llm) == reference


# ---- a request that fails inside a step ----
class FailingDispatch:
    """Wraps the runner's ``dispatch``: a step that runs a row of a request whose prompt holds
    ``marker`` raises ``error`` (as it is launched or as its results are read)."""

    def __init__(self, runner, marker: list[int], error: BaseException, where: str) -> None:
        self.dispatch, self.marker, self.error, self.where = runner.dispatch, marker, error, where
        self.fired, self.marked = 0, []

    def __call__(self, out):
        marked = [seq.request.request_id for seq in out.scheduled_seqs
                  if seq.request.prompt_token_ids[:len(self.marker)] == self.marker]
        self.marked += marked
        fire = bool(marked)
        if fire and self.where == "dispatch":
            self._fire()
        pending = self.dispatch(out)
        if fire:
            pending.result = self._fire
        return pending

    def _fire(self):
        self.fired += 1
        raise self.error


@pytest.mark.parametrize("where", ["dispatch", "result"])
def test_a_request_failing_in_a_step_raises_frees_its_blocks_and_the_engine_goes_on(llm, reference, monkeypatch,
                                                                                  where):
    marker = llm.tokenizer.encode("FAIL")
    failing = FailingDispatch(llm.runner, marker, LookupError(INJECTED), where)
    monkeypatch.setattr(llm.runner, "dispatch", failing)
    with pytest.raises(LookupError) as info:              # the step's own error, its type kept
        llm.generate("FAIL here", GREEDY, use_tqdm=False)
    [request_id] = set(failing.marked)
    assert str(info.value) == INJECTED and info.value.__notes__[-1] == (
        f"requests ['{request_id}']: the engine step failed; this call's requests were ended and the engine goes on")
    assert failing.fired == 1
    assert_idle_and_unharmed(llm)
    assert tokens(llm) == reference

    # With others in the same call: the call raises and every one of its requests ends.
    with pytest.raises(LookupError, match=INJECTED):
        llm.generate([PROMPT, "FAIL again", PROMPT], GREEDY, use_tqdm=False)
    assert failing.fired == 2
    assert_idle_and_unharmed(llm)
    assert tokens(llm) == reference

    # Beam search runs the same way.
    with pytest.raises(LookupError, match=INJECTED):
        llm.beam_search(["FAIL with beams"], BeamSearchParams(beam_width=2, max_tokens=3))
    assert failing.fired == 3
    assert_idle_and_unharmed(llm)
    assert tokens(llm) == reference


def test_an_interrupted_generate_leaves_the_engine_usable(llm, reference, monkeypatch):
    marker = llm.tokenizer.encode("STOP")
    monkeypatch.setattr(llm.runner, "dispatch", FailingDispatch(llm.runner, marker, KeyboardInterrupt(), "result"))
    with pytest.raises(KeyboardInterrupt):
        llm.generate(["STOP now", PROMPT], GREEDY, use_tqdm=False)
    assert_idle_and_unharmed(llm)
    assert tokens(llm) == reference


def test_a_request_that_cannot_be_queued_unqueues_the_ones_before_it(llm, reference, monkeypatch):
    add = llm.engine.add_request
    calls = []

    def add_twice_then_fail(*args, **kwargs):
        calls.append(args[0])
        if len(calls) == 3:
            raise RuntimeError("queue full")
        return add(*args, **kwargs)

    monkeypatch.setattr(llm.engine, "add_request", add_twice_then_fail)
    with pytest.raises(RuntimeError, match="queue full"):
        llm.generate([PROMPT] * 4, GREEDY, use_tqdm=False)
    assert len(calls) == 3
    assert_idle_and_unharmed(llm)
    monkeypatch.undo()
    assert tokens(llm) == reference


# ---- per-prompt lists ----
@pytest.mark.parametrize("kwargs, error, message", [
    (dict(priority=[1]), ValueError, "priority: 1 given for 2 prompts"),
    (dict(priority=[1, 2, 3]), ValueError, "priority: 3 given for 2 prompts"),
    (dict(priority=[0, True]), ValueError, "priority: must be integers, got [True]"),
    (dict(priority=[0, 1.5]), ValueError, "priority: must be integers, got [1.5]"),
    (dict(priority=3), ValueError, "priority: must be a list of integers, one per prompt, got int"),
    (dict(sampling_params=[GREEDY]), ValueError, "sampling_params: 1 given for 2 prompts"),
    (dict(sampling_params=[GREEDY] * 3), ValueError, "sampling_params: 3 given for 2 prompts"),
    (dict(sampling_params={"max_tokens": 4}), TypeError,
     "sampling_params: expected one for all prompts or a list, one per prompt, got dict"),
    (dict(lora_request=[None]), ValueError, "lora_request: 1 given for 2 prompts"),
    (dict(lora_request=[None, None, LoRARequest("a", 1, "/nowhere")]), ValueError,
     "lora_request: 3 given for 2 prompts"),
])
def test_a_per_prompt_list_of_the_wrong_length_is_refused_before_anything_is_queued(llm, kwargs, error, message):
    kwargs = {"sampling_params": GREEDY, **kwargs}
    with pytest.raises(error) as info:
        llm.generate([PROMPT, PROMPT], use_tqdm=False, **kwargs)
    assert str(info.value) == message
    assert_idle_and_unharmed(llm)


def test_priorities_given_one_per_prompt_are_served(llm, reference):
    outputs = llm.generate([PROMPT, PROMPT], [GREEDY, SEEDED], priority=[1, 0], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == reference


def test_beam_search_params_of_the_wrong_length_are_refused(llm):
    beams = BeamSearchParams(beam_width=2, max_tokens=3)
    with pytest.raises(ValueError) as info:
        llm.beam_search([PROMPT, PROMPT], [beams] * 3)
    assert str(info.value) == "sampling_params: 3 given for 2 prompts"
    with pytest.raises(ValueError, match=r"^length_penalty: must be a finite number, got nan$"):
        BeamSearchParams(beam_width=2, max_tokens=3, length_penalty=math.nan)
    assert_idle_and_unharmed(llm)
