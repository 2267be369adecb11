"""The server through the official ``openai`` client: completions and chat, streamed and not,
n > 1, logprobs, stop, usage; the info endpoints."""
import httpx
import pytest

from jaxengine import SamplingParams
from tests.serve.conftest import API_KEY, ENGINE, MAX_MODEL_LEN

AUTH = {"Authorization": f"Bearer {API_KEY}"}
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def offline(chat_checkpoint):
    from jaxengine.llm import LLM

    return LLM(chat_checkpoint, **ENGINE)


def test_completion_equals_the_offline_engine_and_usage_is_exact(client, offline):
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0)
    expected = offline.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0), use_tqdm=False)[0]
    assert r.choices[0].text == expected.outputs[0].text
    assert r.choices[0].finish_reason == expected.outputs[0].finish_reason
    n_prompt = len(offline.tokenizer.encode(PROMPT))
    n_out = len(expected.outputs[0].token_ids)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (
        n_prompt, n_out, n_prompt + n_out)


def test_token_id_prompts_and_a_batch_of_prompts(client, offline):
    ids = offline.tokenizer.encode(PROMPT)
    by_text = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0)
    by_ids = client.completions.create(model="tiny", prompt=ids, max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    batch = client.completions.create(model="tiny", prompt=["a b c", PROMPT], max_tokens=6, temperature=0, n=2)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert batch.choices[2].text == batch.choices[3].text == by_text.choices[0].text      # greedy: n copies
    assert batch.usage.prompt_tokens == len(offline.tokenizer.encode("a b c")) + len(ids)


@pytest.mark.parametrize("n", [1, 2])
def test_streamed_completion_joins_to_the_full_text_with_exact_usage(client, n):
    params = dict(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0, n=n)
    full = client.completions.create(**params)
    stream = client.completions.create(**params, stream=True, stream_options={"include_usage": True})
    texts, finish, usage = [""] * n, [None] * n, None
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
            finish[c.index] = c.finish_reason or finish[c.index]
        usage = chunk.usage or usage
    assert texts == [c.text for c in full.choices]
    assert finish == ["length"] * n
    assert usage.model_dump(include={"prompt_tokens", "completion_tokens", "total_tokens"}) == \
        full.usage.model_dump(include={"prompt_tokens", "completion_tokens", "total_tokens"})


def test_streamed_chat_joins_to_the_full_message(server, client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    full = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens == 10
    prompt = httpx.post(f"{server.url}/tokenize", json={"messages": messages}).json()["tokens"]
    assert full.usage.prompt_tokens == len(prompt)


def test_sse_wire_format_ends_with_done(server):
    body = dict(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0, stream=True)
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=AUTH) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]" and events[-2] != "data: [DONE]"


def test_n_samples_differ_and_a_seed_reproduces(client):
    params = dict(model="tiny", prompt=PROMPT, max_tokens=12, temperature=1.0, n=3, seed=11)
    a = client.completions.create(**params)
    b = client.completions.create(**params)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert len({c.text for c in a.choices}) == 3
    assert a.usage.completion_tokens == 36


def test_logprobs_of_greedy_tokens_are_the_top_ones(client):
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    for value, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 3 and value == pytest.approx(max(top.values()))
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                          temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 5 and all(len(t.top_logprobs) == 2 for t in content)
    assert all(t.logprob == pytest.approx(t.top_logprobs[0].logprob) for t in content)


def test_stop_string_cuts_the_text(client):
    full = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0).choices[0].text
    k = next(i for i in range(4, len(full) - 2) if "\ufffd" not in full[i:i + 2])
    stop = full[k:k + 2]
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop])
    assert r.choices[0].text == full[:full.index(stop)]
    assert r.choices[0].finish_reason == "stop" and r.choices[0].model_extra["stop_reason"] == stop
    streamed = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0, stop=stop,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == full[:full.index(stop)]


def test_vllm_extras_through_extra_body(client):
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0,
                                  extra_body={"ignore_eos": True, "min_tokens": 8, "top_k": 5, "min_p": 0.01,
                                              "repetition_penalty": 1.2, "priority": 1})
    assert r.usage.completion_tokens == 8 and r.choices[0].finish_reason == "length"


def test_models_tokenize_detokenize_health_version(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"] and models.data[0].model_extra["max_model_len"] == MAX_MODEL_LEN
    tokens = httpx.post(f"{server.url}/tokenize", json={"prompt": "héllo"}).json()
    assert tokens == {"tokens": [71, 127, 102, 75, 75, 78], "count": 6, "max_model_len": MAX_MODEL_LEN}
    assert httpx.post(f"{server.url}/detokenize", json={"tokens": tokens["tokens"]}).json() == {"prompt": "héllo"}
    health = httpx.get(f"{server.url}/health")
    assert health.status_code == 200 and health.json() == {
        "status": "ok", "all_buckets_compiled": True, "step_buckets_compiled": 8, "step_buckets": 8,
        "kernel_check": {"status": "not run", "detail": "on the CPU only when forced: the plain-jnp path serves",
                         "kernels": []}}
    assert httpx.get(f"{server.url}/version").json()["version"] == "0.1.0"
