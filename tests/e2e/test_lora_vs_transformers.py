"""Multi-LoRA serving on a tiny Llama: greedy tokens of each adapter are transformers + peft's own
(the adapter applied to the same base), with three adapters and the base model mixed in the same
steps, through chunked prefill, a pool small enough to preempt, and the prefix cache (an adapter
reuses its own KV, never another's); adapters move between device slots and host memory without
reading the disk again; bad adapters are refused by name and change nothing."""
import json

import numpy as np
import pytest
import torch

from jaxengine import LLM, LoRARequest, SamplingParams

MAX_TOKENS = 8
RNG = np.random.default_rng(7)
SHARED, OTHER = (RNG.integers(3, 256, 12).tolist() for _ in range(2))   # three blocks of 4 the cache can hold
PROMPTS = [SHARED + [5], RNG.integers(3, 256, 9).tolist(), SHARED + [8, 2], RNG.integers(3, 256, 3).tolist(),
           OTHER + [11], OTHER + [12]]       # the last two: the prefix-cache test's alone
MIXED = range(4)
# Rank, alpha, targets and rsLoRA of each adapter: attention only, every target (rsLoRA), the MLP and k/o.
ADAPTERS = {"alpha": (4, 8, ["q_proj", "v_proj"], False),
            "beta": (8, 16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], True),
            "gamma": (2, 4, ["k_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], False)}


def make_adapter(base_folder, folder, seed: int, r: int, alpha: int, targets: list[str], rslora: bool):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base_folder), LoraConfig(
        r=r, lora_alpha=alpha, target_modules=targets, use_rslora=rslora, init_lora_weights=False))
    with torch.no_grad():                  # deltas as large as the weights: a wrong slot changes the tokens
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.mul_(2.0)
    model.save_pretrained(folder)


def peft_greedy(base_folder, adapter_folder, prompts) -> list[list[int]]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_folder)
    if adapter_folder is not None:
        model = PeftModel.from_pretrained(model, adapter_folder)
    model.eval()
    model.generation_config.eos_token_id = None
    out = []
    with torch.no_grad():
        for ids in prompts:
            gen = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False,
                                 pad_token_id=0)
            out.append(gen[0, len(ids):].tolist())
    return out


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(base folder, {name: adapter folder}, {name or None: the oracle's tokens per prompt})."""
    from tests.conftest import make_checkpoint

    base = tmp_path_factory.mktemp("lora-base")
    make_checkpoint(base, "llama")
    folders = {}
    for seed, (name, (r, alpha, targets, rslora)) in enumerate(ADAPTERS.items()):
        folders[name] = tmp_path_factory.mktemp(f"lora-{name}")
        make_adapter(base, folders[name], seed, r, alpha, targets, rslora)
    want = {name: peft_greedy(base, folder, PROMPTS) for name, folder in {None: None, **folders}.items()}
    assert len({json.dumps(v) for v in want.values()}) == 4          # every adapter changes the tokens
    return base, folders, want


OPTIONS = dict(skip_tokenizer_init=True, max_num_batched_tokens=32, max_num_seqs=8, block_size=4, max_model_len=64,
               num_kv_blocks=128,
               swap_space=0.001, progress=False, compile_mode="eager", token_buckets=[32], request_buckets=[8],
               enable_lora=True, max_lora_rank=8)


def engine(base, **options):
    return LLM(base, **{**OPTIONS, **options})


def run(llm, jobs):
    """jobs: [(prompt index, adapter request or None)] -> their greedy tokens, all in one generate."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with llm.runner.forbid_compiles():
        outs = llm.generate([PROMPTS[i] for i, _ in jobs], params, use_tqdm=False,
                            lora_request=[lora for _, lora in jobs])
    kv = llm.engine.scheduler.kv
    assert kv.num_free_blocks == kv.num_usable_blocks
    return [o.outputs[0].token_ids for o in outs]


def mixed_jobs(requests):
    """Every prompt under every adapter and the base, interleaved."""
    return [(i, lora) for i in MIXED for lora in (None, *requests.values())]


def expected(want, jobs):
    return [want[None if lora is None else lora.lora_name][i] for i, lora in jobs]


@pytest.fixture(scope="module")
def llm(setup):
    base, folders, _ = setup
    llm = engine(base, max_loras=3, lora_modules=[f"{n}={f}" for n, f in folders.items()])
    return llm


def test_three_adapters_and_the_base_in_the_same_steps_match_peft(llm, setup):
    _, _, want = setup
    jobs = mixed_jobs(llm.loras)
    llm.engine.traces = []
    assert run(llm, jobs) == expected(want, jobs)
    slots = llm.runner.lora
    assert slots.num_disk_reads == 3                   # read at start-up, never again


def test_an_adapter_reuses_its_own_prefix_blocks_and_never_anothers(llm, setup):
    _, _, want = setup
    alpha, beta = llm.loras["alpha"], llm.loras["beta"]
    kv = llm.engine.scheduler.kv
    for prompt, lora, hits in ((4, alpha, 0), (5, beta, 0), (5, alpha, 12), (4, None, 0), (4, beta, 12)):
        before = kv.prefix_cache_hits
        assert run(llm, [(prompt, lora)]) == expected(want, [(prompt, lora)])
        assert kv.prefix_cache_hits - before == hits, (prompt, lora)


def test_the_adapter_limit_holds_and_adapters_move_through_host_memory(setup):
    """max_loras 1: one adapter per step; two host copies: an adapter evicted from the device
    comes back from host memory, a third from disk, under preemption (a pool of 8 blocks)."""
    base, folders, want = setup
    llm = engine(base, max_loras=1, max_cpu_loras=3, num_kv_blocks=9, lora_modules=[f"{n}={f}" for n, f in folders.items()])
    llm.engine.traces = []
    jobs = mixed_jobs(llm.loras)
    seen = []
    original = llm.runner.lora.activate

    def activate(state, adapters):
        seen.append({a.digest for a in adapters})
        return original(state, adapters)

    llm.runner.lora.activate = activate
    assert run(llm, jobs) == expected(want, jobs)
    assert max(map(len, seen)) == 1 and len(set().union(*seen)) == 3
    assert llm.runner.lora.num_disk_reads == 3 and llm.runner.lora.num_slot_writes > 3
    assert sum(t.num_preemptions for t in llm.engine.traces) > 0


def test_bad_adapters_are_refused_by_name_and_change_nothing(llm, setup, tmp_path):
    base, folders, want = setup
    with pytest.raises(ValueError, match="adapter_config.json: no adapter_config.json"):
        llm.load_lora("missing", str(tmp_path))
    config = json.loads((folders["beta"] / "adapter_config.json").read_text())
    (tmp_path / "adapter_config.json").write_text(json.dumps({**config, "r": 16}))
    (tmp_path / "adapter_model.safetensors").write_bytes((folders["beta"] / "adapter_model.safetensors").read_bytes())
    with pytest.raises(ValueError, match="r: 16 exceeds max_lora_rank=8"):
        llm.load_lora("too-big", str(tmp_path))
    with pytest.raises(ValueError, match="lora_request: 1 given for 2 prompts"):
        llm.generate([PROMPTS[0], PROMPTS[1]], lora_request=[llm.loras["alpha"]], use_tqdm=False)
    assert sorted(llm.loras) == ["alpha", "beta", "gamma"] and not llm.engine.has_unfinished_requests()
    jobs = [(1, llm.loras["gamma"]), (3, None)]
    assert run(llm, jobs) == expected(want, jobs)


def test_an_engine_without_lora_refuses_an_adapter(setup):
    base, folders, _ = setup
    llm = LLM(base, **{**OPTIONS, "enable_lora": False, "max_lora_rank": 16})
    with pytest.raises(ValueError, match="serves no LoRA adapters"):
        llm.generate([PROMPTS[0]], lora_request=LoRARequest("alpha", 1, str(folders["alpha"])), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_tensor_parallel_2_splits_the_slots_like_their_projections_and_matches_peft(setup):
    from flax import nnx

    base, folders, want = setup
    llm = engine(base, max_loras=3, tensor_parallel_size=2, lora_modules=[f"{n}={f}" for n, f in folders.items()])
    specs = {path[-1]: variable[...].sharding.spec for path, variable in nnx.to_flat_state(llm.runner.state)
             if len(path) > 1 and path[-2] == "lora"}
    assert specs["b_q_proj"][-1] == "model" and specs["a_qkv"][-2] is None          # column-split: B's output
    assert specs["a_o"][-2] == "model" and specs["b_down_proj"][-1] is None          # row-split: A's input
    jobs = mixed_jobs(llm.loras)
    assert run(llm, jobs) == expected(want, jobs)


def test_batch_lines_pick_adapters_by_model(llm, tmp_path, monkeypatch):
    """python -m jaxengine.generate: a line's model names its adapter; another name is the model."""
    from jaxengine.generate import parse_args, run

    lines = [{"id": "a", "prompt": PROMPTS[1], "model": "gamma"}, {"id": "b", "prompt": PROMPTS[1]},
             {"custom_id": "c", "url": "/v1/completions", "body": {"model": "some-base-name", "prompt": PROMPTS[3]}}]
    (tmp_path / "in.jsonl").write_text("\n".join(json.dumps(line) for line in lines))
    args = parse_args(["--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out.jsonl"),
                       "--max-tokens", str(MAX_TOKENS), "--temperature", "0"])
    asked = []
    generate = llm.generate
    monkeypatch.setattr(llm, "generate", lambda *a, **k: asked.append(k["lora_request"]) or generate(*a, **k))
    assert run(args, llm) == 0
    assert asked == [[llm.loras["gamma"], None, None]]
    got = [json.loads(line)["completion_tokens"] for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert got == [MAX_TOKENS] * 3


def test_an_adapter_reloaded_with_other_weights_under_its_name_reuses_no_stale_kv(llm, setup, tmp_path):
    """The prefix cache keys on content: the same weights under a new name share alpha's blocks;
    other weights loaded under that name share none and give their own tokens."""
    from safetensors.numpy import load_file, save_file

    base, folders, want = setup
    kv = llm.engine.scheduler.kv
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        (tmp_path / name).write_bytes((folders["alpha"] / name).read_bytes())
    run(llm, [(4, llm.loras["alpha"])])                       # alpha's blocks of prompt 4 are cached
    before = kv.prefix_cache_hits
    assert run(llm, [(4, llm.load_lora("same", str(tmp_path)))]) == [want["alpha"][4]]
    assert kv.prefix_cache_hits - before == 12
    assert llm.remove_lora("same")
    tensors = load_file(str(tmp_path / "adapter_model.safetensors"))
    save_file({k: v * (1.5 if "lora_B" in k else 1.0) for k, v in tensors.items()},
              str(tmp_path / "adapter_model.safetensors"))
    changed = llm.load_lora("same", str(tmp_path))
    before = kv.prefix_cache_hits
    assert run(llm, [(4, changed)]) == peft_greedy(base, tmp_path, [PROMPTS[4]])
    assert kv.prefix_cache_hits - before == 0
    llm.remove_lora("same")


def test_a_request_keeps_its_adapter_through_an_unload_and_its_id_taken_by_other_weights(llm, setup, tmp_path):
    """Unloaded while its request runs, its folder deleted, its id given to other weights: the
    request finishes on the weights it came with."""
    import shutil

    _, folders, want = setup
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        (tmp_path / name).write_bytes((folders["beta"] / name).read_bytes())
    lora = llm.load_lora("going", str(tmp_path))
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    request = llm.add_request("in-flight", PROMPTS[1], params, lora_request=lora)
    llm.engine.step()
    assert llm.remove_lora("going")
    shutil.rmtree(tmp_path)
    llm.add_lora(LoRARequest("taker", lora.lora_int_id, str(folders["gamma"])))
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    assert request.output_token_ids == want["beta"][1]
    assert run(llm, [(1, llm.loras["taker"])]) == [want["gamma"][1]]
    llm.remove_lora("taker")
