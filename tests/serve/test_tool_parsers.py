"""Tool calls in the model's own format (``--tool-call-parser``: hermes, llama3_json, mistral):
scripted replies parse to the expected content and calls, the same however a stream cuts them,
each call out as soon as its text is complete; the format comes from the chat template; through
the server, ``tool_choice: "auto"`` streams the content before a call and each call as it parses."""
import json
import random
import re

import openai
import pytest

from jaxengine.serve.tool_parsers import ToolCallParser, detect_tool_parser, parse_tool_calls
from tests.serve.conftest import API_KEY, uvicorn_thread
from tests.serve.test_structured_api import TIME, WEATHER

FUNCTIONS = {"get_weather": {}, "get_time": {}}
OSLO, UTC = ("get_weather", {"city": "Oslo", "days": 2}), ("get_time", {"zone": "UTC"})

CASES = [
    ("hermes", 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>',
     "Sure.", [OSLO]),
    ("hermes", '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>\n<tool_call>{"name": '
               '"get_weather", "arguments": {"city": "Oslo", "days": 2}}</tool_call>\nDone.', "Done.", [UTC, OSLO]),
    ("hermes", '<tool_call>{"name": "other", "arguments": {}}</tool_call>',
     '<tool_call>{"name": "other", "arguments": {}}</tool_call>', []),
    ("hermes", 'Cut <tool_call>{"name": "get_time", "argu', 'Cut <tool_call>{"name": "get_time", "argu', []),
    ("hermes", "Plain text, <tool no call.  \n", "Plain text, <tool no call.  \n", []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Oslo", "days": 2}}', None, [OSLO]),
    ("llama3_json", '<|python_tag|>{"name": "get_time", "parameters": {"zone": "UTC"}}; {"name": "get_weather", '
                    '"parameters": {"city": "Oslo", "days": 2}}', None, [UTC, OSLO]),
    ("llama3_json", 'It is {"name": "get_time", "parameters": {}}', 'It is {"name": "get_time", "parameters": {}}', []),
    ("llama3_json", '  {"not": "a call"}', '  {"not": "a call"}', []),
    ("mistral", '[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "UTC"}}, {"name": "get_weather", '
                '"arguments": {"city": "Oslo", "days": 2}}]', None, [UTC, OSLO]),
    ("mistral", 'Let me check. [TOOL_CALLS]get_time[ARGS]{"zone": "UTC"}[TOOL_CALLS]get_weather[ARGS]'
                '{"city": "Oslo", "days": 2}', "Let me check.", [UTC, OSLO]),
    ("mistral", "[TOOL_CALLS]nothing after", "[TOOL_CALLS]nothing after", []),
]


@pytest.mark.parametrize("parser, text, content, calls", CASES)
def test_replies_parse_to_content_and_calls(parser, text, content, calls):
    got_content, got = parse_tool_calls(parser, text, FUNCTIONS)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls
    ids = [c.id for c in got]
    assert all(re.fullmatch("[A-Za-z0-9]{9}" if parser == "mistral" else "call_[0-9a-f]{24}", i) for i in ids)
    assert len(set(ids)) == len(ids)


@pytest.mark.parametrize("parser, text, content, calls", CASES)
def test_a_stream_parses_the_same_however_it_is_cut_and_each_call_comes_out_when_complete(parser, text, content,
                                                                                          calls):
    for seed in range(40):
        rng = random.Random(seed)
        cuts = sorted(rng.sample(range(1, len(text)), min(rng.randint(1, 12), len(text) - 1)))
        stream = ToolCallParser(parser, FUNCTIONS)
        pieces = [stream.feed(text[a:b]) for a, b in zip([0, *cuts], [*cuts, len(text)])]
        pieces.append(stream.feed("", final=True))
        assert "".join(c for c, _ in pieces) == (content or "")
        assert [(c.name, json.loads(c.arguments)) for _, made in pieces for c in made] == calls
    # fed a character at a time, a call comes out with the character that completes it: after each
    # prefix, as many calls as the prefix holds when parsed whole
    stream, made = ToolCallParser(parser, FUNCTIONS), 0
    for k, char in enumerate(text):
        made += len(stream.feed(char)[1])
        assert made == len(parse_tool_calls(parser, text[:k + 1], FUNCTIONS)[1]), text[:k + 1]

def test_a_call_comes_out_before_the_reply_ends():
    stream = ToolCallParser("hermes", FUNCTIONS)
    assert stream.feed("Sure. <tool_") == ("Sure.", [])          # the space may come before a call: held
    content, calls = stream.feed('call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>')
    assert content == "" and [c.name for c in calls] == ["get_time"]
    assert stream.feed(" More text")[0] == "More text"


@pytest.mark.parametrize("template, parser", [
    ("{{ '<tool_call>' }}{{ tools | tojson }}", "hermes"),
    ("{% if tools %}[AVAILABLE_TOOLS]{{ tools }}[/AVAILABLE_TOOLS]{% endif %}[TOOL_CALLS]", "mistral"),
    ("{{- '<|python_tag|>' + tool_call.name }}", "llama3_json"),
    ('{{- "Environment: ipython\\n" }}', "llama3_json"),
    ("{% for m in messages %}{{ m.content }}{% endfor %}", "hermes"),
    (None, "hermes"),
    ({"default": "x", "tool_use": "[TOOL_CALLS]"}, "mistral"),
])
def test_the_format_comes_from_the_chat_template(template, parser):
    assert detect_tool_parser(template) == parser


# Scripted replies: the regex leaves the tiny model no choice.
HERMES_REPLY = {"structured_outputs": {
    "regex": r'Ok\.\n<tool_call>\{"name": "get_weather", "arguments": \{"city": "Oslo"\}\}</tool_call>'}}
MISTRAL_REPLY = {"structured_outputs": {
    "regex": r'Ok\.\[TOOL_CALLS\]get_time\[ARGS\]\{"zone": "UTC"\}\[TOOL_CALLS\]get_weather\[ARGS\]\{"city": "Oslo"\}'}}
PARAMS = dict(model="tiny", messages=[{"role": "user", "content": "go"}], max_tokens=100, temperature=0,
              tools=[WEATHER, TIME], tool_choice="auto")


def test_auto_tool_choice_parses_the_templates_format_whole_and_streamed(client):
    r = client.chat.completions.create(**PARAMS, extra_body=HERMES_REPLY)
    message = r.choices[0].message
    assert message.content == "Ok." and r.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == \
        [("get_weather", {"city": "Oslo"})]
    chunks = list(client.chat.completions.create(**PARAMS, extra_body=HERMES_REPLY, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Ok."
    calls = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert [(d.index, d.function.name, json.loads(d.function.arguments)) for d in calls] == \
        [(0, "get_weather", {"city": "Oslo"})]
    assert calls[0].id.startswith("call_") and chunks[-1].choices[0].finish_reason == "tool_calls"


@pytest.fixture(scope="module")
def mistral_client(server):
    """A second app over the test server's engine, parsing Mistral's format."""
    from jaxengine.serve.api_server import build_app

    app = build_app(server.engine, served_model_name="tiny", metrics=server.metrics, api_key=API_KEY,
                    tool_call_parser="mistral")
    with uvicorn_thread(app, lifespan="off") as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


def test_each_streamed_call_comes_as_it_parses(mistral_client):
    chunks = [c for c in mistral_client.chat.completions.create(**PARAMS, extra_body=MISTRAL_REPLY, stream=True)
              if c.choices]
    with_calls = [k for k, c in enumerate(chunks) if c.choices[0].delta.tool_calls]
    assert len(with_calls) == 2 and with_calls[0] < with_calls[1]       # the first before the second is written
    first, second = (chunks[k].choices[0].delta.tool_calls[0] for k in with_calls)
    assert (first.index, first.function.name, second.index, second.function.name) == \
        (0, "get_time", 1, "get_weather")
    assert re.fullmatch("[A-Za-z0-9]{9}", first.id) and chunks[-1].choices[0].finish_reason == "tool_calls"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Ok."
    whole = mistral_client.chat.completions.create(**PARAMS, extra_body=MISTRAL_REPLY).choices[0].message
    assert [c.function.name for c in whole.tool_calls] == ["get_time", "get_weather"] and whole.content == "Ok."
