"""Dense matmuls of the model's projections: XLA's dot, or on the CPU OpenBLAS through ``jax.ffi``."""
from jaxengine.kernels.matmul.cpu_matmul import dense, xla_dense

__all__ = ["dense", "xla_dense"]
