"""Mosaic GPU's interpreter runs WGMMA by reading both operands from its simulated shared memory,
so it cannot take an operand held in registers (the left one may be); JAX 0.10's cannot read
through a transposed view either (``ref.transpose``, which the hardware takes as a descriptor
bit): its index helper only knows slices. ``transposed_wgmma_operands`` patches the interpreter's
WGMMA callback to take a register operand by value and, where the shared memory has no
transposing access (JAX 0.10), to read a transposed operand untransposed and transpose the
values. The callback's parameters tell its calling convention (0.10: device and thread ids;
0.11: a mesh location and a thread), not the version number; everything else (TMA copies,
barriers, the simulated shared memory) is JAX's own."""
from __future__ import annotations

import contextlib
import inspect

import numpy as np


@contextlib.contextmanager
def transposed_wgmma_operands():
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks as cb

    original = cb.wgmma
    parameters = set(inspect.signature(original).parameters)
    if {"mesh_location", "thread"} <= parameters:
        wgmma = _wgmma_by_mesh_location(cb)
    elif {"device_id", "grid_point_coords", "thread_id"} <= parameters:
        wgmma = _wgmma_by_thread_id(cb)
    else:
        raise RuntimeError(f"Mosaic GPU interpreter: its wgmma callback takes {sorted(parameters)}, a calling "
                           "convention tests/kernels/mosaic_interpret.py does not know")
    # 0.11 wraps each callback to record a failure against its thread: keep that where it exists.
    cb.wgmma = getattr(cb, "fail_on_exception", lambda f: f)(wgmma)
    try:
        yield
    finally:
        cb.wgmma = original


def _wgmma_by_thread_id(cb):
    """JAX 0.10's callback: threads named by device and thread id."""
    def wgmma(*, token, device_id, grid_point_coords, thread_id, acc_allocation_key_as_array, acc_transforms,
              acc_dtype, a_allocation_key_as_array, a_transforms, b_allocation_key_as_array, b_transforms,
              source_info=None):
        del acc_dtype                              # the accumulator buffer's own
        memory = cb._get_shared_memory()
        thread = memory.get_global_thread_id(int(device_id), int(thread_id))
        info = cb.interpret_utils.GPULoggingInfo(device_id=int(device_id), thread_id=int(thread_id),
                                                 grid_point_coords=tuple(int(x) for x in grid_point_coords),
                                                 source_info=source_info)
        _accumulate(cb, memory, thread, info, (acc_allocation_key_as_array, acc_transforms),
                    (a_allocation_key_as_array, a_transforms), (b_allocation_key_as_array, b_transforms))
        return token

    return wgmma


def _wgmma_by_mesh_location(cb):
    """JAX 0.11's callback: a mesh location and the thread itself."""
    from jax._src.pallas.mosaic_gpu.interpret import shared_memory

    def wgmma(*, token, mesh_location, thread, acc_allocation_key_as_array, acc_transforms,
              a_allocation_key_as_array, a_transforms, b_allocation_key_as_array, b_transforms, source_info=None):
        info = shared_memory.GPULoggingInfo(mesh_location, thread, source_info)
        _accumulate(cb, cb._get_shared_memory(), thread, info, (acc_allocation_key_as_array, acc_transforms),
                    (a_allocation_key_as_array, a_transforms), (b_allocation_key_as_array, b_transforms))
        return token

    return wgmma


def _accumulate(cb, memory, thread, info, acc, a, b):
    """acc += a @ b, each a (key or value, transforms) pair; the product in the accumulator's dtype."""
    from jax._src.state.types import TransposeTransform

    transposing = hasattr(memory, "access")        # 0.11: an access carries a transpose's permutation

    def where(key, transforms):
        transforms = cb.jax.tree.map(int, cb._remove_noop_transforms(transforms))
        return memory.access(key, transforms) if transposing else cb.interpret_utils.to_range(transforms)

    def read(key, transforms):
        if np.ndim(key) == 2:                      # an operand in registers arrives as its value
            return np.asarray(key)
        key, permutation = cb.HostAllocationKey.from_array(key), None
        if not transposing and transforms and isinstance(transforms[-1], TransposeTransform):
            permutation, transforms = transforms[-1].permutation, transforms[:-1]
        value, _, _ = memory.get_buffer_content(key, where(key, transforms), thread, logging_info=info)
        return value if permutation is None else np.transpose(value, permutation)

    a, b = read(*a), read(*b)
    acc_key = cb.HostAllocationKey.from_array(acc[0])
    acc_at = where(acc_key, acc[1])
    value, _, _ = memory.get_buffer_content(acc_key, acc_at, thread, logging_info=info)
    memory.store_buffer_content(acc_key, acc_at, value + np.matmul(a, b, dtype=value.dtype), thread,
                                logging_info=info)
