"""Checkpoints load straight into their shardings: a safetensors checkpoint in several files is
read per device slice (never whole on the host), KV heads fewer than devices are repeated from
slices, and the converted-weights cache of a GGUF restores each shard into place."""
import functools
import tracemalloc

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxengine.models.gguf import load_gguf, read_gguf
from jaxengine.models.mesh import make_mesh
from jaxengine.models.panels import plain
from jaxengine.models.weights import build_model, load_model
from tests.conftest import make_checkpoint
from tests.models.test_weights import write_gguf

# Small, but enough that the weights dominate what the loader allocates: ~23 MB in float32.
MEDIUM = dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
              num_key_value_heads=2, vocab_size=4096)
M = "model"
SPECS = {       # our stacked layout ([L, ...] for layers): the layer axis is never split
    "embed_tokens": P(M, None), "lm_head": P(None, M), "norm.weight": P(),
    "layers.self_attn.q_proj": P(None, None, M, None), "layers.self_attn.k_proj": P(None, None, M, None),
    "layers.self_attn.v_proj": P(None, None, M, None), "layers.self_attn.o_proj": P(None, M, None, None),
    "layers.mlp.gate_proj": P(None, None, M), "layers.mlp.up_proj": P(None, None, M),
    "layers.mlp.down_proj": P(None, M, None), "layers.input_layernorm.weight": P(),
    "layers.post_attention_layernorm.weight": P(),
}
KV_HEAD_AXIS = {"k_proj": 2, "v_proj": 2, "k_bias": 1, "v_bias": 1}     # stacked layout


def params(model) -> dict[str, jax.Array]:
    """Every parameter by name, as the model made it (a weight laid out as panels for the CPU kernel
    read back: ``models.panels``)."""
    out = {}
    for path, var in nnx.to_flat_state(nnx.state(model)):
        if path[-1] == "panels":
            out[".".join(map(str, path[:-1]))] = plain(functools.reduce(getattr, path[:-1], model))
        else:
            out[".".join(map(str, path))] = var.get_value()
    return out


def expected_on_mesh(reference: dict[str, np.ndarray], repeats: int) -> dict[str, np.ndarray]:
    """The full-read parameters as a mesh holds them: each KV head ``repeats`` times in a row."""
    return {name: np.repeat(w, repeats, axis=KV_HEAD_AXIS[name.rsplit(".", 1)[-1]])
            if name.rsplit(".", 1)[-1] in KV_HEAD_AXIS else w for name, w in reference.items()}


def assert_equal_params(model, expected: dict[str, np.ndarray], dtype=np.float32) -> None:
    got = params(model)
    assert got.keys() == expected.keys()
    for name, w in got.items():
        np.testing.assert_array_equal(np.asarray(w), expected[name].astype(dtype), err_msg=name)


@pytest.fixture(scope="module")
def sharded_checkpoint(tmp_path_factory):
    """(folder of a checkpoint in several safetensors files, its parameters read whole)."""
    hf = make_checkpoint(tmp_path_factory.mktemp("medium-one-file"), "llama", **MEDIUM)
    folder = tmp_path_factory.mktemp("medium-sharded")
    hf.save_pretrained(folder, max_shard_size="4MB")
    assert len(list(folder.glob("*.safetensors"))) >= 4
    model, _ = load_model(folder)
    return folder, {name: np.asarray(w) for name, w in params(model).items()}


@pytest.mark.parametrize("tp", [4, 8])
def test_a_sharded_checkpoint_loads_into_its_shardings_without_the_whole_model_on_the_host(sharded_checkpoint, tp):
    folder, reference = sharded_checkpoint
    model_bytes = sum(w.nbytes for w in reference.values())
    mesh = make_mesh(jax.devices()[:tp])
    # tracemalloc sees every host allocation numpy makes (the slices read, their transposes); the
    # device buffers are not traced: on an accelerator they are device memory. (On the CPU they
    # are host memory too, copied from the slices: place() never lets one alias a host array.)
    tracemalloc.start()
    try:
        model, cfg = load_model(folder, mesh=mesh)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    print(f"TP {tp}: loader's peak host memory {peak / 2**20:.2f} MiB, model {model_bytes / 2**20:.2f} MiB "
          f"({peak / model_bytes:.0%})")
    # Reading everything first, as a full read does, would peak above the model's size.
    assert peak < 0.5 * model_bytes
    assert cfg.num_kv_heads == max(2, tp)                        # 2 KV heads repeated to one per device
    for name, w in params(model).items():
        assert w.sharding.is_equivalent_to(NamedSharding(mesh, SPECS[name]), w.ndim), name
    q = params(model)["layers.self_attn.q_proj"]
    assert {s.data.shape for s in q.addressable_shards} == {(4, 256, 8 // tp, 32)}
    assert_equal_params(model, expected_on_mesh(reference, tp // 2))


@pytest.mark.parametrize("model_type,overrides", [("llama", {}), ("qwen2", {}), ("qwen3", dict(head_dim=32))],
                         ids=["llama", "qwen2-bias", "qwen3-qk-norm"])
def test_kv_heads_repeated_from_slices_equal_the_repeated_full_read(tmp_path, model_type, overrides):
    make_checkpoint(tmp_path, model_type, num_attention_heads=8, num_key_value_heads=2, **overrides)
    reference = {name: np.asarray(w) for name, w in params(load_model(tmp_path)[0]).items()}
    model, cfg = load_model(tmp_path, mesh=make_mesh(jax.devices()[:8]))
    assert cfg.num_kv_heads == 8
    k = params(model)["layers.self_attn.k_proj"]
    assert {s.data.shape[2] for s in k.addressable_shards} == {1}          # one (repeated) head per device
    assert_equal_params(model, expected_on_mesh(reference, 4))


def test_the_converted_weights_cache_restores_into_the_shardings(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXENGINE_CACHE", str(tmp_path / "cache"))
    hf = make_checkpoint(tmp_path / "hf", "llama", num_attention_heads=8, num_key_value_heads=2)
    write_gguf(tmp_path / "tiny.gguf", hf)
    cfg, tensors = read_gguf(tmp_path / "tiny.gguf")
    reference = {name: np.asarray(w) for name, w in params(build_model(cfg, tensors)).items()}
    mesh = make_mesh(jax.devices()[:8])
    _, hit = load_gguf(tmp_path / "tiny.gguf", mesh=mesh)
    assert not hit
    monkeypatch.setattr("jaxengine.models.gguf.read_gguf", lambda path: pytest.fail("converted again"))
    for tp, dtype in ((8, jnp.float32), (4, jnp.bfloat16)):
        mesh = make_mesh(jax.devices()[:tp])
        model, hit = load_gguf(tmp_path / "tiny.gguf", dtype, mesh=mesh)
        assert hit and model.config.num_kv_heads == max(2, tp)
        for name, w in params(model).items():
            assert w.sharding.is_equivalent_to(NamedSharding(mesh, SPECS[name]), w.ndim), name
            assert w.dtype == dtype, name
        assert_equal_params(model, expected_on_mesh(reference, tp // 2), dtype)
