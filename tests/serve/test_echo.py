"""``echo`` and prompt logprobs on /v1/completions, as evaluation harnesses use them (lm-eval's
local-completions scores a choice with ``{"prompt": [ids], "max_tokens": 1, "logprobs": 1,
"echo": true, "temperature": 0}``): the prompt's logprobs equal transformers' on the same
weights; string and token-id prompts, batches and n > 1, ``max_tokens: 0``, streaming; vLLM's
``prompt_logprobs`` extra on both endpoints."""
import httpx
import numpy as np
import pytest
import torch

from tests.serve.conftest import API_KEY

AUTH = {"Authorization": f"Bearer {API_KEY}"}
PROMPT = "The cat sat on the mat."


@pytest.fixture(scope="module")
def oracle(chat_checkpoint):
    """Each prompt position's log-softmax over the vocabulary, from transformers."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(chat_checkpoint, dtype=torch.float32).eval()

    def logprobs(ids: list[int]) -> np.ndarray:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0], -1).numpy()
    return logprobs


def post(server, body: dict, path: str = "/v1/completions") -> dict:
    r = httpx.post(server.url + path, json={"model": "tiny", **body}, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_lm_evals_scoring_request_gets_the_models_own_prompt_logprobs(server, oracle):
    ids = server.host.tokenizer.encode(PROMPT)
    choice = post(server, {"prompt": ids, "max_tokens": 1, "logprobs": 1, "echo": True, "temperature": 0})[
        "choices"][0]
    lp, expected = choice["logprobs"], oracle(ids)
    assert choice["text"].startswith(PROMPT) and len(choice["text"]) > len(PROMPT)
    assert len(lp["tokens"]) == len(ids) + 1 and "".join(lp["tokens"][:len(ids)]) == PROMPT
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    want = [expected[i - 1, ids[i]] for i in range(1, len(ids))]
    np.testing.assert_allclose(lp["token_logprobs"][1:len(ids)], want, atol=1e-4)
    for i in range(1, len(ids)):             # the most likely token is among the top ones, with its logprob
        best = int(expected[i - 1].argmax())
        text = server.host.tokenizer.decode([best])
        assert abs(lp["top_logprobs"][i][text] - expected[i - 1, best]) < 1e-4
    assert lp["text_offset"][:3] == [0, 1, 2]          # byte tokens
    np.testing.assert_allclose(lp["token_logprobs"][-1], expected[-1].max(), atol=1e-4)     # the greedy token


def test_echo_of_string_prompts_batches_and_n_and_scoring_only(server):
    out = post(server, {"prompt": ["ab", PROMPT], "max_tokens": 3, "echo": True, "n": 2, "temperature": 0})
    texts = [c["text"] for c in out["choices"]]
    assert [t[:2] for t in texts[:2]] == ["ab", "ab"] and all(t.startswith(PROMPT) for t in texts[2:])
    assert "logprobs" not in out["choices"][0]
    score = post(server, {"prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 2})
    (choice,) = score["choices"]
    n = len(server.host.tokenizer.encode(PROMPT))
    assert choice["text"] == PROMPT and len(choice["logprobs"]["tokens"]) == n
    assert score["usage"]["completion_tokens"] == 0 and score["usage"]["prompt_tokens"] == n
    assert all(len(top) in (2, 3) for top in choice["logprobs"]["top_logprobs"][1:])   # top 2, and the token itself
    bad = httpx.post(f"{server.url}/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 0},
                     headers=AUTH, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"


def test_a_streamed_echo_joins_to_the_whole_one(server, client):
    params = dict(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0, echo=True, logprobs=1)
    whole = client.completions.create(**params)
    text, tokens, logprobs = "", [], []
    for chunk in client.completions.create(**params, stream=True):
        for c in chunk.choices:
            text += c.text
            if c.logprobs is not None:
                tokens += c.logprobs.tokens
                logprobs += c.logprobs.token_logprobs
    assert text == whole.choices[0].text and tokens == whole.choices[0].logprobs.tokens
    assert logprobs == whole.choices[0].logprobs.token_logprobs


def test_vllms_prompt_logprobs_extra_on_both_endpoints(server, oracle):
    ids = server.host.tokenizer.encode(PROMPT)
    choice = post(server, {"prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": 1})["choices"][0]
    entries = choice["prompt_logprobs"]
    assert not choice["text"].startswith(PROMPT) and entries[0] is None and len(entries) == len(ids)
    expected = oracle(ids)
    for i in range(1, len(ids)):
        assert abs(entries[i][str(ids[i])]["logprob"] - expected[i - 1, ids[i]]) < 1e-4
        assert entries[i][str(ids[i])]["decoded_token"] == server.host.tokenizer.decode([ids[i]])
    messages = [{"role": "user", "content": PROMPT}]
    chat = post(server, {"messages": messages, "max_tokens": 1, "prompt_logprobs": 0}, "/v1/chat/completions")
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"] and chat["prompt_logprobs"][0] is None
    assert all(len(entry) == 1 for entry in chat["prompt_logprobs"][1:])         # 0 top ones: the token itself
    stream = httpx.post(f"{server.url}/v1/chat/completions", json={
        "model": "tiny", "messages": messages, "prompt_logprobs": 0, "stream": True}, headers=AUTH, timeout=60)
    assert stream.status_code == 400 and stream.json()["error"]["param"] == "prompt_logprobs"
