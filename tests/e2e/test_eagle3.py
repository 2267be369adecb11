"""Speculative decoding with an EAGLE-3 head on a tiny model. transformers has no EAGLE-3 head, so
the oracle is a torch head written here from the published architecture: every proposal the
engine makes equals the torch head's greedy chain over the same tokens, with the model's hidden
states from transformers; outputs are the model's own (greedy, seeded, n > 1, preemption); the
head's steps compile at start-up; bad heads are refused by name."""
import json

import numpy as np
import pytest
import torch

from jaxengine import LLM, SamplingParams
from tests.helpers import every_draft_goes

OPTIONS = dict(max_num_batched_tokens=32, max_num_seqs=8, block_size=4, max_model_len=128, swap_space=0.002,
               num_kv_blocks=50, progress=False, compile_mode="eager", token_buckets=[8, 32], request_buckets=[8])
PROMPTS = ["abcabcabcab", "the cat saw the cat and the", "xyz", "0101010101",
           "a prompt longer than one step's budget of thirty-two tokens, chunked"]
AUX_LAYERS = [1, 0, 1]          # of the tiny model's two layers (repeats allowed)
DRAFT_VOCAB = 100


class TorchEagle3Head(torch.nn.Module):
    """The published EAGLE-3 head (names as its checkpoints store them), without a KV cache: the
    whole sequence each call."""

    def __init__(self, hf, target_hidden: int, norm_before_residual: bool, own_embedding: bool):
        from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

        super().__init__()
        d, n, kv, hd = hf.hidden_size, hf.num_attention_heads, hf.num_key_value_heads, hf.hidden_size // hf.num_attention_heads
        self.n, self.kv, self.hd, self.theta = n, kv, hd, rope_theta(hf)
        self.norm_before_residual = norm_before_residual
        if own_embedding:
            self.embed_tokens = torch.nn.Embedding(hf.vocab_size, d)
        self.fc = torch.nn.Linear(3 * target_hidden, d, bias=False)
        self.midlayer = torch.nn.Module()
        m = self.midlayer
        m.input_layernorm, m.hidden_norm = LlamaRMSNorm(d, hf.rms_norm_eps), LlamaRMSNorm(d, hf.rms_norm_eps)
        m.post_attention_layernorm = LlamaRMSNorm(d, hf.rms_norm_eps)
        m.self_attn = torch.nn.Module()
        m.self_attn.q_proj = torch.nn.Linear(2 * d, n * hd, bias=False)
        m.self_attn.k_proj = torch.nn.Linear(2 * d, kv * hd, bias=False)
        m.self_attn.v_proj = torch.nn.Linear(2 * d, kv * hd, bias=False)
        m.self_attn.o_proj = torch.nn.Linear(n * hd, d, bias=False)
        m.mlp = LlamaMLP(hf)
        self.norm = LlamaRMSNorm(d, hf.rms_norm_eps)
        self.lm_head = torch.nn.Linear(d, DRAFT_VOCAB, bias=False)

    def rope(self, x):                       # [T, heads, hd], rotate_half layout
        t = x.shape[0]
        inv = 1.0 / (self.theta ** (torch.arange(0, self.hd, 2, dtype=torch.float32) / self.hd))
        f = torch.arange(t, dtype=torch.float32)[:, None] * inv[None]
        cos, sin = torch.cat([f.cos(), f.cos()], -1)[:, None], torch.cat([f.sin(), f.sin()], -1)[:, None]
        x1, x2 = x.chunk(2, -1)
        return x * cos + torch.cat([-x2, x1], -1) * sin

    def forward(self, ids, hidden, embedding):
        m, a = self.midlayer, self.midlayer.self_attn
        e = m.input_layernorm(torch.nn.functional.embedding(ids, embedding))
        normed = m.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([e, normed], -1)
        t = x.shape[0]
        q = self.rope(a.q_proj(x).view(t, self.n, self.hd))
        k = self.rope(a.k_proj(x).view(t, self.kv, self.hd)).repeat_interleave(self.n // self.kv, 1)
        v = a.v_proj(x).view(t, self.kv, self.hd).repeat_interleave(self.n // self.kv, 1)
        scores = torch.einsum("qnh,knh->nqk", q, k) / self.hd ** 0.5
        scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
        o = torch.einsum("nqk,knh->qnh", scores.softmax(-1), v).reshape(t, -1)
        residual = residual + a.o_proj(o)
        prenorm = residual + m.mlp(m.post_attention_layernorm(residual))
        return self.norm(prenorm), prenorm


def rope_theta(hf) -> float:
    return float((getattr(hf, "rope_parameters", None) or {}).get("rope_theta") or getattr(hf, "rope_theta", 10000.0))


def make_head(folder, target_folder, *, norm_before_residual: bool, own_embedding: bool, seed: int):
    """An EAGLE-3 head checkpoint for the tiny chat model (random weights, a reduced vocabulary)."""
    from safetensors.torch import save_file
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(target_folder)
    hf.num_hidden_layers = 1
    torch.manual_seed(seed)
    head = TorchEagle3Head(hf, hf.hidden_size, norm_before_residual, own_embedding).eval()
    with torch.no_grad():
        for name, p in head.named_parameters():
            p.copy_(torch.randn_like(p) * (0.2 if "norm" in name else 0.3) + (1.0 if "norm" in name else 0.0))
    ids = np.sort(np.random.default_rng(seed).choice(hf.vocab_size, DRAFT_VOCAB, replace=False))
    head.d2t = torch.as_tensor(ids - np.arange(DRAFT_VOCAB), dtype=torch.int64)
    tensors = {k: v.contiguous() for k, v in head.state_dict().items()}
    tensors["d2t"] = head.d2t
    tensors["t2d"] = torch.zeros(hf.vocab_size, dtype=torch.bool).index_fill_(0, torch.as_tensor(ids), True)
    save_file(tensors, folder / "model.safetensors")
    config = {k: getattr(hf, k) for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                          "num_key_value_heads", "rms_norm_eps", "vocab_size",
                                          "max_position_embeddings", "hidden_act")}
    config.update(rope_theta=rope_theta(hf), architectures=["LlamaForCausalLMEagle3"], model_type="llama", num_hidden_layers=1,
                  draft_vocab_size=DRAFT_VOCAB, target_hidden_size=hf.hidden_size,
                  norm_before_residual=norm_before_residual, eagle_config={
                      "eagle_aux_hidden_state_layer_ids": AUX_LAYERS, "use_aux_hidden_state": True})
    (folder / "config.json").write_text(json.dumps(config))
    return head


def reference_drafts(target, head, tokens: list[int], k: int) -> list[int]:
    """The head's greedy chain after ``tokens`` (the last one not yet computed by the model): its
    hidden states at every position but the last, each with the token after it, then k steps."""
    with torch.no_grad():
        states = target(torch.tensor([tokens[:-1]]), output_hidden_states=True).hidden_states
        hidden = head.fc(torch.cat([states[i][0] for i in AUX_LAYERS], -1))
        embedding = head.embed_tokens.weight if hasattr(head, "embed_tokens") else target.model.embed_tokens.weight
        ids, drafts = list(tokens[1:]), []
        for _ in range(k):
            normed, prenorm = head(torch.tensor(ids), hidden, embedding)
            best = int(head.lm_head(normed[-1]).argmax())
            drafts.append(best + int(head.d2t[best]))
            ids.append(drafts[-1])
            hidden = torch.cat([hidden, prenorm[-1:]])
        return drafts


def speculating(target, head_folder, k=3):
    llm = LLM(target, speculative_config={"method": "eagle3", "model": str(head_folder), "num_speculative_tokens": k},
              **OPTIONS)
    every_draft_goes(llm)
    llm.engine.traces = []
    return llm


def recording(llm) -> list:
    """Every proposal the engine makes: (the sequence's tokens then, the draft)."""
    runner = llm.engine.runner
    drafter, made = runner.drafter, []
    propose = drafter.propose

    def recorded(rows):
        drafts = propose(rows)
        batch = runner.batch
        made.extend((batch.tokens[batch.slot_of[seq_id], :position + 1].tolist(), draft)
                    for seq_id, position, draft in zip(rows.seq_ids, rows.positions.tolist(), drafts))
        return drafts
    drafter.propose = recorded
    return made


@pytest.fixture(scope="module")
def heads(chat_checkpoint, tmp_path_factory):
    """(head folder, torch head) x (own embedding, norm after residual; the model's, norm before)."""
    made = []
    for i, (before, own) in enumerate([(False, True), (True, False)]):
        folder = tmp_path_factory.mktemp(f"eagle3-{i}")
        made.append((folder, make_head(folder, chat_checkpoint, norm_before_residual=before, own_embedding=own,
                                       seed=i)))
    return made


@pytest.fixture(scope="module")
def engines(chat_checkpoint, heads):
    return LLM(chat_checkpoint, **OPTIONS), speculating(chat_checkpoint, heads[0][0])


def outputs(llm, prompts, params):
    return [[(c.token_ids, c.finish_reason) for c in r.outputs] for r in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("variant", [0, 1], ids=["own-embedding", "model-embedding-norm-before-residual"])
def test_every_proposal_is_the_torch_heads_greedy_chain(chat_checkpoint, heads, engines, variant):
    """Chunked prefill, verification with rejections and acceptances, drafting on: each proposal
    equals the reference over the sequence's tokens at that moment."""
    from transformers import AutoModelForCausalLM

    folder, head = heads[variant]
    llm = engines[1] if variant == 0 else speculating(chat_checkpoint, folder)
    made = recording(llm)
    target = AutoModelForCausalLM.from_pretrained(chat_checkpoint, dtype=torch.float32).eval()
    outputs(llm, PROMPTS, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    assert len(made) > 10
    for tokens, draft in made:
        assert draft == reference_drafts(target, head, tokens, len(draft)), tokens


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
                                    SamplingParams(temperature=1.0, seed=4, max_tokens=30, ignore_eos=True),
                                    SamplingParams(temperature=0.7, seed=9, n=2, max_tokens=24)],
                         ids=["greedy", "seeded", "n2"])
def test_the_heads_drafts_change_no_output(engines, params):
    plain, eagle = engines
    eagle.engine.traces.clear()
    with eagle.engine.runner.forbid_compiles():
        assert outputs(eagle, PROMPTS, params) == outputs(plain, PROMPTS, params)
    assert sum(t.num_draft_tokens for t in eagle.engine.traces) > 50


def test_preemption_swaps_and_recomputes_the_heads_cache(engines):
    plain, eagle = engines
    prompts = [p * 2 for p in PROMPTS[:4]] * 2              # 8 rows of ~40 tokens, outputs 40: 50 blocks of 4 overflow
    for params in (SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
                   SamplingParams(temperature=0.8, seed=1, n=2, max_tokens=30, ignore_eos=True)):   # n=2: swapped
        eagle.engine.traces.clear()
        assert outputs(eagle, prompts, params) == outputs(plain, prompts, params)
        traces = eagle.engine.traces
        assert sum(t.num_preemptions for t in traces) > 0 and sum(t.num_draft_tokens for t in traces) > 0
    kv = eagle.engine.scheduler.kv
    assert kv.num_free_blocks == kv.num_usable_blocks


def test_the_pool_holds_the_heads_one_layer(engines):
    plain, eagle = engines
    sizes = [llm.engine_args.kv_bytes_per_block(llm.model_config, llm.kv_dtype, llm.draft_config)
             for llm in engines]
    assert sizes[1] == sizes[0] * 3 // 2                    # the model's two layers and the head's one
    assert eagle.engine.runner.drafter.aux_layers == tuple(AUX_LAYERS)


def test_bad_heads_are_refused_by_name(chat_checkpoint, heads, tmp_path):
    import shutil

    folder = heads[0][0]

    def head_with(name, change):
        bad = tmp_path / name
        shutil.copytree(folder, bad)
        config = json.loads((bad / "config.json").read_text())
        change(config)
        (bad / "config.json").write_text(json.dumps(config))
        return bad

    cases = [(head_with("arch", lambda c: c.update(architectures=["LlamaForCausalLM"])),
              r"architectures 'LlamaForCausalLM' is not an EAGLE-3 head"),
             (head_with("vocab", lambda c: c.update(vocab_size=300)), r"vocab_size 300 is not the model's \(258\)"),
             (head_with("layers", lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[0, 1, 5])),
              r"eagle_aux_hidden_state_layer_ids \[0, 1, 5\] must be three layers of the model's 2"),
             (head_with("width", lambda c: c.update(target_hidden_size=32)), r"fc has shape \(192, 64\), expected \(96, 64\)")]
    for bad, message in cases:
        with pytest.raises(ValueError, match="speculative_config.model: .*" + message):
            LLM(chat_checkpoint, speculative_config={"method": "eagle3", "model": str(bad)}, **OPTIONS)
    with pytest.raises(ValueError, match="speculative_config.model: the draft model's checkpoint is required with "
                                         "method eagle3"):
        LLM(chat_checkpoint, speculative_config={"method": "eagle3"}, **OPTIONS)


def test_a_row_drafts_on_from_the_sample_its_verified_tokens_end_on(engines, monkeypatch):
    """What the runner hands its drafter after a step: a row whose draft of 3 kept 2 starts from
    its third sample, at the position of its last output token; a plain decode from its only
    sample; a prompt's last chunk from its one sample, after the chunk. A row the scheduler did
    not ask for, and one that sampled nothing, are not proposed for."""
    from types import SimpleNamespace

    runner, made = engines[1].engine.runner, []
    monkeypatch.setattr(runner, "drafter", SimpleNamespace(propose=lambda rows: made.append(rows) or
                                                           [[0]] * len(rows.seq_ids)))
    out = SimpleNamespace(seq_ids=[7, 8, 9, 10, 11], num_samples=[4, 1, 1, 0, 1],
                          num_computed_tokens=[20, 30, 0, 3, 40], num_scheduled_tokens=[4, 1, 6, 5, 1],
                          draft_token_ids={7: [5, 6, 7]}, propose={7: 3, 8: 2, 9: 4, 10: 1})
    slots = np.array([0, 1, 2, 3, 4])
    drafts = runner._propose(out, slots, np.array([0, 4, 5, 6, 6]), [[5, 6, 1], [3], [2], [], [8]])
    assert drafts == {7: [0], 8: [0], 9: [0]}
    rows = made[0]
    assert rows.seq_ids == [7, 8, 9]
    assert rows.sample_rows.tolist() == [2, 4, 5] and rows.positions.tolist() == [23, 31, 6]
    assert rows.counts.tolist() == [3, 2, 4]
    assert rows.last_tokens.tolist() == runner.batch.tokens[[0, 1, 2], [23, 31, 6]].tolist()


def test_the_head_splits_over_two_devices_as_the_model_does(engines, chat_checkpoint, heads):
    """Tensor parallel 2 (simulated devices): the head's cache split by KV heads, the same tokens,
    and every proposal the torch head's chain."""
    from transformers import AutoModelForCausalLM

    plain, _ = engines
    folder, head = heads[0]
    tp2 = LLM(chat_checkpoint, tensor_parallel_size=2, speculative_config={
        "method": "eagle3", "model": str(folder), "num_speculative_tokens": 3}, **OPTIONS)
    every_draft_goes(tp2)
    made = recording(tp2)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    assert outputs(tp2, PROMPTS, params) == outputs(plain, PROMPTS, params)
    target = AutoModelForCausalLM.from_pretrained(chat_checkpoint, dtype=torch.float32).eval()
    assert len(made) > 10
    for tokens, draft in made:
        assert draft == reference_drafts(target, head, tokens, len(draft)), tokens
    assert len(tp2.engine.runner.drafter.kv_caches[0].sharding.device_set) == 2


def test_sampled_drafts_from_the_head_keep_greedy_outputs_and_compile_nothing(chat_checkpoint, heads, engines):
    """draft_sampling "sampled" with the head: sampling requests' drafts are drawn from the head's
    distribution (over its reduced vocabulary) and verified by rejection sampling; greedy requests
    keep their outputs token for token; nothing compiles after start-up."""
    plain, _ = engines
    llm = every_draft_goes(LLM(chat_checkpoint, speculative_config={
        "method": "eagle3", "model": str(heads[0][0]), "num_speculative_tokens": 3, "draft_sampling": "sampled"},
        **OPTIONS))
    llm.engine.traces = []
    with llm.engine.runner.forbid_compiles():
        got = outputs(llm, PROMPTS, SamplingParams(temperature=1.0, seed=5, max_tokens=20, ignore_eos=True))
        greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
        assert outputs(llm, PROMPTS, greedy) == outputs(plain, PROMPTS, greedy)
    assert [len(c[0][0]) for c in got] == [20] * len(PROMPTS)
    assert sum(t.num_draft_tokens for t in llm.engine.traces) > 50
    drafts = llm.engine.runner.drafter.draft_probs
    assert drafts.shape[1:] == (3, 258) and np.allclose(np.asarray(drafts).sum(-1)[np.asarray(drafts).sum(-1) > 0], 1)
