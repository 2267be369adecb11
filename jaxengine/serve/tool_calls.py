"""Chat tool calling: the constraint that ``tool_choice`` puts on the output, and the output turned
back into OpenAI's ``tool_calls``.

- a named function (``{"type": "function", "function": {"name": ...}}``): the output is that
  function's arguments, constrained to its ``parameters`` schema;
- ``"required"``: the output is a JSON array of one or more calls (one with
  ``parallel_tool_calls: false``), each ``{"name": <one of the tools>, "parameters": <its
  arguments>}`` (the schema says which);
- ``"auto"``: no constraint; calls the model wrote in its own format (``serve.tool_parsers``:
  hermes, llama3_json or mistral) become ``tool_calls`` and the text around them the content;
- ``"none"`` (or no tools): plain text.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from jaxengine.sampling_params import StructuredOutputsParams
from jaxengine.serve.tool_parsers import ToolCall, ToolCallParser, parse_tool_calls

ANY_OBJECT = {"type": "object"}


@dataclass(frozen=True)
class ToolMode:
    """What ``tools`` + ``tool_choice`` ask of one chat request."""

    kind: str                            # "none", "auto", "required" or "named"
    functions: dict[str, dict]           # name -> parameters schema
    name: str | None = None              # "named": the function
    parallel: bool = True                # "required": more than one call allowed
    parser: str = "hermes"               # "auto": the model's format (also the style of call ids)

    @property
    def constraint(self) -> StructuredOutputsParams | None:
        if self.kind == "named":
            return StructuredOutputsParams(json=self.functions[self.name] or ANY_OBJECT, field="tool_choice")
        if self.kind == "required":
            return StructuredOutputsParams(json=required_schema(self.functions, self.parallel), field="tool_choice")
        return None

    def calls(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The finished output -> (content, tool calls). Output that does not parse (cut short by
        max_tokens) stays content."""
        if self.kind == "named":
            return None, [ToolCall.make(self.name, text, self.parser)]
        if self.kind == "required":
            try:
                calls = [ToolCall.make(c["name"], c["parameters"], self.parser) for c in json.loads(text)]
            except (ValueError, TypeError, KeyError):
                return text, []
            return None, calls
        if self.kind == "auto":
            return parse_tool_calls(self.parser, text, self.functions)
        return text, []

    def stream_parser(self) -> ToolCallParser:
        """"auto": a parser to feed a streamed reply to."""
        return ToolCallParser(self.parser, self.functions)


def tool_mode(tools: list | None, tool_choice, parallel_tool_calls: bool = True, parser: str = "hermes") -> ToolMode:
    """ValueError naming ``tools`` / ``tool_choice`` for what cannot be served. ``parser``: one of
    ``tool_parsers.FORMATS``."""
    functions = {}
    for tool in tools or []:
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(function, dict) \
                or not isinstance(function.get("name"), str):
            raise ValueError("tools: each tool must be {\"type\": \"function\", \"function\": {\"name\": ..., "
                             "\"parameters\": {...}}}")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise ValueError(f"tools: the parameters of {function['name']!r} must be a JSON schema object")
        functions[function["name"]] = parameters
    choice = "auto" if tool_choice is None and functions else (tool_choice or "none")
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
        if name not in functions:
            raise ValueError(f"tool_choice: {name!r} is not one of the tools {sorted(functions)}")
        return ToolMode("named", functions, name, parser=parser)
    if choice not in ("none", "auto", "required"):
        raise ValueError(f"tool_choice: must be 'none', 'auto', 'required' or a named function, got {choice!r}")
    if choice != "none" and not functions:
        raise ValueError(f"tool_choice: {choice!r} needs tools")
    return ToolMode(choice, functions, parallel=parallel_tool_calls, parser=parser)


def required_schema(functions: dict[str, dict], parallel: bool = True) -> dict:
    """A JSON array of one or more calls (exactly one unless ``parallel``) of the given
    functions, each with valid parameters."""
    calls = [{"type": "object", "properties": {"name": {"const": name}, "parameters": params or ANY_OBJECT},
              "required": ["name", "parameters"], "additionalProperties": False}
             for name, params in functions.items()]
    return {"type": "array", "minItems": 1, **({} if parallel else {"maxItems": 1}), "items": {"anyOf": calls}}

