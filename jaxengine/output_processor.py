"""Output processing shared by the offline ``LLM`` and the server: each sequence's tokens become
text as they arrive (incremental detokenizing, ``min_tokens``, stop strings), and a stop string
finishes its sequence. One path, so the offline text equals the streamed text."""
from __future__ import annotations

from collections.abc import Callable

from jaxengine.request import Request, RequestStatus, Sequence
from jaxengine.sampling_params import SamplingParams

FinishSequence = Callable[..., None]        # (seq, status, stop_reason, num_output_tokens=...)
REPLACEMENT = "\ufffd"      # what a decode shows for an incomplete UTF-8 sequence
CONTEXT_TOKENS = 6          # prompt tokens decoded with the first output token (its leading space)


class IncrementalDetokenizer:
    """The text of a growing token sequence, one token at a time.

    Decodes a small window ending at the newest token against the same window without it (the
    prompt's last tokens give the first window its context, so a leading space comes out as it
    does in the whole text), and holds back text that ends in an incomplete multi-byte
    character until it completes. One token at a time, so the text does not depend on how the
    tokens were grouped into steps.
    """

    def __init__(self, tokenizer, prompt_ids: list[int], *, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_ids[-CONTEXT_TOKENS:])
        self.read_offset = len(self.ids)
        self.prefix_offset = 0

    def decode_next(self, token_id: int) -> str:
        """The text that ``token_id`` completes ("" while a character is still incomplete)."""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) <= len(prefix) or full.endswith(REPLACEMENT):
            return ""                 # nothing new, or a character still incomplete
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self._trim()
        return full[len(prefix):]

    def flush(self) -> str:
        """What is held back (an incomplete character decodes as U+FFFD)."""
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        tail = self._decode(self.ids[self.prefix_offset:])[len(prefix):]
        self.prefix_offset = self.read_offset = len(self.ids)
        return tail

    def _trim(self) -> None:
        """Drop tokens before the window so a long output costs no memory beyond it."""
        if self.prefix_offset > 64:
            del self.ids[:self.prefix_offset]
            self.read_offset -= self.prefix_offset
            self.prefix_offset = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)


class StopStringMatcher:
    """Holds text back while its tail could still become a stop string; cuts at the first match."""

    def __init__(self, stop: list[str], include_stop_str_in_output: bool = False) -> None:
        self.stop = [s for s in stop if s]
        self.include = include_stop_str_in_output
        self.pending = ""

    def feed(self, text: str) -> tuple[str, str | None]:
        """New text in -> (text safe to emit, the stop string that matched or None)."""
        self.pending += text
        hits = [(i, s) for s in self.stop if (i := self.pending.find(s)) >= 0]
        if hits:
            i, s = min(hits)
            out = self.pending[:i + len(s)] if self.include else self.pending[:i]
            self.pending = ""
            return out, s
        keep = self._held_back()
        out, self.pending = self.pending[:len(self.pending) - keep], self.pending[len(self.pending) - keep:]
        return out, None

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out

    def _held_back(self) -> int:
        """Length of the longest tail of the pending text that starts some stop string."""
        for n in range(min(len(self.pending), max((len(s) for s in self.stop), default=1) - 1), 0, -1):
            tail = self.pending[-n:]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0


class SequenceText:
    """One sequence's text, token by token. The text of the first ``min_tokens`` tokens is
    emitted as it is and never matched against the stop strings: a stop string matches only
    text generated after that boundary (one that starts before it does not match)."""

    def __init__(self, tokenizer, prompt_ids: list[int], params: SamplingParams) -> None:
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=params.skip_special_tokens)
        self.matcher = StopStringMatcher(params.stop, params.include_stop_str_in_output)
        self.min_tokens = params.min_tokens
        self.num_tokens = 0            # output tokens taken in
        self.pieces: list[str] = []    # the text emitted so far (joined only when asked for)
        self.stop_str: str | None = None

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def add(self, token_ids: list[int]) -> str:
        """New output tokens -> the text they release; after a stop string, nothing."""
        start = len(self.pieces)
        for token_id in token_ids:
            if self.stop_str is not None:
                break
            self.num_tokens += 1
            self._emit(self.detokenizer.decode_next(token_id))
        return "".join(self.pieces[start:])

    def finish(self) -> str:
        """The text still held back (the sequence ended)."""
        if self.stop_str is not None:
            return ""
        start = len(self.pieces)
        self._emit(self.detokenizer.flush())
        if self.stop_str is None:
            self.pieces.append(self.matcher.flush())
        return "".join(self.pieces[start:])

    def _emit(self, text: str) -> None:
        if self.num_tokens <= self.min_tokens or not self.matcher.stop:
            self.pieces.append(text)
            return
        out, self.stop_str = self.matcher.feed(text)
        self.pieces.append(out)


def beam_stop_check(tokenizer, params: SamplingParams):
    """For a beam search with stop strings: output tokens -> the stop string their text holds,
    or None (a beam's earlier text held none, or it would have stopped there)."""
    if not params.stop:
        return None

    def stop_in(token_ids: list[int]) -> str | None:
        text = tokenizer.decode(token_ids, skip_special_tokens=params.skip_special_tokens)
        return next((s for s in params.stop if s in text), None)

    return stop_in


class OutputProcessor:
    """The texts of one request's sequences. ``finish_sequence`` (the scheduler's) ends a
    sequence whose text reached a stop string; the tokens after it are discarded."""

    def __init__(self, request: Request, tokenizer, finish_sequence: FinishSequence) -> None:
        self.request = request
        self.tokenizer = tokenizer
        self.finish_sequence = finish_sequence
        self.texts: dict[int, SequenceText] = {}

    def new_text(self, seq: Sequence, final: bool = False) -> str:
        """Text of the tokens of ``seq`` not yet processed (placeholders excluded); ``final``
        also releases what is held back, for a finished sequence."""
        if self.tokenizer is None:
            return ""
        state = self._state(seq)
        start = seq.num_prompt_tokens + state.num_tokens
        text = state.add(seq.token_ids[start:seq.num_real_tokens])
        if state.stop_str is not None and (not seq.is_finished or seq.num_output_tokens > state.num_tokens):
            # The tokens after the one that completed the stop string (a speculative step outputs
            # several at once, and a later one may already have ended the sequence) are not the
            # sequence's.
            self.finish_sequence(seq, RequestStatus.FINISHED_STOPPED, state.stop_str, num_output_tokens=state.num_tokens)
        return text + state.finish() if final else text

    def process(self) -> None:
        """Take in the new tokens of every live sequence (a stop string finishes its sequence).
        A beam search's text comes at its end: its beams fork and drop, and the search itself
        checks stop strings (``beam_stop_check``)."""
        if self.request.beam is not None:
            return
        for seq in self.request.seqs:
            if not seq.is_finished:
                self.new_text(seq)

    def final_texts(self) -> list[str]:
        """Each sequence's whole text, once the request has finished."""
        if self.tokenizer is None:
            return [""] * len(self.request.seqs)
        for seq in self.request.seqs:
            self.new_text(seq, final=True)
        return [self._state(seq).text for seq in self.request.seqs]

    def _state(self, seq: Sequence) -> SequenceText:
        state = self.texts.get(seq.seq_id)
        if state is None:
            state = self.texts[seq.seq_id] = SequenceText(self.tokenizer, self.request.prompt_token_ids,
                                                          self.request.sampling_params)
        return state
