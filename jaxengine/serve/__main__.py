"""python -m jaxengine.serve: the OpenAI-compatible server (default: the embedded SmolLM2 on
127.0.0.1:8000). SIGTERM or Ctrl-C stops accepting, lets in-flight requests finish for
``--shutdown-grace`` seconds, aborts the rest and exits 0.

Across several processes (``--distributed-coordinator``, ``--num-processes``, ``--process-id``),
process 0 serves and the others run its steps on their devices (no HTTP server there)."""
from __future__ import annotations

import argparse
import contextlib
import gc
import os
import signal
import sys
import threading

import uvicorn

from jaxengine.default_model import NAME as DEFAULT_MODEL_NAME
from jaxengine.engine_args import EngineArgs, HelpFormatter
from jaxengine.serve.reasoning import REASONING_PARSERS
from jaxengine.serve.tool_parsers import FORMATS as TOOL_CALL_FORMATS
from jaxengine.logs import add_log_level_arg, configure_logging


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m jaxengine.serve", description=__doc__.split("\n\n")[0],
                                     formatter_class=HelpFormatter)
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on")
    g.add_argument("--port", type=int, default=8000, help="port to listen on")
    g.add_argument("--api-key", default=os.environ.get("JAXENGINE_API_KEY"),
                   help="require 'Authorization: Bearer <key>' on /v1/* (or set JAXENGINE_API_KEY; "
                        "default: none required)")
    g.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                   help="split a reasoning model's <think>...</think> from its chat answer into "
                        "message.reasoning_content (and reasoning), streamed as their own deltas "
                        "(default: none, the whole reply is content)")
    g.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_CALL_FORMATS),
                   help="the format of the tool calls a model writes with tool_choice 'auto', turned into "
                        "tool_calls and streamed as each call completes (default: the format the chat "
                        "template writes, else hermes)")
    g.add_argument("--served-model-name", default=None,
                   help="the model name clients send (default: the model folder or file name)")
    g.add_argument("--max-waiting-requests", type=int, default=1024,
                   help="bound of the waiting queue; beyond it requests get 503 with Retry-After")
    g.add_argument("--allow-runtime-lora-updating", action=argparse.BooleanOptionalAction,
                   default=os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").lower() in ("1", "true"),
                   help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter, which load and unload LoRA "
                        "adapters while the server runs (with --enable-lora; or set "
                        "VLLM_ALLOW_RUNTIME_LORA_UPDATING=true; default: off)")
    g.add_argument("--shutdown-grace", type=float, default=10.0,
                   help="seconds in-flight requests may take to finish after SIGTERM")
    add_log_level_arg(g, default="info")
    EngineArgs.add_cli_args(parser)
    return parser.parse_args(argv)


class _Server(uvicorn.Server):
    """uvicorn re-raises a caught SIGTERM after its graceful shutdown (exit status 143); here a
    signal only asks for the shutdown, so a clean stop exits 0. A second signal forces it."""

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        handled = (signal.SIGINT, signal.SIGTERM)
        previous = {s: signal.signal(s, self._on_signal) for s in handled}
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    def _on_signal(self, _signum, _frame) -> None:
        self.force_exit = self.should_exit
        self.should_exit = True


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configure_logging(args.log_level)
    engine_args = EngineArgs.from_cli_args(args)
    from jaxengine.multihost_worker import join_job

    if (status := join_job(engine_args, "python -m jaxengine.serve")) is not None:
        return status
    from jaxengine.host import EngineHost
    from jaxengine.serve.api_server import build_app
    from jaxengine.serve.async_engine import AsyncEngine
    from jaxengine.serve.metrics import EngineMetrics

    print("jaxengine: loading the model and compiling (this takes a moment)...", flush=True)
    host = EngineHost.from_engine_args(engine_args)
    name = args.served_model_name or default_served_name(args.model, host.model_path)
    metrics = EngineMetrics(name)
    engine = AsyncEngine(host, max_waiting_requests=args.max_waiting_requests, observer=metrics)
    app = build_app(engine, served_model_name=name, metrics=metrics, api_key=args.api_key,
                    reasoning_parser=args.reasoning_parser, tool_call_parser=args.tool_call_parser,
                    allow_runtime_lora_updating=args.allow_runtime_lora_updating)
    server = _Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                    timeout_graceful_shutdown=args.shutdown_grace))
    threading.Thread(target=_announce, args=(server, args, name), daemon=True).start()
    # What start-up built lives as long as the server: out of the collector's sight, a full
    # collection no longer walks it (a pause of a tenth of a second on the default model,
    # which stalls every stream).
    gc.collect()
    gc.freeze()
    server.run()
    return 0


def default_served_name(model: str | None, path) -> str:
    if model is None:
        return DEFAULT_MODEL_NAME
    return path.stem if path.suffix == ".gguf" else path.name


def _announce(server: uvicorn.Server, args: argparse.Namespace, name: str) -> None:
    """Print the URL once the socket is listening."""
    import time

    while not server.started and not server.should_exit:
        time.sleep(0.05)
    if server.started:
        print(f"jaxengine: serving {name} at http://{args.host}:{args.port}/v1 (Ctrl-C to stop)", flush=True)


if __name__ == "__main__":
    sys.exit(main())
