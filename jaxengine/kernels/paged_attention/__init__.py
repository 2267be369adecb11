"""Paged attention over a block-table KV cache: metadata, KV writes, and the plain-jnp reference
(the Pallas kernels plug into the same interface)."""
from jaxengine.kernels.paged_attention.metadata import AttentionMetadata
from jaxengine.kernels.paged_attention.reference import paged_attention, write_kv
from jaxengine.kernels.paged_attention.tiled import paged_attention_tiled

__all__ = ["AttentionMetadata", "paged_attention", "paged_attention_tiled", "write_kv"]
