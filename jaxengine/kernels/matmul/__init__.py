"""Dense and grouped (mixture-of-experts) matmuls of the model's projections: XLA's dot and
ragged_dot, or on the CPU OpenBLAS through ``jax.ffi``."""
from jaxengine.kernels.matmul.cpu_matmul import dense, dense_each, grouped_dense, xla_dense, xla_grouped_dense

__all__ = ["dense", "dense_each", "grouped_dense", "xla_dense", "xla_grouped_dense"]
