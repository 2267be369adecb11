"""Bad input gets its status and OpenAI's error JSON naming the field; the server keeps serving.
Also: the API key, a full queue (503), an internal failure in one request, a client that leaves."""
import asyncio
import json

import httpx
import pytest

from tests.serve.conftest import API_KEY, MAX_MODEL_LEN

AUTH = {"Authorization": f"Bearer {API_KEY}"}
GOOD = {"model": "tiny", "prompt": "hello", "max_tokens": 4, "temperature": 0}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}

BAD = [  # (endpoint, body changes, param named in the error)
    ("completions", {"temperature": -0.5}, "temperature"),
    ("completions", {"top_p": 0}, "top_p"),
    ("completions", {"top_p": 1.5}, "top_p"),
    ("completions", {"n": 0}, "n"),
    ("completions", {"max_tokens": 0}, "max_tokens"),
    ("completions", {"min_tokens": 9, "max_tokens": 4}, "min_tokens"),
    ("completions", {"logprobs": 21}, "logprobs"),
    ("chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("completions", {"prompt": [5, 300, 7]}, "prompt_token_ids"),
    ("completions", {"prompt": ""}, "prompt"),
    ("completions", {"prompt": []}, "prompt"),
    ("chat/completions", {"messages": []}, "messages"),
    ("completions", {"temperature": "hot"}, "temperature"),
    ("completions", {"n": "two"}, "n"),
    ("completions", {"prompt": None}, "prompt"),
    ("completions", {"stop_token_ids": [999]}, "stop_token_ids"),
    ("completions", {"logit_bias": {"x": 1.0}}, "logit_bias"),
    ("completions", {"repetition_penalty": 0}, "repetition_penalty"),
    ("completions", {"n": 33}, "n"),                                 # more than max_num_seqs: would never run
]


def post(server, endpoint: str, body, headers=AUTH, **kw) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/{endpoint}", json=body, headers=headers, timeout=60, **kw)


@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
def test_a_model_not_served_is_a_404_naming_the_field(server, endpoint):
    r = post(server, endpoint, {**(CHAT if endpoint.startswith("chat") else GOOD), "model": "gpt-4"})
    assert r.status_code == 404
    error = r.json()["error"]
    assert error == {"message": "model: the model `gpt-4` does not exist; this server serves `tiny`",
                     "type": "not_found_error", "param": "model", "code": 404}


@pytest.mark.parametrize("endpoint,change,param", BAD, ids=[f"{e}-{p}-{i}" for i, (e, _, p) in enumerate(BAD)])
def test_invalid_parameter_is_400_naming_the_field(server, endpoint, change, param):
    base = CHAT if endpoint.startswith("chat") else GOOD
    r = post(server, endpoint, {**base, **change})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["code"] == 400 and error["type"] == "invalid_request_error"
    assert param in error["message"]
    assert post(server, "completions", GOOD).status_code == 200      # and the server keeps serving


def test_malformed_json_is_400(server):
    r = httpx.post(f"{server.url}/v1/completions", content=b'{"model": "tiny", "prompt": ', headers={
        **AUTH, "content-type": "application/json"})
    assert r.status_code == 400 and "malformed JSON" in r.json()["error"]["message"]


def test_prompt_plus_max_tokens_over_the_context_is_400_with_the_limit(server):
    r = post(server, "completions", {**GOOD, "max_tokens": MAX_MODEL_LEN})
    assert r.status_code == 400
    assert f"maximum context length of {MAX_MODEL_LEN} tokens" in r.json()["error"]["message"]


def test_api_key_guards_v1_only(server):
    assert post(server, "completions", GOOD, headers={}).status_code == 401
    wrong = post(server, "completions", GOOD, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == 401
    assert httpx.get(f"{server.url}/v1/models").status_code == 401
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/metrics").status_code == 200


def test_full_waiting_queue_is_503_with_retry_after(server):
    bound, server.engine.max_waiting_requests = server.engine.max_waiting_requests, 0
    try:
        r = post(server, "completions", GOOD)
    finally:
        server.engine.max_waiting_requests = bound
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert post(server, "completions", GOOD).status_code == 200


def test_internal_failure_ends_only_that_request(server, monkeypatch):
    from jaxengine.serve.async_engine import AsyncEngine

    poison = server.host.tokenizer.encode("poison")
    original = AsyncEngine._delta

    def failing(self, tracked, now):
        if tracked.request.prompt_token_ids == poison:
            raise RuntimeError("injected failure")
        return original(self, tracked, now)

    monkeypatch.setattr(AsyncEngine, "_delta", failing)

    async def both():
        async with httpx.AsyncClient(headers=AUTH, timeout=60) as c:
            return await asyncio.gather(
                c.post(f"{server.url}/v1/completions", json={**GOOD, "prompt": "poison"}),
                c.post(f"{server.url}/v1/completions", json={**GOOD, "max_tokens": 20, "ignore_eos": True}))

    bad, good = asyncio.run(both())
    assert bad.status_code == 500 and "injected failure" in bad.json()["error"]["message"]
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 20
    streamed = post(server, "completions", {**GOOD, "prompt": "poison", "stream": True})
    events = [line for line in streamed.text.splitlines() if line]
    assert "injected failure" in json.loads(events[-2][len("data: "):])["error"]["message"]
    assert events[-1] == "data: [DONE]"
    server.wait_idle()


def test_a_client_that_leaves_mid_stream_frees_its_request(server):
    aborted = server.metric("request_success_total", finished_reason="abort")
    body = {**GOOD, "max_tokens": 100, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=AUTH, timeout=60) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: "))
    server.wait_idle()
    assert server.metric("request_success_total", finished_reason="abort") == aborted + 1
    assert server.metric("kv_cache_usage_perc") == 0 and server.metric("num_requests_running") == 0


def test_api_key_comes_from_the_environment_too(monkeypatch):
    from jaxengine.serve.__main__ import parse_args

    monkeypatch.setenv("JAXENGINE_API_KEY", "from-env")
    assert parse_args([]).api_key == "from-env"
    assert parse_args(["--api-key", "flag"]).api_key == "flag"
    monkeypatch.delenv("JAXENGINE_API_KEY")
    args = parse_args([])
    assert (args.api_key, args.host, args.port, args.model) == (None, "127.0.0.1", 8000, None)


def test_clients_that_give_up_on_whole_responses_free_their_requests(server, monkeypatch):
    import time

    from jaxengine.serve.async_engine import AsyncEngine

    original = AsyncEngine._emit_all
    monkeypatch.setattr(AsyncEngine, "_emit_all", lambda self: (time.sleep(0.005), original(self)))   # a slow model
    aborted = server.metric("request_success_total", finished_reason="abort")
    body = {**GOOD, "prompt": "slow", "max_tokens": 120, "ignore_eos": True}

    async def give_up():
        async with httpx.AsyncClient(headers=AUTH, timeout=0.1) as c:
            return await asyncio.gather(*(c.post(f"{server.url}/v1/completions", json=body) for _ in range(8)),
                                        return_exceptions=True)

    results = asyncio.run(give_up())
    assert all(isinstance(r, httpx.TimeoutException) for r in results), results
    server.wait_idle()
    assert server.metric("request_success_total", finished_reason="abort") >= aborted + 1
    assert server.metric("kv_cache_usage_perc") == 0


def test_max_tokens_up_to_the_context_limit_is_served_exactly_and_one_more_is_400(server):
    prompt = list(range(65, 85))                                    # 20 tokens
    body = {**GOOD, "prompt": prompt, "ignore_eos": True}
    at_limit = post(server, "completions", {**body, "max_tokens": MAX_MODEL_LEN - 20})
    assert at_limit.status_code == 200, at_limit.text
    assert at_limit.json()["usage"] == {"prompt_tokens": 20, "completion_tokens": MAX_MODEL_LEN - 20,
                                        "total_tokens": MAX_MODEL_LEN,
                                        "prompt_tokens_details": {"cached_tokens": 0}}
    assert at_limit.json()["choices"][0]["finish_reason"] == "length"
    over = post(server, "completions", {**body, "max_tokens": MAX_MODEL_LEN - 19})
    assert over.status_code == 400
    error = over.json()["error"]
    assert error["param"] == "max_tokens" and error["code"] == 400
    assert f"exceeds the maximum context length of {MAX_MODEL_LEN} tokens" in error["message"]
    server.wait_idle()


def test_a_request_that_outgrows_the_whole_kv_pool_is_200_with_length_and_its_text(server):
    """n samples of an 8-token prompt alone on the pool: they share the prompt's two blocks and
    each fills blocks of its own until the pool has fewer free blocks than samples."""
    server.wait_idle()
    kv, n, prompt = server.engine.engine.scheduler.kv, 32, list(range(65, 73))
    own_blocks = (kv.num_usable_blocks - len(prompt) // kv.block_size) // n
    num_tokens = (len(prompt) // kv.block_size + own_blocks) * kv.block_size - len(prompt) + 1
    assert len(prompt) + num_tokens < MAX_MODEL_LEN           # the pool, not max_tokens, ends it
    lengths = server.metric("request_success_total", finished_reason="length")
    body = {**GOOD, "prompt": prompt, "n": n, "max_tokens": MAX_MODEL_LEN - len(prompt), "ignore_eos": True}
    r = post(server, "completions", body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["usage"]["completion_tokens"] == n * num_tokens
    assert {c["finish_reason"] for c in out["choices"]} == {"length"}
    alone = post(server, "completions", {**body, "n": 1, "max_tokens": num_tokens}).json()["choices"][0]
    assert [c["text"] for c in out["choices"]] == [alone["text"]] * n            # greedy: the same text
    server.wait_idle()
    assert server.metric("request_success_total", finished_reason="length") == lengths + 2
