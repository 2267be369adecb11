"""Request validation on both endpoints: ``stream_options`` only with ``stream: true``, a
``seed`` that fits a signed 64-bit integer, and a ``best_of`` of at least 1 and at least ``n``
(above ``n`` is not served: every sample is returned); each a 400 naming the field."""
import httpx
import openai
import pytest

from tests.serve.conftest import API_KEY

AUTH = {"Authorization": f"Bearer {API_KEY}"}
BODIES = {"completions": {"model": "tiny", "prompt": "hello", "max_tokens": 3, "temperature": 0},
          "chat/completions": {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}}
SEED_MAX = (1 << 63) - 1

BAD = [({"stream_options": {"include_usage": True}}, "stream_options"),
       ({"stream_options": {"include_usage": False}, "stream": False}, "stream_options"),
       ({"stream_options": {}}, "stream_options"),
       ({"seed": SEED_MAX + 1}, "seed"),
       ({"seed": -SEED_MAX - 2}, "seed"),
       ({"seed": 1 << 80, "stream": True}, "seed"),
       ({"best_of": -1}, "best_of"),
       ({"best_of": 0}, "best_of"),
       ({"best_of": -3, "stream": True}, "best_of"),
       ({"n": 2, "best_of": 1}, "best_of"),
       ({"best_of": 2}, "best_of")]


def post(server, endpoint: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/{endpoint}", json=body, headers=AUTH, timeout=60)


@pytest.mark.parametrize("endpoint", sorted(BODIES))
@pytest.mark.parametrize("change,param", BAD, ids=[f"{p}-{i}" for i, (_, p) in enumerate(BAD)])
def test_invalid_stream_options_seed_or_best_of_is_400_naming_it(server, endpoint, change, param):
    r = post(server, endpoint, {**BODIES[endpoint], **change})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["param"], error["code"], error["type"]) == (param, 400, "invalid_request_error")
    assert error["message"].startswith(f"{param}: ")
    server.wait_idle()                 # nothing was queued


@pytest.mark.parametrize("endpoint", sorted(BODIES))
@pytest.mark.parametrize("change", [{"seed": SEED_MAX}, {"seed": -SEED_MAX - 1}, {"seed": 0},
                                    {"stream_options": None}, {"stream_options": None, "stream": False},
                                    {"best_of": None}, {"best_of": 1}, {"n": 2, "best_of": 2}])
def test_valid_seeds_best_of_and_no_stream_options_are_served(server, endpoint, change):
    r = post(server, endpoint, {**BODIES[endpoint], **change})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1


@pytest.mark.parametrize("endpoint", sorted(BODIES))
def test_stream_options_with_a_stream_are_served(server, endpoint):
    body = {**BODIES[endpoint], "stream": True, "stream_options": {"include_usage": True}, "seed": SEED_MAX}
    with httpx.stream("POST", f"{server.url}/v1/{endpoint}", json=body, headers=AUTH, timeout=60) as r:
        assert r.status_code == 200
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]" and '"usage"' in events[-2]


def test_the_openai_client_sees_the_400s(client):
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model="tiny", prompt="hello", max_tokens=3, stream_options={"include_usage": True})
    assert error.value.body["param"] == "stream_options"
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                       seed=1 << 64)
    assert error.value.body["param"] == "seed" and "signed 64-bit" in error.value.body["message"]
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model="tiny", prompt="hello", max_tokens=3, best_of=-1)
    assert error.value.body["param"] == "best_of" and ">= 1" in error.value.body["message"]
