"""Quantized weights (jaxengine/kernels/matmul/quantized.py): the reference quantization's exact values, int4
packing, and the matmul through the CPU kernel and through XLA against NumPy on the weights the
quantized ones stand for."""
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxengine.kernels.matmul import dense, dense_each, grouped_dense, xla_dense, xla_grouped_dense
from jaxengine.kernels.matmul.quantized import (FORMATS, QuantizedWeight, can_tile, dequantize, dequantize_reference,
                                                pack_int4, quantize, tile, tiles_available, unpack_int4_host, untile)

needs_compiler = pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler to build the kernel")


def test_int8_is_symmetric_per_group_and_int4_spans_min_to_max():
    w = np.array([[0.5, -1.27, 0.01, 0.0], [2.0, 3.0, 4.0, 5.5]], np.float32)
    values, scale, offset = quantize(w, "int8", 2)
    assert offset is None
    np.testing.assert_array_equal(scale, np.float16([[1.27 / 127, 0.01 / 127], [3.0 / 127, 5.5 / 127]]))
    np.testing.assert_array_equal(values, [[50, -127, 127, 0], [85, 127, 92, 127]])
    values, scale, offset = quantize(w, "int4", 4)
    np.testing.assert_array_equal(scale, np.float16([[1.77 / 15], [3.5 / 15]]))
    np.testing.assert_array_equal(offset, np.float16([[-1.27], [2.0]]))
    np.testing.assert_array_equal(values, [[15, 0, 11, 11], [0, 4, 9, 15]])
    values, scale, offset = quantize(w, "int4", 4, offset=False)          # Q4_0's symmetric range
    np.testing.assert_array_equal(scale, np.float16([[1.27 / 7], [5.5 / 7]]))
    np.testing.assert_array_equal(offset, -8 * scale)
    np.testing.assert_array_equal(values, [[11, 1, 8, 8], [11, 12, 13, 15]])


def test_fp8_scales_each_group_to_the_e4m3_range_in_float32():
    w = np.array([[0.5, -1.25, 0.01, 0.0], [2.0, 3.0, 4.0, 4.48]], np.float32)
    values, scale, offset = quantize(w, "fp8", 2)
    assert offset is None and values.dtype == jnp.float8_e4m3fn and scale.dtype == np.float32
    np.testing.assert_array_equal(scale, np.float32([[1.25, 0.01], [3.0, 4.48]]) / np.float32(448))
    # 0.5 / (1.25 / 448) = 179.2 -> 176 (e4m3 steps of 16 from 128 to 256); 4 / (4.48 / 448) = 400,
    # halfway between 384 and 416 (steps of 32 above 256) -> 384 (ties to even); the maxima 448
    np.testing.assert_array_equal(values.astype(np.float32), [[176, -448, 448, 0], [288, 448, 384, 448]])
    np.testing.assert_allclose(dequantize_reference(values, scale, None), w, rtol=0.07)


def test_int4_packs_two_elements_a_byte_low_nibble_first():
    values = np.array([[1, 2], [15, 0], [3, 4], [5, 6]], np.uint8)
    packed = pack_int4(values, axis=0)
    np.testing.assert_array_equal(packed, [[0xF1, 0x02], [0x53, 0x64]])
    np.testing.assert_array_equal(unpack_int4_host(packed, axis=0), values)
    with pytest.raises(ValueError, match="even"):
        pack_int4(values[:3], axis=0)
    with pytest.raises(ValueError, match="does not divide"):
        quantize(np.ones((2, 6), np.float32), "int4", 4)


def quantized(rng, layers: int, k: int, n: int, fmt: str, group: int, offset: bool):
    """A random stacked [L, K, N] weight quantized along K, and the f32 weights it stands for."""
    w = rng.standard_normal((layers, k, n), np.float32)
    values, scale, zero = quantize(w, fmt, group, axis=1, offset=offset)
    bits = FORMATS[fmt].bits
    q = pack_int4(values, axis=1) if bits == 4 else values
    qw = QuantizedWeight(jnp.asarray(q), jnp.asarray(scale), None if zero is None else jnp.asarray(zero), bits)
    return qw, dequantize_reference(values, scale, zero, axis=1)


@needs_compiler
@settings(max_examples=8, deadline=None)
@given(rows=st.sampled_from([1, 2, 5, 8, 9, 33]), groups=st.integers(1, 3), n=st.sampled_from([8, 16, 40, 72, 100]),
       scheme=st.sampled_from([("int8", 16, False), ("int8", 32, True), ("int4", 16, True), ("int4", 32, False),
                               ("int8-f32", 16, True), ("int4-f32", 32, True), ("fp8", 16, False)]), seed=st.integers(0, 99))
def test_the_cpu_kernel_and_xla_match_numpy_on_the_dequantised_weights(rows, groups, n, scheme, seed):
    # 1-8 rows: the fused loop (8 columns at a time, then one at a time past them); more: sgemm
    # (float16 or float32 scales; fp8: XLA's dequantise-and-dot on both paths)
    fmt, group, offset = scheme
    rng = np.random.default_rng(seed)
    qw, w = quantized(rng, 3, group * groups, n, fmt, group, offset)
    x = rng.standard_normal((rows, w.shape[1]), np.float32)
    np.testing.assert_allclose(dequantize(qw), w, rtol=1e-6, atol=1e-6)
    for layer in (0, 2):
        want = x @ w[layer]
        np.testing.assert_allclose(jax.jit(dense)(x, qw, jnp.int32(layer)), want, rtol=1e-5, atol=1e-4)
        np.testing.assert_allclose(jax.jit(xla_dense)(x, qw, jnp.int32(layer)), want, rtol=1e-5, atol=1e-4)


@needs_compiler
def test_two_contracted_axes_group_within_the_last_one_as_o_proj():
    # o_proj [N, H, D]: groups run along H within each head; the matmul contracts N and H together,
    # and q_proj [D, N, H] has two output axes
    rng = np.random.default_rng(1)
    w = rng.standard_normal((2, 3, 8, 24), np.float32)                    # [L, N, H, D]
    values, scale, zero = quantize(w, "int4", 4, axis=2)
    qw = QuantizedWeight(jnp.asarray(pack_int4(values, axis=2)), jnp.asarray(scale), jnp.asarray(zero), 4)
    assert qw.q.shape == (2, 3, 4, 24) and qw.scale.shape == (2, 3, 2, 24) and qw.group == 4
    ref = dequantize_reference(values, scale, zero, axis=2).reshape(2, 24, 24)
    x = rng.standard_normal((3, 24), np.float32)
    for fn in (dense, xla_dense):
        np.testing.assert_allclose(jax.jit(fn)(x, qw, jnp.int32(1)), x @ ref[1], rtol=1e-5, atol=1e-4)
    one = qw.layer(0)
    np.testing.assert_allclose(jax.jit(dense)(x, one), x @ ref[0], rtol=1e-5, atol=1e-4)
    values, scale, _ = quantize(w.reshape(2, 24, 3, 8), "int8", 8, axis=1)          # [L, D, N, H]
    q_proj = QuantizedWeight(jnp.asarray(values), jnp.asarray(scale), None, 8, out_axes=2)
    ref = dequantize_reference(values, scale, None, axis=1)
    for fn in (dense, xla_dense):
        out = jax.jit(fn)(x, q_proj, jnp.int32(1))
        assert out.shape == (3, 3, 8)
        np.testing.assert_allclose(out, np.einsum("td,dnh->tnh", x, ref[1]), rtol=1e-5, atol=1e-4)


@needs_compiler
@pytest.mark.parametrize("rows", [1, 3, 9])         # as bytes in one job (AVX-512 VNNI), or one product after another
@pytest.mark.parametrize("fmt, offset", [("int4", True), ("int8", False), ("int4-f32", True), ("int8-f32", True)])
def test_one_call_for_several_weights_gives_each_weights_product(rows, fmt, offset):
    """q, k and v (or gate and up) of one x: one call of the kernel, each product as its own call
    gives it, and as NumPy on the dequantised weights; a format the call does not take (fp8), or
    weights of mixed formats, go one product at a time."""
    rng = np.random.default_rng(rows)
    k = 64
    weights = [quantized(rng, 3, k, n, fmt, 32, offset) for n in (96, 32, 32)]     # q, k, v widths
    x = rng.standard_normal((rows, k), np.float32)
    for layer in (0, 2):
        together = jax.jit(lambda x, ws, i: dense_each(dense, x, ws, i))(x, [qw for qw, _ in weights], jnp.int32(layer))
        assert len(together) == 3
        for got, (qw, w) in zip(together, weights):
            np.testing.assert_allclose(got, jax.jit(dense)(x, qw, jnp.int32(layer)), rtol=1e-6, atol=1e-6)
            np.testing.assert_allclose(got, x @ w[layer], rtol=1e-5, atol=1e-4)
    mixed = [weights[0][0], quantized(rng, 3, k, 32, "fp8", 32, False)[0]]
    for got, qw in zip(jax.jit(lambda x, ws: dense_each(dense, x, ws, jnp.int32(1)))(x, mixed), mixed):
        np.testing.assert_allclose(got, jax.jit(dense)(x, qw, jnp.int32(1)), rtol=1e-6, atol=1e-6)
    hlo = jax.jit(lambda x, ws: dense_each(dense, x, ws, jnp.int32(1))).lower(x, [qw for qw, _ in weights]).as_text()
    assert hlo.count("stablehlo.custom_call @jaxengine_cpu_") == 1          # one call for the three


def grouped_reference(x: np.ndarray, w: np.ndarray, sizes: list[int]) -> np.ndarray:
    """Rows of x sorted by group, group g times w[g]; rows past the groups 0."""
    out, start = np.zeros((x.shape[0], w.shape[-1]), np.float32), 0
    for expert, size in enumerate(sizes):
        out[start:start + size] = x[start:start + size] @ w[expert]
        start += size
    return out


@needs_compiler
@pytest.mark.parametrize("scheme", [("int8", 16, False), ("int4", 16, True), ("int8-f32", 32, True),
                                    ("int4-f32", 16, False), ("fp8", 32, False)])
@pytest.mark.parametrize("sizes", [[3, 0, 2, 1], [0, 12, 0, 0], [1, 1, 1, 1]])      # few rows, many (sgemm), rows past
def test_grouped_experts_read_quantized_match_numpy_on_the_dequantised_weights(scheme, sizes):
    fmt, group, offset = scheme
    rng = np.random.default_rng(sum(sizes))
    layers, experts, k, n = 2, 4, 2 * group, 24
    qw, w = quantized(rng, layers * experts, k, n, fmt, group, offset)     # [L*E, K, N] -> [L, E, K, N]
    stacked = jax.tree.map(lambda a: a.reshape(layers, experts, *a.shape[1:]), qw)
    w = w.reshape(layers, experts, k, n)
    x = rng.standard_normal((14, k), np.float32)                           # 14 rows: some past the groups
    group_sizes = jnp.asarray(sizes, jnp.int32)
    for layer in (0, 1):
        want = grouped_reference(x, w[layer], sizes)
        for fn in (grouped_dense, xla_grouped_dense):
            got = jax.jit(fn)(x, stacked, group_sizes, jnp.int32(layer))
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4, err_msg=f"{fn.__name__} layer {layer}")
    one = stacked.layer(1)                                                 # one layer's experts [E, K, N]
    np.testing.assert_allclose(jax.jit(grouped_dense)(x, one, group_sizes), grouped_reference(x, w[1], sizes),
                               rtol=1e-5, atol=1e-4)


@needs_compiler
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_every_format_builds_and_runs_its_cpu_kernel_dense_and_grouped(fmt):
    """A kernel that fails to build falls back to XLA silently (the results agree): the lowered
    step must call the kernel itself."""
    from jaxengine.kernels.matmul.quantized import GROUPED_TARGETS, TARGETS, available

    assert available()
    key = (FORMATS[fmt].values.name, FORMATS[fmt].scale.name)
    group = 16
    qw, _ = quantized(np.random.default_rng(0), 4, 2 * group, 8, fmt, group, FORMATS[fmt].bits == 4)
    x = jnp.ones((3, 2 * group), jnp.float32)
    assert TARGETS[key] in jax.jit(dense).lower(x, qw, jnp.int32(1)).as_text()
    experts = jax.tree.map(lambda a: a.reshape(2, 2, *a.shape[1:]), qw)
    assert GROUPED_TARGETS[key] in jax.jit(grouped_dense).lower(x, experts, jnp.array([1, 2]), jnp.int32(1)).as_text()


@needs_compiler
def test_the_cpu_kernel_reads_every_fp8_byte_exactly_subnormals_included():
    codes = np.arange(256, dtype=np.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]                  # not NaN: a NaN weight would spread to every row
    q = codes.view(jnp.float8_e4m3fn).reshape(-1, 1).repeat(16, 1)     # 16 columns: the 8-wide path
    qw = QuantizedWeight(jnp.asarray(q), jnp.ones((1, 16), jnp.float32), None, 8)
    picks = np.eye(len(codes), dtype=np.float32)           # row i picks weight row i: its value times 1
    for rows in (2, 12):                                   # the fused loop, sgemm on a dequantised block
        got = np.concatenate([np.asarray(jax.jit(dense)(jnp.asarray(picks[i:i + rows]), qw))
                              for i in range(0, len(codes) - rows + 1, rows)])
        np.testing.assert_array_equal(got, q[:len(got)].astype(np.float32))


@needs_compiler
@pytest.mark.parametrize("fmt", ["int8", "int4", "int4-f32"])
def test_a_decode_rows_bytes_keep_float32s_accuracy_and_its_infs_and_nans(fmt):
    """Up to 8 rows multiply as bytes on a CPU with AVX-512 VNNI (tiled weights: AVX2 too), x written as three int8 terms per
    group of 32 (each value within 6.2e-8 of its group's largest |x|): the product is within that
    and float32's rounding of the f64 one however the group's values spread (here over e^16),
    zero and subnormal groups included, and an inf or a NaN in x reaches the output as in float32
    arithmetic (the other rows unharmed)."""
    rng = np.random.default_rng(3)
    qw, w = quantized(rng, 2, 128, 64, fmt, 32, fmt.startswith("int4"))
    x = rng.standard_normal((3, 128), np.float32) * np.exp(rng.uniform(-8, 8, (3, 128))).astype(np.float32)
    x[1, 40:72] = 0.0                                     # a group of zeros
    x[2, :32] = np.float32(1e-41)                         # a group of subnormals
    want = x.astype(np.float64) @ w[1].astype(np.float64)
    spread = np.abs(x).reshape(3, 4, 32).max(-1).repeat(32, -1)        # each value's group's largest |x|
    bound = (spread * 6.2e-8 + np.abs(x) * 2 ** -22).astype(np.float64) @ np.abs(w[1]).astype(np.float64)
    got = np.asarray(jax.jit(dense)(x, qw, jnp.int32(1)), np.float64)
    assert (np.abs(got - want) <= bound + 1e-30).all(), np.abs(got - want).max()
    for bad in (np.inf, np.nan):
        y = x.copy()
        y[1, 5] = bad
        out = np.asarray(jax.jit(dense)(y, qw, jnp.int32(1)))
        assert np.isnan(out[1]).any() or np.isinf(out[1]).all()
        assert (np.abs(out[[0, 2]] - want[[0, 2]]) <= bound[[0, 2]] + 1e-30).all()


@needs_compiler
@pytest.mark.parametrize("n", [192, 200, 4160])
def test_decode_rows_multiplied_from_several_threads_at_once_each_get_their_own_product(n):
    """A few rows' product shares its work with helper threads that one call at a time may use: calls
    from several threads at once (computations on several devices) each get exactly the product
    they get alone, narrow weights (a layer's), wide ones (an LM head's) and widths off the 16-column
    tiles (split by columns) alike."""
    from concurrent.futures import ThreadPoolExecutor

    rng = np.random.default_rng(5)
    qw, _ = quantized(rng, 2, 256, n, "int4", 32, True)
    xs = [rng.standard_normal((1 + i % 3, 256), np.float32) for i in range(6)]
    step = jax.jit(dense)
    alone = [np.asarray(step(x, qw, jnp.int32(i % 2))) for i, x in enumerate(xs)]

    def repeat(i: int) -> bool:
        return all(np.array_equal(np.asarray(step(xs[i], qw, jnp.int32(i % 2))), alone[i]) for _ in range(40))

    with ThreadPoolExecutor(len(xs)) as pool:
        assert all(pool.map(repeat, range(len(xs))))


@pytest.fixture
def tiles():
    if not tiles_available():
        pytest.skip("the tiled layout serves a CPU with AVX2 or AVX-512 VNNI and VBMI only")


@pytest.mark.parametrize("fmt, group, offset", [("int4", 32, True), ("int8", 16, False), ("int4-f32", 16, True),
                                                ("int8-f32", 32, True)])
def test_tiles_hold_each_value_scale_and_offset_where_the_layout_says_and_give_them_back(tiles, fmt, group, offset):
    rng = np.random.default_rng(7)
    qw, _ = quantized(rng, 2, 2 * group, 48, fmt, group, offset)
    tw = tile(qw, stacked=True)
    bits, size = FORMATS[fmt].bits, FORMATS[fmt].scale.itemsize
    steps = group * bits // 32                               # 64-byte words of 4 rows of q a group
    assert tw.blocks.dtype == np.uint8 and tw.blocks.shape == (2, 3, 2, 64 * steps + 16 * size * (1 + offset))
    assert (tw.bits, tw.group, tw.offset, tw.out_shape, tw.k) == (bits, group, offset, (48,), 2 * group)
    blocks, q = np.asarray(tw.blocks), np.asarray(qw.q).view(np.uint8)
    # layer 1, tile 2 (columns 32..47), group 1, its step 1, column j = 5, row i = 3 of the step
    row = 4 * (1 * steps + 1) + 3
    assert blocks[1, 2, 1, 64 * 1 + 4 * 5 + 3] == q[1, row, 32 + 5]
    scales = blocks[1, 2, 1, 64 * steps:64 * steps + 16 * size].view(FORMATS[fmt].scale)
    np.testing.assert_array_equal(scales, np.asarray(qw.scale)[1, 1, 32:48])
    back = untile(tw)
    np.testing.assert_array_equal(back.q, qw.q)
    np.testing.assert_array_equal(back.scale, qw.scale)
    assert (back.offset is None) == (not offset)
    if offset:
        np.testing.assert_array_equal(back.offset, qw.offset)
    assert not can_tile(quantized(rng, 1, 32, 40, fmt, 16, offset)[0])      # 40 columns: not whole tiles
    assert not can_tile(quantized(rng, 1, 32, 48, "fp8", 16, False)[0])


@pytest.mark.parametrize("rows", [1, 3, 8, 9, 33])    # as bytes (up to 8), else dequantised tiles and sgemm
@pytest.mark.parametrize("fmt, offset", [("int4", True), ("int8", False), ("int4-f32", True), ("int8-f32", True)])
def test_tiled_weights_give_the_row_major_kernels_products(tiles, rows, fmt, offset):
    """Each product within float32's rounding of the row-major layout's (the same bytes, summed
    over the groups in another order; exactly it where many rows go to sgemm) and of NumPy's on the
    dequantised weights; several weights of one x in one call, each as it gets alone; XLA's path
    on a tiled weight as on the weight it came from; a weight not stacked over layers."""
    rng = np.random.default_rng(rows)
    k = 96
    weights = [quantized(rng, 3, k, n, fmt, 32, offset) for n in (64, 32, 32)]
    tiled = [tile(qw, stacked=True) for qw, _ in weights]
    x = rng.standard_normal((rows, k), np.float32)
    together = jax.jit(lambda x, ws, i: dense_each(dense, x, ws, i))
    for layer in (0, 2):
        outs = together(x, tiled, jnp.int32(layer))
        for got, tw, (qw, w) in zip(outs, tiled, weights):
            row_major = np.asarray(jax.jit(dense)(x, qw, jnp.int32(layer)))
            np.testing.assert_array_equal(got, jax.jit(dense)(x, tw, jnp.int32(layer)))
            if rows > 8:
                np.testing.assert_array_equal(got, row_major)
            # float32's rounding of sums of |x||w| (a wrong value is off by far more)
            assert (np.abs(got - row_major) <= 1e-6 * (np.abs(x) @ np.abs(w[layer]))).all()
            np.testing.assert_allclose(got, x @ w[layer], rtol=1e-5, atol=1e-4)
            np.testing.assert_array_equal(jax.jit(xla_dense)(x, tw, jnp.int32(layer)),
                                          jax.jit(xla_dense)(x, qw, jnp.int32(layer)))
    hlo = together.lower(x, tiled, jnp.int32(1)).as_text()
    assert hlo.count("stablehlo.custom_call @jaxengine_cpu_tiled_matmuls") == 1
    one = tile(weights[0][0].layer(1), stacked=False)
    np.testing.assert_allclose(jax.jit(dense)(x, one), x @ weights[0][1][1], rtol=1e-5, atol=1e-4)


def test_tiled_weights_keep_the_output_axes_and_pass_infs_and_nans_to_their_rows_only(tiles):
    rng = np.random.default_rng(11)
    w = rng.standard_normal((2, 64, 4, 8), np.float32)                     # q_proj [L, D, N, H]
    values, scale, zero = quantize(w, "int4", 32, axis=1)
    qw = QuantizedWeight(jnp.asarray(pack_int4(values, axis=1)), jnp.asarray(scale), jnp.asarray(zero), 4, out_axes=2)
    tw = tile(qw, stacked=True)
    ref = dequantize_reference(values, scale, zero, axis=1)
    x = rng.standard_normal((3, 64), np.float32)
    out = jax.jit(dense)(x, tw, jnp.int32(1))
    assert out.shape == (3, 4, 8)
    np.testing.assert_allclose(out, np.einsum("td,dnh->tnh", x, ref[1]), rtol=1e-5, atol=1e-4)
    for bad in (np.inf, np.nan):
        y = x.copy()
        y[1, 5] = bad
        got = np.asarray(jax.jit(dense)(y, tw, jnp.int32(1)))
        assert not np.isfinite(got[1]).any() and np.isfinite(got[[0, 2]]).all()
        # (the call's rows then go through sgemm: the same products, rounded another way)
        np.testing.assert_allclose(got[[0, 2]], np.asarray(out)[[0, 2]], rtol=1e-5, atol=1e-5)


def test_the_tiled_kernel_refuses_blocks_of_the_wrong_size_with_an_error_naming_them(tiles):
    x = jnp.ones((1, 64), jnp.float32)
    blocks = jnp.zeros((1, 2, 2, 100), jnp.uint8)                          # int4 group 32 f16: 320 bytes a block
    call = jax.ffi.ffi_call("jaxengine_cpu_tiled_matmuls", [jax.ShapeDtypeStruct((1, 32), jnp.float32)])
    with pytest.raises(Exception, match="tiles \\[L, N / 16, K / G, block\\]"):
        jax.block_until_ready(call(x, jnp.int32(0), blocks, bits=np.int64(4), scale_bytes=np.int64(2), offset=True,
                                   group=np.int64(32)))
