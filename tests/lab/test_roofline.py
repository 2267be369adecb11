"""The lab's what-if profiles: the roofline of datasheet figures at the assumed efficiencies,
labelled a model, saved and read back as one."""
import pytest

from jaxengine.costmodel.profile import StepShape, load_profile
from jaxengine.costmodel.roofline import RooflineProfile, roofline_profile


def test_roofline_profile_of_llama_3_8b_on_h200():
    p = roofline_profile("h200", "llama-3-8b")
    kv_per_token = 2 * 32 * 8 * 128 * 2                 # K and V, layers, KV heads, head size, bf16
    assert p.kv_bytes_per_token == kv_per_token
    assert p.num_gpu_blocks == int((141e9 * 0.9 - 8.03e9 * 2) // (kv_per_token * 16))
    decode = StepShape(64, 64, 1024, 64 * 1024, attention_work=64 * 1024)
    memory_bound = (8.03e9 * 2 + 64 * 1024 * kv_per_token) / (4.8e12 * 0.75)
    assert p.step_seconds(decode, 64) == pytest.approx(0.004 + memory_bound)
    prefill = StepShape(8192, 1, 8192, 8192, attention_work=8192 * 4096)
    compute_bound = (2 * 8.03e9 * 8192 + 4 * 32 * 32 * 128 * 8192 * 4096) / (989e12 * 0.5)
    assert p.step_seconds(prefill, 8192) == pytest.approx(0.004 + compute_bound)
    assert "not a measurement" in p.note
    with pytest.raises(ValueError, match="hardware: unknown 'tpu'"):
        roofline_profile("tpu")


def test_a_saved_roofline_profile_reads_back_as_one(tmp_path):
    p = roofline_profile("h100", "smollm2-135m", step_overhead_s=0.001)
    loaded = load_profile(p.save(tmp_path / "roofline.json"))
    assert isinstance(loaded, RooflineProfile) and loaded == p
    shape = StepShape(16, 16, 300, 4000, attention_work=4000)
    assert loaded.step_seconds(shape, 16) == p.step_seconds(shape, 16)


def test_a_mixture_of_experts_reads_the_experts_its_tokens_touch_and_computes_the_active_ones():
    p = roofline_profile("h200", "qwen3-30b-a3b")
    m = p.model
    routed = (30.5e9 - 3.35e9) * 128 / 120                       # every routed expert's weights
    assert m.params_read(1) == pytest.approx(30.5e9 - routed + routed * 8 / 128)
    assert m.params_read(4096) == pytest.approx(30.5e9)         # a big batch touches every expert
    kv = 2 * 48 * 4 * 128 * 2
    decode = StepShape(1, 1, 1024, 1024, attention_work=1024)
    assert p.step_seconds(decode, 1) == pytest.approx(0.004 + (m.params_read(1) * 2 + 1024 * kv) / (4.8e12 * 0.75))
    prefill = StepShape(8192, 1, 8192, 8192, attention_work=8192 * 4096)
    flops = 2 * 3.35e9 * 8192 + 4 * 48 * 32 * 128 * 8192 * 4096      # the active parameters, not all 30.5e9
    assert p.step_seconds(prefill, 8192) == pytest.approx(0.004 + flops / (989e12 * 0.5))


def test_a_hybrid_models_recurrent_layers_cost_its_rows_states_whatever_their_context():
    """Qwen3.5-27B: 16 of its 64 layers keep KV; each sequence of a step reads and writes its
    recurrent state (48 layers' float32 states) once, at any context length."""
    p = roofline_profile("h200", "qwen3.5-27b")
    state = 4 * 48 * (48 * 128 * 128 + 3 * 10240)
    assert p.model.state_bytes_per_slot == state and round(state / 1e6, 1) == 156.9
    kv = 2 * 16 * 4 * 256 * 2                                    # the attention layers only
    assert p.kv_bytes_per_token == kv
    free = 141e9 * 0.9 - 27.8e9 * 2         # 257 slots would take more than half of it: 227 do
    assert free // 2 // state == 227 and p.num_gpu_blocks == int((free - 227 * state) // (kv * 16))
    for context in (1024, 65536):
        decode = StepShape(64, 64, context, 64 * context, attention_work=64 * context)
        read = 27.8e9 * 2 + 64 * context * kv + 2 * 64 * state
        assert p.step_seconds(decode, 64) == pytest.approx(0.004 + read / (4.8e12 * 0.75))
    prefill = StepShape(8192, 1, 8192, 8192, attention_work=8192 * 4096)
    flops = 2 * 27.8e9 * 8192 + 4 * 16 * 24 * 256 * 8192 * 4096     # attention in 16 layers
    assert p.step_seconds(prefill, 8192) == pytest.approx(0.004 + flops / (989e12 * 0.5))
