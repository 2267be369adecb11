"""The OpenAI-compatible HTTP app (FastAPI): routes, API key, errors in OpenAI's JSON shape."""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

import jaxengine
from jaxengine.serve import protocol as p
from jaxengine.serve.async_engine import AsyncEngine, EngineStoppedError, EngineUnhealthyError, OverloadedError, \
    QueueFullError
from jaxengine.serve.dashboard import autopilot_targets, engine_settings, page_html
from jaxengine.serve.metrics import EngineMetrics
from jaxengine.serve.openai_serving import OpenAIServing, RequestError, param_of
from jaxengine.serve.responses import ResponsesRequest, ResponsesServing

logger = logging.getLogger(__name__)
RETRY_AFTER_S = 1
# Paths behind the API key. The dashboard's page holds no data and stays open (as /metrics does);
# its data route also names the model path and every engine setting, so it takes the key.
GUARDED_PATHS = ("/v1", "/dashboard/state")
# What the OpenAPI document says a request route answers besides 200: every error in OpenAI's
# shape (a refused body is a 400 here, not FastAPI's 422).
ERRORS = {"default": {"model": p.ErrorResponse, "description": "An error, in OpenAI's JSON shape"}}


def get_route(app: FastAPI, path: str, **kw):
    """A GET route that answers HEAD too (load generators probe with HEAD before they GET). The
    HEAD route stays out of the OpenAPI document: one route with both methods gives both one
    operation id."""
    def register(endpoint):
        app.head(path, include_in_schema=False, **kw)(endpoint)
        return app.get(path, **kw)(endpoint)
    return register


def error_response(status: int, message: str, param: str | None = None, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(p.error_body(status, message, param), status_code=status, headers=headers)


def build_app(engine: AsyncEngine, *, served_model_name: str, metrics: EngineMetrics,
              api_key: str | None = None, reasoning_parser: str | None = None,
              tool_call_parser: str | None = None, allow_runtime_lora_updating: bool = False) -> FastAPI:
    """The app; starting it starts the engine thread, stopping it stops the engine.
    ``allow_runtime_lora_updating``: serve the LoRA load and unload endpoints."""
    serving = OpenAIServing(engine, served_model_name, reasoning_parser, tool_call_parser)
    logger.info("tool calls (tool_choice auto) parsed as %s%s", serving.tool_call_parser,
                "" if tool_call_parser else " (from the chat template)")
    responses = ResponsesServing(serving)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        engine.start()
        yield
        engine.shutdown()

    app = FastAPI(title="jaxengine", version=jaxengine.__version__, lifespan=lifespan)
    app.state.engine, app.state.metrics = engine, metrics
    capacity = engine.host.kv_cache_capacity()
    metrics.kv_tokens.set(capacity["tokens"])
    metrics.kv_tokens_per_gib.set(capacity["tokens_per_gib"])
    metrics.set_kernel_check(engine.host.kernel_check)
    _add_auth(app, api_key)
    _add_error_handlers(app)
    _add_info_routes(app, engine, serving, metrics)
    _add_dashboard_routes(app, engine, serving, metrics)
    if allow_runtime_lora_updating:
        _add_lora_routes(app, engine, serving)

    @app.post("/v1/completions", responses=ERRORS)
    async def completions(body: p.CompletionRequest, raw: Request):
        return await _respond(raw, *await serving.completion(body))

    @app.post("/v1/chat/completions", responses=ERRORS)
    async def chat_completions(body: p.ChatCompletionRequest, raw: Request):
        return await _respond(raw, *await serving.chat(body))

    @app.post("/v1/responses", responses=ERRORS)
    async def create_response(body: ResponsesRequest, raw: Request):
        return await _respond(raw, *await responses.create(body))

    return app


async def _respond(raw: Request, result, is_stream: bool):
    if is_stream:
        # A client that goes away cancels this stream; closing it aborts the request.
        return StreamingResponse(result, media_type="text/event-stream")
    task = asyncio.ensure_future(anext(result))
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=0.25)
            if not task.done() and await raw.is_disconnected():
                task.cancel()
                return Response(status_code=499)
        body = task.result()
        return JSONResponse(body if isinstance(body, dict) else body.model_dump(exclude_none=True))
    finally:
        if not task.done():
            task.cancel()
            await asyncio.wait({task})       # let the cancellation unwind before closing
        await result.aclose()


def _add_auth(app: FastAPI, api_key: str | None) -> None:
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)


class ApiKeyMiddleware:
    """``Authorization: Bearer <key>`` on /v1/* and the dashboard's data. Plain ASGI on purpose: Starlette's
    BaseHTTPMiddleware wraps ``receive``, and then a handler no longer sees its client leave."""

    def __init__(self, app, api_key: str) -> None:
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(GUARDED_PATHS):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                response = error_response(401, "missing or wrong API key (send 'Authorization: Bearer <key>')")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def invalid_request(_request: Request, error: RequestValidationError):
        first = error.errors()[0]
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        if first.get("type") == "json_invalid":
            return error_response(400, f"malformed JSON: {first.get('msg')}", None)
        field = ".".join(loc) or None
        if first.get("type") == "value_error" and field is None:      # a body's own check names its field
            message = str(first["ctx"]["error"])
            return error_response(400, message, param_of(ValueError(message)))
        return error_response(400, f"{field or 'body'}: {first.get('msg')}", loc[0] if loc else None)

    @app.exception_handler(HTTPException)
    async def http_error(_request: Request, error: HTTPException):
        """FastAPI's and Starlette's own errors (a body that does not parse, an unknown route, a
        wrong method) in OpenAI's shape too."""
        return error_response(error.status_code, str(error.detail), headers=error.headers)

    @app.exception_handler(ValueError)
    async def bad_value(_request: Request, error: ValueError):
        return error_response(400, str(error), param_of(error))

    @app.exception_handler(RequestError)
    async def request_error(_request: Request, error: RequestError):
        return error_response(error.status, error.message, error.param)

    @app.exception_handler(QueueFullError)
    async def queue_full(_request: Request, error: QueueFullError):
        return error_response(503, str(error), headers={"Retry-After": str(RETRY_AFTER_S)})

    @app.exception_handler(OverloadedError)
    async def overloaded(_request: Request, error: OverloadedError):
        return error_response(503, str(error), headers={"Retry-After": str(error.retry_after_s)})

    @app.exception_handler(EngineStoppedError)
    async def stopping(_request: Request, error: EngineStoppedError):
        return error_response(503, str(error), headers={"Retry-After": str(RETRY_AFTER_S)})

    @app.exception_handler(EngineUnhealthyError)
    async def unhealthy(_request: Request, error: EngineUnhealthyError):
        return error_response(503, f"the server cannot serve requests: {error}")

    @app.exception_handler(Exception)
    async def internal(_request: Request, error: Exception):
        logger.exception("request failed")
        return error_response(500, f"internal error: {error}")


def _add_info_routes(app: FastAPI, engine: AsyncEngine, serving: OpenAIServing, metrics: EngineMetrics) -> None:
    host = engine.host

    @get_route(app, "/health")
    async def health():
        """200 while the engine serves, saying how many step buckets are compiled (it serves
        while the larger ones compile) and what the start-up kernel check found (a kernel that
        failed it was replaced by the plain-jnp path, which serves); 503 with the reason once it
        cannot (restart it)."""
        if (problem := engine.health_problem) is not None:
            return error_response(503, f"the server cannot serve requests: {problem}")
        compiled, total = host.compile_progress()
        return {"status": "ok", "all_buckets_compiled": compiled == total, "step_buckets_compiled": compiled,
                "step_buckets": total, "kernel_check": host.kernel_check.as_dict()}

    @get_route(app, "/version")
    async def version():
        return {"version": jaxengine.__version__}

    @get_route(app, "/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @get_route(app, "/v1/models")
    async def models():
        """The base model and every LoRA adapter served (``parent``: the base)."""
        max_len = host.config.scheduler.max_model_len
        cards = [p.ModelCard(id=serving.model_name, root=str(host.model_path), max_model_len=max_len)]
        cards += [p.ModelCard(id=name, root=lora.lora_path, parent=serving.model_name, max_model_len=max_len)
                  for name, lora in list(serving.adapters.items())]
        return p.ModelList(data=cards).model_dump()

    @app.post("/tokenize", responses=ERRORS)
    async def tokenize(body: p.TokenizeRequest):
        serving.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise RequestError(400, "prompt: give either prompt or messages", "prompt")
        if serving.tokenizer is None:
            raise RequestError(400, "prompt: the server runs without a tokenizer", "prompt")
        if body.messages is not None:
            ids = await engine.encode_chat([m.as_template_input() for m in body.messages], body.add_generation_prompt)
        else:
            ids = await engine.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return {"tokens": ids, "count": len(ids), "max_model_len": host.config.scheduler.max_model_len}

    @app.post("/detokenize", responses=ERRORS)
    async def detokenize(body: p.DetokenizeRequest):
        serving.check_model(body.model)
        vocab = host.model_config.vocab_size
        if bad := [t for t in body.tokens if not 0 <= t < vocab]:
            raise RequestError(400, f"tokens: {bad[:5]} outside the vocabulary of {vocab} tokens", "tokens")
        if serving.tokenizer is None:
            raise RequestError(400, "tokens: the server runs without a tokenizer", "tokens")
        return {"prompt": await engine.decode(body.tokens)}


def _add_lora_routes(app: FastAPI, engine: AsyncEngine, serving: OpenAIServing) -> None:
    """vLLM's runtime adapter endpoints: load and unload an adapter by name while the server runs
    (on the engine thread, between steps: running requests go on; one still running with an
    unloaded adapter finishes with it)."""
    host = engine.host

    @app.post("/v1/load_lora_adapter", responses=ERRORS)
    async def load_lora_adapter(body: p.LoadLoRAAdapterRequest):
        if host.config.lora is None:
            raise RequestError(400, "lora_name: this server serves no LoRA adapters (start it with --enable-lora)",
                               "lora_name")
        if body.lora_name == serving.model_name or body.lora_name in serving.adapters:
            raise RequestError(400, f"lora_name: `{body.lora_name}` is already served", "lora_name")
        try:
            await engine.run_on_engine_thread(lambda: host.load_lora(body.lora_name, body.lora_path))
        except ValueError as error:
            raise RequestError(400, str(error), "lora_path") from None
        return Response(f"Success: LoRA adapter '{body.lora_name}' added successfully.", media_type="text/plain")

    @app.post("/v1/unload_lora_adapter", responses=ERRORS)
    async def unload_lora_adapter(body: p.UnloadLoRAAdapterRequest):
        if not await engine.run_on_engine_thread(lambda: host.remove_lora(body.lora_name)):
            raise RequestError(404, f"lora_name: no adapter named `{body.lora_name}` is loaded", "lora_name")
        return Response(f"Success: LoRA adapter '{body.lora_name}' removed successfully.", media_type="text/plain")


def _add_dashboard_routes(app: FastAPI, engine: AsyncEngine, serving: OpenAIServing, metrics: EngineMetrics) -> None:
    page, settings = page_html(), engine_settings(engine.host)

    @get_route(app, "/dashboard", response_class=HTMLResponse)
    async def dashboard():
        """The live dashboard: a static page that polls /dashboard/state once a second."""
        return HTMLResponse(page)

    @get_route(app, "/dashboard/state")
    async def dashboard_state():
        targets = autopilot_targets(engine.engine)
        state = {"model": serving.model_name, "health": engine.health_problem,
                 "settings": {**settings, "autopilot": targets}, **metrics.dashboard.snapshot(targets)}
        return JSONResponse(state, headers={"Cache-Control": "no-store"})
