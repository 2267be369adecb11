"""Runs the benchmark's requests through vLLM's offline ``LLM`` and writes its tokens and time.

Executed by vLLM's own interpreter (its own venv; it imports nothing of jaxengine):

    VLLM_PYTHON jaxengine/bench/vllm_worker.py REQUESTS.json RESULT.json

REQUESTS.json: {"model", "engine": {vLLM LLM keyword arguments}, "prompts": [[token ids]],
"output_lens": [n]}. Greedy, ``ignore_eos``, each request its own ``max_tokens``; the time is
``generate`` alone (start-up, torch.compile included, is timed apart)."""
import json
import sys
import time


def main() -> None:
    spec = json.loads(open(sys.argv[1]).read())
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    start = time.perf_counter()
    llm = LLM(model=spec["model"], **spec["engine"])
    load_s = time.perf_counter() - start
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in spec["prompts"]]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in spec["output_lens"]]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    import vllm

    result = {"elapsed_s": elapsed, "load_s": load_s, "vllm_version": vllm.__version__,
              "tokens": [list(o.outputs[0].token_ids) for o in outputs]}
    with open(sys.argv[2], "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
