"""The roofline every floor in the project is computed by, pinned to hand-computed values
(chosen so that each is exact in floating point)."""
from types import SimpleNamespace

from jaxengine.costmodel.floors import attention_flops, floor_seconds, kv_bytes_per_token, step_floor_seconds

# 2 layers, 4 query heads, 2 KV heads of 8
MODEL = SimpleNamespace(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8)


def test_the_floor_is_the_slower_of_reading_and_computing():
    assert floor_seconds(8.0, 2.0, bytes_read=12.0, bandwidth_bytes_s=4.0) == 4.0       # compute-bound
    assert floor_seconds(8.0, 2.0, bytes_read=20.0, bandwidth_bytes_s=4.0) == 5.0       # memory-bound
    assert floor_seconds(8.0, 2.0) == 4.0                                               # no bytes counted


def test_kv_bytes_and_attention_flops_of_a_small_model():
    assert kv_bytes_per_token(MODEL, 2) == 2 * 2 * 2 * 8 * 2 == 128       # K and V, layers, KV heads, head size, bf16
    assert attention_flops(MODEL, 100) == 4 * 2 * 4 * 8 * 100 == 25600     # q.k and p.v, layers, query heads, head size


def test_a_decode_step_is_memory_bound_and_a_prefill_compute_bound():
    at = dict(bytes_per_param=2, bandwidth_bytes_s=100.0, flops_per_s=1000.0)
    # 4 rows attending to 100 tokens in all: read 1000 x 2 + 100 x 128 = 14,800 bytes (148 s),
    # compute 2 x 1000 x 4 + 25,600 = 33,600 FLOPs (33.6 s)
    assert step_floor_seconds(MODEL, 1000, 4, 100, 100, **at) == 148.0
    # a 64-token prompt: 64 x (64 - 31.5) = 2,080 attended pairs; read 2000 + 64 x 128 = 10,192
    # bytes (101.92 s), compute 2 x 1000 x 64 + 256 x 2,080 = 660,480 FLOPs (660.48 s)
    assert step_floor_seconds(MODEL, 1000, 64, 64, 2080, **at) == 660.48
