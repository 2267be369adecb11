"""The CPU's projection matmuls through OpenBLAS (jaxengine/kernels/matmul) against NumPy, and where they serve."""
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxengine.kernels.matmul import cpu_matmul, dense, xla_dense

needs_compiler = pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler to build the kernel")


@needs_compiler
@pytest.mark.parametrize("rows, k, n", [(1, 64, 48), (3, 40, 17), (6, 37, 50), (8, 64, 40), (17, 96, 200),
                                        (64, 128, 33)])
def test_the_kernel_matches_numpy_for_every_layer_of_a_stack(rows, k, n):
    # rows 1 is OpenBLAS's gemv, 2-8 the few-rows loop (K off its groups of 4 too), more sgemm;
    # N off the 16-column blocks leaves a short last block
    rng = np.random.default_rng(rows)
    x = rng.standard_normal((rows, k), np.float32)
    w = rng.standard_normal((3, k, n), np.float32)
    call = jax.jit(cpu_matmul.matmul)
    for layer in range(3):
        np.testing.assert_allclose(call(x, w, layer), x @ w[layer], rtol=1e-5, atol=1e-4)


@needs_compiler
def test_dense_flattens_trailing_axes_with_and_without_a_layer_index():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((5, 32), np.float32))
    stacked = jnp.asarray(rng.standard_normal((4, 32, 3, 8), np.float32))       # [L, D, N, H] as q_proj
    out = jax.jit(dense)(x, stacked, jnp.int32(2))
    assert out.shape == (5, 3, 8)
    np.testing.assert_allclose(out, np.einsum("td,dnh->tnh", x, stacked[2]), rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(jax.jit(dense)(x, stacked[1]), np.einsum("td,dnh->tnh", x, stacked[1]),
                               rtol=1e-5, atol=1e-4)


@needs_compiler
def test_the_kernel_serves_f32_on_the_cpu_only_and_falls_back_to_xla():
    x32, w32 = jnp.ones((2, 8), jnp.float32), jnp.ones((8, 4), jnp.float32)
    assert cpu_matmul.available() and cpu_matmul.serves(x32, w32)
    assert not cpu_matmul.serves(x32.astype(jnp.bfloat16), w32.astype(jnp.bfloat16))
    hlo = jax.jit(dense).lower(x32.astype(jnp.bfloat16), w32.astype(jnp.bfloat16)).as_text()
    assert cpu_matmul.TARGET not in hlo and "dot" in hlo
    assert cpu_matmul.TARGET in jax.jit(dense).lower(x32, w32).as_text()
    np.testing.assert_array_equal(xla_dense(x32, w32), np.full((2, 4), 8.0, np.float32))


def test_a_layer_index_out_of_range_is_an_error_not_a_stray_read():
    if not cpu_matmul.available():
        pytest.skip("the kernel is not built here")
    with pytest.raises(Exception, match="layer index out of range"):
        jax.block_until_ready(jax.jit(cpu_matmul.matmul)(jnp.ones((2, 8)), jnp.ones((3, 8, 4)), 3))


@needs_compiler
@pytest.mark.parametrize("sizes, rows", [([5, 0, 7, 3, 0, 10, 2, 4], 37), ([1], 1), ([0, 0, 3], 8), ([0, 0], 4)])
def test_the_grouped_kernel_multiplies_each_group_by_its_expert_and_zeroes_the_rest(sizes, rows):
    # empty groups (experts no token chose), one row (gemv), and rows past the groups (padding)
    rng = np.random.default_rng(rows)
    k, n = 24, 40
    x = rng.standard_normal((rows, k), np.float32)
    w = rng.standard_normal((2, len(sizes), k, n), np.float32)
    call = jax.jit(cpu_matmul.grouped_matmul)
    starts = np.cumsum([0] + sizes)
    for layer in range(2):
        out = np.asarray(call(x, w, np.asarray(sizes, np.int32), layer))
        for e, (a, b) in enumerate(zip(starts[:-1], starts[1:])):
            np.testing.assert_allclose(out[a:b], x[a:b] @ w[layer, e], rtol=1e-5, atol=1e-4)
        np.testing.assert_array_equal(out[starts[-1]:], 0.0)
        np.testing.assert_allclose(out, cpu_matmul.xla_grouped_dense(x, w, jnp.asarray(sizes), layer),
                                   rtol=1e-5, atol=1e-4)


def test_group_sizes_past_the_rows_are_an_error_not_a_stray_read():
    if not cpu_matmul.available():
        pytest.skip("the kernel is not built here")
    with pytest.raises(Exception, match="group sizes must be >= 0 and sum to at most M"):
        jax.block_until_ready(jax.jit(cpu_matmul.grouped_matmul)(jnp.ones((4, 8)), jnp.ones((1, 2, 8, 4)),
                                                                 jnp.asarray([3, 2]), 0))


@needs_compiler
@pytest.mark.parametrize("rows", [1, 5, 12, 13, 30, 64])
def test_a_weight_laid_out_as_panels_multiplies_as_the_row_major_one(rows):
    # rows: one block of rows and its remainders (12 a block where the CPU has AVX-512, else 6);
    # q_proj's [L, D, N, H] (two output axes), of 96 columns (three strips of 32)
    rng = np.random.default_rng(rows)
    w = rng.standard_normal((3, 40, 6, 16), np.float32)
    x = rng.standard_normal((rows, 40), np.float32)
    laid = cpu_matmul.panel(w, out_axes=2, stacked=True)
    assert laid.panels.shape == (3, 3, 40, 32) and laid.out_shape == (6, 16) and laid.k == 40
    np.testing.assert_array_equal(cpu_matmul.unpanel(laid), w.reshape(3, 40, 6, 16))
    np.testing.assert_array_equal(laid.panels[1, 2, 7], w[1, 7].reshape(-1)[64:96])   # strip 2 of row 7
    for layer in range(3):
        out = jax.jit(dense)(x, laid, jnp.int32(layer))
        assert out.shape == (rows, 6, 16)
        np.testing.assert_allclose(out, np.einsum("tk,knh->tnh", x, w[layer]), rtol=1e-5, atol=1e-4)
    alone = cpu_matmul.panel(w[2].reshape(40, 96), out_axes=1, stacked=False)     # one layer, no index
    np.testing.assert_allclose(jax.jit(dense)(x, alone), x @ w[2].reshape(40, 96), rtol=1e-5, atol=1e-4)
    assert cpu_matmul.PANEL_TARGET in jax.jit(dense).lower(x, alone).as_text()
    np.testing.assert_allclose(xla_dense(x, alone), x @ w[2].reshape(40, 96), rtol=1e-5, atol=1e-4)


@needs_compiler
def test_panels_refuse_a_width_off_the_strips_and_a_layer_out_of_range():
    assert not cpu_matmul.can_panel((40, 48), 1) and cpu_matmul.can_panel((40, 3, 32), 2)
    with pytest.raises(ValueError, match="does not lay out as panels of 32 columns"):
        cpu_matmul.panel(np.ones((40, 48), np.float32), out_axes=1, stacked=False)
    laid = cpu_matmul.panel(np.ones((2, 8, 32), np.float32), out_axes=1, stacked=True)
    with pytest.raises(Exception, match="layer index out of range"):
        jax.block_until_ready(jax.jit(dense)(jnp.ones((2, 8)), laid, jnp.int32(2)))
    bf16 = jnp.ones((2, 8), jnp.bfloat16)                     # not the kernel's: XLA's dot on the weight laid back
    assert cpu_matmul.PANEL_TARGET not in jax.jit(dense).lower(bf16, laid, jnp.int32(0)).as_text()
    np.testing.assert_array_equal(dense(bf16, laid, jnp.int32(1)), np.full((2, 32), 8.0))


def test_the_choice_of_matmul_holds_for_the_whole_process(monkeypatch):
    from jaxengine.kernels.matmul import openblas

    monkeypatch.setattr(openblas, "_choice", None)
    assert openblas.cpu_matmul_kernels_chosen() is True          # reading it fixes the default
    openblas.use_cpu_matmul_kernels(True)                         # the same choice again: fine
    with pytest.raises(ValueError, match="cpu_matmul_kernels: this process already runs its models with "
                                         "cpu_matmul_kernels=True"):
        openblas.use_cpu_matmul_kernels(False)


@needs_compiler
def test_the_option_off_keeps_xla_dot_on_the_weights_as_loaded(tmp_path):
    """``LLM(cpu_matmul_kernels=False)`` (``--no-cpu-matmul-kernels``), in a process of its own:
    no weight laid out as panels, no call to the kernels in a step, the same greedy tokens."""
    import subprocess
    import sys

    from tests.conftest import make_checkpoint

    make_checkpoint(tmp_path, "llama", num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=False)
    code = f"""
import jax
from flax import nnx
from jaxengine import LLM, SamplingParams
from jaxengine.models.panels import PanelParam
llm = LLM({str(tmp_path)!r}, cpu_matmul_kernels={{flag}}, skip_tokenizer_init=True, max_model_len=64,
          max_num_seqs=2, max_num_batched_tokens=32, num_kv_blocks=16, progress=False)
panels = sum(isinstance(node, PanelParam) for _, node in nnx.iter_graph(llm.model))
out = llm.generate([{{"prompt_token_ids": [3, 17, 42, 9]}}], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                   use_tqdm=False)
print("RESULT", panels, list(out[0].outputs[0].token_ids))
"""
    results = {}
    for flag in (True, False):
        run = subprocess.run([sys.executable, "-c", code.replace("{flag}", str(flag))], capture_output=True,
                             text=True, timeout=600)
        assert run.returncode == 0, run.stderr[-3000:]
        line = next(x for x in run.stdout.splitlines() if x.startswith("RESULT"))
        panels, tokens = line.split(" ", 2)[1:]
        results[flag] = int(panels), tokens
    assert results[True][0] > 0 and results[False][0] == 0
    assert results[True][1] == results[False][1]
