"""Which paged-attention implementation the model uses: ``auto | pallas | reference``."""
from __future__ import annotations

from collections.abc import Callable

import jax

BACKENDS = ("auto", "pallas", "reference")


def select_attention(backend: str = "auto", device: jax.Device | None = None) -> Callable:
    """``reference``: the plain-jnp path (tiled for the CPU, checked against the per-token
    reference). ``pallas``: the ragged Pallas kernel (interpreted on the CPU, for tests).
    ``auto``: Pallas on a CUDA GPU of compute capability 8.0 or newer (the Triton lowering),
    else the reference."""
    if backend not in BACKENDS:
        raise ValueError(f"attention_backend: must be one of {list(BACKENDS)}, got {backend!r}")
    device = device or jax.devices()[0]
    if backend == "auto":
        backend = "pallas" if _triton_capable(device) else "reference"
    if backend == "pallas":
        from jaxengine.kernels.paged_attention.kernel import paged_attention_pallas

        return paged_attention_pallas
    from jaxengine.kernels.paged_attention.tiled import paged_attention_tiled

    return paged_attention_tiled


def _triton_capable(device: jax.Device) -> bool:
    if device.platform != "gpu":
        return False
    capability = getattr(device, "compute_capability", "0.0")
    return float(capability) >= 8.0
