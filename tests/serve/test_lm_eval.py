"""lm-eval, the evaluation harness people point at a vLLM server, against a live test server: its
``local-completions`` model runs a multiple-choice task (loglikelihood), a perplexity task
(loglikelihood_rolling) and a generation task (generate_until), each from a task file written
here, and every number it reports equals the one computed from transformers on the same weights."""
import json

import numpy as np
import pytest
import torch

from tests.serve.conftest import API_KEY

QUESTIONS = [("The cat sat on the", ["mat.", "moon.", "dog"], 0),
             ("Two plus two is", ["four", "five."], 1)]
TEXTS = ["The quick brown fox jumps over the lazy dog.", "A b c d e f g."]
PROMPTS = ["Once upon a time", "Hello"]

MC_TASK = """task: tiny_mc
dataset_path: json
dataset_kwargs: {{data_files: {{test: {data}}}}}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list: [{{metric: acc}}]
"""
ROLLING_TASK = """task: tiny_ppl
dataset_path: json
dataset_kwargs: {{data_files: {{test: {data}}}}}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list: [{{metric: word_perplexity}}]
"""
GEN_TASK = """task: tiny_gen
dataset_path: json
dataset_kwargs: {{data_files: {{test: {data}}}}}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "x"
generation_kwargs: {{until: ["."], max_gen_toks: 6, do_sample: false, temperature: 0}}
metric_list: [{{metric: exact_match}}]
"""


def write_task(folder, template: str, name: str, rows: list[dict]) -> None:
    data = folder / f"{name}.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / f"{name}.yaml").write_text(template.format(data=data))


@pytest.fixture(scope="module")
def samples(server, chat_checkpoint, tmp_path_factory, monkeypatch_module):
    """lm-eval's per-document results for the three tasks, from one run against the server."""
    cache = tmp_path_factory.mktemp("hf_cache")
    for var, value in [("HF_DATASETS_OFFLINE", "1"), ("HF_HUB_OFFLINE", "1"), ("HF_HOME", str(cache)),
                       ("HF_DATASETS_CACHE", str(cache)),
                       ("OPENAI_API_KEY", API_KEY)]:   # local-completions sends it as its bearer token
        monkeypatch_module.setenv(var, value)
    import lm_eval
    from lm_eval.tasks import TaskManager

    tasks = tmp_path_factory.mktemp("lm_eval_tasks")
    write_task(tasks, MC_TASK, "mc", [{"question": q, "choices": c, "answer": a} for q, c, a in QUESTIONS])
    write_task(tasks, ROLLING_TASK, "ppl", [{"text": t} for t in TEXTS])
    write_task(tasks, GEN_TASK, "gen", [{"prompt": p} for p in PROMPTS])
    model_args = (f"model=tiny,base_url={server.url}/v1/completions,tokenizer={chat_checkpoint},"
                  f"tokenizer_backend=huggingface,max_length=64,max_retries=1")
    out = lm_eval.simple_evaluate(model="local-completions", model_args=model_args,
                                  tasks=["tiny_mc", "tiny_ppl", "tiny_gen"],
                                  task_manager=TaskManager(include_path=str(tasks)), log_samples=True,
                                  limit=None, bootstrap_iters=0)
    return {task: sorted(rows, key=lambda r: r["doc_id"]) for task, rows in out["samples"].items()}


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


@pytest.fixture(scope="module")
def model(chat_checkpoint):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(chat_checkpoint, dtype=torch.float32).eval()


def continuation_logprob(model, context: list[int], continuation: list[int]) -> float:
    ids = context + continuation
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0], -1).numpy()
    return float(sum(logp[i - 1, ids[i]] for i in range(len(context), len(ids))))


def test_a_multiple_choice_task_scores_each_choice_as_transformers_does(samples, model, server):
    encode = server.host.tokenizer.encode
    for row, (question, choices, _) in zip(samples["tiny_mc"], QUESTIONS):
        got = [loglik for loglik, _greedy in row["filtered_resps"]]
        want = [continuation_logprob(model, encode(question), encode(" " + c)) for c in choices]
        np.testing.assert_allclose(got, want, atol=1e-4)
        assert row["acc"] == float(int(np.argmax(want)) == row["target"])


def test_a_perplexity_task_scores_each_text_as_transformers_does(samples, model, server):
    prefix = server.host.tokenizer.eos_token_id       # lm-eval's rolling windows start after the EOS token
    for row, text in zip(samples["tiny_ppl"], TEXTS):
        (loglik,) = row["filtered_resps"]
        want = continuation_logprob(model, [prefix], server.host.tokenizer.encode(text))
        np.testing.assert_allclose(loglik, want, atol=1e-4)


def test_a_generation_task_gets_transformers_greedy_text(samples, model, server):
    tok = server.host.tokenizer
    for row, prompt in zip(samples["tiny_gen"], PROMPTS):
        ids = tok.encode(prompt)
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False,
                                 eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
        want = tok.decode(out[0, len(ids):], skip_special_tokens=True).split(".")[0]
        assert row["filtered_resps"] == [want]

