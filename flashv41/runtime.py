"""Choosing where the kernels run: a real CUDA GPU, or Numba's CUDA simulator on the CPU.

Numba reads `NUMBA_ENABLE_CUDASIM` once, when `numba.cuda` is first imported, so the choice must
be made before that. `select_backend()` is called by `stages/__init__.py`, i.e. before any kernel
module is imported:

- `NUMBA_ENABLE_CUDASIM` already set (to anything): respected as is;
- otherwise: the simulator when no CUDA driver can be initialised, the GPU when one can.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

_SIM = "NUMBA_ENABLE_CUDASIM"


def cuda_driver_available() -> bool:
    """True when libcuda loads and cuInit(0) succeeds (a driver and at least one device)."""
    names = [n for n in ("libcuda.so.1", "libcuda.so", ctypes.util.find_library("cuda")) if n]
    for name in names:
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        try:
            return int(lib.cuInit(0)) == 0
        except AttributeError:
            return False
    return False


def select_backend() -> bool:
    """Decide GPU or simulator (once); returns True when the simulator is in use."""
    if _SIM not in os.environ:
        os.environ[_SIM] = "0" if cuda_driver_available() else "1"
    if using_simulator():
        # The simulator runs each CUDA thread as a Python thread and polls them from a manager
        # loop: with the default 5 ms switch interval every barrier costs about 5 ms, with 0.1 ms
        # about ten times less. It only changes how often the interpreter switches threads.
        sys.setswitchinterval(1e-4)
    return using_simulator()


def using_simulator() -> bool:
    return os.environ.get(_SIM, "0") not in ("", "0")


def backend_name() -> str:
    """'CUDA simulator (CPU)' or the GPU's name."""
    select_backend()
    if using_simulator():
        return "CUDA simulator (CPU)"
    from numba import cuda

    name = cuda.get_current_device().name
    return name.decode() if isinstance(name, bytes) else str(name)
