"""`python -m jaxengine.serve --model <a mixture of experts>` end to end through the openai client:
transformers' greedy tokens, and the experts' load on /metrics and the dashboard."""
import os
import re
import subprocess
import sys
import threading
import time

import httpx
import openai
import torch

from tests.serve.conftest import free_port


def test_the_server_serves_a_mixture_of_experts_with_transformers_tokens(moe_chat_checkpoint):
    from transformers import AutoTokenizer

    folder, hf = moe_chat_checkpoint
    port = free_port()
    cmd = [sys.executable, "-m", "jaxengine.serve", "--model", str(folder), "--port", str(port),
           "--served-model-name", "tiny-moe", "--max-model-len", "128", "--num-kv-blocks", "64", "--block-size", "4",
           "--max-num-seqs", "4", "--max-num-batched-tokens", "32", "--token-buckets", "32", "--request-buckets", "4",
           "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "JAX_PLATFORMS": "cpu"})
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    try:
        deadline = time.monotonic() + 240
        while not any("serving tiny-moe at" in line for line in lines):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)
            time.sleep(0.1)
        url = f"http://127.0.0.1:{port}"
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
        text = client.completions.create(model="tiny-moe", prompt="hello experts", max_tokens=8, temperature=0,
                                         extra_body={"ignore_eos": True}).choices[0].text
        tokenizer = AutoTokenizer.from_pretrained(folder)
        ids = tokenizer("hello experts")["input_ids"]
        hf.generation_config.eos_token_id = None
        with torch.no_grad():
            expected = hf.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, pad_token_id=0)[0, len(ids):]
        assert text == tokenizer.decode(expected)
        chat = client.chat.completions.create(model="tiny-moe", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=4, temperature=0)
        assert chat.choices[0].finish_reason in ("length", "stop")

        metrics = httpx.get(f"{url}/metrics").text
        routed = [float(v) for v in re.findall(r'jaxengine:expert_tokens_total\{expert="\d+",model_name="tiny-moe"\} '
                                               r'(\S+)', metrics)]
        assert len(routed) == 8 and sum(routed) > 0
        state = httpx.get(f"{url}/dashboard/state").json()
        assert len(state["expert_tokens"]) == 8 and sum(state["expert_tokens"]) == sum(routed)
    finally:
        proc.terminate()
        proc.wait(30)
