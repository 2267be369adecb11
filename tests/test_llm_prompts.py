"""``LLM.generate`` takes vLLM's prompt forms: a string, a list of token ids, ``{"prompt": ...}``,
``{"prompt_token_ids": [...]}``, one or a list of them; anything else is a ValueError naming
``prompts`` that leaves the engine as it was."""
import pytest

from jaxengine import SamplingParams

GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(chat_checkpoint):
    from jaxengine.llm import LLM

    # the tokens from 16: not a bucket test, and fewer compiles
    return LLM(chat_checkpoint, max_num_batched_tokens=64, token_buckets=[16, 32, 64], request_buckets=[8], max_num_seqs=8, block_size=4,
               max_model_len=64, num_kv_blocks=64, progress=False, compile_mode="eager")


def summary(outputs) -> list[tuple]:
    return [(o.prompt, o.prompt_token_ids, o.outputs[0].text, o.outputs[0].token_ids) for o in outputs]


def test_every_prompt_form_gives_the_same_output(llm):
    ids = llm.tokenizer.encode("hello")
    [(_, _, text, out_ids)] = summary(llm.generate("hello", GREEDY, use_tqdm=False))
    by_text = ("hello", ids, text, out_ids)
    by_ids = (None, ids, text, out_ids)
    forms = [("hello", [by_text]), (ids, [by_ids]), ({"prompt": "hello"}, [by_text]),
             ({"prompt_token_ids": ids}, [by_ids]), (["hello"], [by_text]), ([ids], [by_ids]),
             ([{"prompt": "hello"}, {"prompt_token_ids": ids}, "hello", ids], [by_text, by_ids, by_text, by_ids]),
             (({"prompt": "hello"},), [by_text])]
    for prompts, expected in forms:
        assert summary(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected, prompts


def test_a_prompt_dict_carries_a_cache_salt(llm):
    ids = llm.tokenizer.encode("salted prompt, long enough for full blocks")
    plain = llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)[0]
    again = llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)[0]
    salted = llm.generate({"prompt_token_ids": ids, "cache_salt": "user-1"}, GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens > 0 and salted.num_cached_tokens == 0
    assert salted.outputs[0].token_ids == plain.outputs[0].token_ids


BAD = [
    ({}, "exactly one of 'prompt' and 'prompt_token_ids'"),
    ({"prompt": "a", "prompt_token_ids": [1]}, "exactly one of 'prompt' and 'prompt_token_ids'"),
    ({"text": "hello"}, "unsupported prompt keys ['text']"),
    ({"prompt": 5}, "'prompt' must be a string, got int"),
    ({"prompt": None}, "'prompt' must be a string, got NoneType"),
    ({"prompt_token_ids": []}, "prompt_token_ids must be a non-empty list of token ids"),
    ({"prompt_token_ids": "abc"}, "prompt_token_ids must be a non-empty list of token ids"),
    ({"prompt_token_ids": [1, -2]}, "prompt_token_ids must hold non-negative integers"),
    ({"prompt": "a", "cache_salt": 3}, "cache_salt must be a string, got int"),
    (5, "must be a prompt or a list of prompts, got int"),
    (None, "must be a prompt or a list of prompts, got NoneType"),
    (3.5, "must be a prompt or a list of prompts, got float"),
    ([], "no prompt given"),
    ([[]], "a token-id prompt must be a non-empty list of token ids"),
    ([None], "each prompt must be a string, a list of token ids or a dict"),
    ([7.0, 2], "each prompt must be a string, a list of token ids or a dict"),
    ([1, "a"], "a token-id prompt must hold non-negative integers"),
    ([1, True], "a token-id prompt must hold non-negative integers"),
    ([[1, [2]]], "a token-id prompt must hold non-negative integers"),
    (["ok", {"prompt": ["nested"]}], "'prompt' must be a string, got list"),
    ([{"prompt_token_ids": [[1, 2]]}], "prompt_token_ids must hold non-negative integers"),
]


@pytest.mark.parametrize("prompts,message", BAD, ids=[f"bad-{i}" for i in range(len(BAD))])
def test_a_bad_prompt_is_a_value_error_naming_prompts(llm, prompts, message):
    with pytest.raises(ValueError) as error:
        llm.generate(prompts, GREEDY, use_tqdm=False)
    assert str(error.value).startswith("prompts: ") and message in str(error.value)
    scheduler = llm.engine.scheduler
    assert not scheduler.has_unfinished_requests() and scheduler.kv.usage == 0
    assert llm.generate("hello", GREEDY, use_tqdm=False)[0].outputs[0].token_ids     # and it still serves
