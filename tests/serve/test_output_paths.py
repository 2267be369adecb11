"""One output path: for the same tokens the offline ``LLM`` text equals the server's whole text
and its streamed concatenation (several prompts, n > 1, seeds, with and without stop strings),
on the byte-level tokenizer and on a SentencePiece-style (Metaspace) one whose decode drops the
leading space at the start of a text. Stop strings match only text after ``min_tokens``."""
from dataclasses import dataclass, field

import httpx
import pytest

from jaxengine import SamplingParams
from tests.conftest import make_chat_checkpoint, make_checkpoint
from tests.serve.conftest import ENGINE
from tests.serve.live import serving, stream_texts

WORDS = ["<unk>", "</s>"] + [f"▁{w}" for w in "the cat sat on a mat dog ran to big red small house tree and or . ,"
                             .split()]
PROMPTS = {"byte": ["The quick brown fox", "Once upon a time", "a b c"],
           "metaspace": ["the cat sat on", "a big red house", "dog ran to the tree ."]}
SAMPLED = dict(n=2, seed=7, temperature=1.0, max_tokens=16)
GREEDY = dict(temperature=0.0, max_tokens=24, ignore_eos=True)
MIN_TOKENS = 8


def make_metaspace_checkpoint(folder) -> None:
    """A tiny Llama whose tokenizer maps words with their leading "▁" to ids, as SentencePiece does."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    make_checkpoint(folder, "llama", vocab_size=len(WORDS), eos_token_id=1, bos_token_id=0)
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>").save_pretrained(folder)


@dataclass
class Stack:
    """An LLM's offline outputs for each case, then a server on the same LLM."""

    name: str
    llm: object
    prompts: list[str]
    bodies: dict = field(default_factory=dict)     # case -> the server request body
    offline: dict = field(default_factory=dict)    # case -> list of RequestOutput
    url: str = ""
    min_tokens_stop: str = ""
    head: str = ""                                 # the text of the first MIN_TOKENS greedy tokens
    full: str = ""                                 # the greedy text without a stop string
    expected: str = ""                             # the min_tokens case's exact text


def clean_stop(text: str, start: int, words: bool) -> str:
    """A stop string from ``text`` at or after ``start``: a word, or one printable ASCII character."""
    if words:
        return next(w for w in text[start:].split() if w != ".")
    return next(c for c in text[start:] if c.isascii() and c.isalnum())


def run_offline(stack: Stack, case: str, **params) -> None:
    stack.bodies[case] = params
    stack.offline[case] = stack.llm.generate(stack.prompts, SamplingParams(**params), use_tqdm=False)


def min_tokens_case(stack: Stack) -> None:
    """A stop string that occurs inside the text of the first MIN_TOKENS greedy tokens."""
    llm, words = stack.llm, stack.name == "metaspace"
    full = llm.generate(stack.prompts[0], SamplingParams(**GREEDY), use_tqdm=False)[0].outputs[0]
    head = llm.tokenizer.decode(full.token_ids[:MIN_TOKENS], skip_special_tokens=True)
    head = " " + head if words else head               # the leading space the prompt's context gives
    stop = clean_stop(head, 1, words)
    tail = full.text[len(head):]
    stack.min_tokens_stop, stack.head, stack.full = stop, head, full.text
    stack.expected = head + tail[:tail.index(stop)] if stop in tail else full.text
    stack.bodies["min_tokens"] = dict(GREEDY, stop=[stop], min_tokens=MIN_TOKENS)
    stack.offline["min_tokens"] = llm.generate(stack.prompts[0], SamplingParams(**stack.bodies["min_tokens"]),
                                               use_tqdm=False)


@pytest.fixture(scope="module", params=["byte", "metaspace"])
def stack(request, tmp_path_factory):
    from jaxengine.llm import LLM

    folder = tmp_path_factory.mktemp(f"paths-{request.param}")
    (make_chat_checkpoint if request.param == "byte" else make_metaspace_checkpoint)(folder)
    stack = Stack(request.param, LLM(folder, **ENGINE), PROMPTS[request.param])
    run_offline(stack, "plain", **SAMPLED)
    words = request.param == "metaspace"
    stops = sorted({clean_stop(out.outputs[0].text, 3, words) for out in stack.offline["plain"]})
    run_offline(stack, "stop", **SAMPLED, stop=stops)
    min_tokens_case(stack)
    with serving(stack.llm) as url:
        stack.url = url
        yield stack


def offline_choices(stack: Stack, case: str) -> list[tuple[str, str]]:
    return [(c.text, c.finish_reason) for out in stack.offline[case] for c in out.outputs]


@pytest.mark.parametrize("case", ["plain", "stop"])
def test_offline_text_equals_the_servers_whole_and_streamed_text(stack, case):
    body = {"model": "tiny", "prompt": stack.prompts, **stack.bodies[case]}
    whole = httpx.post(f"{stack.url}/v1/completions", json=body, timeout=120).json()
    streamed, finish = stream_texts(stack.url, "completions", body)
    expected = offline_choices(stack, case)
    assert [(c["text"], c["finish_reason"]) for c in whole["choices"]] == expected
    assert [(streamed[i], finish[i]) for i in range(len(expected))] == expected
    if case == "stop":
        assert any(c.stop_reason in stack.bodies[case]["stop"] for out in stack.offline[case] for c in out.outputs)


def test_the_first_output_token_keeps_the_leading_space_the_prompt_gives_it(stack):
    tokenizer = stack.llm.tokenizer
    for out in stack.offline["plain"]:
        for c in out.outputs:
            whole = tokenizer.decode(out.prompt_token_ids + c.token_ids, skip_special_tokens=True)
            assert c.text == whole[len(tokenizer.decode(out.prompt_token_ids, skip_special_tokens=True)):]
            if stack.name == "metaspace" and c.token_ids and c.token_ids[0] > 1:
                assert c.text.startswith(" ") and tokenizer.decode(c.token_ids, skip_special_tokens=True) == c.text[1:]


def test_a_stop_string_inside_the_first_min_tokens_does_not_end_the_request(stack):
    stop, expected = stack.min_tokens_stop, stack.expected
    assert stack.full.startswith(stack.head) and not stack.head.endswith("\ufffd")
    offline = stack.offline["min_tokens"][0].outputs[0]
    assert stop in expected[:len(expected) - 1] and offline.text == expected
    assert len(offline.token_ids) > MIN_TOKENS
    body = {"model": "tiny", "prompt": stack.prompts[0], **stack.bodies["min_tokens"]}
    whole = httpx.post(f"{stack.url}/v1/completions", json=body, timeout=120).json()["choices"][0]
    streamed, finish = stream_texts(stack.url, "completions", body)
    assert whole["text"] == streamed[0] == expected
    assert whole["finish_reason"] == finish[0] == offline.finish_reason
