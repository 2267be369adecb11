"""The Responses API (``POST /v1/responses``, the OpenAI SDK's ``client.responses.create``): a
request becomes a chat completion run; the run's output becomes response items (reasoning, a
message, function calls), whole or as the API's typed server-sent events.

Responses are not stored: ``previous_response_id`` is refused, the client sends the whole
conversation (its earlier output items included) in ``input``."""
from __future__ import annotations

import json
import time
import uuid
from contextlib import aclosing
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from jaxengine.serve import protocol as p
from jaxengine.serve.openai_serving import ChatRun, OpenAIServing, RequestError

TEXT_PARTS = ("input_text", "output_text", "text")
ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    type: Literal["text", "json_schema", "json_object"]
    name: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: TextFormat | None = None


class ResponsesRequest(p.RequestBody):
    """The fields this server honours; any other is a 400 naming it (not silently dropped)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    store: bool | None = None                  # accepted; nothing is stored
    previous_response_id: str | None = None    # refused with a 400 saying why
    truncation: Literal["disabled"] | None = None     # "auto" would drop input without saying
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    priority: int = 0
    slo: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


def chat_request(request: ResponsesRequest) -> p.ChatCompletionRequest:
    """The chat completion request that produces the response; RequestError naming the field."""
    if request.previous_response_id is not None:
        raise RequestError(400, "previous_response_id: responses are not stored here; send the whole "
                                "conversation in input", "previous_response_id")
    fields = dict(model=request.model, messages=chat_messages(request.input, request.instructions),
                  max_completion_tokens=request.max_output_tokens, stream=request.stream,
                  tools=chat_tools(request.tools), tool_choice=chat_tool_choice(request.tool_choice),
                  parallel_tool_calls=request.parallel_tool_calls, response_format=response_format(request.text),
                  stream_options={"include_usage": True} if request.stream else None)
    for name in ("temperature", "top_p", "user", "top_k", "min_p", "repetition_penalty", "seed", "stop", "priority",
                 "slo", "structured_outputs", "chat_template_kwargs"):
        fields[name] = getattr(request, name)
    try:
        return p.ChatCompletionRequest(**fields)
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(x) for x in first.get("loc", ()))
        raise RequestError(400, f"{where or 'input'}: {first.get('msg')}", "input") from None


def chat_messages(items: str | list[dict], instructions: str | None) -> list[dict]:
    messages = [{"role": "system", "content": instructions}] if instructions else []
    if isinstance(items, str):
        items = [{"role": "user", "content": items}] if items else []
    if not items:
        raise RequestError(400, "input: must not be empty", "input")
    for i, item in enumerate(items):
        where, kind = f"input[{i}]", item.get("type", "message")
        if kind == "message":
            messages.append(_message(item, where))
        elif kind == "function_call":
            call = {"id": _string(item, "call_id", where), "type": "function", "function": {
                "name": _string(item, "name", where), "arguments": _string(item, "arguments", where)}}
            if messages and messages[-1]["role"] == "assistant":     # calls of the same turn
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = _key(item, "output", where)
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", where),
                             "content": output if isinstance(output, str) else _text(output, f"{where}.output")})
        elif kind != "reasoning":            # earlier thinking: chat templates leave it out too
            raise RequestError(400, f"{where}.type: {kind!r} is not supported (supported: {list(ITEM_TYPES)})",
                               "input")
    return messages


def _message(item: dict, where: str) -> dict:
    role = _string(item, "role", where)
    if role not in ROLES:
        raise RequestError(400, f"{where}.role: must be one of {list(ROLES)}, got {role!r}", "input")
    content = _key(item, "content", where)
    return {"role": ROLES[role], "content": content if isinstance(content, str) else _text(content, f"{where}.content")}


def _text(parts, where: str) -> str:
    """Content parts -> their text; anything but text is refused (the server serves text only)."""
    if not isinstance(parts, list):
        raise RequestError(400, f"{where}: must be a string or a list of content parts", "input")
    texts = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in TEXT_PARTS:
            texts.append(_string(part, "text", f"{where}[{j}]"))
        elif kind == "refusal":
            texts.append(_string(part, "refusal", f"{where}[{j}]"))
        else:
            raise RequestError(400, f"{where}[{j}].type: {kind!r} is not supported (this server takes text "
                                    f"only: {list(TEXT_PARTS)})", "input")
    return "".join(texts)


def _key(item: dict, key: str, where: str):
    if key not in item:
        raise RequestError(400, f"{where}.{key}: missing", "input")
    return item[key]


def _string(item: dict, key: str, where: str) -> str:
    if not isinstance(value := _key(item, key, where), str):
        raise RequestError(400, f"{where}.{key}: must be a string, got {type(value).__name__}", "input")
    return value


def chat_tools(tools: list[dict] | None) -> list[dict] | None:
    """Responses' flat function tools -> chat's nested ones."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise RequestError(400, f"tools[{i}].type: {tool.get('type')!r} is not supported (function tools "
                                    f"only)", "tools")
        out.append({"type": "function", "function": {
            "name": _key(tool, "name", f"tools[{i}]"), "description": tool.get("description"),
            "parameters": tool.get("parameters")}})
    return out


def chat_tool_choice(choice) -> str | dict | None:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise RequestError(400, f"tool_choice: must be 'none', 'auto', 'required' or {{\"type\": \"function\", "
                            f"\"name\": ...}}, got {choice!r}", "tool_choice")


def response_format(text: TextConfig | None) -> dict | None:
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.json_schema is None:
        raise RequestError(400, "text.format.schema: a json_schema format needs a schema", "text")
    return {"type": "json_schema", "json_schema": {"name": fmt.name, "schema": fmt.json_schema, "strict": fmt.strict}}


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def reasoning_item(text: str, status: str = "completed") -> dict:
    return {"id": item_id("rs"), "type": "reasoning", "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}


def message_item(text: str, status: str = "completed") -> dict:
    return {"id": item_id("msg"), "type": "message", "role": "assistant", "status": status,
            "content": [output_text(text)]}


def output_text(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(call_id: str, name: str, arguments: str) -> dict:
    return {"id": item_id("fc"), "type": "function_call", "call_id": call_id, "name": name, "arguments": arguments,
            "status": "completed"}


class ResponsesServing:
    """``create(request)`` -> (an async iterator of SSE lines, or of one response dict; is it a stream)."""

    def __init__(self, chat: OpenAIServing) -> None:
        self.chat = chat

    async def create(self, request: ResponsesRequest) -> tuple[Any, bool]:
        run = await self.chat.start_chat(chat_request(request))
        head = self._head(request)
        if request.stream:
            return self._events(run, head), True
        return self._whole(run, head), False

    def _head(self, request: ResponsesRequest) -> dict:
        """The response's fields that echo the request."""
        return {"id": item_id("resp"), "object": "response", "created_at": int(time.time()),
                "model": self.chat.response_model(request.model), "instructions": request.instructions,
                "max_output_tokens": request.max_output_tokens, "temperature": request.temperature,
                "top_p": request.top_p, "tools": request.tools or [], "tool_choice": request.tool_choice or "auto",
                "parallel_tool_calls": request.parallel_tool_calls, "store": False,
                "text": request.text.model_dump(exclude_none=True, by_alias=True) if request.text and request.text.format
                else {"format": {"type": "text"}}, "metadata": request.metadata or {}, "user": request.user,
                "error": None, "incomplete_details": None}

    async def _whole(self, run: ChatRun, head: dict):
        async with aclosing(self.chat.chat_response(run)) as responses:
            chat = await anext(responses)
        choice = chat.choices[0]
        message, incomplete = choice.message, choice.finish_reason == "length"
        status = "incomplete" if incomplete else "completed"
        items = [reasoning_item(message.reasoning_content, status)] if message.reasoning_content else []
        calls = message.tool_calls or []
        if message.content or not calls:
            items.append(message_item(message.content or "", status))
        items += [call_item(c.id, c.function.name, c.function.arguments) for c in calls]
        yield await self._finished(head, items, chat.usage, message.reasoning_content, incomplete)

    async def _finished(self, head: dict, items: list[dict], usage: p.UsageInfo, thinking: str | None,
                        incomplete: bool) -> dict:
        reasoning_tokens = len(await self.chat.engine.encode(thinking, add_special_tokens=False)) if thinking else 0
        return {**head, "status": "incomplete" if incomplete else "completed", "output": items,
                "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None, "usage": {
                    "input_tokens": usage.prompt_tokens,
                    "input_tokens_details": {"cached_tokens": usage.prompt_tokens_details.cached_tokens},
                    "output_tokens": usage.completion_tokens,
                    "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
                    "total_tokens": usage.total_tokens}}

    async def _events(self, run: ChatRun, head: dict):
        stream = _EventStream()
        yield stream.event("response.created", response={**head, "status": "in_progress", "output": []})
        yield stream.event("response.in_progress", response={**head, "status": "in_progress", "output": []})
        usage, finish = p.UsageInfo(), None
        async with aclosing(self.chat.chat_chunks(run, include_usage=True)) as chunks:
            async for chunk in chunks:
                if isinstance(chunk, RequestError):
                    for event in stream.failed(head, chunk):
                        yield event
                    return
                usage = chunk.usage or usage
                for c in chunk.choices:
                    for event in stream.delta(c.delta):
                        yield event
                    finish = c.finish_reason or finish
        incomplete = finish == "length"
        for event in stream.close_all("incomplete" if incomplete else "completed"):
            yield event
        response = await self._finished(head, stream.items, usage, stream.thinking, incomplete)
        yield stream.event("response.incomplete" if incomplete else "response.completed", response=response)


class _EventStream:
    """Chat deltas -> the Responses API's events, numbered: one output item open at a time,
    each closed (its done events) when the output moves to another kind."""

    def __init__(self) -> None:
        self.sequence = 0
        self.items: list[dict] = []            # finished items
        self.open: dict | None = None          # the item being written
        self.thinking = ""

    def event(self, kind: str, **fields) -> str:
        # json.dumps escapes every control and non-ASCII character: each event's data is one line
        data = json.dumps({"type": kind, "sequence_number": self.sequence, **fields})
        self.sequence += 1
        return f"event: {kind}\ndata: {data}\n\n"

    def delta(self, delta: p.DeltaMessage):
        if delta.reasoning_content:
            self.thinking += delta.reasoning_content
            yield from self._text("reasoning", delta.reasoning_content)
        if delta.content:
            yield from self._text("message", delta.content)
        for call in delta.tool_calls or []:
            if call.id is not None:               # a new call
                yield from self._close("completed")
                yield from self._add(call_item(call.id, call.function.name, ""))
            arguments = call.function.arguments or ""
            if arguments:
                self.open["arguments"] += arguments
                yield self._at("response.function_call_arguments.delta", delta=arguments)

    def _text(self, kind: str, text: str):
        if self.open is not None and self.open["type"] != kind:
            yield from self._close("completed")
        if self.open is None:
            yield from self._add_text(kind)
        self.open["content"][0]["text"] += text
        name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        yield self._at(name, content_index=0, delta=text, **extra)

    def _add_text(self, kind: str):
        yield from self._add(reasoning_item("") if kind == "reasoning" else message_item(""))
        yield self._at("response.content_part.added", content_index=0, part=self.open["content"][0])

    def _add(self, item: dict):
        self.open = {**item, "status": "in_progress"}
        yield self.event("response.output_item.added", output_index=len(self.items), item=self.open)

    def _at(self, kind: str, **fields) -> str:
        return self.event(kind, item_id=self.open["id"], output_index=len(self.items), **fields)

    def _close(self, status: str):
        item = self.open
        if item is None:
            return
        if item["type"] == "function_call":
            yield self._at("response.function_call_arguments.done", arguments=item["arguments"], name=item["name"])
            status = "completed"
        else:
            part = item["content"][0]
            name = "response.reasoning_text.done" if item["type"] == "reasoning" else "response.output_text.done"
            yield self._at(name, content_index=0, text=part["text"],
                           **({} if item["type"] == "reasoning" else {"logprobs": []}))
            yield self._at("response.content_part.done", content_index=0, part=part)
        item["status"] = status
        yield self.event("response.output_item.done", output_index=len(self.items), item=item)
        self.items.append(item)
        self.open = None

    def close_all(self, status: str):
        if self.open is None and not self.items:          # an empty answer is still a message
            yield from self._add_text("message")
        yield from self._close(status)

    def failed(self, head: dict, error: RequestError):
        code = "server_error" if error.status >= 500 else "invalid_prompt"
        yield self.event("error", code=code, message=error.message, param=error.param)
        yield self.event("response.failed", response={**head, "status": "failed", "output": self.items,
                                                      "error": {"code": code, "message": error.message}})

