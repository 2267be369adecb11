"""Paged attention over a block-table KV cache: metadata, KV writes, and the plain-jnp reference
(the Pallas kernels plug into the same interface)."""
from jaxengine.kernels.paged_attention.metadata import AttentionMetadata
from jaxengine.kernels.paged_attention.reference import paged_attention, write_kv

__all__ = ["AttentionMetadata", "paged_attention", "write_kv"]
