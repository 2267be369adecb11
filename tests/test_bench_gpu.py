"""scripts/bench_gpu.py picks the engine run's kernels only among those whose outputs matched the
plain-jnp path's in the same run, the fastest of them."""
import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_gpu", ROOT / "scripts" / "bench_gpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def case(pallas_ms, mosaic_ms, write_ms, *, pallas=True, mosaic=True, write=True):
    return {"pallas_ms": pallas_ms, "pallas_matches": pallas, "mosaic_ms": mosaic_ms, "mosaic_matches": mosaic,
            "kv_write_pallas_ms": write_ms, "kv_write_pallas_matches": write,
            "kv_write_xla_scatter_ms": 1.0, "kv_write_xla_scatter_matches": True}


def results(tmp_path, decode: dict, mixed: dict) -> Path:
    (tmp_path / "kernel.json").write_text(json.dumps({"decode": decode, "mixed": mixed}))
    return tmp_path


def test_the_faster_kernel_when_both_match(bench, tmp_path):
    out = results(tmp_path, case(2.0, 1.0, 0.5), case(2.0, 1.0, 0.5))
    assert (bench.faster_kernel(out), bench.faster_kv_write(out)) == ("pallas-mosaic", "pallas")


def test_a_faster_kernel_that_disagreed_is_not_chosen(bench, tmp_path):
    out = results(tmp_path, case(2.0, 1.0, 0.5), case(2.0, 1.0, 0.5, mosaic=False))
    assert bench.faster_kernel(out) == "pallas-triton"


def test_the_plain_jnp_path_when_no_kernel_matched(bench, tmp_path):
    out = results(tmp_path, case(2.0, 1.0, 0.5, pallas=False), case(2.0, 1.0, 0.5, mosaic=False))
    assert bench.faster_kernel(out) == "reference"
    assert bench.faster_kernel(tmp_path / "nothing-ran") == "reference"


def test_a_faster_kv_write_that_disagreed_is_not_chosen(bench, tmp_path):
    decode, mixed = case(2.0, 1.0, 0.5), case(2.0, 1.0, 0.5)
    mixed["kv_write_pallas_matches"] = False
    assert bench.faster_kv_write(results(tmp_path, decode, mixed)) == "xla_scatter"


def test_block_sizes_only_from_matching_sweep_entries(bench, tmp_path, monkeypatch):
    from jaxengine.kernels.paged_attention import kernel

    sizes = lambda pages: {"block_q": 16, "pages_per_block": pages, "num_warps": 4, "num_stages": 2}  # noqa: E731
    sweep = [{"sizes": sizes(8), "ms": 0.5, "matches": False}, {"sizes": sizes(2), "ms": 0.7, "matches": True}]
    (tmp_path / "kernel.json").write_text(json.dumps({"decode_sweep": sweep}))
    monkeypatch.setitem(kernel.TUNED, (128, 16, "bfloat16"), kernel.TUNED[(128, 16, "bfloat16")])
    chosen = bench.use_best_sizes(tmp_path, 128, 16)
    assert chosen["decode_sweep"]["pages_per_block"] == 2


def test_the_decode_floor_is_the_roofline_of_the_measured_ceilings(bench):
    from types import SimpleNamespace

    cfg = SimpleNamespace(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8)
    ceil = {"copy_bandwidth_gbs": 1.0, "bf16_matmul_tflops": 1.0}
    # bf16 weights and KV: 1000 x 2 + 100 x 128 bytes at 1 GB/s; 33,600 FLOPs at 1 TFLOP/s is less
    assert bench.decode_floor_ms(cfg, 1000, 4, 100, ceil) == pytest.approx(14800 / 1e9 * 1e3)
