"""The OpenAI protocol as pydantic models (requests, responses, stream chunks, errors), with
vLLM's extra sampling fields, which the ``openai`` client sends through ``extra_body``."""
from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator

from jaxengine.sampling_params import STRUCTURED_KINDS, BeamSearchParams, SamplingParams, StructuredOutputsParams


SEED_MIN, SEED_MAX = -(1 << 63), (1 << 63) - 1     # a signed 64-bit integer, as in vLLM
MAX_BEAM_TOKENS = 1 << 30      # no max_tokens: up to the context length (OpenAIServing fits it to the prompt)
# Sampling fields beam search does not use, with their neutral values.
BEAM_UNSUPPORTED = {"top_p": None, "top_k": None, "min_p": None, "seed": None, "presence_penalty": 0.0,
                    "frequency_penalty": 0.0, "repetition_penalty": None, "logit_bias": None,
                    "best_of": None}


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def lone_surrogate(value, where: str = "") -> str | None:
    """Where in a request's JSON a string holds a lone surrogate (``"\\ud800"`` is valid JSON but
    no text: it cannot be encoded, so neither a tokenizer nor a response could take it); None if
    nowhere."""
    if isinstance(value, str):
        try:
            value.encode()
        except UnicodeEncodeError:
            return where or "body"
    elif isinstance(value, dict):
        for key, item in value.items():
            inner = f"{where}.{key}" if where else str(key)
            if (found := lone_surrogate(key, inner) or lone_surrogate(item, inner)) is not None:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            if (found := lone_surrogate(item, f"{where}[{i}]")) is not None:
                return found
    return None


class RequestBody(BaseModel):
    """A request's JSON body: its strings are text (checked once, before any field)."""

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data):
        if (where := lone_surrogate(data)) is not None:        # a key on the path may hold one: escaped
            where = where.encode("utf-8", "backslashreplace").decode()
            raise ValueError(f"{where}: not valid Unicode (a lone surrogate such as \\ud800)")
        return data


class StreamOptions(BaseModel):
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    name: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


# vLLM's guided_* extras -> StructuredOutputsParams fields
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


class _SamplingRequest(RequestBody):
    """Fields both endpoints share. Unknown fields are ignored, as OpenAI's API does."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: int = 1
    best_of: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: int = 0
    slo: dict[str, Any] | None = None     # the request's own latency targets for the autopilot (ms)
    use_beam_search: bool = False          # n is then the beam width
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False
    # Structured output: OpenAI's response_format, or vLLM's structured_outputs / guided_* extras.
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    prompt_logprobs: int | None = None       # vLLM's: the prompt tokens' logprobs and the top ones
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The request's one output constraint, or None; ValueError naming the field."""
        sources = []
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None or fmt.json_schema.json_schema is None:
                raise ValueError("response_format: json_schema needs a schema")
            sources.append(StructuredOutputsParams(json=fmt.json_schema.json_schema, field="response_format"))
        elif fmt is not None and fmt.type == "json_object":
            sources.append(StructuredOutputsParams(json_object=True, field="response_format"))
        if self.structured_outputs is not None:
            accepted = [*STRUCTURED_KINDS, "thinking"]      # thinking: where the constraint starts
            unknown = sorted(set(self.structured_outputs) - set(accepted))
            if unknown:
                raise ValueError(f"structured_outputs: unknown keys {unknown} (accepted: {accepted})")
            sources.append(StructuredOutputsParams(**self.structured_outputs))
        for name, kind in GUIDED_FIELDS.items():
            if getattr(self, name) is not None:
                sources.append(StructuredOutputsParams(**{kind: getattr(self, name)}, field=name))
        if len(sources) > 1:
            raise ValueError(f"{sources[1].field}: only one output constraint per request (also given: "
                             f"{sources[0].field})")
        return sources[0] if sources else None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None = None,
                        defaults: dict | None = None) -> SamplingParams | BeamSearchParams:
        """-> SamplingParams (BeamSearchParams with use_beam_search); a bad value raises
        ValueError naming the field. ``defaults``: the checkpoint's generation defaults
        (``generation_config``), for the fields the request leaves unset."""
        self._check_stream_options_and_seed()
        if self.use_beam_search:
            if prompt_logprobs is not None:
                raise ValueError("prompt_logprobs: not supported with use_beam_search")
            return self.beam_search_params(max_tokens, logprobs)
        constraint = self.structured_outputs_params()
        bias = None
        if self.logit_bias:
            try:
                bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except ValueError:
                raise ValueError("logit_bias: keys must be token ids (integers as strings)") from None
        d = defaults or {}

        def unset(name: str, value, engine_default):
            return (d.get(name, engine_default) if value is None else value)
        if max_tokens is None:
            max_tokens = d.get("max_tokens")
        return SamplingParams(
            n=self.n, best_of=self.best_of, temperature=unset("temperature", self.temperature, 1.0),
            top_p=unset("top_p", self.top_p, 1.0), top_k=unset("top_k", self.top_k, 0) or 0,
            min_p=unset("min_p", self.min_p, 0.0),
            seed=self.seed, presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=unset("repetition_penalty", self.repetition_penalty, 1.0),
            logit_bias=bias, stop=self.stop or [], stop_token_ids=self.stop_token_ids or [],
            include_stop_str_in_output=self.include_stop_str_in_output, ignore_eos=self.ignore_eos,
            max_tokens=max_tokens, min_tokens=self.min_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens, structured_outputs=constraint)


    def beam_search_params(self, max_tokens: int | None, logprobs: int | None) -> BeamSearchParams:
        """use_beam_search: n beams; the sampling knobs that beam search has no use for are refused."""
        for name, neutral in BEAM_UNSUPPORTED.items():
            if getattr(self, name) != neutral:
                raise ValueError(f"{name}: not supported with use_beam_search")
        if logprobs is not None:
            raise ValueError("logprobs: not supported with use_beam_search")
        return BeamSearchParams(
            beam_width=self.n, max_tokens=MAX_BEAM_TOKENS if max_tokens is None else max_tokens,
            ignore_eos=self.ignore_eos, temperature=self.temperature or 0.0, length_penalty=self.length_penalty,
            early_stopping=self.early_stopping, stop=self.stop or [], stop_token_ids=self.stop_token_ids or [],
            include_stop_str_in_output=self.include_stop_str_in_output, skip_special_tokens=self.skip_special_tokens,
            structured_outputs=self.structured_outputs_params(), min_tokens=self.min_tokens)

    def _check_stream_options_and_seed(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed with stream: true")
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise ValueError(f"seed: must be a signed 64-bit integer (in [{SEED_MIN}, {SEED_MAX}]), got {self.seed}")


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[TextPart] | None = None

    def as_template_input(self) -> dict:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        return {**(self.model_extra or {}), "role": self.role, "content": content or ""}


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None     # vLLM's: extra variables for the chat template


# ---- responses ----
class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0          # prompt tokens the prefix cache served


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)    # None: an echoed prompt's first token
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's ``prompt_logprobs`` entry: one candidate token at one prompt position."""

    logprob: float
    decoded_token: str


PromptLogprobs = list[dict[str, PromptLogprob] | None]      # per prompt position, by token id


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(BaseModel):
    id: str
    object: str = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] = Field(default_factory=list)


class FunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallOut(BaseModel):
    id: str | None = None
    type: Literal["function"] | None = None
    index: int | None = None          # in stream deltas
    function: FunctionCall


class ChatMessageOut(BaseModel):
    role: str = "assistant"
    content: str | None = ""
    tool_calls: list[ToolCallOut] | None = None
    reasoning_content: str | None = None      # with --reasoning-parser: the thinking (vLLM's name)
    reasoning: str | None = None              # the same, vLLM's newer name

    @model_serializer(mode="wrap")
    def _content_always(self, handler):
        """``content`` stays in the JSON when it is null (beside ``tool_calls``), as in OpenAI's
        shape, though responses are written without their other null fields."""
        data = handler(self)
        data.setdefault("content", None)
        return data


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: str = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = None


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None
    tool_calls: list[ToolCallOut] | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: str = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: str = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "jaxengine"
    root: str
    parent: str | None = None       # a LoRA adapter's base model
    max_model_len: int


class LoadLoRAAdapterRequest(RequestBody):
    """``POST /v1/load_lora_adapter`` (vLLM's)."""

    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(RequestBody):
    """``POST /v1/unload_lora_adapter`` (vLLM's)."""

    lora_name: str
    lora_int_id: int | None = None


class ModelList(BaseModel):
    object: str = "list"
    data: list[ModelCard]


class TokenizeRequest(RequestBody):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(RequestBody):
    model: str | None = None
    tokens: list[int]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorInfo


ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               503: "service_unavailable", 500: "internal_server_error"}


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    return ErrorResponse(error=ErrorInfo(message=message, type=ERROR_TYPES.get(status, "error"), param=param,
                                         code=status)).model_dump()
