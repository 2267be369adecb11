"""Which paged-attention implementation the model uses: ``auto | pallas | cpu | reference``, plus
``pallas-triton`` and ``pallas-mosaic`` to force one of the two Pallas kernels."""
from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import jax

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "pallas", "pallas-triton", "pallas-mosaic", "cpu", "reference")

# Whether ``pallas`` uses the Mosaic GPU kernel on Hopper for the layouts it serves (16-bit
# caches, head size a multiple of 64). Off until scripts/gpu_check.sh has measured it faster than
# the Triton kernel on an H100/H200 (its table compares the two): no GPU run has done so yet.
MOSAIC_ON_HOPPER = False


def select_attention(backend: str = "auto", device: jax.Device | None = None) -> Callable:
    """``reference``: the plain-jnp path alone (tiled, checked against the per-token reference).
    ``cpu``: the compiled CPU kernel (``cpu_decode``) for every layer it serves (an f32 or FP8
    cache on a CPU), the plain-jnp path for the others. ``pallas``: the ragged Pallas kernels
    (interpreted on the CPU, for tests): the Triton-lowered one, or on Hopper the Mosaic GPU one
    where it serves the layout and ``MOSAIC_ON_HOPPER``. ``auto``: ``pallas`` on a CUDA GPU of
    compute capability 8.0 or newer (the Triton lowering's floor), else ``cpu``."""
    if backend not in BACKENDS:
        raise ValueError(f"attention_backend: must be one of {list(BACKENDS)}, got {backend!r}")
    device = device or jax.devices()[0]
    if backend == "auto":
        backend = "pallas" if _capability(device) >= (8, 0) else "cpu"
    if backend in ("cpu", "reference"):
        from jaxengine.kernels.paged_attention.tiled import paged_attention_tiled

        return paged_attention_tiled if backend == "cpu" else functools.partial(paged_attention_tiled,
                                                                                 decode_kernel=False)
    from jaxengine.kernels.paged_attention.kernel import paged_attention_pallas
    from jaxengine.kernels.paged_attention.mosaic_kernel import paged_attention_mosaic

    if backend == "pallas-triton":
        return paged_attention_pallas
    if backend == "pallas-mosaic":
        return paged_attention_mosaic
    if MOSAIC_ON_HOPPER and _capability(device)[0] == 9:
        return functools.partial(_mosaic_where_supported, fallback=paged_attention_pallas)
    return paged_attention_pallas


def _mosaic_where_supported(q, k_cache, v_cache, md, *, fallback: Callable, **kw):
    """The Mosaic GPU kernel for the layouts it serves, decided when the layer is traced."""
    from jaxengine.kernels.paged_attention.mosaic_kernel import paged_attention_mosaic, supports

    if supports(q, k_cache):
        return paged_attention_mosaic(q, k_cache, v_cache, md, **kw)
    return fallback(q, k_cache, v_cache, md, **kw)


def where_served(attention_fn: Callable) -> Callable:
    """``attention_fn`` for the inputs it serves, the plain-jnp path for the others (decided when
    the layer is traced): latent attention's one key head of R + Hr (576 for DeepSeek-V3) is not a
    head size the Pallas kernels take."""
    return functools.partial(_where_served, kernel=attention_fn)


def _where_served(q, k_cache, v_cache, md, *, kernel: Callable, **kw):
    return serving_kernel(kernel, q, k_cache, v_cache, md)(q, k_cache, v_cache, md, **kw)


def serving_kernel(kernel: Callable, q, k_cache, v_cache, md) -> Callable:
    """``kernel`` if it serves these inputs, else the plain-jnp path (logged)."""
    from jaxengine.kernels.paged_attention.kernel import paged_attention_pallas, validate
    from jaxengine.kernels.paged_attention.mosaic_kernel import paged_attention_mosaic, supports
    from jaxengine.kernels.paged_attention.tiled import paged_attention_tiled

    inner = getattr(kernel, "func", kernel)
    problem = None
    if inner is paged_attention_mosaic and not supports(q, k_cache):
        problem = "the Mosaic GPU kernel does not serve this layout"
    elif inner is paged_attention_pallas or (inner is _mosaic_where_supported and not supports(q, k_cache)):
        try:
            validate(q, k_cache, v_cache, md)
        except ValueError as e:
            problem = str(e)
    if problem is None:
        return kernel
    logger.info("attention of q %s over caches %s: %s; the plain-jnp path serves it", q.shape, k_cache.shape, problem)
    return paged_attention_tiled


def _capability(device: jax.Device) -> tuple[int, int]:
    if device.platform != "gpu":
        return (0, 0)
    major, _, minor = str(getattr(device, "compute_capability", "0.0")).partition(".")
    return int(major), int(minor or 0)
