"""What third-party clients read: HEAD on every GET route (load generators probe with it),
``content: null`` beside ``tool_calls`` (OpenAI's message shape), and the prefix cache's hit in
``usage.prompt_tokens_details.cached_tokens`` on both endpoints, whole and streamed."""
import httpx
import pytest

from tests.serve.conftest import API_KEY, ENGINE

AUTH = {"Authorization": f"Bearer {API_KEY}"}
GET_ROUTES = ["/health", "/version", "/metrics", "/v1/models", "/dashboard", "/dashboard/state"]


@pytest.mark.parametrize("path", GET_ROUTES)
def test_head_answers_wherever_get_does(server, path):
    get = httpx.get(server.url + path, headers=AUTH, timeout=30)
    head = httpx.head(server.url + path, headers=AUTH, timeout=30)
    assert get.status_code == head.status_code == 200
    assert head.content == b"" and head.headers["content-type"] == get.headers["content-type"]


def test_a_tool_call_message_has_content_null(server):
    tool = {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}
    body = {"model": "tiny", "messages": [{"role": "user", "content": "time?"}], "max_tokens": 40, "temperature": 0,
            "tools": [tool], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}
    message = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=AUTH, timeout=60).json()[
        "choices"][0]["message"]
    assert "content" in message and message["content"] is None and message["tool_calls"][0]["function"]["name"] == \
        "get_time"
    body.pop("tools"), body.pop("tool_choice")
    plain = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=AUTH, timeout=60).json()
    assert isinstance(plain["choices"][0]["message"]["content"], str)


def test_cached_tokens_count_the_prefix_cache_hit_on_both_endpoints(client, server):
    """A prompt of 41 tokens, new to the cache: 0 cached; the same again: its 10 full blocks of 4
    before the last token, 40 tokens; whole and streamed usage alike; chat too (whose template's
    first block other chats may have cached already)."""
    block = ENGINE["block_size"]
    prompt = "cached-prefix check: " + "abcdefghij" * 2        # 41 byte tokens
    n_prompt = len(server.host.tokenizer.encode(prompt))
    first = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens == n_prompt and first.usage.prompt_tokens_details.cached_tokens == 0
    hit = (n_prompt - 1) // block * block
    again = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens == hit
    stream = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    usage = [c.usage for c in stream if c.usage is not None][-1]
    assert usage.prompt_tokens_details.cached_tokens == hit and usage.prompt_tokens == n_prompt
    messages = [{"role": "user", "content": "a chat prompt long enough to fill some blocks of the cache"}]
    chat = [client.chat.completions.create(model="tiny", messages=messages, max_tokens=2, temperature=0)
            for _ in range(2)]
    assert chat[0].usage.prompt_tokens_details.cached_tokens < chat[1].usage.prompt_tokens_details.cached_tokens
    assert chat[1].usage.prompt_tokens_details.cached_tokens == (chat[1].usage.prompt_tokens - 1) // block * block
