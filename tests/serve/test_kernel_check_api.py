"""A kernel that fails the start-up check: the engine serves on the plain-jnp path, and /health
(still 200) and /metrics say which kernel failed."""
import httpx

from jaxengine import host as host_module
from jaxengine.kernels.paged_attention import paged_attention_tiled
from jaxengine.runner import kernel_check
from tests.serve.conftest import API_KEY, ENGINE, uvicorn_thread


def wrong_scale(q, k_cache, v_cache, md, *, scale, **kw):
    """A kernel with a bug: its softmax scale is off by half."""
    return paged_attention_tiled(q, k_cache, v_cache, md, scale=scale * 1.5, **kw)


def complete(url: str) -> str:
    body = {"model": "tiny", "prompt": "Hello there", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    reply = httpx.post(f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
    assert reply.status_code == 200
    return reply.json()["choices"][0]["text"]


def test_a_failed_kernel_check_shows_in_health_and_metrics_and_the_fallback_serves(chat_checkpoint, server,
                                                                                   monkeypatch):
    from jaxengine.llm import LLM
    from jaxengine.serve.api_server import build_app
    from jaxengine.serve.async_engine import AsyncEngine
    from jaxengine.serve.metrics import EngineMetrics

    monkeypatch.setattr(kernel_check, "_on_accelerator", lambda: True)
    monkeypatch.setattr(host_module, "select_attention", lambda backend="auto": wrong_scale)
    llm = LLM(chat_checkpoint, **ENGINE)
    assert llm.model.layers.self_attn.attention_fn.inner is paged_attention_tiled
    metrics = EngineMetrics("tiny")
    app = build_app(AsyncEngine(llm, observer=metrics), served_model_name="tiny", metrics=metrics, api_key=API_KEY)
    with uvicorn_thread(app) as url:
        health = httpx.get(f"{url}/health")
        assert health.status_code == 200
        check = health.json()["kernel_check"]
        assert check["status"] == "failed" and check["detail"] == (
            "attention (4 query and 2 KV heads of 16, float32 queries, float32 cache, pages of 4)")
        (kernel,) = check["kernels"]            # the KV write is the XLA scatter: nothing to check
        assert {k: v for k, v in kernel.items() if k != "problem"} == {
            "kernel": "attention", "name": "wrong_scale", "ok": False, "serving": "paged_attention_tiled"}
        assert kernel["problem"].startswith("disagrees with the plain-jnp path: max |difference| ")
        labels = {"model_name": "tiny", "kernel": "attention", "name": "wrong_scale"}
        assert metrics.registry.get_sample_value("jaxengine:kernel_check_ok", labels) == 0.0
        assert ('jaxengine:kernel_check_ok{kernel="attention",model_name="tiny",name="wrong_scale"} 0.0'
                in httpx.get(f"{url}/metrics").text)
        # The same greedy text as the server whose engine never had the bug.
        assert complete(url) == complete(server.url)
