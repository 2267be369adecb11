"""Incremental detokenization and stop strings, on a byte-level BPE tokenizer trained here."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxengine.tokenizer import IncrementalDetokenizer, StopStringMatcher

ALPHABET = list("abcdefghij klmnop,.!") + ["é", "ö", "ß", "日", "本", "語", "🙂", "👍🏽", "\n"]


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<eos>"])
    corpus = ["hello world, the end. " * 3, "日本語 の テキスト 🙂 héllo wörld straße", "abc def ghi jkl mno"] * 20
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def stream(tokenizer, prompt_ids, out_ids, chunk=1, **kw):
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, **kw)
    deltas = []
    for i in range(0, len(out_ids), chunk):
        deltas.append(detok.step(out_ids[i:i + chunk]))
        if detok.stopped:
            break
    return deltas, detok


texts = st.lists(st.sampled_from(ALPHABET), max_size=40).map("".join)


@settings(max_examples=200, deadline=None)
@given(prompt=texts.filter(bool), output=texts, chunk=st.integers(1, 3))
def test_joined_deltas_equal_the_full_decode(tokenizer, prompt, output, chunk):
    prompt_ids = tokenizer.encode(prompt)
    out_ids = tokenizer.encode(output)
    deltas, detok = stream(tokenizer, prompt_ids, out_ids, chunk)
    joined = "".join(d.text for d in deltas) + detok.finish()
    assert joined == tokenizer.decode(out_ids) == output
    assert all("\ufffd" not in d.text for d in deltas)   # never a half character


def test_multibyte_characters_split_across_tokens_are_held_until_complete(tokenizer):
    ids = tokenizer.encode("👍🏽")
    assert len(ids) > 2                                    # the emoji spans several byte tokens
    deltas, detok = stream(tokenizer, tokenizer.encode("x"), ids)
    texts = [d.text for d in deltas]                     # two code points: the hand, then the tone
    assert [t for t in texts if t] == ["👍", "🏽"] and texts[0] == "" and texts[-1] == "🏽"
    assert "".join(d.text for d in deltas) + detok.finish() == "👍🏽"


def test_stop_string_spanning_tokens_is_cut_and_nothing_after_it_is_emitted(tokenizer):
    out_ids = tokenizer.encode("hello world, the end. more text")
    deltas, detok = stream(tokenizer, tokenizer.encode("q"), out_ids, stop=["the end"])
    assert detok.output_text == "hello world, " and deltas[-1].stop_str == "the end"
    assert detok.finish() == "" and detok.step(tokenizer.encode("x")).text == ""
    _, kept = stream(tokenizer, tokenizer.encode("q"), out_ids, stop=["the end"], include_stop_str_in_output=True)
    assert kept.output_text == "hello world, the end"


def test_held_back_text_is_released_once_it_cannot_match():
    m = StopStringMatcher(["STOP"])
    assert m.feed("abc ST") == ("abc ", None)
    assert m.feed("O") == ("", None)
    assert m.feed("P!") == ("", "STOP")
    m = StopStringMatcher(["STOP", "xy"])
    assert m.feed("aST") == ("a", None)
    assert m.feed("x") == ("ST", None)
    assert m.feed("z") == ("xz", None)
    assert m.flush() == ""
