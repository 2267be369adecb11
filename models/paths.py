"""Where jaxengine keeps what it downloads and converts: ``$JAXENGINE_CACHE``, by default
~/.cache/jaxengine. Imports neither JAX nor Flax, so host-side code can find the cache cheaply."""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    return Path(os.environ.get("JAXENGINE_CACHE", Path.home() / ".cache" / "jaxengine"))
