"""A server on an already built ``LLM`` (which may have run offline first), in a thread."""
import contextlib
import json

import httpx

from tests.serve.conftest import uvicorn_thread


@contextlib.contextmanager
def serving(llm, api_key: str | None = None):
    """Yields the server's base URL while it runs on ``llm``'s engine."""
    from jaxengine.serve.api_server import build_app
    from jaxengine.serve.async_engine import AsyncEngine
    from jaxengine.serve.metrics import EngineMetrics

    metrics = EngineMetrics("tiny")
    app = build_app(AsyncEngine(llm, observer=metrics), served_model_name="tiny", metrics=metrics, api_key=api_key)
    with uvicorn_thread(app) as url:
        yield url


def stream_texts(url: str, endpoint: str, body: dict, headers: dict | None = None) -> tuple[dict, dict]:
    """A streamed request -> ({choice index: joined text}, {choice index: finish reason})."""
    texts, finish = {}, {}
    with httpx.stream("POST", f"{url}/v1/{endpoint}", json={**body, "stream": True}, headers=headers,
                      timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for c in json.loads(line[len("data: "):])["choices"]:
                piece = c["text"] if "text" in c else c["delta"].get("content") or ""
                texts[c["index"]] = texts.get(c["index"], "") + piece
                finish[c["index"]] = c.get("finish_reason") or finish.get(c["index"])
    return texts, finish
