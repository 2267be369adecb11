"""Beam search through the server (vLLM's extras: ``use_beam_search`` with ``n`` as the width,
``length_penalty``, ``early_stopping``): completions and chat, streamed and not, equal to
``LLM.beam_search`` on the same model; refused knobs are named."""
import pytest

from jaxengine import BeamSearchParams
from jaxengine.tokenizer import apply_chat_template
from tests.serve.conftest import ENGINE

PROMPT = "The quick brown fox"
BEAM = {"use_beam_search": True, "length_penalty": 0.5, "early_stopping": True}


@pytest.fixture(scope="module")
def offline(chat_checkpoint):
    from jaxengine.llm import LLM

    return LLM(chat_checkpoint, **ENGINE)


def expected(offline, prompt, width=3, max_tokens=10):
    params = BeamSearchParams(beam_width=width, max_tokens=max_tokens, length_penalty=0.5, early_stopping=True)
    return offline.beam_search([prompt], params)[0].sequences


@pytest.mark.parametrize("stream", [False, True])
def test_completion_beams_equal_the_offline_beam_search(client, offline, stream):
    want = expected(offline, PROMPT)
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, n=3, extra_body=BEAM, stream=stream,
                                  **({"stream_options": {"include_usage": True}} if stream else {}))
    texts, finish, usage = [""] * 3, [None] * 3, None
    for chunk in (r if stream else [r]):
        for c in chunk.choices:
            texts[c.index] += c.text
            finish[c.index] = c.finish_reason or finish[c.index]
        usage = chunk.usage or usage
    assert texts == [s.text for s in want]
    assert finish == [s.finish_reason for s in want]
    prompt_len = len(offline.tokenizer.encode(PROMPT))
    assert usage.completion_tokens == sum(len(s.tokens) - prompt_len for s in want)


def test_chat_beams_equal_the_offline_beam_search(client, offline):
    messages = [{"role": "user", "content": "Hello there"}]
    want = expected(offline, apply_chat_template(offline.tokenizer, messages), width=2)
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, n=2, extra_body=BEAM)
    assert [c.message.content for c in r.choices] == [s.text for s in want]


@pytest.mark.parametrize("extra, field", [({"top_p": 0.5}, "top_p"), ({"seed": 3}, "seed"),
                                          ({"logprobs": 2}, "logprobs"), ({"n": 11}, "beam_width"),
                                          ({"best_of": 2}, "best_of")])
def test_beam_search_refuses_what_it_does_not_use(client, extra, field):
    import openai

    body = {**BEAM, **{k: v for k, v in extra.items() if k != "n"}}
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, n=extra.get("n", 2), extra_body=body)
    assert field in str(info.value)
