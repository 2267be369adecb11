"""python -m jaxengine.bench end to end on a tiny checkpoint: throughput (random with both
baselines, shared prefix with prefix caching), latency per bucket, a two-point sweep."""
import argparse
import json
import statistics

import pytest

from jaxengine.bench.__main__ import main

# One engine shape for every test: its six step buckets compile once (JAX's persistent cache).
ENGINE = ["--max-num-batched-tokens", "32", "--max-num-seqs", "4", "--request-buckets", "2,4", "--max-model-len", "128"]
SHARED_PREFIX = ["--dataset", "shared-prefix", "--prefix-len", "16", "--input-len", "16", "--output-len", "4",
                 "--num-prompts", "4"]


def bench(checkpoint, tmp_path, mode, *options, sweep=()) -> tuple[dict, dict]:
    """Run a mode (a sweep: its options, then the target's) on the tiny engine with ``options``;
    returns (the result it returned, the JSON file it wrote)."""
    path = tmp_path / "result.json"
    result = main([mode, "--result-file", str(path), "--no-progress", *sweep, "--model", str(checkpoint), *ENGINE,
                   *options])
    return result, json.loads(path.read_text())


def test_throughput_random_against_both_baselines(chat_checkpoint, tmp_path):
    result, saved = bench(chat_checkpoint, tmp_path, "throughput", "--num-prompts", "6", "--input-len", "5:40",
                          "--output-len", "7", "--baseline", "naive", "--baseline", "hf",
                          "--baseline-batch-size", "4")
    assert saved == json.loads(json.dumps(result))
    m, lens = result["metrics"], result["requests"]
    assert m["num_requests"] == 6 and lens["output_lens"] == [7] * 6
    assert m["output_tokens"] == sum(lens["output_lens"]) == 6 * 7
    assert m["prompt_tokens"] == sum(lens["prompt_lens"])
    assert all(5 <= n <= 40 for n in lens["prompt_lens"])
    assert m["requests_per_s"] == 6 / m["elapsed_s"]
    assert m["output_tokens_per_s"] == 42 / m["elapsed_s"]
    assert m["input_tokens_per_s"] == m["prompt_tokens"] / m["elapsed_s"]
    assert m["prefix_cache_hit_rate"] == 0.0 and m["preemptions"] == 0
    traces = result["traces"]
    assert len(traces) == m["num_steps"]
    # Every prompt token is computed once, and every output token but the last is fed back once.
    assert m["tokens_computed"] == sum(t["num_prefill_tokens"] + t["num_decode_tokens"] for t in traces)
    assert m["tokens_computed"] == m["prompt_tokens"] + 6 * (7 - 1)
    assert [t["time_s"] for t in traces] == sorted(t["time_s"] for t in traces)
    assert traces[-1]["time_s"] <= m["elapsed_s"]
    for name in ("naive", "hf"):
        b = result["baselines"][name]
        assert b["output_tokens"] == 42 and b["requests_per_s"] == 6 / b["elapsed_s"]
        assert b["ratio"]["output_tokens_per_s"] == m["output_tokens_per_s"] / b["output_tokens_per_s"]
        assert b["same_tokens"] is True and b["mismatched_requests"] == 0      # greedy: the engine's tokens


def test_shared_prefix_hits_the_prefix_cache_exactly(chat_checkpoint, tmp_path):
    # The step budget is one prompt (16 + 16 tokens): the first request's prefill runs alone, and
    # the three others then find its full block of prefix cached.
    result, _ = bench(chat_checkpoint, tmp_path, "throughput", *SHARED_PREFIX)
    m = result["metrics"]
    assert m["prompt_tokens"] == 4 * 32 and m["cached_prompt_tokens"] == 3 * 16
    assert m["prefix_cache_hit_rate"] == 3 * 16 / (4 * 32) == 0.375
    assert m["tokens_computed"] == 4 * 32 - 3 * 16 + 4 * (4 - 1)
    assert m["output_tokens"] == 4 * 4
    assert result["workload"]["dataset"] == "shared-prefix" and result["engine_args"]["enable_prefix_caching"]


def test_latency_times_every_bucket_pair(chat_checkpoint, tmp_path):
    result, saved = bench(chat_checkpoint, tmp_path, "latency", "--repeats", "3", "--context-len", "20",
                          "--baseline", "matmul")
    assert saved["mode"] == "latency"
    rows = [(r["kind"], r["tokens"], r["rows"], r["token_bucket"], r["row_bucket"], r["context_len"])
            for r in result["rows"]]
    assert rows == [("prefill", 2, 2, 2, 2, 0), ("prefill", 4, 4, 4, 4, 0), ("prefill", 8, 4, 8, 4, 0),
                    ("prefill", 16, 4, 16, 4, 0), ("prefill", 32, 4, 32, 4, 0),       # rows: at least 4 from 4 tokens
                    ("decode", 2, 2, 2, 2, 20), ("decode", 4, 4, 4, 4, 20)]
    for r in result["rows"]:
        assert r["reached"] and len(r["times_ms"]) == 3 and r["step_ms"] == pytest.approx(statistics.median(r["times_ms"]))
        assert r["us_per_token"] == pytest.approx(r["step_ms"] * 1e3 / r["tokens"])
        assert r["x_matmul_floor"] == r["us_per_token"] / result["baseline"]["floor_us_per_token"]
    # 2 layers of hidden 64, 4 query + 2 + 2 KV heads of 16, MLP 128: QKV 64*128, O 64*64, MLP 3*64*128
    # multiply-adds per layer, 2 FLOPs each: 147,456 FLOPs per token
    floor = result["baseline"]
    assert floor["floor_us_per_token"] == pytest.approx(147456 / (floor["matmul_gflops"] * 1e9) * 1e6)


def test_sweep_over_prefix_caching(chat_checkpoint, tmp_path):
    result, saved = bench(chat_checkpoint, tmp_path, "sweep", *SHARED_PREFIX,
                          sweep=["--grid", "enable_prefix_caching=true,false", "throughput"])
    assert saved["mode"] == "sweep" and saved["target"] == "throughput"
    assert saved["grid"] == {"enable_prefix_caching": [True, False]}
    assert [p["params"] for p in saved["points"]] == [{"enable_prefix_caching": True},
                                                      {"enable_prefix_caching": False}]
    assert [p["result"]["metrics"]["prefix_cache_hit_rate"] for p in saved["points"]] == [0.375, 0.0]
    assert [p["result"]["engine_args"]["enable_prefix_caching"] for p in saved["points"]] == [True, False]
    assert saved["frontier"] and set(saved["frontier"]) <= {0, 1}


def test_parse_axis_single_and_linked():
    from jaxengine.bench.sweep import parse_axis

    assert parse_axis("--max-num-seqs=1,2") == (("max_num_seqs",), [("1",), ("2",)])
    assert parse_axis("enable_chunked_prefill+max_num_batched_tokens=true+32,false+128") == (
        ("enable_chunked_prefill", "max_num_batched_tokens"), [("true", "32"), ("false", "128")])
    for bad in ("max_num_seqs", "a+b=1+2,3", "=1,2"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_axis(bad)


def test_a_linked_axis_moves_its_options_together():
    from jaxengine.bench import sweep

    target = argparse.ArgumentParser()
    target.add_argument("--chunked", action=argparse.BooleanOptionalAction, default=True)
    target.add_argument("--budget", type=int, default=8)
    target.add_argument("--rate", type=float, default=1.0)
    seen = []
    args = argparse.Namespace(
        grid=[sweep.parse_axis("rate=1,2"), sweep.parse_axis("chunked+budget=true+32,false+128")], target="serve",
        target_parser=target, progress=False, chunked=True, budget=8, rate=1.0,
        target_run=lambda a: seen.append((a.rate, a.chunked, a.budget)) or {})
    result = sweep.run(args)
    assert seen == [(1.0, True, 32), (1.0, False, 128), (2.0, True, 32), (2.0, False, 128)]
    assert result["grid"] == {"rate": [1.0, 2.0], "chunked+budget": ["True+32", "False+128"]}
    assert [p["params"] for p in result["points"]][1] == {"rate": 1.0, "chunked": False, "budget": 128}


def test_sweep_rejects_an_unknown_option(tmp_path):
    with pytest.raises(ValueError, match="'max_num_batched_tokenz' is not an option"):
        main(["sweep", "--result-file", str(tmp_path / "r.json"), "--grid", "max_num_batched_tokenz=1,2"])
    with pytest.raises(ValueError, match="--grid max_num_seqs: 'x'"):
        main(["sweep", "--result-file", str(tmp_path / "r.json"), "--grid", "max_num_seqs=1,x"])
    with pytest.raises(ValueError, match="axes of different options"):
        main(["sweep", "--result-file", str(tmp_path / "r.json"), "--grid", "max_num_seqs+block_size=1+16",
              "--grid", "max_num_seqs=1,2"])


def test_sweep_of_preemption_modes_under_memory_pressure(chat_checkpoint, tmp_path):
    # 4 groups of 2 sequences, 16 + 20 tokens each: a group needs 1 shared + 2 x 2 own blocks of 16
    # at its end, 20 blocks for all four, and the pool has 10: groups are preempted.
    result, saved = bench(chat_checkpoint, tmp_path, "sweep", "--num-prompts", "4", "--input-len", "16",
                          "--output-len", "20", "--n", "2", "--num-kv-blocks", "10", "--max-num-seqs", "8",
                          "--request-buckets", "2,4,8", "--no-enable-prefix-caching",
                          sweep=["--grid", "preemption_mode=recompute,swap", "throughput"])
    recompute, swap = (p["result"] for p in saved["points"])
    for r in (recompute, swap):
        m = r["metrics"]
        assert r["sampling"] == {"n": 2, "temperature": 1.0, "seed": 0, "ignore_eos": True}
        assert r["requests"]["output_lens"] == [2 * 20] * 4 and m["output_tokens"] == 4 * 2 * 20
        assert m["preemptions"] > 0 and m["peak_kv_usage"] <= 1.0
    assert recompute["metrics"]["blocks_swapped_out"] == recompute["metrics"]["blocks_swapped_in"] == 0
    assert swap["metrics"]["blocks_swapped_out"] == swap["metrics"]["blocks_swapped_in"] > 0
    # Recompute computes the preempted prompts (and outputs) again; swap computes each prompt once.
    assert recompute["metrics"]["prefill_tokens"] > 4 * 16 == swap["metrics"]["prefill_tokens"]


def test_throughput_refuses_baselines_for_groups(tmp_path):
    with pytest.raises(ValueError, match="--baseline runs one greedy sequence per request"):
        main(["throughput", "--result-file", str(tmp_path / "r.json"), "--n", "2", "--baseline", "hf"])


def test_beam_search_throughput_against_transformers_and_the_blocks_it_shares(chat_checkpoint, tmp_path):
    result, _ = bench(chat_checkpoint, tmp_path, "throughput", "--num-prompts", "3", "--input-len", "20",
                      "--output-len", "6", "--beam-width", "2", "--baseline", "hf", "--baseline-batch-size", "1",
                      "--max-num-seqs", "8", "--request-buckets", "2,4,8")
    m = result["metrics"]
    assert result["requests"]["output_lens"] == [2 * 6] * 3 and m["output_tokens"] == 3 * 2 * 6
    hf = result["baselines"]["hf"]
    assert hf["same_tokens"] is True and hf["output_tokens"] == m["output_tokens"]
    # Two beams share their 20-token prompt's full blocks (one of 16): fewer blocks than copies.
    assert 0 < m["peak_kv_blocks"] < m["peak_kv_blocks_copied"]
    assert m["kv_blocks_saved"] == 1 - m["peak_kv_blocks"] / m["peak_kv_blocks_copied"]


FAKE_VLLM = '''
import json, os
class SamplingParams:
    def __init__(self, **kw):
        self.kw = kw
class LLM:
    def __init__(self, model, **engine):
        json.dump({"model": model, "engine": engine, "preload": os.environ.get("LD_PRELOAD", "")},
                  open(os.environ["FAKE_VLLM_RECORD"], "w"))
    def generate(self, prompts, params, use_tqdm):
        class Out:
            def __init__(self, ids):
                self.outputs = [type("C", (), {"token_ids": ids})()]
        # The prompt's first tokens as its output: not what the engine generates.
        return [Out([p["prompt_token_ids"][0]] * s.kw["max_tokens"]) for p, s in zip(prompts, params)]
__version__ = "0.0-fake"
'''


def test_vllm_baseline_runs_the_same_requests_in_its_own_interpreter(chat_checkpoint, tmp_path, monkeypatch):
    """vLLM stands in as a fake package under this interpreter: the worker gets the engine's
    limits and the requests, and its tokens are compared with the engine's."""
    import sys

    fake = tmp_path / "fake"
    (fake / "vllm").mkdir(parents=True)
    (fake / "vllm" / "__init__.py").write_text(FAKE_VLLM)
    (fake / "vllm" / "inputs.py").write_text("def TokensPrompt(prompt_token_ids):\n    return {'prompt_token_ids': prompt_token_ids}\n")
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f"#!/bin/sh\nPYTHONPATH={fake} exec {sys.executable} \"$@\"\n")
    python.chmod(0o755)
    record = tmp_path / "record.json"
    monkeypatch.setenv("FAKE_VLLM_RECORD", str(record))
    result, _ = bench(chat_checkpoint, tmp_path, "throughput", "--num-prompts", "3", "--input-len", "8",
                      "--output-len", "4", "--baseline", "vllm", "--vllm-python", str(python))
    seen = json.loads(record.read_text())
    assert seen["model"] == str(chat_checkpoint)
    assert seen["engine"] == {"dtype": "float32", "max_model_len": 128, "max_num_batched_tokens": 32, "max_num_seqs": 4,
                              "enable_prefix_caching": True, "kv_cache_memory_bytes": 1 << 30, "seed": 0}
    b = result["baselines"]["vllm"]
    assert b["vllm_version"] == "0.0-fake" and b["output_tokens"] == 12
    assert b["same_tokens"] is False and b["mismatched_requests"] == 3
    assert b["ratio"]["output_tokens_per_s"] == result["metrics"]["output_tokens_per_s"] / b["output_tokens_per_s"]
    with pytest.raises(ValueError, match="--vllm-python: .* does not exist"):
        bench(chat_checkpoint, tmp_path, "throughput", "--num-prompts", "1", "--baseline", "vllm",
              "--vllm-python", str(tmp_path / "nothing"))
    with pytest.raises(ValueError, match="--baseline vllm: needs --vllm-python"):
        main(["throughput", "--result-file", str(tmp_path / "r.json"), "--baseline", "vllm"])
    with pytest.raises(ValueError, match="--vllm-model: .* is not a Hugging Face folder"):    # before the engine runs
        main(["throughput", "--result-file", str(tmp_path / "r.json"), "--baseline", "vllm",
              "--vllm-python", str(python), "--model", str(tmp_path / "model.gguf")])


def test_throughput_and_latency_on_a_mixture_of_experts(moe_chat_checkpoint, tmp_path):
    folder, _ = moe_chat_checkpoint
    result, _ = bench(folder, tmp_path, "throughput", "--num-prompts", "4", "--input-len", "12",
                      "--output-len", "5")
    assert result["metrics"]["output_tokens"] == 20
    cfg_experts = [len(t["expert_tokens"]) for t in result["traces"] if t["num_prefill_tokens"] + t["num_decode_tokens"]]
    assert cfg_experts and set(cfg_experts) == {8}                     # the experts' load is in every step's trace
    result, _ = bench(folder, tmp_path, "latency", "--repeats", "1", "--context-len", "8")
    assert all(r["reached"] and r["step_ms"] > 0 for r in result["rows"])


def test_the_naive_baseline_refuses_a_mixture_of_experts_before_the_engine_runs(moe_chat_checkpoint, tmp_path):
    folder, _ = moe_chat_checkpoint
    with pytest.raises(ValueError, match=r"--baseline naive: the plain JAX loop runs dense Llama-family models; "
                                         r"Qwen3MoeForCausalLM has a mixture of experts"):
        bench(folder, tmp_path, "throughput", "--num-prompts", "2", "--input-len", "8", "--output-len", "2",
              "--baseline", "naive")
