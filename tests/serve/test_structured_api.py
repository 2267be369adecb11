"""Structured output and tool calling through the server with the official ``openai`` client:
response_format (json_schema, json_object), vLLM's guided_* and structured_outputs extras, tools
with tool_choice required / named / auto, whole and streamed; bad constraints are 400s naming
the field and the server keeps serving."""
import json
import re

import jsonschema
import openai
import pytest


SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 9}},
          "required": ["city", "days"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": SCHEMA}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}
MESSAGES = [{"role": "user", "content": "Plan my trip"}]


def test_response_format_json_schema_and_json_object(client):
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=80, temperature=0,
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "trip", "schema": SCHEMA}})
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    r = client.completions.create(model="tiny", prompt="{", max_tokens=80, temperature=0,
                                  extra_body={"response_format": {"type": "json_object"}})
    assert isinstance(json.loads(r.choices[0].text), dict)


@pytest.mark.parametrize("extra, check", [
    ({"guided_regex": "[0-9]{3}-[0-9]{4}"}, lambda t: re.fullmatch("[0-9]{3}-[0-9]{4}", t)),
    ({"guided_choice": ["left", "right"]}, lambda t: t in ("left", "right")),
    ({"guided_json": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
    ({"structured_outputs": {"grammar": 'start: "go " DIR\nDIR: "north" | "south"'}},
     lambda t: t in ("go north", "go south")),
])
def test_vllm_extras_streamed(client, extra, check):
    stream = client.completions.create(model="tiny", prompt="Answer:", max_tokens=60, temperature=0, stream=True,
                                       extra_body=extra)
    text = "".join(c.choices[0].text for c in stream if c.choices)
    assert check(text), text


def test_tool_choice_named_whole_and_streamed(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=80, temperature=0,
                                       tools=[WEATHER, TIME], tool_choice=named)
    (call,) = r.choices[0].message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), SCHEMA)
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
    stream = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=80, temperature=0,
                                            tools=[WEATHER, TIME], tool_choice=named, stream=True)
    names, arguments, finish = set(), "", None
    for chunk in stream:
        for c in chunk.choices:
            for delta in c.delta.tool_calls or []:
                names.add(delta.function.name) if delta.function.name else None
                arguments += delta.function.arguments or ""
            finish = c.finish_reason or finish
    assert names == {"get_weather"} and finish == "tool_calls"
    assert arguments == call.function.arguments            # greedy: the same call, in pieces


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_required_calls_given_functions(client, stream):
    # One call (the tiny model would chain calls past max_tokens): parallel_tool_calls=false.
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=96, temperature=0,
                                       tools=[WEATHER, TIME], tool_choice="required", stream=stream,
                                       parallel_tool_calls=False)
    if stream:
        calls = [d for chunk in r for c in chunk.choices for d in (c.delta.tool_calls or [])]
    else:
        calls = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls"
    assert calls
    schemas = {"get_weather": SCHEMA, "get_time": TIME["function"]["parameters"]}
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_tool_choice_auto_returns_text_when_the_model_makes_no_call(client):
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12, temperature=0,
                                       tools=[WEATHER])
    assert r.choices[0].message.tool_calls is None and isinstance(r.choices[0].message.content, str)


def test_required_schema_allows_parallel_calls_unless_told_not_to():
    from jaxengine.serve.tool_calls import required_schema

    functions = {"get_weather": SCHEMA}
    calls = [{"name": "get_weather", "parameters": {"city": "Oslo", "days": 2}}] * 2
    jsonschema.validate(calls, required_schema(functions))
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(calls, required_schema(functions, parallel=False))
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_time", "parameters": {}}], required_schema(functions))


@pytest.mark.parametrize("extra, field", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "response_format"),
    ({"guided_regex": "a(b"}, "guided_regex"),
    ({"guided_grammar": "start: nothing_defined"}, "guided_grammar"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
])
def test_bad_constraints_are_400s_naming_the_field_and_serving_goes_on(client, extra, field):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, extra_body=extra)
    assert field in str(info.value)
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length")
