"""Completions and chat completions: requests -> engine requests; engine deltas -> OpenAI
responses, whole or as server-sent events."""
from __future__ import annotations

import asyncio
import dataclasses
import json
from contextlib import aclosing
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from jaxengine.lora_request import LoRARequest
from jaxengine.request import LatencyTargets
from jaxengine.sampling_params import BeamSearchParams, SamplingParams
from jaxengine.serve import protocol as p
from jaxengine.serve.async_engine import AsyncEngine, RequestDelta
from jaxengine.serve.reasoning import REASONING_PARSERS, ReasoningSplit, split_reasoning
from jaxengine.serve.tool_calls import ToolMode, tool_mode
from jaxengine.serve.tool_parsers import FORMATS, ToolCallParser, detect_tool_parser, new_call_id


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
    def __init__(self, engine: AsyncEngine, served_model_name: str, reasoning_parser: str | None = None,
                 tool_call_parser: str | None = None) -> None:
        """``reasoning_parser``: one of ``serve.reasoning.REASONING_PARSERS`` (the thinking of a
        chat response goes to ``reasoning_content``), or None. ``tool_call_parser``: one of
        ``serve.tool_parsers.FORMATS``, the format of the calls a model makes with ``tool_choice:
        "auto"`` (None: the one its chat template writes)."""
        if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser: must be one of {list(REASONING_PARSERS)}, got {reasoning_parser!r}")
        if tool_call_parser is not None and tool_call_parser not in FORMATS:
            raise ValueError(f"tool_call_parser: must be one of {list(FORMATS)}, got {tool_call_parser!r}")
        self.reasoning_parser = reasoning_parser
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.tool_call_parser = tool_call_parser or detect_tool_parser(getattr(self.tokenizer, "chat_template", None))
        self.model_name = served_model_name
        self.defaults = getattr(getattr(engine, "host", None), "generation_defaults", {})   # generation_config

    # ---- requests -> engine ----
    def check_model(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter a request's ``model`` names (None: the base model); an unknown name is
        a 404, as OpenAI answers for a model that does not exist."""
        if model is None or model == self.model_name:
            return None
        adapter = self.adapters.get(model)
        if adapter is None:
            served = [self.model_name, *self.adapters]
            raise RequestError(404, f"model: the model `{model}` does not exist; this server serves "
                                    f"{', '.join(f'`{m}`' for m in served)}", "model")
        return adapter

    @property
    def adapters(self) -> dict[str, LoRARequest]:
        """The LoRA adapters served by name (``LLM.loras``)."""
        return getattr(getattr(self.engine, "host", None), "loras", {})

    def response_model(self, model: str | None) -> str:
        """The ``model`` a response names: the adapter asked for, else the base model."""
        return model if model is not None and model in self.adapters else self.model_name

    def _start(self, request_id: str, prompts: list[list[int]], params: SamplingParams | BeamSearchParams,
               request: p.CompletionRequest | p.ChatCompletionRequest) -> AsyncIterator[tuple[int, RequestDelta]]:
        """Check every prompt before queueing any, then merge their delta streams."""
        slo = LatencyTargets.from_ms(request.slo)
        lora = self.check_model(request.model)
        each = [self._fit(params, ids) for ids in prompts]
        for ids, prompt_params in zip(prompts, each):
            self.engine.check(ids, prompt_params, slo)
        return _merge([self.engine.generate(f"{request_id}-{i}", ids, prompt_params, priority=request.priority,
                                            slo=slo, lora_request=lora)
                       for i, (ids, prompt_params) in enumerate(zip(prompts, each))])

    def _fit(self, params: SamplingParams | BeamSearchParams, ids: list[int]) -> SamplingParams | BeamSearchParams:
        """A beam search without max_tokens runs up to the context length (a sampled request
        leaves it None: the scheduler stops it there)."""
        if not isinstance(params, BeamSearchParams) or params.max_tokens != p.MAX_BEAM_TOKENS:
            return params
        room = self.engine.host.config.scheduler.max_model_len - len(ids)
        return dataclasses.replace(params, max_tokens=max(room, 1))      # no room: check() refuses the prompt

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
        return await self.engine.encode_chat([m.as_template_input() for m in request.messages], tools=offered,
                                             template_kwargs=request.chat_template_kwargs)

    # ---- completions ----
    async def completion(self, request: p.CompletionRequest) -> tuple[AsyncIterator, bool]:
        """-> (an async iterator of SSE lines, or of one response object; is it a stream).
        ``echo``: each choice's text starts with its prompt, and with ``logprobs`` so do its
        logprobs (the prompt tokens' own, the first one null); ``max_tokens: 0`` with echo scores
        the prompt only (one token is generated and left out)."""
        self.check_model(request.model)
        score_only = request.max_tokens == 0
        if score_only and not request.echo:
            raise RequestError(400, "max_tokens: must be at least 1 (0 only with echo: true, which scores the "
                                    "prompt)", "max_tokens")
        echo_logprobs = request.logprobs if request.echo else None
        wanted = [k for k in (request.prompt_logprobs, echo_logprobs) if k is not None]
        params = request.sampling_params(1 if score_only else request.max_tokens, request.logprobs,
                                         max(wanted) if wanted else None, self.defaults)
        if request.echo and isinstance(params, BeamSearchParams):
            raise RequestError(400, "echo: not supported with use_beam_search", "echo")
        prompts = await self.completion_prompts(request)
        request_id = p.random_id("cmpl")
        deltas = self._start(request_id, prompts, params, request)
        if score_only:
            deltas = _without_outputs(deltas)
        echo = None
        if request.echo or request.prompt_logprobs is not None:
            texts = [x if isinstance(x, str) else await self.engine.decode(ids) if request.echo else ""
                     for x, ids in zip(request.prompts(), prompts)]
            echo = _Echo(prompts, texts if request.echo else [""] * len(prompts), echo_logprobs is not None,
                         request.prompt_logprobs is not None)
            deltas = echo.watch(deltas)
        model = self.response_model(request.model)
        if request.stream:
            include_usage = bool(request.stream_options and request.stream_options.include_usage)
            return self._completion_stream(request_id, model, deltas, request.n, include_usage, echo), True
        return self._completion_full(request_id, model, deltas, request.n, len(prompts), echo), False

    def _completion_stream(self, request_id: str, model: str, deltas, n: int, include_usage: bool,
                           echo: "_Echo | None"):
        started: set[tuple[int, int]] = set()

        def chunk(i: int, c, usage: p.UsageInfo | None = None) -> p.CompletionResponse:
            choices = []
            if c is not None:
                first = (i, c.index) not in started
                started.add((i, c.index))
                choices = [self._completion_choice(i * n + c.index, c, echo, i if first else None)]
            return p.CompletionResponse(id=request_id, model=model, choices=choices, usage=usage)

        return _sse_stream(_chunk_stream(deltas, chunk, include_usage))

    async def _completion_full(self, request_id: str, model: str, deltas, n: int, num_prompts: int,
                               echo: "_Echo | None"):
        choices, usage = await _gather(deltas, n, num_prompts)
        yield p.CompletionResponse(id=request_id, model=model, usage=usage, choices=[
            self._completion_choice(k, c, echo, k // n) for k, c in enumerate(choices)])

    def _completion_choice(self, index: int, c, echo: "_Echo | None", prompt: int | None) -> p.CompletionChoice:
        """Choice ``index``; ``prompt``: the index of the prompt to echo before it (None: none, as
        in a stream's later chunks)."""
        text, start, prompt_logprobs = c.text, None, None
        if echo is not None and prompt is not None:
            text = echo.texts[prompt] + text
            start = self._echo_logprobs(echo, prompt) if echo.logprobs else None
            prompt_logprobs = self._vllm_prompt_logprobs(echo, prompt) if echo.vllm else None
        return p.CompletionChoice(index=index, text=text, finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                                  logprobs=self._completion_logprobs(c, start), prompt_logprobs=prompt_logprobs)

    def _echo_logprobs(self, echo: "_Echo", prompt: int) -> p.CompletionLogprobs:
        """The prompt's tokens as logprobs: the first one's null, then each given those before it."""
        out, offset = p.CompletionLogprobs(), 0
        for token, entry in zip(echo.prompts[prompt], echo.logprobs_of(prompt)):
            text = self._token_text(token)
            out.tokens.append(text)
            out.token_logprobs.append(None if entry is None else entry[token])
            out.top_logprobs.append(None if entry is None else self._top_by_text(entry))
            out.text_offset.append(offset)
            offset += len(text)
        return out

    def _vllm_prompt_logprobs(self, echo: "_Echo", prompt: int) -> p.PromptLogprobs:
        return [None if entry is None else {str(t): p.PromptLogprob(logprob=v, decoded_token=self._token_text(t))
                                            for t, v in entry.items()} for entry in echo.logprobs_of(prompt)]

    def _top_by_text(self, top: dict[int, float]) -> dict[str, float]:
        entry: dict[str, float] = {}
        for t, v in sorted(top.items(), key=lambda kv: -kv[1]):     # best first; the same text keeps the best
            entry.setdefault(self._token_text(t), v)
        return entry

    def _completion_logprobs(self, choice, start: p.CompletionLogprobs | None = None) -> p.CompletionLogprobs | None:
        """The choice's tokens' logprobs, after ``start`` (an echoed prompt's) when given."""
        if not choice.logprobs:
            return start
        out = start or p.CompletionLogprobs()
        offset = out.text_offset[-1] + len(out.tokens[-1]) if out.tokens else 0
        for token, (lp, top) in zip(choice.token_ids, choice.logprobs):
            text = self._token_text(token)
            out.tokens.append(text)
            out.token_logprobs.append(lp)
            out.top_logprobs.append(self._top_by_text(top))
            out.text_offset.append(offset)
            offset += len(text)
        return out

    # ---- chat ----
    async def chat(self, request: p.ChatCompletionRequest) -> tuple[AsyncIterator, bool]:
        run = await self.start_chat(request)
        if request.stream:
            include_usage = bool(request.stream_options and request.stream_options.include_usage)
            return _sse_stream(self.chat_chunks(run, include_usage)), True
        return self.chat_response(run), False

    async def start_chat(self, request: p.ChatCompletionRequest) -> "ChatRun":
        """Check the request, queue it, and return its run (not yet read)."""
        self.check_model(request.model)
        if request.top_logprobs is not None and not request.logprobs:
            raise RequestError(400, "top_logprobs: needs logprobs=true", "top_logprobs")
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        if request.prompt_logprobs is not None and request.stream:
            raise RequestError(400, "prompt_logprobs: not supported with stream: true on chat completions",
                               "prompt_logprobs")
        try:
            max_tokens = request.max_tokens if request.max_completion_tokens is None else request.max_completion_tokens
            params = request.sampling_params(max_tokens, logprobs, request.prompt_logprobs, self.defaults)
        except ValueError as error:          # the chat API calls the logprobs count top_logprobs
            if param_of(error) == "logprobs":
                raise RequestError(400, "top_logprobs" + str(error)[len("logprobs"):], "top_logprobs") from None
            raise
        tools = tool_mode(request.tools, request.tool_choice, request.parallel_tool_calls, self.tool_call_parser)
        if tools.kind == "auto" and tools.parser == "mistral":      # [TOOL_CALLS] is a special token
            params = dataclasses.replace(params, skip_special_tokens=False)
        if tools.constraint is not None:
            if params.structured_outputs is not None:
                raise RequestError(400, f"tool_choice: {request.tool_choice!r} constrains the output; it cannot "
                                        f"be combined with {params.structured_outputs.field}", "tool_choice")
            params = dataclasses.replace(params, structured_outputs=tools.constraint)
        # With a reasoning parser the constraint holds for the answer after the thinking, unless the
        # request's structured_outputs names its own "thinking" (null: from the first token).
        if (self.reasoning_parser is not None and params.structured_outputs is not None
                and "thinking" not in (request.structured_outputs or {})):
            thinking = "starts" if REASONING_PARSERS[self.reasoning_parser] else "optional"
            params = dataclasses.replace(params, structured_outputs=dataclasses.replace(
                params.structured_outputs, thinking=thinking))
        prompt = await self.chat_prompt(request, tools)
        request_id = p.random_id("chatcmpl")
        deltas = self._start(request_id, [prompt], params, request)
        echo = None
        if request.prompt_logprobs is not None:
            echo = _Echo([prompt], [""], False, True)
            deltas = echo.watch(deltas)
        return ChatRun(request_id, deltas, request.n, tools, echo, self.response_model(request.model))

    def chat_chunks(self, run: "ChatRun", include_usage: bool):
        """The run's stream chunks (a RequestError item if it fails; with ``include_usage`` a
        last chunk carries the usage)."""
        request_id, tools = run.request_id, run.tools
        started: set[int] = set()
        held: dict[int, str] = {}            # "required": the text so far (parsed at the end)
        parsers: dict[int, ToolCallParser] = {}    # "auto": each choice's calls as they parse
        num_calls: dict[int, int] = {}
        splits: dict[int, ReasoningSplit] = {}     # with a reasoning parser: each choice's split so far
        called: set[int] = set()             # named tool: the choices whose call has been announced

        def chunk(_i: int, c, usage: p.UsageInfo | None = None) -> p.ChatCompletionChunk | None:
            if c is None:
                return p.ChatCompletionChunk(id=request_id, model=run.model, choices=[], usage=usage)
            role = None if c.index in started else "assistant"
            first = c.index not in started
            started.add(c.index)
            finish = c.finish_reason
            if tools.kind == "named":            # the arguments stream as they come, after any thinking
                thinking, text = self._feed(splits, c)
                calls = None
                if text or finish is not None or (first and self.reasoning_parser is None):
                    calls = [p.ToolCallOut(index=0, function=p.FunctionCall(arguments=text))]
                    if c.index not in called:
                        called.add(c.index)
                        calls = [p.ToolCallOut(index=0, id=new_call_id(tools.parser), type="function",
                                               function=p.FunctionCall(name=tools.name, arguments=text))]
                message = p.DeltaMessage(role=role, tool_calls=calls, reasoning_content=thinking or None,
                                         reasoning=thinking or None)
                finish = "tool_calls" if finish == "stop" else finish
            elif tools.kind == "auto":
                thinking, text = self._feed(splits, c)
                parser = parsers.setdefault(c.index, tools.stream_parser())
                content, calls = parser.feed(text, final=finish is not None)
                before = num_calls.get(c.index, 0)
                num_calls[c.index] = before + len(calls)
                if num_calls[c.index] and finish == "stop":
                    finish = "tool_calls"
                message = p.DeltaMessage(role=role, content=content or ("" if first else None),
                                         reasoning_content=thinking or None, reasoning=thinking or None,
                                         tool_calls=_call_deltas(calls, before))
            elif tools.kind == "required":
                held[c.index] = held.get(c.index, "") + c.text
                if finish is None:
                    return None if not first else p.ChatCompletionChunk(id=request_id, model=run.model, choices=[
                        p.ChatStreamChoice(index=c.index, delta=p.DeltaMessage(role=role, content=""))])
                thinking, text = self._split(held.pop(c.index))
                content, calls, finish = _tool_message(tools, text, finish)
                message = p.DeltaMessage(role=role, content=content, reasoning_content=thinking, reasoning=thinking,
                                         tool_calls=_call_deltas(calls))
            elif self.reasoning_parser is not None:
                thinking, text = self._feed(splits, c)
                message = p.DeltaMessage(role=role, content=text or ("" if first else None),
                                         reasoning_content=thinking or None, reasoning=thinking or None)
            else:
                message = p.DeltaMessage(content=c.text, role=role)
            choice = p.ChatStreamChoice(index=c.index, delta=message, finish_reason=finish,
                                        stop_reason=c.stop_reason, logprobs=self._chat_logprobs(c))
            return p.ChatCompletionChunk(id=request_id, model=run.model, choices=[choice])

        return _chunk_stream(run.deltas, chunk, include_usage)

    async def chat_response(self, run: "ChatRun"):
        """The run's one response, when it has finished."""
        request_id, tools, echo = run.request_id, run.tools, run.echo
        choices, usage = await _gather(run.deltas, run.n, 1)
        out = []
        for k, c in enumerate(choices):
            thinking, text = self._split(c.text)
            content, calls, finish = _tool_message(tools, text, c.finish_reason)
            message = p.ChatMessageOut(content=content, reasoning_content=thinking, reasoning=thinking, tool_calls=[
                p.ToolCallOut(id=call.id, type="function", function=p.FunctionCall(name=call.name,
                                                                                   arguments=call.arguments))
                for call in calls] or None)
            out.append(p.ChatChoice(index=k, message=message, finish_reason=finish, stop_reason=c.stop_reason,
                                    logprobs=self._chat_logprobs(c)))
        yield p.ChatCompletionResponse(id=request_id, model=run.model, usage=usage, choices=out,
                                       prompt_logprobs=None if echo is None else self._vllm_prompt_logprobs(echo, 0))

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

    def _feed(self, splits: dict[int, ReasoningSplit], c) -> tuple[str, str]:
        """A streamed delta -> (its new thinking, its new answer text); all answer without a parser."""
        if self.reasoning_parser is None:
            return "", c.text
        split = splits.setdefault(c.index, ReasoningSplit(REASONING_PARSERS[self.reasoning_parser]))
        return split.feed(c.text, final=c.finish_reason is not None)

    def _split(self, text: str) -> tuple[str | None, str]:
        """A finished output -> (its thinking, None without a parser or thinking; its answer)."""
        return (None, text) if self.reasoning_parser is None else split_reasoning(self.reasoning_parser, text)

    def _token_text(self, token: int) -> str:
        return self.engine.token_text(token)


# ---- helpers ----
@dataclass
class ChatRun:
    """A queued chat request: its id, its deltas (read once), what its output is parsed for."""

    request_id: str
    deltas: AsyncIterator
    n: int
    tools: ToolMode
    echo: "_Echo | None" = None
    model: str = ""                  # the model its responses name (the adapter asked for, or the base)


@dataclass
class _Echo:
    """What a completion echoes of its prompts: their ids and texts, and the prompt logprobs the
    engine sends in each request's first delta (``watch`` records them)."""

    prompts: list[list[int]]
    texts: list[str]
    logprobs: bool                    # echo the prompt's logprobs in ``logprobs``
    vllm: bool                        # vLLM's ``prompt_logprobs`` field
    seen: dict[int, list] = field(default_factory=dict)

    async def watch(self, deltas):
        async with aclosing(deltas):
            async for i, delta in deltas:
                if delta.prompt_logprobs is not None:
                    self.seen[i] = delta.prompt_logprobs
                yield i, delta

    def logprobs_of(self, prompt: int) -> list:
        return self.seen.get(prompt) or [None] * len(self.prompts[prompt])


async def _without_outputs(deltas):
    """A scoring request's deltas with its one generated token left out (``max_tokens: 0``)."""
    async with aclosing(deltas):
        async for i, delta in deltas:
            yield i, dataclasses.replace(delta, choices=[
                dataclasses.replace(c, text="", token_ids=[], logprobs=[]) for c in delta.choices])


def _tool_message(tools: ToolMode, text: str, finish_reason: str | None):
    """A finished choice's text -> (content, tool calls, finish reason: "tool_calls" when calls
    were made and the output ended of itself)."""
    content, calls = tools.calls(text)
    if calls and finish_reason == "stop":
        finish_reason = "tool_calls"
    return content, calls, finish_reason


def _call_deltas(calls, start: int = 0) -> list[p.ToolCallOut] | None:
    """Whole calls as stream deltas, numbered from ``start``; None for none."""
    return [p.ToolCallOut(index=start + k, id=call.id, type="function",
                          function=p.FunctionCall(name=call.name, arguments=call.arguments))
            for k, call in enumerate(calls)] or None


# Characters that Python's str.splitlines (and so clients such as httpx's aiter_lines) treat as
# line breaks, though SSE breaks lines only at CR and LF: escaped in the JSON (they can only occur
# inside its strings), an event is one line for every client.
LINE_BREAKS = {ord(c): f"\\u{ord(c):04x}" for c in "\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"}


def _sse(payload) -> str:
    body = payload.model_dump_json(exclude_none=True) if hasattr(payload, "model_dump_json") else json.dumps(payload)
    return f"data: {body.translate(LINE_BREAKS)}\n\n"


async def _chunk_stream(deltas, chunk, include_usage: bool):
    """``chunk(prompt index, choice delta)`` per choice delta, a RequestError if the request
    fails, ``chunk(0, None, usage)`` last when asked for."""
    usage = p.UsageInfo()
    async with aclosing(deltas):
        async for i, delta in deltas:
            if delta.error:
                yield RequestError(delta.error_status, delta.error)
                return
            _count(usage, delta)
            for c in delta.choices:
                if (event := chunk(i, c)) is not None:      # None: a choice held back until it ends
                    yield event
        if include_usage:
            yield chunk(0, None, _total(usage))


async def _sse_stream(chunks):
    """Server-sent events of the chunks (an error event for a RequestError), then [DONE]."""
    async with aclosing(chunks):
        async for item in chunks:
            yield _sse(p.error_body(item.status, item.message) if isinstance(item, RequestError) else item)
    yield "data: [DONE]\n\n"


def _count(usage: p.UsageInfo, delta: RequestDelta) -> None:
    usage.completion_tokens += sum(len(c.token_ids) for c in delta.choices)
    if delta.finished:
        usage.prompt_tokens += delta.num_prompt_tokens
        usage.prompt_tokens_details.cached_tokens += delta.num_cached_tokens


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
