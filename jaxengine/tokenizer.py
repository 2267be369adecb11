"""Tokenizers (transformers), chat templates, and a tokenizer per thread for the server."""
from __future__ import annotations

import contextlib
import copy
import os
import sys
import tempfile
import threading
from pathlib import Path

from jaxengine.paths import CheckpointFileError, converted_cache_path, read_json_object

# The JSON files transformers reads for a tokenizer, in the order it reads them.
TOKENIZER_JSON_FILES = ("tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                        "chat_template.json", "tokenizer.json")
NO_TOKENIZER_HINT = "; give skip_tokenizer_init to run without one (prompts as token ids)"


def load_tokenizer(path: str | os.PathLike):
    """``AutoTokenizer`` from a checkpoint folder, or built from a GGUF file's metadata. A
    tokenizer that does not load is a CheckpointFileError naming the broken file (or, where no
    one file is to blame, the folder) and what is wrong, transformers' error chained."""
    path = Path(path)
    if path.suffix == ".gguf":
        return _gguf_tokenizer(path)
    return _folder_tokenizer(path)


def _folder_tokenizer(folder: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except Exception as error:              # a broken file fails anywhere in transformers, as any type
        raise _broken_tokenizer(folder, error) from error


def _broken_tokenizer(folder: Path, error: Exception) -> CheckpointFileError:
    """Which of ``folder``'s tokenizer files made transformers fail with ``error``, and how;
    looked for only after a failure, so a good tokenizer is not read twice."""
    from tokenizers import Tokenizer

    for name in TOKENIZER_JSON_FILES:
        if (folder / name).is_file():
            try:
                read_json_object(folder / name)
            except CheckpointFileError as broken:
                return broken
    for template in folder.glob("*.jinja"):
        try:
            template.read_text(encoding="utf-8")
        except UnicodeDecodeError as broken:
            return CheckpointFileError(template, f"not UTF-8 text ({broken})")
    if (folder / "tokenizer.json").is_file():
        try:
            Tokenizer.from_file(str(folder / "tokenizer.json"))
        except Exception as broken:         # the Rust library raises a bare Exception
            return CheckpointFileError(folder / "tokenizer.json", f"not a tokenizer file the tokenizers library "
                                                                  f"reads ({broken})")
    return CheckpointFileError(folder, f"its tokenizer does not load ({type(error).__name__}: {error})"
                                       f"{NO_TOKENIZER_HINT}")


def _gguf_tokenizer(path: Path):
    """Building the tokenizer from a GGUF file reads all of the file's metadata, which takes
    seconds; the first time it is saved beside the file's converted weights (in the cache), and
    later starts load that folder."""
    from transformers import AutoTokenizer

    cached = converted_cache_path(path) / "tokenizer"
    if cached.is_dir():
        try:
            return _folder_tokenizer(cached)
        except CheckpointFileError as error:
            raise CheckpointFileError(error.path, f"{error.problem}; it is the cached copy of {path}'s tokenizer: "
                                                  f"delete {cached} to build it again") from error.__cause__
    try:
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    except Exception as error:              # transformers' GGUF reader fails as any type
        raise CheckpointFileError(path, f"no tokenizer transformers can build from its metadata "
                                        f"({type(error).__name__}: {error}){NO_TOKENIZER_HINT}") from error
    cached.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cached.parent) as tmp:
        tokenizer.save_pretrained(tmp)
        with contextlib.suppress(OSError):        # another process saved it first
            os.rename(tmp, cached)                # complete, or not there at all
    return tokenizer


def apply_chat_template(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                        tools: list[dict] | None = None, template_kwargs: dict | None = None) -> list[int]:
    """``template_kwargs``: extra variables for the template (``{"enable_thinking": false}``); not
    the call's own arguments (``tokenize``, ``chat_template``, ...). A conversation the template
    cannot render (its own refusal, or a message field of the wrong type) is a ValueError."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("messages: this model's tokenizer has no chat template; send a plain prompt")
    template_kwargs = template_kwargs or {}
    if taken := sorted(set(template_kwargs) & _chat_template_arguments(tokenizer)):
        raise ValueError(f"chat_template_kwargs: {taken} are arguments of the template call itself, not "
                         f"template variables")
    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True,
                                            **({"tools": tools} if tools else {}), **template_kwargs)
    except Exception as error:
        if not _refused_by_template(error):
            raise
        raise ValueError(f"messages: the chat template cannot render this conversation "
                         f"({type(error).__name__}: {error})") from error
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def _refused_by_template(error: Exception) -> bool:
    """The conversation's fault: the template's own refusal (``raise_exception``) or a message
    field of a type it cannot use; not a broken template (a syntax error), the model's fault."""
    if isinstance(error, TypeError):
        return True
    jinja2 = sys.modules.get("jinja2")       # loaded by transformers if it got as far as rendering
    return jinja2 is not None and isinstance(error, jinja2.TemplateError) \
        and not isinstance(error, jinja2.TemplateSyntaxError)


def _chat_template_arguments(tokenizer) -> set[str]:
    """The names ``apply_chat_template`` takes itself, and ``messages`` (the conversation's name
    in the template): a template variable of one of these names would clash with it."""
    import inspect

    params = inspect.signature(tokenizer.apply_chat_template).parameters.values()
    return {"messages", *(p.name for p in params if p.kind is not inspect.Parameter.VAR_KEYWORD)}


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
