"""Host-side core: scheduler and paged KV cache manager. Pure Python; imports no JAX."""
