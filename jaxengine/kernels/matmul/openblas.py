"""Where the CPU kernels find OpenBLAS: the ``scipy-openblas32`` wheel, the build NumPy and SciPy
are built against, with its headers."""
from __future__ import annotations

import functools
import logging
import os

logger = logging.getLogger(__name__)


@functools.cache
def openblas_build() -> dict | None:
    """The compiler's include and link arguments for OpenBLAS, or None (a warning says why, once)
    without the wheel or with ``JAXENGINE_CPU_MATMUL_KERNEL=0``: the callers keep XLA's dot."""
    if os.environ.get("JAXENGINE_CPU_MATMUL_KERNEL", "1") == "0":
        return None
    try:
        import scipy_openblas32 as openblas
    except ImportError:
        logger.warning("the CPU matmul kernels need the scipy-openblas32 package; using XLA's dot")
        return None
    lib = openblas.get_lib_dir()
    return dict(include_dirs=[openblas.get_include_dir()],
                link_args=[f"-L{lib}", f"-l{openblas.get_library()}", f"-Wl,-rpath,{lib}"])
