"""Where jaxengine keeps what it downloads and converts: ``$JAXENGINE_CACHE``, by default
~/.cache/jaxengine, and the folder of a checkpoint's converted weights (and tokenizer) in it.
Imports neither JAX nor Flax, so host-side code can find the cache cheaply."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path


def cache_dir() -> Path:
    return Path(os.environ.get("JAXENGINE_CACHE", Path.home() / ".cache" / "jaxengine"))


def converted_cache_path(path: Path, variant: str = "") -> Path:
    """The cache folder of ``path``'s converted weights: keyed by its size and modification time
    too, so a file replaced in place is converted again; a ``variant`` (another conversion of
    the same file) has a folder of its own."""
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_dir() / "converted" / f"{path.stem}-{key}{'-' + variant if variant else ''}"
