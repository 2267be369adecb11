"""The Responses API through the official ``openai`` client (``client.responses.create``): the
same greedy output as the chat completion of the same conversation, whole and streamed (its
typed, numbered events), input items (messages, content parts, function calls and their
outputs), function tools with ``tool_choice``, ``text.format`` JSON schema; what it cannot serve
is a 400 naming the field, and the server keeps serving."""
import json

import jsonschema
import openai
import pytest

from tests.serve.conftest import ENGINE
from tests.serve.test_structured_api import SCHEMA, TIME, WEATHER

WEATHER_FLAT = {"type": "function", **WEATHER["function"]}
TIME_FLAT = {"type": "function", **TIME["function"]}
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say something nice"}]


def test_a_whole_response_is_the_chat_completion_of_the_same_conversation(client):
    chat = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=12, temperature=0)
    r = client.responses.create(model="tiny", instructions="Be brief.", input="Say something nice",
                                max_output_tokens=12, temperature=0)
    assert r.id.startswith("resp_") and r.object == "response" and r.model == "tiny"
    (item,) = r.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    assert r.output_text == chat.choices[0].message.content != ""
    cut = chat.choices[0].finish_reason == "length"
    assert (r.status, r.incomplete_details and r.incomplete_details.reason) == \
        (("incomplete", "max_output_tokens") if cut else ("completed", None))
    assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert r.usage.total_tokens == chat.usage.total_tokens and r.usage.output_tokens_details.reasoning_tokens == 0
    # the same prompt ran just before: the prefix cache serves its full blocks but the last token's
    assert r.usage.input_tokens_details.cached_tokens == (r.usage.input_tokens - 1) // ENGINE["block_size"] * 4
    assert (r.instructions, r.max_output_tokens, r.temperature, r.tool_choice, r.text.format.type) == \
        ("Be brief.", 12, 0, "auto", "text")


def test_a_streamed_response_sends_numbered_typed_events_that_add_up_to_the_whole(client):
    params = dict(model="tiny", instructions="Be brief.", input="Say something nice", max_output_tokens=12,
                  temperature=0)
    whole = client.responses.create(**params)
    events = list(client.responses.create(**params, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * deltas,
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     f"response.{whole.status}"]
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == events[-4].text == events[-3].part.text == events[-2].item.content[0].text == whole.output_text
    assert {e.item_id for e in events[3:-2]} == {events[2].item.id}
    final = events[-1].response
    assert final.output_text == whole.output_text and final.usage.output_tokens == whole.usage.output_tokens


def test_input_items_make_the_same_prompt_as_chat_messages(client):
    """A developer message, content parts, an assistant turn with a call, the call's output."""
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": "Checking.", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
    items = [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Be brief."}]},
             {"role": "user", "content": [{"type": "input_text", "text": "Weather "}, {"type": "input_text",
                                                                                     "text": "in Oslo?"}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
             {"type": "reasoning", "id": "rs_1", "summary": []},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}]
    r = client.responses.create(model="tiny", input=items, max_output_tokens=8, temperature=0)
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.output_text == chat.choices[0].message.content


@pytest.mark.parametrize("stream", [False, True])
def test_a_named_function_tool_gives_a_function_call_item(client, stream):
    params = dict(model="tiny", input="Plan my trip", max_output_tokens=80, temperature=0,
                  tools=[WEATHER_FLAT, TIME_FLAT], tool_choice={"type": "function", "name": "get_weather"})
    if stream:
        events = list(client.responses.create(**params, stream=True))
        arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
        (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
        assert done.arguments == arguments
        r = events[-1].response
    else:
        r = client.responses.create(**params)
    (item,) = r.output
    assert item.type == "function_call" and item.name == "get_weather" and item.call_id.startswith("call_")
    assert item.id.startswith("fc_") and r.status == "completed"
    jsonschema.validate(json.loads(item.arguments), SCHEMA)
    if stream:
        assert item.arguments == arguments


@pytest.mark.parametrize("stream", [False, True])
def test_required_tool_choice_calls_one_of_the_tools(client, stream):
    params = dict(model="tiny", input="Plan my trip", max_output_tokens=80, temperature=0,
                  tools=[WEATHER_FLAT, TIME_FLAT], tool_choice="required", parallel_tool_calls=False)
    r = list(client.responses.create(**params, stream=True))[-1].response if stream \
        else client.responses.create(**params)
    (item,) = r.output
    assert item.type == "function_call" and item.name in ("get_weather", "get_time")
    json.loads(item.arguments)


def test_text_format_json_schema_constrains_the_output(client):
    r = client.responses.create(model="tiny", input="Plan my trip", max_output_tokens=80, temperature=0,
                                text={"format": {"type": "json_schema", "name": "trip", "schema": SCHEMA}})
    jsonschema.validate(json.loads(r.output_text), SCHEMA)
    assert r.text.format.type == "json_schema"


@pytest.mark.parametrize("params, param, words", [
    ({"extra_body": {"frobnicate": 1}}, "frobnicate", "Extra inputs are not permitted"),
    ({"previous_response_id": "resp_123"}, "previous_response_id", "not stored"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
     "input", "input[0].content[0].type: 'input_image' is not supported"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input", "input[0].type: 'item_reference'"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input", "input[0].call_id: missing"),
    ({"input": []}, "input", "input: must not be empty"),
    ({"tools": [{"type": "web_search"}]}, "tools", "tools[0].type: 'web_search' is not supported"),
    ({"tools": [WEATHER_FLAT], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice", "nope"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text", "needs a schema"),
    ({"truncation": "auto"}, "truncation", "truncation"),
])
def test_what_cannot_be_served_is_a_400_naming_the_field(client, server, params, param, words):
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(**{"model": "tiny", "input": "hi", "max_output_tokens": 4, **params})
    error = caught.value.body
    assert error["param"] == param and words in error["message"], error
    server.wait_idle()
    assert client.responses.create(model="tiny", input="hi", max_output_tokens=2).output_text is not None
