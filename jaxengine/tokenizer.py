"""Tokenizers (transformers), chat templates, incremental detokenization, and a tokenizer per
thread for the server."""
from __future__ import annotations

import copy
import os
import threading
from pathlib import Path

REPLACEMENT = "\ufffd"      # what a decode shows for an incomplete UTF-8 sequence
CONTEXT_TOKENS = 6          # prompt tokens decoded with the first output token (its leading space)


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


class PerThreadTokenizer:
    """A private copy of a tokenizer for each thread that asks.

    Hugging Face fast tokenizers are Rust objects behind a borrow check: one shared between the
    engine thread (decoding) and the threads that encode prompts can fail with "Already
    borrowed". A lock would make every stream wait while a long prompt is encoded; a copy per
    thread costs one deep copy per thread and shares nothing."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._local = threading.local()

    def get(self):
        tokenizer = getattr(self._local, "tokenizer", None)
        if tokenizer is None:
            tokenizer = self._local.tokenizer = copy.deepcopy(self.tokenizer)
        return tokenizer


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
