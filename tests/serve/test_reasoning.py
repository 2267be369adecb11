"""Reasoning models (``--reasoning-parser``): the thinking of a chat response goes to
``reasoning_content`` (and ``reasoning``), the answer to ``content``, whole and streamed alike,
however the stream cuts the tags; ``chat_template_kwargs`` reach the template. The tiny model's
outputs are scripted with a regex constraint."""
import random

import openai
import pytest

from jaxengine.serve.reasoning import ReasoningSplit, split_reasoning
from tests.serve.conftest import API_KEY, uvicorn_thread

# "thinking": null: the regex holds from the first token, thinking included (it scripts both)
THINKING = {"structured_outputs": {"regex": "<think>\\n[a-z]{3,8} [a-z]{3,8}\\n</think>\\n\\n[A-Z][a-z]{2,8}\\.",
                                   "thinking": None}}


@pytest.fixture(scope="module")
def reasoning_client(server):
    """A second app over the test server's engine, with the qwen3 parser."""
    from jaxengine.serve.api_server import build_app

    app = build_app(server.engine, served_model_name="tiny", metrics=server.metrics, api_key=API_KEY,
                    reasoning_parser="qwen3")
    with uvicorn_thread(app, lifespan="off") as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.mark.parametrize("parser, text, want", [
    ("qwen3", "<think>\nhmm ok\n</think>\n\nThe answer.", ("\nhmm ok\n", "The answer.")),
    ("qwen3", "The answer.", (None, "The answer.")),
    ("qwen3", "a </think> b", (None, "a </think> b")),
    ("deepseek_r1", "hmm ok</think>The answer.", ("hmm ok", "The answer.")),
    ("deepseek_r1", "<think>hmm</think>ok", ("hmm", "ok")),
    ("deepseek_r1", "cut short in thought", ("cut short in thought", "")),
])
def test_the_split_is_the_same_however_the_stream_cuts_it(parser, text, want):
    assert split_reasoning(parser, text) == want
    for seed in range(30):
        rng = random.Random(seed)
        cuts = sorted(rng.sample(range(1, len(text)), min(5, len(text) - 1)))
        split = ReasoningSplit(parser == "deepseek_r1")
        pieces = [split.feed(text[a:b]) for a, b in zip([0, *cuts], [*cuts, len(text)])] + [split.feed("", final=True)]
        got = "".join(t for t, _ in pieces), "".join(a for _, a in pieces)
        assert (got[0] if split.thought else None, got[1]) == want


def test_thinking_and_answer_are_split_whole_and_streamed(reasoning_client, client):
    params = dict(model="tiny", messages=[{"role": "user", "content": "think first"}], max_tokens=60,
                  temperature=0, extra_body=THINKING)
    raw = client.chat.completions.create(**params).choices[0].message.content       # the parser-less server
    thinking, answer = raw.split("</think>")
    message = reasoning_client.chat.completions.create(**params).choices[0].message
    assert message.content == answer.lstrip("\n") and message.content[0].isupper()
    assert message.reasoning_content == message.reasoning == thinking[len("<think>"):]
    streamed = {"reasoning_content": "", "content": ""}
    for chunk in reasoning_client.chat.completions.create(**params, stream=True):
        for c in chunk.choices:
            streamed["content"] += c.delta.content or ""
            streamed["reasoning_content"] += getattr(c.delta, "reasoning_content", None) or ""
    assert streamed == {"reasoning_content": message.reasoning_content, "content": message.content}


def test_chat_template_kwargs_reach_the_template(server, reasoning_client):
    from jaxengine.tokenizer import apply_chat_template

    tokenizer = server.host.tokenizer.__class__.from_pretrained(server.host.model_path)
    tokenizer.chat_template = ("{% if enable_thinking is defined and not enable_thinking %}N{% else %}T{% endif %}"
                               "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    messages = [{"role": "user", "content": "x"}]
    assert tokenizer.decode(apply_chat_template(tokenizer, messages, template_kwargs={"enable_thinking": False})) == "Nx"
    assert tokenizer.decode(apply_chat_template(tokenizer, messages)) == "Tx"
    r = reasoning_client.chat.completions.create(model="tiny", messages=messages, max_tokens=3, temperature=0,
                                                 extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.choices[0].message.content is not None and getattr(r.choices[0].message, "reasoning_content", None) is None


def test_the_responses_api_gives_the_thinking_as_a_reasoning_item(reasoning_client, server):
    params = dict(model="tiny", input="think first", max_output_tokens=60, temperature=0, extra_body=THINKING)
    chat = reasoning_client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "think first"}],
                                                    max_tokens=60, temperature=0, extra_body=THINKING)
    thinking, answer = chat.choices[0].message.reasoning_content, chat.choices[0].message.content
    r = reasoning_client.responses.create(**params)
    assert [item.type for item in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == thinking and r.output_text == answer
    assert r.usage.output_tokens_details.reasoning_tokens == len(server.host.tokenizer.encode(
        thinking, add_special_tokens=False))
    events = list(reasoning_client.responses.create(**params, stream=True))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == thinking
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == answer
    kinds = [e.type for e in events if e.type.startswith("response.output_item")]
    assert kinds == ["response.output_item.added", "response.output_item.done"] * 2
    assert [item.type for item in events[-1].response.output] == ["reasoning", "message"]
