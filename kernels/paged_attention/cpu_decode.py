"""The CPU's decode attention as a small compiled kernel (``cpu_decode.cc``) called through
``jax.ffi``: it reads each row's pages in place, where XLA gathers them into a temporary first, and
shares the rows between the cores through XLA's own thread pool (BENCHMARKS.md, "decode attention
read in place").

The source ships with the package and is compiled on first use with the machine's C++ compiler
(``$CXX``, else ``g++``) against the FFI headers jaxlib ships, into ``$JAXENGINE_CACHE/kernels``,
keyed by the source, jaxlib's version and the CPU. Without a compiler, or with
``JAXENGINE_CPU_DECODE_KERNEL=0``, ``available()`` is False and the plain-jnp path serves (a
warning says why, once).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

from jaxengine.models.paths import cache_dir

logger = logging.getLogger(__name__)
SOURCE = Path(__file__).with_name("cpu_decode.cc")
TARGET = "jaxengine_paged_decode"
MAX_HEADS, MAX_PAGE = 128, 64         # the kernel's kMaxHeads and kMaxPage
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC")


def serves(q: jax.Array, k_cache: jax.Array) -> bool:
    """Whether the kernel serves this layer on this backend: f32, a CPU, N and S in its limits."""
    num_heads, kv_heads = q.shape[1], k_cache.shape[2]
    return (jax.default_backend() == "cpu" and k_cache.dtype == jnp.float32 and num_heads % kv_heads == 0
            and num_heads <= MAX_HEADS and k_cache.shape[1] <= MAX_PAGE and available())


@functools.cache
def available() -> bool:
    if os.environ.get("JAXENGINE_CPU_DECODE_KERNEL", "1") == "0":
        return False
    try:
        library = ctypes.CDLL(str(_built_library()))
    except (OSError, subprocess.CalledProcessError) as e:
        why = f"{e}: {e.stderr.strip()[-500:]}" if isinstance(e, subprocess.CalledProcessError) else str(e)
        logger.warning("the CPU decode-attention kernel could not be built (%s); using the plain-jnp path", why)
        return False
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(library.JaxenginePagedDecode), platform="cpu")
    return True


def paged_decode(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, tables: jax.Array, lens: jax.Array, *,
                 sliding_window: int | None = None, soft_cap: float | None = None) -> jax.Array:
    """q [B, N, H] f32, already scaled; tables [B, M]; lens [B] keys each row attends to (0: a
    padding row, whose output is zeros) -> [B, N, H] f32."""
    if not available():
        raise RuntimeError("the CPU decode-attention kernel is not available (see the warning logged)")
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32), vmap_method="sequential")
    return call(q.astype(jnp.float32), k_cache, v_cache, tables.astype(jnp.int32), lens.astype(jnp.int32),
                sliding_window=int(sliding_window or 0), soft_cap=np.float32(soft_cap or 0.0))


def _built_library() -> Path:
    """The compiled kernel, built on first use; concurrent builders each write their own file
    and rename it into place."""
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise FileNotFoundError("no C++ compiler (g++ or $CXX) on PATH")
    key = hashlib.sha256(b"\0".join([SOURCE.read_bytes(), jaxlib.__version__.encode(), " ".join(FLAGS).encode(),
                                     compiler.encode(), _cpu_identity()])).hexdigest()[:16]
    path = cache_dir() / "kernels" / f"cpu_decode-{key}.so"
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".so", delete=False) as tmp:
        pass
    try:
        subprocess.run([compiler, *FLAGS, f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o", tmp.name],
                       check=True, capture_output=True, text=True)
        os.replace(tmp.name, path)
    finally:
        Path(tmp.name).unlink(missing_ok=True)
    return path


def _cpu_identity() -> bytes:
    """-march=native code runs only where it was built: key the build by the CPU's model and flags."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor().encode()
    return "".join(line for line in info.splitlines(keepends=True)
                   if line.startswith(("model name", "flags"))).encode()
