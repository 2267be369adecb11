"""Where the CPU kernels find OpenBLAS: the ``scipy-openblas32`` wheel, the build NumPy and SciPy
are built against, with its headers."""
from __future__ import annotations

import functools
import logging

logger = logging.getLogger(__name__)


_choice: bool | None = None     # the process's: the compiled CPU matmul kernels (True) or XLA's dot


def use_cpu_matmul_kernels(enabled: bool) -> None:
    """The process's choice of matmul on the CPU (the engine option ``cpu_matmul_kernels``, set at
    start-up before a model is built): the compiled kernels, or XLA's dot. A model's weights are
    laid out for the one chosen, so the choice holds for the whole process: another one after the
    first use is a ValueError."""
    global _choice
    if _choice is not None and _choice != bool(enabled):
        raise ValueError(f"cpu_matmul_kernels: this process already runs its models with "
                         f"cpu_matmul_kernels={_choice}; the choice holds for the whole process")
    _choice = bool(enabled)


def cpu_matmul_kernels_chosen() -> bool:
    """The process's choice (True until one is made; reading it fixes it)."""
    global _choice
    if _choice is None:
        _choice = True
    return _choice


@functools.cache
def openblas_build() -> dict | None:
    """The compiler's include and link arguments for OpenBLAS, or None (a warning says why, once)
    without the wheel or with ``cpu_matmul_kernels`` off: the callers keep XLA's dot."""
    if not cpu_matmul_kernels_chosen():
        return None
    try:
        import scipy_openblas32 as openblas
    except ImportError:
        logger.warning("the CPU matmul kernels need the scipy-openblas32 package; using XLA's dot")
        return None
    lib = openblas.get_lib_dir()
    return dict(include_dirs=[openblas.get_include_dir()],
                link_args=[f"-L{lib}", f"-l{openblas.get_library()}", f"-Wl,-rpath,{lib}"])
