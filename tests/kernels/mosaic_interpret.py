"""Mosaic GPU's interpreter (JAX 0.10) runs WGMMA by reading both operands from its simulated
shared memory, but not through a transposed view (``plgpu.transpose_ref``, which the hardware
takes as a descriptor bit): its index helper only knows slices. ``transposed_wgmma_operands``
patches the interpreter's WGMMA callback to read such an operand untransposed and transpose the
values, and to take an operand held in registers (the left one may be) by value; everything else
(TMA copies, barriers, the simulated shared memory) is JAX's own."""
from __future__ import annotations

import contextlib

import numpy as np


@contextlib.contextmanager
def transposed_wgmma_operands():
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks as cb
    from jax._src.state.types import TransposeTransform

    original = cb.wgmma

    def read(key, transforms, thread, info):
        if np.ndim(key) == 2:                    # an operand in registers arrives as its value
            return np.asarray(key)
        permutation = None
        if transforms and isinstance(transforms[-1], TransposeTransform):
            permutation, transforms = transforms[-1].permutation, transforms[:-1]
        transforms = cb.jax.tree.map(int, cb._remove_noop_transforms(transforms))
        value, _, _ = cb._get_shared_memory().get_buffer_content(
            cb.HostAllocationKey.from_array(key), cb.interpret_utils.to_range(transforms), thread, logging_info=info)
        return value if permutation is None else np.transpose(value, permutation)

    def wgmma(*, token, device_id, grid_point_coords, thread_id, acc_allocation_key_as_array, acc_transforms,
              acc_dtype, a_allocation_key_as_array, a_transforms, b_allocation_key_as_array, b_transforms,
              source_info=None):
        memory = cb._get_shared_memory()
        thread = memory.get_global_thread_id(int(device_id), int(thread_id))
        info = cb.interpret_utils.GPULoggingInfo(device_id=int(device_id), thread_id=int(thread_id),
                                                 grid_point_coords=tuple(int(x) for x in grid_point_coords),
                                                 source_info=source_info)
        a = read(a_allocation_key_as_array, a_transforms, thread, info)
        b = read(b_allocation_key_as_array, b_transforms, thread, info)
        acc_key = cb.HostAllocationKey.from_array(acc_allocation_key_as_array)
        acc_range = cb.interpret_utils.to_range(cb.jax.tree.map(int, cb._remove_noop_transforms(acc_transforms)))
        acc, _, _ = memory.get_buffer_content(acc_key, acc_range, thread, logging_info=info)
        memory.store_buffer_content(acc_key, acc_range, acc + np.matmul(a, b, dtype=acc_dtype), thread,
                                    logging_info=info)
        return token

    cb.wgmma = wgmma
    try:
        yield
    finally:
        cb.wgmma = original
