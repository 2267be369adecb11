"""Reasoning models' thinking, split from the answer (``--reasoning-parser``, vLLM's names): the
``<think>...</think>`` family. ``deepseek_r1``: the chat template opens the thinking itself, so
the output is thinking until ``</think>`` (an opening ``<think>`` in it is dropped). ``qwen3``:
the output thinks only where it opens with ``<think>`` (with ``enable_thinking: false`` in
``chat_template_kwargs`` it does not). The thinking goes to ``message.reasoning_content`` (and
vLLM's newer ``reasoning``), the rest to ``content``; tool calls are parsed from the content."""
from __future__ import annotations

from dataclasses import dataclass

START, END = "<think>", "</think>"
REASONING_PARSERS = {"deepseek_r1": True, "qwen3": False}     # name -> does the output start thinking


@dataclass
class ReasoningSplit:
    """One choice's output, fed as it streams: ``feed(text)`` -> (thinking, answer) new text;
    the same split whatever the pieces (the newlines after ``</think>`` are dropped)."""

    starts_thinking: bool
    state: str = "start"              # start: nothing decided yet; think; after (the tag's newlines); answer
    pending: str = ""                 # text that may be the start of a tag
    thought: bool = False             # the output had a thinking part

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        buffer, self.pending = self.pending + text, ""
        thinking, answer = "", ""
        while buffer:
            if self.state == "start":
                stripped = buffer.lstrip()
                if stripped.startswith(START):
                    buffer, self.state, self.thought = stripped[len(START):], "think", True
                elif START.startswith(stripped) and not final:
                    self.pending = buffer                  # maybe "<thi": wait for more
                    break
                else:
                    self.state = "think" if self.starts_thinking else "answer"
                    self.thought = self.starts_thinking
            elif self.state == "think":
                at = buffer.find(END)
                if at >= 0:
                    thinking += buffer[:at]
                    buffer, self.state = buffer[at + len(END):], "after"
                    continue
                keep = 0 if final else _partial_tag(buffer, END)
                thinking += buffer[:len(buffer) - keep]
                self.pending = buffer[len(buffer) - keep:]
                break
            elif self.state == "after":
                buffer = buffer.lstrip("\n")
                if buffer:
                    self.state = "answer"
            else:
                answer += buffer
                break
        return thinking, answer


def split_reasoning(parser: str, text: str) -> tuple[str | None, str]:
    """A finished output -> (its thinking, None if it had none; its answer)."""
    split = ReasoningSplit(REASONING_PARSERS[parser])
    thinking, answer = split.feed(text, final=True)
    return (thinking if split.thought else None), answer


def _partial_tag(text: str, tag: str) -> int:
    """How many trailing characters of ``text`` may begin ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
