"""LoRA adapters over the API: ``model`` picks the adapter (tokens as transformers + peft give),
``/v1/models`` lists them with their parent, an unknown name is a 404 in OpenAI's shape, and the
runtime load / unload endpoints (behind their flag) change adapters while another request streams,
its tokens unchanged; a bad adapter is a 400 naming the file and field, and the server serves on."""
import json
import threading

import httpx
import pytest

from tests.e2e.test_lora_vs_transformers import make_adapter, peft_greedy
from tests.serve.conftest import ENGINE, uvicorn_thread

PROMPT = [72, 101, 108, 108, 111, 32, 119]
MAX_TOKENS = 8      # the oracle's length (peft_greedy)


@pytest.fixture(scope="module")
def adapters(chat_checkpoint, tmp_path_factory):
    """{name: (folder, the oracle's tokens for PROMPT)} of two adapters of the chat checkpoint."""
    out = {}
    for seed, (name, targets) in enumerate((("fr", ["q_proj", "v_proj"]), ("de", ["o_proj", "down_proj"]))):
        folder = tmp_path_factory.mktemp(f"serve-lora-{name}")
        make_adapter(chat_checkpoint, folder, seed, 4, 8, targets, False)
        out[name] = (folder, peft_greedy(chat_checkpoint, folder, [PROMPT])[0])
    out[None] = (None, peft_greedy(chat_checkpoint, None, [PROMPT])[0])
    assert len({tuple(tokens) for _, tokens in out.values()}) == 3
    return out


@pytest.fixture(scope="module")
def lora_server(chat_checkpoint, adapters):
    """(URL with the runtime endpoints, URL of a second app over the same engine without them, llm)."""
    from jaxengine.llm import LLM
    from jaxengine.serve.api_server import build_app
    from jaxengine.serve.async_engine import AsyncEngine
    from jaxengine.serve.metrics import EngineMetrics

    llm = LLM(chat_checkpoint, **{**ENGINE, "token_buckets": [64], "request_buckets": [32]}, enable_lora=True,
              max_loras=2, max_lora_rank=8, lora_modules=[f"fr={adapters['fr'][0]}"])
    engine = AsyncEngine(llm)
    app = build_app(engine, served_model_name="tiny", metrics=EngineMetrics("tiny-lora"),
                    allow_runtime_lora_updating=True)
    plain = build_app(engine, served_model_name="tiny", metrics=EngineMetrics("tiny-lora-plain"))
    with uvicorn_thread(app) as url, uvicorn_thread(plain, lifespan="off") as plain_url:
        yield url, plain_url, llm


def complete(url: str, model: str, max_tokens: int = MAX_TOKENS, **extra) -> dict:
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **extra}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()


def text(response: dict) -> str:
    return response["choices"][0]["text"]


def test_model_selects_the_adapter_and_models_lists_them(lora_server, adapters):
    url, _, llm = lora_server
    cards = httpx.get(f"{url}/v1/models").json()["data"]
    assert [(c["id"], c["parent"]) for c in cards] == [("tiny", None), ("fr", "tiny")]
    assert cards[1]["root"] == str(adapters["fr"][0])
    for model, name in (("fr", "fr"), ("tiny", None)):
        out = complete(url, model)
        assert out["model"] == model and text(out) == llm.tokenizer.decode(adapters[name][1])


def test_an_unknown_model_is_a_404_in_openais_shape(lora_server):
    import openai

    url, _, _ = lora_server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.NotFoundError) as caught:
        client.completions.create(model="es", prompt="hi", max_tokens=2)
    error = caught.value.body
    assert error["param"] == "model" and "`es` does not exist" in error["message"] and "`fr`" in error["message"]


def test_runtime_load_and_unload_leave_a_streaming_request_unchanged(lora_server, adapters, tmp_path):
    url, plain_url, llm = lora_server
    alone = text(complete(url, "tiny", max_tokens=110))
    streamed: list[str] = []

    def stream() -> None:
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 110, "temperature": 0, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    streamed.append(json.loads(line[6:])["choices"][0]["text"])

    reader = threading.Thread(target=stream)
    reader.start()
    load = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "de", "lora_path": str(adapters["de"][0])})
    assert load.status_code == 200 and "added" in load.text
    assert reader.is_alive()                         # loaded while the other request streams
    assert text(complete(url, "de")) == llm.tokenizer.decode(adapters["de"][1])
    assert httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "de"}).status_code == 200
    reader.join(60)
    assert "".join(streamed) == alone
    assert complete(url, "de")["error"]["code"] == 404
    missing = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "de"})
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "lora_name"
    (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4,
                                                             "target_modules": ["q_proj"]}))
    bad = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(tmp_path)})
    assert bad.status_code == 400 and "adapter_model.safetensors: missing" in bad.json()["error"]["message"]
    assert sorted(llm.loras) == ["fr"]
    assert text(complete(url, "fr")) == llm.tokenizer.decode(adapters["fr"][1])      # serving on
    assert httpx.post(f"{plain_url}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "y"}).status_code == 404
