"""An API fuzzer over the server's own OpenAPI document (schemathesis): valid and invalid bodies
for every operation get no 5xx, only errors in OpenAI's shape, and afterwards the server still
serves and holds no KV block. Then what the fuzzer found, pinned: values far out of range are
refused at once, and the requests that once failed inside the server are 400s naming the field."""
import time

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from jaxengine.serve.protocol import ERROR_TYPES
from tests.serve.conftest import API_KEY, MAX_MODEL_LEN

AUTH = {"Authorization": f"Bearer {API_KEY}"}
EXAMPLES = 50          # per operation and mode (derandomized: the same cases every run)
BUDGET_S = 45          # all operations together; cases past an operation's share of what is left, after its first, are not sent
TIMEOUT_S = 20         # one request: any longer is a hang, not a slow answer
BODIES = {"POST /tokenize": "TokenizeRequest", "POST /detokenize": "DetokenizeRequest",
          "POST /v1/completions": "CompletionRequest", "POST /v1/chat/completions": "ChatCompletionRequest",
          "POST /v1/responses": "ResponsesRequest"}
MESSAGES = [{"role": "user", "content": "hi"}]


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers=AUTH, timeout=TIMEOUT_S)


def assert_openai_error(status: int, body) -> None:
    error = body["error"]
    assert (error["code"], error["type"]) == (status, ERROR_TYPES[status])
    assert isinstance(error["message"], str) and error["message"]


def test_the_openapi_document_describes_every_request_body(server):
    doc = httpx.get(f"{server.url}/openapi.json", timeout=TIMEOUT_S).json()
    ops = {f"{method.upper()} {path}": op for path, item in doc["paths"].items() for method, op in item.items()}
    with_body = {name: op["requestBody"]["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[1]
                 for name, op in ops.items() if "requestBody" in op}
    assert with_body == BODIES
    for name in BODIES:           # a refused body is a 400 in OpenAI's shape, not FastAPI's 422
        assert sorted(ops[name]["responses"]) == ["200", "default"]
        assert ops[name]["responses"]["default"]["content"]["application/json"]["schema"] == {
            "$ref": "#/components/schemas/ErrorResponse"}
    assert not [name for name in ops if name.startswith("HEAD ")]        # HEAD is served, not documented
    ids = [op["operationId"] for op in ops.values()]
    assert len(ids) == len(set(ids))


def test_fuzzed_requests_get_no_5xx_and_leave_the_server_serving(server):
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    runs = []
    for result in schema.get_all_operations():
        operation = result.ok()
        # Only a body can be made invalid: no route takes parameters.
        modes = list(schemathesis.GenerationMode) if operation.body else [schemathesis.GenerationMode.POSITIVE]
        runs += [(operation, mode) for mode in modes]
    end, failures, sent = time.monotonic() + BUDGET_S, [], {}
    for done, (operation, mode) in enumerate(runs):      # time an operation leaves is passed on
        name = f"{operation.method.upper()} {operation.path} ({mode.value})"
        deadline, sent[name] = time.monotonic() + (end - time.monotonic()) / (len(runs) - done), 0

        @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True, print_blob=False,
                  suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy(generation_mode=mode))
        def send(case):
            if sent[name] and time.monotonic() > deadline:     # the first case always goes: a slow
                return                                         # machine may take the share to make it
            sent[name] += 1
            response = case.call(headers=AUTH, timeout=TIMEOUT_S)
            status = response.status_code
            if status >= 500:
                failures.append(f"{name}: {status} {response.text[:300]}\n  body: {case.body!r}"[:1200])
            elif status >= 400:
                assert_openai_error(status, response.json())

        send()
    assert not failures, "\n".join(failures)
    assert all(sent.values()), sent
    server.wait_idle()
    kv = server.engine.engine.scheduler.kv
    assert kv.num_free_blocks == kv.num_usable_blocks          # no KV block held
    health = httpx.get(f"{server.url}/health", timeout=TIMEOUT_S)
    assert health.status_code == 200 and health.json()["status"] == "ok"


# Sizes that would make a request slow or huge if taken: each refused before anything runs.
HUGE = [("/v1/completions", {"n": 10**6}, "n"),
        ("/v1/completions", {"n": 10**6, "best_of": 10**6}, "n"),
        ("/v1/completions", {"max_tokens": 10**9}, "max_tokens"),
        ("/v1/completions", {"max_tokens": None, "min_tokens": 10**9}, "min_tokens"),
        ("/v1/completions", {"logprobs": 10**9}, "logprobs"),
        ("/v1/completions", {"prompt_logprobs": 10**9}, "prompt_logprobs"),
        ("/v1/completions", {"top_k": 10**20}, "top_k"),
        ("/v1/completions", {"use_beam_search": True, "n": 10**6}, "beam_width"),
        ("/v1/completions", {"use_beam_search": True, "n": 2, "length_penalty": 1e308}, "length_penalty"),
        ("/v1/chat/completions", {"n": 10**6}, "n"),
        ("/v1/chat/completions", {"max_completion_tokens": 10**9}, "max_tokens"),
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 10**9}, "top_logprobs"),
        ("/v1/responses", {"max_output_tokens": 10**9}, "max_tokens")]


def base_body(path: str) -> dict:
    return {"/v1/completions": {"prompt": "hi"}, "/v1/chat/completions": {"messages": MESSAGES},
            "/v1/responses": {"input": "hi"}}[path]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path,change,param", HUGE, ids=[f"{p}-{i}" for i, (_, _, p) in enumerate(HUGE)])
def test_huge_values_are_refused_at_once(server, path, change, param, stream):
    start = time.monotonic()
    r = post(server, path, {**base_body(path), **change, "stream": stream})
    assert r.status_code == 400 and time.monotonic() - start < 2.0
    assert_openai_error(400, r.json())
    assert r.json()["error"]["message"].startswith(f"{param}: ")


# Each of these once failed inside the server (a 500); now a 400 naming what to fix.
FOUND = [("/v1/completions", {"prompt": "hi", "max_tokens": None, "min_tokens": 200}, "min_tokens",
          "min_tokens: prompt (2 tokens) + min_tokens (200) = 202 exceeds the maximum context length of 128 tokens"),
         ("/v1/completions", {"prompt": "hi", "use_beam_search": True, "n": 2, "max_tokens": 3, "length_penalty": 11},
          "length_penalty", "length_penalty: must be in [-10, 10], got 11.0"),
         ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2, "chat_template_kwargs": {"messages": []}},
          "chat_template_kwargs",
          "chat_template_kwargs: ['messages'] are arguments of the template call itself, not template variables"),
         ("/v1/responses", {"input": "hi", "max_output_tokens": 2,
                            "chat_template_kwargs": {"tokenize": False, "add_generation_prompt": False}},
          "chat_template_kwargs", "chat_template_kwargs: ['add_generation_prompt', 'tokenize'] are arguments of "
                                  "the template call itself, not template variables"),
         ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "guided_regex": "a{1000000}"}, None,
          "guided_regex: too complex to follow (lexer error: too many expressions constructed)"),
         ("/v1/responses", {"input": [{"type": "message", "role": "user", "content": [{"type": "input_text",
                                                                                       "text": 5}]}]},
          "input", "input[0].content[0].text: must be a string, got int"),
         ("/v1/responses", {"input": [{"type": "message", "role": ["user"], "content": "hi"}]},
          "input", "input[0].role: must be a string, got list"),
         ("/v1/responses", {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": {}}]},
          "input", "input[0].arguments: must be a string, got dict")]


@pytest.mark.parametrize("path,body,param,message", FOUND, ids=[f"{p}-{i}" for i, (_, _, p, _) in enumerate(FOUND)])
def test_what_the_fuzzer_found_is_a_400_naming_the_field(server, path, body, param, message):
    r = post(server, path, body)
    assert r.status_code == 400, r.text
    assert r.json() == {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": 400}}
    server.wait_idle()
    assert httpx.get(f"{server.url}/health", timeout=TIMEOUT_S).status_code == 200


# Bodies that are not text: raw bytes (a lone surrogate decodes, then no tokenizer or response takes it).
RAW = [("/v1/completions", b'{"prompt": "\xed\xa0\x80"}', "prompt",
        "prompt: not valid Unicode (a lone surrogate such as \\ud800)"),
       ("/v1/responses", b'{"input": "hi", "instructions": "\\udc00"}', "instructions",
        "instructions: not valid Unicode (a lone surrogate such as \\ud800)"),
       ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "tools": [{"\\ud800": 1}]}', None,
        "tools[0].\\ud800: not valid Unicode (a lone surrogate such as \\ud800)"),
       ("/v1/completions", b'{"prompt": "\xff"}', None, "There was an error parsing the body")]


@pytest.mark.parametrize("path,content,param,message", RAW, ids=[f"{p}-{i}" for i, (_, _, p, _) in enumerate(RAW)])
def test_a_body_that_is_not_text_is_a_400(server, path, content, param, message):
    r = httpx.post(f"{server.url}{path}", content=content, headers={**AUTH, "Content-Type": "application/json"},
                   timeout=TIMEOUT_S)
    assert r.status_code == 400, r.text
    assert r.json() == {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": 400}}


@pytest.mark.parametrize("field", ["max_completion_tokens", "max_output_tokens"])
def test_a_zero_token_budget_is_refused_not_unbounded(server, field):
    path = "/v1/chat/completions" if field == "max_completion_tokens" else "/v1/responses"
    r = post(server, path, {**base_body(path), field: 0})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "max_tokens: must be None or an integer >= 1, got 0"


def test_max_completion_tokens_wins_over_max_tokens(server):
    r = post(server, "/v1/chat/completions", {"messages": MESSAGES, "max_completion_tokens": 3, "max_tokens": 50,
                                              "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_beam_search_without_max_tokens_runs_to_the_context_length(server):
    r = post(server, "/v1/completions", {"prompt": "hi", "use_beam_search": True, "n": 2, "max_tokens": None,
                                         "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert [c["finish_reason"] for c in r.json()["choices"]] == ["length", "length"]
    assert r.json()["usage"]["completion_tokens"] == 2 * (MAX_MODEL_LEN - 2)


# ---- the chat template call (what reached the template unchecked)
@pytest.fixture(scope="module")
def tokenizer_folder(tmp_path_factory):
    from tests.conftest import save_byte_tokenizer

    folder = tmp_path_factory.mktemp("byte-tokenizer")
    save_byte_tokenizer(folder)
    return folder


def tokenizer_with(folder, template: str):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = template
    return tokenizer


@pytest.mark.parametrize("template,messages,error", [
    ("{{ raise_exception('roles must alternate') }}", MESSAGES, "TemplateError: roles must alternate"),
    ("{% for m in messages %}{% for call in m.tool_calls %}{{ call }}{% endfor %}{% endfor %}",
     [{"role": "assistant", "content": "", "tool_calls": 5}], "TypeError: 'int' object is not iterable")])
def test_a_conversation_the_template_refuses_is_a_value_error(tokenizer_folder, template, messages, error):
    from jaxengine.tokenizer import apply_chat_template

    with pytest.raises(ValueError) as raised:
        apply_chat_template(tokenizer_with(tokenizer_folder, template), messages)
    assert str(raised.value) == f"messages: the chat template cannot render this conversation ({error})"


def test_a_broken_model_template_is_not_blamed_on_the_request(tokenizer_folder):
    from jinja2 import TemplateSyntaxError

    from jaxengine.tokenizer import apply_chat_template

    with pytest.raises(TemplateSyntaxError):
        apply_chat_template(tokenizer_with(tokenizer_folder, "{% for m in messages %}"), MESSAGES)
