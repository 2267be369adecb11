"""Lowering a Triton-backed Pallas kernel for CUDA on a machine without a GPU: from JAX 0.11 the
lowering asks the abstract mesh which GPU it targets (0.10's fell back to sm_90 by itself), so
``as_on_h100`` names one (sm_90) there; on a GPU the lowering reads the device itself."""
import contextlib

import jax


def as_on_h100():
    if jax.devices()[0].platform == "gpu":
        return contextlib.nullcontext()
    device = jax.sharding.AbstractDevice(device_kind="NVIDIA H100", num_cores=None, platform="gpu")
    return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device))
