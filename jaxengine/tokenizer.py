"""Tokenizers (transformers), chat templates, and a tokenizer per thread for the server."""
from __future__ import annotations

import contextlib
import copy
import os
import tempfile
import threading
from pathlib import Path


def load_tokenizer(path: str | os.PathLike):
    """``AutoTokenizer`` from a checkpoint folder, or built from a GGUF file's metadata."""
    from transformers import AutoTokenizer

    path = Path(path)
    if path.suffix == ".gguf":
        return _gguf_tokenizer(path)
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def _gguf_tokenizer(path: Path):
    """Building the tokenizer from a GGUF file reads all of the file's metadata, which takes
    seconds; the first time it is saved beside the file's converted weights (in the cache), and
    later starts load that folder."""
    from transformers import AutoTokenizer

    from jaxengine.models.paths import converted_cache_path

    cached = converted_cache_path(path) / "tokenizer"
    if cached.is_dir():
        return AutoTokenizer.from_pretrained(cached, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    cached.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cached.parent) as tmp:
        tokenizer.save_pretrained(tmp)
        with contextlib.suppress(OSError):        # another process saved it first
            os.rename(tmp, cached)                # complete, or not there at all
    return tokenizer


def apply_chat_template(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                        tools: list[dict] | None = None, template_kwargs: dict | None = None) -> list[int]:
    """``template_kwargs``: extra variables for the template (``{"enable_thinking": false}``)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("messages: this model's tokenizer has no chat template; send a plain prompt")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True,
                                        **({"tools": tools} if tools else {}), **(template_kwargs or {}))
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
