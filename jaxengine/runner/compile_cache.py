"""JAX's persistent compilation cache under ``$JAXENGINE_CACHE/xla`` (default
~/.cache/jaxengine/xla): a second start of the same model and buckets loads its step programs
instead of compiling them (the default model on the CPU: 43 s -> 13 s to start).
``JAXENGINE_XLA_CACHE=0`` turns it off; a cache directory the user set for JAX is left alone.

Processes share the folder and may start together; JAX writes an entry in place, so the cache is
given a size bound (least recently used entries go past it): with one, JAX takes a file lock
around each read and write, and no process reads an entry another is still writing. An entry
written with no bound (by an older version, or a process with JAX's own setting) has no access
time beside it, and JAX's eviction, which reads every entry's, then fails every later write (a
warning per program, nothing cached again): such entries are given one when the cache opens."""
from __future__ import annotations

import logging
import os
from pathlib import Path

import jax

from jaxengine.paths import cache_dir

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
    if jax.config.jax_compilation_cache_max_size != -1:
        stamp_unstamped_entries(Path(path))
    logger.info("persistent compilation cache: %s", path)
    return path


def stamp_unstamped_entries(path: Path) -> int:
    """Give each entry of the cache at ``path`` that lacks one an access-time file (its own
    modification time, as JAX writes them: 8 bytes of nanoseconds, little-endian); returns how
    many. A process writing an entry meanwhile writes its own after, over this one."""
    count = 0
    for entry in path.glob("*-cache") if path.is_dir() else ():
        atime = entry.with_name(entry.name.removesuffix("-cache") + "-atime")
        if not atime.exists():
            try:
                atime.write_bytes(entry.stat().st_mtime_ns.to_bytes(8, "little"))
                count += 1
            except OSError as e:                    # a read-only or vanished entry: JAX will say so
                logger.warning("compilation cache entry %s: %s", entry, e)
    return count
