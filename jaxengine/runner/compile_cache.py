"""JAX's persistent compilation cache under ``$JAXENGINE_CACHE/xla`` (default
~/.cache/jaxengine/xla): a second start of the same model and buckets loads its step programs
instead of compiling them (the default model on the CPU: 43 s -> 13 s to start).
``JAXENGINE_XLA_CACHE=0`` turns it off; a cache directory the user set for JAX is left alone.

Processes share the folder and may start together; JAX writes an entry in place, so the cache is
given a size bound (least recently used entries go past it): with one, JAX takes a file lock
around each read and write, and no process reads an entry another is still writing."""
from __future__ import annotations

import logging
import os

import jax

from jaxengine.models.paths import cache_dir

logger = logging.getLogger(__name__)
MAX_BYTES = 16 << 30          # far above the step programs of the models one machine serves


def enable_persistent_cache() -> str | None:
    """Point JAX at the cache (once); returns the directory in use, or None when off."""
    if os.environ.get("JAXENGINE_XLA_CACHE", "1") == "0":
        return None
    current = jax.config.jax_compilation_cache_dir
    if current:
        return current
    path = str(cache_dir() / "xla")
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)   # the step buckets, not tiny ops
    if jax.config.jax_compilation_cache_max_size == -1:                       # unbounded: no lock
        jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
    logger.info("persistent compilation cache: %s", path)
    return path
