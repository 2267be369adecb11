"""Tool calls written in a model's own text format -> OpenAI tool calls, incrementally. The reply
streams through a ``ToolCallParser``, which lets content out as it comes, holds back only what
may begin a call, and hands out each call once its text is complete; a finished reply is parsed
by the same parser fed all at once, so whole and streamed responses agree.

Formats (``--tool-call-parser``; by default the one the chat template writes, else hermes):

- ``hermes`` (Hermes, Qwen2.5, Qwen3): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``;
- ``llama3_json`` (Llama 3.1-3.3): the reply is ``{"name": ..., "parameters": {...}}``, after an
  optional ``<|python_tag|>``, several calls separated by ``;``;
- ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``, or in newer templates
  ``[TOOL_CALLS]name[ARGS]{...}`` per call; call ids are 9 letters and digits, which Mistral's
  templates require of the ids sent back.

A call that does not parse, or that names no given function, stays content."""
from __future__ import annotations

import json
import secrets
import string
import uuid
from dataclasses import dataclass

_DECODER = json.JSONDecoder()
_ALNUM = string.ascii_letters + string.digits


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str          # JSON text
    id: str

    @classmethod
    def make(cls, name: str, arguments, parser: str = "hermes") -> "ToolCall":
        text = arguments if isinstance(arguments, str) else json.dumps(arguments)
        return cls(name, text, new_call_id(parser))


def new_call_id(parser: str = "hermes") -> str:
    if parser == "mistral":
        return "".join(secrets.choice(_ALNUM) for _ in range(9))
    return f"call_{uuid.uuid4().hex[:24]}"


# A format's parse of text that starts where a call starts: None while incomplete, else
# (the (name, arguments) pairs found, or None if the text is no valid call; characters used).
Parsed = "tuple[list[tuple[str, object]] | None, int] | None"


class _Hermes:
    marker, end = "<tool_call>", "</tool_call>"

    def find(self, text: str, opening: bool) -> int | None:
        i = text.find(self.marker)
        return None if i < 0 else i

    def held(self, text: str, opening: bool) -> int:
        return _marker_prefix(text, self.marker)

    def parse(self, text: str, final: bool) -> Parsed:
        end = text.find(self.end)
        if end < 0:
            return (None, len(text)) if final else None
        try:
            call = json.loads(text[len(self.marker):end])
        except ValueError:
            return None, end + len(self.end)
        return _named(call, "arguments"), end + len(self.end)


class _Llama3Json:
    """Only a reply that opens with a call (or a call right after one, ``;`` between) is one."""

    marker = "<|python_tag|>"

    def find(self, text: str, opening: bool) -> int | None:
        if (i := text.find(self.marker)) >= 0:
            return i
        j = len(text) - len(text.lstrip())
        return j if opening and text[j:j + 1] in ("{", ";") else None

    def held(self, text: str, opening: bool) -> int:
        return len(text) if opening and not text.strip() else _marker_prefix(text, self.marker)

    def parse(self, text: str, final: bool) -> Parsed:
        i = len(self.marker) if text.startswith(self.marker) else 0
        while i < len(text) and (text[i].isspace() or text[i] == ";"):
            i += 1
        if i == len(text):
            return ([], i) if final else None
        try:
            call, end = _DECODER.raw_decode(text, i)
        except ValueError:
            return (None, len(text)) if final else None
        return _named(call, "parameters", "arguments"), end


class _Mistral:
    marker, args = "[TOOL_CALLS]", "[ARGS]"

    def find(self, text: str, opening: bool) -> int | None:
        i = text.find(self.marker)
        return None if i < 0 else i

    def held(self, text: str, opening: bool) -> int:
        return _marker_prefix(text, self.marker)

    def parse(self, text: str, final: bool) -> Parsed:
        i = _skip_space(text, len(self.marker))
        if i == len(text):
            return (None, i) if final else None
        if text[i] == "[":                                    # [TOOL_CALLS][{...}, ...]
            try:
                calls, end = _DECODER.raw_decode(text, i)
            except ValueError:
                return (None, len(text)) if final else None
            named = [_named(c, "arguments") for c in calls] if isinstance(calls, list) else [None]
            return (None if None in named else [c for one in named for c in one]), end
        k = text.find(self.args, i)                           # [TOOL_CALLS]name[ARGS]{...}
        if k < 0:
            return (None, len(text)) if final else None
        try:
            arguments, end = _DECODER.raw_decode(text, _skip_space(text, k + len(self.args)))
        except ValueError:
            return (None, len(text)) if final else None
        return [(text[i:k].strip(), arguments)], end


FORMATS = {"hermes": _Hermes(), "llama3_json": _Llama3Json(), "mistral": _Mistral()}


def detect_tool_parser(chat_template) -> str:
    """The format the chat template writes tool calls in (hermes when it says nothing)."""
    text = chat_template if isinstance(chat_template, str) else json.dumps(chat_template or "")
    if FORMATS["mistral"].marker in text:
        return "mistral"
    if FORMATS["llama3_json"].marker in text or "Environment: ipython" in text:
        return "llama3_json"
    return "hermes"


class ToolCallParser:
    """One reply's tool calls, fed piece by piece: ``feed(text)`` -> (content to let out, calls
    completed). Whitespace next to a call is dropped."""

    def __init__(self, parser: str, functions: dict[str, dict]) -> None:
        self.parser, self.format, self.functions = parser, FORMATS[parser], functions
        self.pending = ""           # text not let out yet: what may begin a call, trailing whitespace
        self.opening = True         # nothing but whitespace and calls so far
        self.after_call = False     # whitespace from here on is next to a call

    def feed(self, text: str, final: bool = False) -> tuple[str, list[ToolCall]]:
        self.pending += text
        out, calls = [], []
        while (start := self.format.find(self.pending, self.opening)) is not None:
            before = self.pending[:start].rstrip()
            space = self.pending[len(before):start]         # dropped if a call follows
            out.append(self._content(before))
            parsed = self.format.parse(self.pending[start:], final)
            if parsed is None:                      # incomplete: wait for more text
                self.pending = self.pending[len(before):]
                return "".join(out), calls
            found, used = parsed
            block, self.pending = self.pending[start:start + used], self.pending[start + used:]
            if found is None or any(name not in self.functions for name, _ in found):
                out.append(self._content(space + block))
            else:
                calls += [ToolCall.make(name, arguments, self.parser) for name, arguments in found]
                self.after_call = True
        keep = 0 if final else self._held()
        out.append(self._content(self.pending[:len(self.pending) - keep]))
        self.pending = self.pending[len(self.pending) - keep:]
        return "".join(out), calls

    def _held(self) -> int:
        """How much of the pending text to hold back: what may begin a call, and the whitespace
        before it (dropped if a call follows)."""
        marker = self.format.held(self.pending, self.opening)
        return marker + _trailing_space(self.pending[:len(self.pending) - marker])

    def _content(self, text: str) -> str:
        if self.after_call:
            text = text.lstrip()
        if text:
            self.after_call = False
            if text.strip():
                self.opening = False
        return text


def parse_tool_calls(parser: str, text: str, functions: dict[str, dict]) -> tuple[str | None, list[ToolCall]]:
    """A finished reply -> (content, None when only calls remain; tool calls)."""
    content, calls = ToolCallParser(parser, functions).feed(text, final=True)
    return (content or None) if calls else content, calls


def _named(call, *argument_keys: str) -> list[tuple[str, object]] | None:
    """A parsed call object -> [(name, arguments)], None if it is not one."""
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = next((call[k] for k in argument_keys if k in call), {})
    return [(call["name"], arguments)]


def _marker_prefix(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that begins ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _trailing_space(text: str) -> int:
    return len(text) - len(text.rstrip())


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i
