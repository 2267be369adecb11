"""Tokenizers (transformers), chat templates, and incremental detokenization with stop strings."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

REPLACEMENT = "\ufffd"      # what a decode shows for an incomplete UTF-8 sequence


def load_tokenizer(path: str | os.PathLike):
    """``AutoTokenizer`` from a checkpoint folder, or built from a GGUF file's metadata."""
    from transformers import AutoTokenizer

    path = Path(path)
    if path.suffix == ".gguf":
        return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def apply_chat_template(tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("messages: this model's tokenizer has no chat template; send a plain prompt")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


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


@dataclass
class TextDelta:
    text: str                  # new text to emit (may be empty)
    stop_str: str | None       # set when a stop string ended the sequence


class IncrementalDetokenizer:
    """Text deltas for a growing token sequence, for streaming.

    Decodes a small window ending at the newest tokens against the same window without them
    (the prompt gives the first window its context, so leading spaces come out right), and
    holds back text that ends in an incomplete multi-byte character until it completes.
    """

    def __init__(self, tokenizer, prompt_ids: list[int], *, skip_special_tokens: bool = True,
                 stop: list[str] | None = None, include_stop_str_in_output: bool = False) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_ids)
        self.read_offset = len(self.ids)
        self.prefix_offset = max(len(self.ids) - 6, 0)
        self.stop = StopStringMatcher(stop or [], include_stop_str_in_output)
        self.output_text = ""
        self.stopped = False

    def step(self, new_token_ids: list[int]) -> TextDelta:
        if self.stopped:
            return TextDelta("", None)
        self.ids.extend(new_token_ids)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) <= len(prefix) or full.endswith(REPLACEMENT):
            return TextDelta("", None)            # nothing new, or a character still incomplete
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return self._emit(full[len(prefix):])

    def finish(self) -> str:
        """Flush what was held back (an incomplete character decodes as U+FFFD)."""
        if self.stopped:
            return ""
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        tail = self._decode(self.ids[self.prefix_offset:])[len(prefix):]
        self.read_offset = self.prefix_offset = len(self.ids)
        text = self.stop.feed(tail)[0] + self.stop.flush()
        self.output_text += text
        return text

    def _emit(self, text: str) -> TextDelta:
        out, stop_str = self.stop.feed(text)
        self.output_text += out
        self.stopped = stop_str is not None
        return TextDelta(out, stop_str)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
