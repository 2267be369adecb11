"""Incremental detokenization, stop strings and min_tokens, on a byte-level BPE tokenizer trained
here and a Metaspace (SentencePiece-style) one; a tokenizer per thread."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxengine.output_processor import IncrementalDetokenizer, SequenceText, StopStringMatcher
from jaxengine.sampling_params import SamplingParams
from jaxengine.tokenizer import PerThreadTokenizer

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


def stream(tokenizer, prompt_ids, out_ids, chunk=1, **params):
    """Feed ``out_ids`` ``chunk`` tokens at a time -> (the text deltas, the SequenceText)."""
    seq = SequenceText(tokenizer, prompt_ids, SamplingParams(max_tokens=None, **params))
    deltas = []
    for i in range(0, len(out_ids), chunk):
        deltas.append(seq.add(out_ids[i:i + chunk]))
        if seq.stop_str is not None:
            break
    return deltas, seq


texts = st.lists(st.sampled_from(ALPHABET), max_size=40).map("".join)


@settings(max_examples=200, deadline=None)
@given(prompt=texts.filter(bool), output=texts, chunk=st.integers(1, 3))
def test_joined_deltas_equal_the_full_decode(tokenizer, prompt, output, chunk):
    prompt_ids = tokenizer.encode(prompt)
    out_ids = tokenizer.encode(output)
    deltas, seq = stream(tokenizer, prompt_ids, out_ids, chunk)
    joined = "".join(deltas) + seq.finish()
    assert joined == seq.text == tokenizer.decode(out_ids) == output
    assert all("\ufffd" not in d for d in deltas)   # never a half character


def test_multibyte_characters_split_across_tokens_are_held_until_complete(tokenizer):
    ids = tokenizer.encode("👍🏽")
    assert len(ids) > 2                                    # the emoji spans several byte tokens
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("x"))
    texts = [detok.decode_next(t) for t in ids]          # two code points: the hand, then the tone
    assert [t for t in texts if t] == ["👍", "🏽"] and texts[0] == "" and texts[-1] == "🏽"
    assert "".join(texts) + detok.flush() == "👍🏽"


def test_an_incomplete_character_at_the_end_flushes_as_a_replacement(tokenizer):
    ids = tokenizer.encode("a👍")
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("x"))
    assert "".join(detok.decode_next(t) for t in ids[:-1]) == "a"
    assert detok.flush() == "\ufffd"


def test_stop_string_spanning_tokens_is_cut_and_nothing_after_it_is_emitted(tokenizer):
    out_ids = tokenizer.encode("hello world, the end. more text")
    deltas, seq = stream(tokenizer, tokenizer.encode("q"), out_ids, stop=["the end"])
    assert seq.text == "hello world, " and seq.stop_str == "the end"
    assert seq.finish() == "" and seq.add(tokenizer.encode("x")) == ""
    _, kept = stream(tokenizer, tokenizer.encode("q"), out_ids, stop=["the end"], include_stop_str_in_output=True)
    assert kept.text == "hello world, the end"


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


@pytest.mark.parametrize("chunk", [1, 4, 100])
def test_stop_strings_match_only_text_after_min_tokens(tokenizer, chunk):
    out_ids = tokenizer.encode("hello world, the end. abc the end. more")
    head = next(m for m in range(len(out_ids)) if tokenizer.decode(out_ids[:m]).endswith("the end"))
    deltas, seq = stream(tokenizer, tokenizer.encode("q"), out_ids, chunk, stop=["the end"], min_tokens=head)
    assert seq.text == "hello world, the end. abc " and seq.stop_str == "the end"
    # a match may not start before the boundary either: one token fewer still stops at the second
    _, straddle = stream(tokenizer, tokenizer.encode("q"), out_ids, chunk, stop=["the end"], min_tokens=head - 1)
    assert straddle.text == "hello world, the end. abc " and straddle.stop_str == "the end"
    before = max(m for m in range(len(out_ids)) if "t" not in tokenizer.decode(out_ids[:m]))
    _, early = stream(tokenizer, tokenizer.encode("q"), out_ids, chunk, stop=["the end"], min_tokens=before)
    assert early.text == "hello world, " and early.stop_str == "the end"


def test_a_stop_string_only_inside_the_first_min_tokens_never_stops(tokenizer):
    out_ids = tokenizer.encode("the end and more")
    head = next(m for m in range(len(out_ids)) if tokenizer.decode(out_ids[:m]).endswith("the end"))
    deltas, seq = stream(tokenizer, tokenizer.encode("q"), out_ids, stop=["the end"], min_tokens=head)
    assert "".join(deltas) + seq.finish() == "the end and more" and seq.stop_str is None


@pytest.fixture(scope="module")
def metaspace():
    """A SentencePiece-style tokenizer: every word token carries its leading space as "▁", which
    a decode drops at the start of the text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "</s>"] + [f"▁{w}" for w in ["the", "cat", "sat", "on", "a", "mat", "."]]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>")


def test_the_first_output_token_keeps_its_leading_space_from_the_prompts_context(metaspace):
    prompt, out = metaspace.encode("the cat"), metaspace.encode("sat on a mat")
    assert metaspace.decode(out) == "sat on a mat"        # decoded alone, the space is dropped
    for chunk in (1, 2, 4):
        deltas, seq = stream(metaspace, prompt, out, chunk)
        assert "".join(deltas) + seq.finish() == " sat on a mat"
        assert metaspace.decode(prompt + out) == metaspace.decode(prompt) + seq.text


def test_each_thread_gets_its_own_tokenizer_copy(tokenizer):
    import threading

    per_thread = PerThreadTokenizer(tokenizer)
    mine = per_thread.get()
    assert per_thread.get() is mine and mine is not tokenizer
    other = []
    thread = threading.Thread(target=lambda: other.append(per_thread.get()))
    thread.start()
    thread.join()
    assert other[0] is not mine and other[0] is not tokenizer
    assert other[0].encode("héllo wörld") == mine.encode("héllo wörld") == tokenizer.encode("héllo wörld")
