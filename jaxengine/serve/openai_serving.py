"""Completions and chat completions: requests -> engine requests; engine deltas -> OpenAI
responses, whole or as server-sent events."""
from __future__ import annotations

import asyncio
import dataclasses
import json
from contextlib import aclosing
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from jaxengine.sampling_params import BeamSearchParams, SamplingParams
from jaxengine.serve import protocol as p
from jaxengine.serve.async_engine import AsyncEngine, RequestDelta
from jaxengine.serve.tool_calls import ToolCall, ToolMode, tool_mode


class RequestError(Exception):
    """A request-level error to report as OpenAI's error JSON."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def param_of(error: ValueError) -> str | None:
    """Our ValueErrors start with the field they are about: 'top_p: must be ...'."""
    head = str(error).split(":", 1)[0]
    return head if head.isidentifier() else None


@dataclass
class _Choice:
    """A choice's output gathered from its deltas (for a non-streamed response)."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class OpenAIServing:
    def __init__(self, engine: AsyncEngine, served_model_name: str) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.model_name = served_model_name

    # ---- requests -> engine ----
    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise RequestError(400, f"model: `{model}` is not served here; this server serves "
                                    f"`{self.model_name}`", "model")

    def _start(self, request_id: str, prompts: list[list[int]], params: SamplingParams | BeamSearchParams,
               priority: int) -> AsyncIterator[tuple[int, RequestDelta]]:
        """Check every prompt before queueing any, then merge their delta streams."""
        for ids in prompts:
            self.engine.check(ids, params)
        return _merge([self.engine.generate(f"{request_id}-{i}", ids, params, priority=priority)
                       for i, ids in enumerate(prompts)])

    async def completion_prompts(self, request: p.CompletionRequest) -> list[list[int]]:
        """Token ids of each prompt (text is tokenized off the event loop)."""
        prompts = request.prompts()
        if not prompts or any(len(x) == 0 for x in prompts):
            raise RequestError(400, "prompt: must not be empty", "prompt")
        return list(await asyncio.gather(*(self.engine.encode(x) for x in prompts)))

    async def chat_prompt(self, request: p.ChatCompletionRequest, tools: ToolMode | None = None) -> list[int]:
        if self.tokenizer is None:
            raise RequestError(400, "messages: the server runs without a tokenizer", "messages")
        offered = request.tools if tools is not None and tools.kind != "none" else None
        return await self.engine.encode_chat([m.as_template_input() for m in request.messages], tools=offered)

    # ---- completions ----
    async def completion(self, request: p.CompletionRequest) -> tuple[AsyncIterator, bool]:
        """-> (an async iterator of SSE lines, or of one response object; is it a stream)."""
        if request.echo:
            raise RequestError(400, "echo: not supported", "echo")
        self.check_model(request.model)
        params = request.sampling_params(request.max_tokens, request.logprobs)
        prompts = await self.completion_prompts(request)
        request_id = p.random_id("cmpl")
        deltas = self._start(request_id, prompts, params, request.priority)
        if request.stream:
            include_usage = bool(request.stream_options and request.stream_options.include_usage)
            return self._completion_stream(request_id, deltas, request.n, include_usage), True
        return self._completion_full(request_id, deltas, request.n, len(prompts)), False

    def _completion_stream(self, request_id: str, deltas, n: int, include_usage: bool):
        def chunk(i: int, c, usage: p.UsageInfo | None = None) -> p.CompletionResponse:
            choices = [] if c is None else [p.CompletionChoice(
                index=i * n + c.index, text=c.text, finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                logprobs=self._completion_logprobs(c))]
            return p.CompletionResponse(id=request_id, model=self.model_name, choices=choices, usage=usage)

        return _sse_stream(deltas, chunk, include_usage)

    async def _completion_full(self, request_id: str, deltas, n: int, num_prompts: int):
        choices, usage = await _gather(deltas, n, num_prompts)
        yield p.CompletionResponse(id=request_id, model=self.model_name, usage=usage, choices=[
            p.CompletionChoice(index=k, text=c.text, finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                               logprobs=self._completion_logprobs(c)) for k, c in enumerate(choices)])

    def _completion_logprobs(self, choice) -> p.CompletionLogprobs | None:
        if not choice.logprobs:
            return None
        out, offset = p.CompletionLogprobs(), 0
        for token, (lp, top) in zip(choice.token_ids, choice.logprobs):
            text = self._token_text(token)
            out.tokens.append(text)
            out.token_logprobs.append(lp)
            entry: dict[str, float] = {}
            for t, v in top.items():                # best first; tokens with the same text keep the best
                entry.setdefault(self._token_text(t), v)
            out.top_logprobs.append(entry)
            out.text_offset.append(offset)
            offset += len(text)
        return out

    # ---- chat ----
    async def chat(self, request: p.ChatCompletionRequest) -> tuple[AsyncIterator, bool]:
        self.check_model(request.model)
        if request.top_logprobs is not None and not request.logprobs:
            raise RequestError(400, "top_logprobs: needs logprobs=true", "top_logprobs")
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        try:
            params = request.sampling_params(request.max_completion_tokens or request.max_tokens, logprobs)
        except ValueError as error:          # the chat API calls the logprobs count top_logprobs
            if param_of(error) == "logprobs":
                raise RequestError(400, "top_logprobs" + str(error)[len("logprobs"):], "top_logprobs") from None
            raise
        tools = tool_mode(request.tools, request.tool_choice, request.parallel_tool_calls)
        if tools.constraint is not None:
            if params.structured_outputs is not None:
                raise RequestError(400, f"tool_choice: {request.tool_choice!r} constrains the output; it cannot "
                                        f"be combined with {params.structured_outputs.field}", "tool_choice")
            params = dataclasses.replace(params, structured_outputs=tools.constraint)
        prompt = await self.chat_prompt(request, tools)
        request_id = p.random_id("chatcmpl")
        deltas = self._start(request_id, [prompt], params, request.priority)
        if request.stream:
            include_usage = bool(request.stream_options and request.stream_options.include_usage)
            return self._chat_stream(request_id, deltas, include_usage, tools), True
        return self._chat_full(request_id, deltas, request.n, tools), False

    def _chat_stream(self, request_id: str, deltas, include_usage: bool, tools: ToolMode):
        started: set[int] = set()
        held: dict[int, str] = {}            # tool modes parsed at the end: the text so far

        def chunk(_i: int, c, usage: p.UsageInfo | None = None) -> p.ChatCompletionChunk | None:
            if c is None:
                return p.ChatCompletionChunk(id=request_id, model=self.model_name, choices=[], usage=usage)
            role = None if c.index in started else "assistant"
            first = c.index not in started
            started.add(c.index)
            finish = c.finish_reason
            if tools.kind == "named":            # the arguments stream as they come
                call = p.ToolCallOut(index=0, function=p.FunctionCall(arguments=c.text))
                if first:
                    call = p.ToolCallOut(index=0, id=ToolCall.make(tools.name, "").id, type="function",
                                         function=p.FunctionCall(name=tools.name, arguments=c.text))
                message = p.DeltaMessage(role=role, tool_calls=[call])
                finish = "tool_calls" if finish == "stop" else finish
            elif tools.kind in ("required", "auto"):
                held[c.index] = held.get(c.index, "") + c.text
                if finish is None:
                    return None if not first else p.ChatCompletionChunk(id=request_id, model=self.model_name, choices=[
                        p.ChatStreamChoice(index=c.index, delta=p.DeltaMessage(role=role, content=""))])
                content, calls, finish = _tool_message(tools, held.pop(c.index), finish)
                message = p.DeltaMessage(role=role, content=content, tool_calls=[
                    p.ToolCallOut(index=k, id=call.id, type="function", function=p.FunctionCall(
                        name=call.name, arguments=call.arguments)) for k, call in enumerate(calls)] or None)
            else:
                message = p.DeltaMessage(content=c.text, role=role)
            choice = p.ChatStreamChoice(index=c.index, delta=message, finish_reason=finish,
                                        stop_reason=c.stop_reason, logprobs=self._chat_logprobs(c))
            return p.ChatCompletionChunk(id=request_id, model=self.model_name, choices=[choice])

        return _sse_stream(deltas, chunk, include_usage)

    async def _chat_full(self, request_id: str, deltas, n: int, tools: ToolMode):
        choices, usage = await _gather(deltas, n, 1)
        out = []
        for k, c in enumerate(choices):
            content, calls, finish = _tool_message(tools, c.text, c.finish_reason)
            message = p.ChatMessageOut(content=content, tool_calls=[
                p.ToolCallOut(id=call.id, type="function", function=p.FunctionCall(name=call.name,
                                                                                   arguments=call.arguments))
                for call in calls] or None)
            out.append(p.ChatChoice(index=k, message=message, finish_reason=finish, stop_reason=c.stop_reason,
                                    logprobs=self._chat_logprobs(c)))
        yield p.ChatCompletionResponse(id=request_id, model=self.model_name, usage=usage, choices=out)

    def _chat_logprobs(self, choice) -> p.ChatLogprobs | None:
        if not choice.logprobs:
            return None
        content = []
        for token, (lp, top) in zip(choice.token_ids, choice.logprobs):
            text = self._token_text(token)
            content.append(p.TokenLogprob(token=text, logprob=lp, bytes=list(text.encode()), top_logprobs=[
                p.TopLogprob(token=(t_text := self._token_text(t)), logprob=v, bytes=list(t_text.encode()))
                for t, v in top.items()]))
        return p.ChatLogprobs(content=content)

    def _token_text(self, token: int) -> str:
        return self.engine.token_text(token)


# ---- helpers ----
def _tool_message(tools: ToolMode, text: str, finish_reason: str | None):
    """A finished choice's text -> (content, tool calls, finish reason: "tool_calls" when calls
    were made and the output ended of itself)."""
    content, calls = tools.calls(text)
    if calls and finish_reason == "stop":
        finish_reason = "tool_calls"
    return content, calls, finish_reason


# Characters that Python's str.splitlines (and so clients such as httpx's aiter_lines) treat as
# line breaks, though SSE breaks lines only at CR and LF: escaped in the JSON (they can only occur
# inside its strings), an event is one line for every client.
_LINE_BREAKS = {ord(c): f"\\u{ord(c):04x}" for c in "\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"}


def _sse(payload) -> str:
    body = payload.model_dump_json(exclude_none=True) if hasattr(payload, "model_dump_json") else json.dumps(payload)
    return f"data: {body.translate(_LINE_BREAKS)}\n\n"


async def _sse_stream(deltas, chunk, include_usage: bool):
    """Server-sent events: ``chunk(prompt index, choice delta)`` per choice delta, an error
    event if the request fails, ``chunk(0, None, usage)`` last when asked for, then [DONE]."""
    usage = p.UsageInfo()
    async with aclosing(deltas):
        async for i, delta in deltas:
            if delta.error:
                yield _sse(p.error_body(delta.error_status, delta.error))
                break
            _count(usage, delta)
            for c in delta.choices:
                if (event := chunk(i, c)) is not None:      # None: a choice held back until it ends
                    yield _sse(event)
        else:
            if include_usage:
                yield _sse(chunk(0, None, _total(usage)))
    yield "data: [DONE]\n\n"


def _count(usage: p.UsageInfo, delta: RequestDelta) -> None:
    usage.completion_tokens += sum(len(c.token_ids) for c in delta.choices)
    if delta.finished:
        usage.prompt_tokens += delta.num_prompt_tokens


def _total(usage: p.UsageInfo) -> p.UsageInfo:
    usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
    return usage


async def _gather(deltas, n: int, num_prompts: int) -> tuple[list[_Choice], p.UsageInfo]:
    """All deltas of a non-streamed request -> its choices (prompt-major) and usage."""
    choices, usage = [_Choice() for _ in range(n * num_prompts)], p.UsageInfo()
    async with aclosing(deltas):
        async for i, delta in deltas:
            if delta.error:
                raise RequestError(delta.error_status, delta.error)
            _count(usage, delta)
            for c in delta.choices:
                choice = choices[i * n + c.index]
                choice.text += c.text
                choice.token_ids += c.token_ids
                choice.logprobs += c.logprobs
                if c.finish_reason is not None:
                    choice.finish_reason, choice.stop_reason = c.finish_reason, c.stop_reason
    return choices, _total(usage)


async def _merge(streams: list[AsyncIterator[RequestDelta]]) -> AsyncIterator[tuple[int, RequestDelta]]:
    """(prompt index, delta) from several requests' streams as they come; closing this closes
    (and so aborts) all of them."""
    if len(streams) == 1:
        try:
            async for delta in streams[0]:
                yield 0, delta
        finally:
            await streams[0].aclose()
        return
    merged: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream) -> None:
        try:
            async for delta in stream:
                await merged.put((i, delta))
        finally:
            await stream.aclose()
            await merged.put((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, delta = await merged.get()
            if delta is None:
                remaining -= 1
            else:
                yield i, delta
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
