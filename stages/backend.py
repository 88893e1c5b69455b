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


def harden_simulator() -> None:
    """Make Numba's simulated shared memory thread-safe (call after numba.cuda is imported).

    The simulator hands every thread of a block the same NumPy array for a `cuda.shared.array`
    line, created by whichever thread gets there first; that check-then-create is not locked, so
    two threads arriving together can each get a private array and the block's threads stop
    sharing memory. Serialising the allocation restores the CUDA semantics.
    """
    import threading
    import traceback

    import numpy as np
    from numba.core import types
    from numba.cuda.simulator import kernelapi
    from numba.np import numpy_support

    shared = kernelapi.FakeCUDAShared
    if getattr(shared.array, "_flashv41_locked", False):
        return
    dynamic = shared.array
    lock = threading.Lock()

    def array(self, shape, dtype, alignment=None):
        if shape == 0 or alignment is not None:  # dynamic shared memory, or the simulator's refusal
            return dynamic(self, shape, dtype, alignment)
        # one array per source line of the kernel (as the simulator keys them), created once
        caller = tuple(traceback.extract_stack(sys._getframe())[-2][0:2])
        with lock:
            found = self._allocations.get(caller)
            if found is None:
                as_numpy = numpy_support.as_dtype(dtype) if isinstance(dtype, types.Type) else dtype
                found = self._allocations[caller] = np.empty(shape, as_numpy)
        return found

    # patching the simulator's class on purpose (a function attribute marks it done), which mypy
    # flags as an assignment to a method and an unknown attribute
    array._flashv41_locked = True  # type: ignore[attr-defined]
    shared.array = array  # type: ignore[method-assign]


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
