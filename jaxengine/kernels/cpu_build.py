"""Build and register the package's small C++ CPU kernels (called from XLA through ``jax.ffi``).

Each kernel's source ships with the package and is compiled on first use with the machine's C++
compiler (``$CXX``, else ``g++``) against the FFI headers jaxlib ships, into
``$JAXENGINE_CACHE/kernels``, keyed by the sources, jaxlib's version, the flags and the CPU (the
code is built for this CPU). A kernel that cannot be built is logged once and its caller keeps
XLA's path.
"""
from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

import jax
import jaxlib

from jaxengine.paths import cache_dir

try:
    import fcntl
except ImportError:        # not on Windows
    fcntl = None

logger = logging.getLogger(__name__)
HERE = Path(__file__).parent
SHARED_HEADERS = (HERE / "cpu_pool.h", HERE / "cpu_gemm.h", HERE / "fp8.h")
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC")


def register_kernel(source: Path, symbol: str, target: str, what: str, *, include_dirs: Sequence[str] = (),
                    link_args: Sequence[str] = ()) -> bool:
    """Build ``source`` (cached), register its handler ``symbol`` as the CPU FFI target ``target``;
    False with a warning naming ``what`` when it cannot be built or loaded."""
    try:
        library = ctypes.CDLL(str(built_library(source, include_dirs=include_dirs, link_args=link_args)))
    except (OSError, subprocess.CalledProcessError) as e:
        why = f"{e}: {e.stderr.strip()[-500:]}" if isinstance(e, subprocess.CalledProcessError) else str(e)
        logger.warning("the %s kernel could not be built (%s); using XLA's path", what, why)
        return False
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, symbol)), platform="cpu")
    return True


def built_library(source: Path, *, include_dirs: Sequence[str] = (), link_args: Sequence[str] = ()) -> Path:
    """The compiled ``source``, built on first use, by one process while others starting together
    wait for it; the build is written to a file of its own and renamed into place, so a failed
    build leaves nothing behind."""
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise FileNotFoundError("no C++ compiler (g++ or $CXX) on PATH")
    includes = [str(HERE), jax.ffi.include_dir(), *include_dirs]
    key = hashlib.sha256(b"\0".join([
        source.read_bytes(), *(h.read_bytes() for h in SHARED_HEADERS), jaxlib.__version__.encode(),
        " ".join([*FLAGS, *includes, *link_args]).encode(), compiler.encode(), _cpu_identity()])).hexdigest()[:16]
    path = cache_dir() / "kernels" / f"{source.stem}-{key}.so"
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with _build_lock(cache_dir() / "locks" / f"{path.stem}.lock"):
        if path.exists():                  # another process built it while this one waited
            return path
        with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".so", delete=False) as tmp:
            pass
        try:
            subprocess.run([compiler, *FLAGS, *(f"-I{d}" for d in includes), str(source), "-o", tmp.name,
                            *link_args], check=True, capture_output=True, text=True)
            os.replace(tmp.name, path)
        finally:
            Path(tmp.name).unlink(missing_ok=True)
    return path


@contextlib.contextmanager
def _build_lock(lock: Path):
    """Processes starting together (a server's replicas, a job's processes) build a kernel once:
    the others wait for it (a build takes seconds of a core). Where there are no file locks, each
    builds its own copy and the rename keeps the cache whole."""
    if fcntl is None:
        yield
        return
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _cpu_identity() -> bytes:
    """-march=native code runs only where it was built: key the build by the CPU's model and flags."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor().encode()
    return "".join(line for line in info.splitlines(keepends=True)
                   if line.startswith(("model name", "flags"))).encode()
