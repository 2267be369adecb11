"""A live server on a tiny model with a byte tokenizer, in a thread of the test process."""
import contextlib
import socket
import threading
import time
from dataclasses import dataclass

import pytest

API_KEY = "test-key"
MAX_MODEL_LEN = 128
# Not about step buckets: those from 16 tokens, the fewer compiles (a tiny model's step costs
# the same at 1 token as at 16); the bucket tests run the defaults.
ENGINE = dict(max_num_batched_tokens=64, token_buckets=[16, 32, 64], max_num_seqs=32, block_size=4,
              max_model_len=MAX_MODEL_LEN, num_kv_blocks=400, progress=False, async_scheduling=True, compile_mode="eager")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def uvicorn_thread(app, log_level: str = "warning", lifespan: str = "auto"):
    """Serve ``app`` on a free loopback port in a thread; yields the base URL while it runs
    (``lifespan="off"``: a second app over an engine another app has started)."""
    import uvicorn

    port = free_port()
    uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level=log_level, lifespan=lifespan))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not uv.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        uv.should_exit = True
        thread.join(30)


@dataclass
class LiveServer:
    url: str
    host: object            # the EngineHost the server runs on
    engine: object
    metrics: object

    def metric(self, name: str, **labels) -> float:
        labels = {"model_name": "tiny", **labels}
        value = self.metrics.registry.get_sample_value(f"jaxengine:{name}", labels)
        return 0.0 if value is None else value

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Until the engine holds no request and no KV block."""
        deadline = time.monotonic() + timeout
        engine = self.engine.engine
        while time.monotonic() < deadline:
            if not self.engine.num_unfinished and not engine.has_unfinished_requests() and engine.stats().kv_usage == 0:
                time.sleep(0.6)        # one idle turn of the engine loop refreshes the gauges
                return
            time.sleep(0.05)
        raise AssertionError(f"engine not idle: {engine.num_unfinished} requests unfinished")


@pytest.fixture(scope="session")
def server(chat_checkpoint):
    """What ``python -m jaxengine.serve`` builds: an EngineHost from EngineArgs, driven by the
    AsyncEngine (no LLM object in between)."""
    from jaxengine.engine_args import EngineArgs
    from jaxengine.host import EngineHost
    from jaxengine.serve.api_server import build_app
    from jaxengine.serve.async_engine import AsyncEngine
    from jaxengine.serve.metrics import EngineMetrics

    options = {key: value for key, value in ENGINE.items() if key != "progress"}
    host = EngineHost.from_engine_args(EngineArgs(model=str(chat_checkpoint), **options), progress=False)
    assert type(host) is EngineHost
    metrics = EngineMetrics("tiny")
    engine = AsyncEngine(host, observer=metrics)
    app = build_app(engine, served_model_name="tiny", metrics=metrics, api_key=API_KEY)
    with uvicorn_thread(app) as url:
        yield LiveServer(url, host, engine, metrics)


@pytest.fixture(scope="session")
def client(server):
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
