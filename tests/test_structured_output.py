"""Structured output on a tiny random model (where unconstrained output is noise, so the
constraint does all the work): JSON schemas, regexes, choices and grammars, in mixed batches
with unconstrained requests whose tokens do not change; n > 1, beam search, preemption and
prefix caching; invalid constraints named; a cut-off JSON ends with "length"."""
import json
import re

import jsonschema
import pytest

from jaxengine import BeamSearchParams, SamplingParams
from jaxengine.request import RequestStatus
from jaxengine.sampling_params import StructuredOutputsParams

# Not about step buckets: those from 16 tokens, the fewer compiles (a tiny model's step costs
# the same at 1 token as at 16); the bucket tests run the defaults.
FROM_16 = {32: [16, 32], 64: [16, 32, 64]}

SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 8},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                                      "zip": {"type": "integer", "minimum": 0, "maximum": 99999}},
                    "required": ["city", "zip"], "additionalProperties": False}},
        "required": ["name", "address"], "additionalProperties": False},
    "array": {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 2, "maxItems": 3}},
        "required": ["tags"], "additionalProperties": False},
    "pattern": {"type": "object", "properties": {
        "code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
        "ok": {"type": "boolean"}}, "required": ["code", "ok"], "additionalProperties": False},
    "numbers": {"type": "object", "properties": {
        "count": {"type": "integer", "minimum": 1, "maximum": 50},
        "level": {"enum": [1, 2, 3]},
        "ratio": {"type": "number", "minimum": 0, "maximum": 1}},
        "required": ["count", "level", "ratio"], "additionalProperties": False},
}
MAX_TOKENS = 120
PROMPTS = ["Give me data:", "The record is", "x"]


@pytest.fixture(scope="module")
def llm(chat_checkpoint):
    from jaxengine.llm import LLM

    return LLM(chat_checkpoint, max_num_batched_tokens=64, token_buckets=FROM_16[64], max_num_seqs=16, block_size=4, max_model_len=256,
               num_kv_blocks=600, progress=False, compile_mode="eager")


def constrained(**kind) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_outputs=StructuredOutputsParams(**kind))


def released(llm) -> bool:
    kv = llm.engine.scheduler.kv
    return kv.num_free_blocks == kv.num_usable_blocks and not llm.engine.has_unfinished_requests()


def test_json_schemas_in_a_mixed_batch_validate_and_leave_the_others_alone(llm):
    plain = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    alone = llm.generate(PROMPTS, plain, use_tqdm=False)
    params = [constrained(json=s) for s in SCHEMAS.values()] + [plain] * len(PROMPTS)
    outs = llm.generate([PROMPTS[0]] * len(SCHEMAS) + PROMPTS, params, use_tqdm=False)
    for schema, out in zip(SCHEMAS.values(), outs):
        jsonschema.validate(json.loads(out.outputs[0].text), schema)
        assert out.outputs[0].finish_reason == "stop"
    assert [o.outputs[0].token_ids for o in outs[len(SCHEMAS):]] == [o.outputs[0].token_ids for o in alone]
    assert released(llm)


def test_regex_choice_grammar_and_json_object(llm):
    grammar = 'start: "answer: " ("yes" | "no") " (" NUMBER ")"\nNUMBER: /[1-9][0-9]?/'
    params = [constrained(regex=r"[a-z]{3,6}@[a-z]{2,5}\.(com|org)"), constrained(choice=["alpha", "beta", "gamma"]),
              constrained(grammar=grammar), constrained(json_object=True)]
    regex_out, choice_out, grammar_out, object_out = (o.outputs[0].text for o in
                                                      llm.generate(["Mail:", "Pick:", "Q:", "{"], params,
                                                                   use_tqdm=False))
    assert re.fullmatch(r"[a-z]{3,6}@[a-z]{2,5}\.(com|org)", regex_out)
    assert choice_out in ("alpha", "beta", "gamma")
    assert re.fullmatch(r"answer: (yes|no) \([1-9][0-9]?\)", grammar_out)
    assert isinstance(json.loads(object_out), dict)
    assert released(llm)


def test_groups_beams_and_a_cut_off_json(llm):
    schema = SCHEMAS["numbers"]
    group = llm.generate(["Data:"], SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=MAX_TOKENS,
                                                   structured_outputs=StructuredOutputsParams(json=schema)),
                         use_tqdm=False)[0]
    for out in group.outputs:
        jsonschema.validate(json.loads(out.text), schema)
    beams = llm.beam_search(["Data:"], BeamSearchParams(beam_width=3, max_tokens=MAX_TOKENS,
                                                        structured_outputs=StructuredOutputsParams(json=schema)))
    assert len(beams[0].sequences) == 3
    for seq in beams[0].sequences:
        jsonschema.validate(json.loads(seq.text), schema)
    cut = llm.generate(["Data:"], SamplingParams(temperature=0, max_tokens=5, structured_outputs=StructuredOutputsParams(
        json=schema)), use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "length" and len(cut.token_ids) == 5 and cut.text.startswith("{")
    assert released(llm)


def test_preemption_and_prefix_caching_keep_outputs_valid(chat_checkpoint, llm):
    from jaxengine.llm import LLM

    small = LLM(chat_checkpoint, max_num_batched_tokens=32, token_buckets=FROM_16[32], max_num_seqs=8, block_size=4, max_model_len=256,
                num_kv_blocks=40, enable_prefix_caching=True, progress=False, compile_mode="eager")
    small.engine.traces = []
    params = [constrained(json=s) for s in SCHEMAS.values()] * 2
    prompts = ["The shared part of a prompt, then " + str(i) for i in range(len(params))]
    outs = small.generate(prompts, params, use_tqdm=False)
    assert sum(t.num_preemptions for t in small.engine.traces) > 0
    assert sum(t.num_prefix_hit_tokens for t in small.engine.traces) > 0
    for p, out in zip(params, outs):
        jsonschema.validate(json.loads(out.outputs[0].text), p.structured_outputs.json)
    reference = llm.generate(prompts, params, use_tqdm=False)          # a big pool: no preemption
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in reference]


@pytest.mark.parametrize("kind, message", [
    (dict(json={"type": "strin"}), "structured_outputs: invalid JSON schema"),
    (dict(json="{not json"), "structured_outputs: invalid JSON schema"),
    (dict(regex="a(b"), "structured_outputs: invalid regular expression"),
    (dict(grammar="start: foo"), "structured_outputs: invalid grammar"),
    (dict(json={"type": "object", "if": {"type": "object"}}), 'Unimplemented keys: ["if"]'),
    (dict(json={"type": "integer", "minimum": 5, "maximum": 1}), "Unsatisfiable schema"),
    (dict(regex=r"[^\s\S]"), "structured_outputs: unsatisfiable regular expression"),
    (dict(grammar='start: a\na: a "x"'), "structured_outputs: unsatisfiable grammar"),
])
def test_invalid_constraints_are_named_before_anything_runs(llm, kind, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        llm.generate(["x"], constrained(**kind), use_tqdm=False)
    assert released(llm)


def test_a_stop_string_ends_a_constrained_output(llm):
    params = SamplingParams(temperature=0, max_tokens=60, stop=[" "], structured_outputs=StructuredOutputsParams(
        regex="[a-z]{2,8}( [a-z]{2,8}){3}"))
    out = llm.generate(["Words:"], params, use_tqdm=False)[0].outputs[0]
    assert re.fullmatch("[a-z]{2,8}", out.text) and out.finish_reason == "stop" and out.stop_reason == " "


def test_exactly_one_kind_and_no_tokenizer():
    with pytest.raises(ValueError, match="structured_outputs: exactly one of json, regex, choice, grammar, "
                                         "json_object must be given, got none"):
        StructuredOutputsParams()
    for bad in ([], "abc", ["a", 1]):          # a string is not the list of its characters
        with pytest.raises(ValueError, match="choice must be a non-empty list"):
            StructuredOutputsParams(choice=bad)


def test_an_invalid_constraint_submitted_to_the_engine_fails_its_request_alone(llm):
    engine = llm.engine
    bad = engine.add_request("bad", [1, 2, 3], constrained(regex="a(b"))
    good = engine.add_request("good", [1, 2, 3], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert bad.status is RequestStatus.WAITING_FOR_GRAMMAR
    finished = []
    while engine.has_unfinished_requests():
        finished += engine.step()
    assert bad.status is RequestStatus.FINISHED_IGNORED and "invalid regular expression" in bad.status_reason
    assert good.status is RequestStatus.FINISHED_LENGTH and len(good.seqs[0].output_token_ids) == 4
    assert {r.request_id for r in finished} == {"bad", "good"}
    engine.flush()
    assert released(llm)


def test_async_scheduling_runs_the_others_ahead_while_grammars_wait_for_their_tokens(chat_checkpoint, llm):
    from jaxengine.llm import LLM

    fast = LLM(chat_checkpoint, max_num_batched_tokens=64, token_buckets=FROM_16[64], max_num_seqs=16, block_size=4, max_model_len=256,
               num_kv_blocks=600, async_scheduling=True, progress=False, compile_mode="eager")
    plain = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    params = [constrained(json=s) for s in SCHEMAS.values()] + [plain] * len(PROMPTS)
    prompts = [PROMPTS[0]] * len(SCHEMAS) + PROMPTS
    outs = fast.generate(prompts, params, use_tqdm=False)
    assert fast.engine.num_run_ahead > 0
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in
                                                      llm.generate(prompts, params, use_tqdm=False)]
    assert released(fast)


def test_the_default_model_writes_valid_json_and_matching_text():
    from jaxengine import default_model
    from jaxengine.llm import LLM

    try:
        default_model.default_model_path(progress=False)
    except RuntimeError as e:
        pytest.skip(str(e))
    # One step bucket (the three prompts prefill together in it): a single compile of the model.
    llm = LLM(max_num_batched_tokens=128, max_num_seqs=8, max_model_len=512, token_buckets=[128],
              request_buckets=[8], progress=False)
    schemas = [SCHEMAS["nested"], SCHEMAS["numbers"]]
    params = [SamplingParams(temperature=0, max_tokens=100, structured_outputs=StructuredOutputsParams(json=s))
              for s in schemas]
    params.append(SamplingParams(temperature=0, max_tokens=20, structured_outputs=StructuredOutputsParams(
        regex=r"(Monday|Tuesday|Friday), [0-9]{1,2} (May|June)")))
    outs = llm.chat([[{"role": "user", "content": "Describe a person and where they live, as JSON."}],
                     [{"role": "user", "content": "Give three numbers as JSON."}],
                     [{"role": "user", "content": "Name a day and a date."}]], params, use_tqdm=False)
    for schema, out in zip(schemas, outs):
        jsonschema.validate(json.loads(out.outputs[0].text), schema)
    assert re.fullmatch(r"(Monday|Tuesday|Friday), [0-9]{1,2} (May|June)", outs[2].outputs[0].text)


@pytest.mark.parametrize("mode, opening", [("starts", ""), ("optional", "<think>")])
def test_after_thinking_the_constraint_holds_for_the_answer_only(llm, mode, opening):
    """A reasoning model thinks freely up to ``</think>`` (JSON-looking text included), then the
    constraint holds; "optional" also takes an answer with no thinking, "starts" insists on it."""
    compiler = llm.engine.structured.compiler
    tokenizer = compiler.hf_tokenizer

    def allowed(params: StructuredOutputsParams, text: str) -> int:
        ids = tokenizer.encode(text, add_special_tokens=False)
        return len(tokenizer.decode(ids[:compiler.compile(params).matcher().valid_prefix(ids)]))

    answers = {"json": '{"n": 4}', "regex": "yes", "choice": "beta", "grammar": "ok"}
    kinds = {"json": {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]},
             "regex": "yes|no", "choice": ["alpha", "beta"], "grammar": 'start: "ok"'}
    for kind, answer in answers.items():
        params = StructuredOutputsParams(**{kind: kinds[kind]}, thinking=mode)
        thought = opening + 'hmm {"no": json} < /think\n</think>\n\n'
        assert allowed(params, thought + answer) == len(thought + answer)
        assert allowed(params, thought + "Xnope") == len(thought)
        matcher = compiler.compile(params).matcher()
        assert all(matcher.accept(t) for t in tokenizer.encode(answer, add_special_tokens=False))
        assert matcher.is_accepting == (mode == "optional")     # "starts": that was still thinking
    with pytest.raises(ValueError, match="thinking must be one of"):
        StructuredOutputsParams(regex="a", thinking="always")
