"""The GPU stages: one module of Numba CUDA kernels and a host wrapper per pipeline stage.

Importing this package selects the backend (real GPU or the CUDA simulator) before numba.cuda
is first imported; see flashv41.runtime.
"""

from flashv41.runtime import harden_simulator, select_backend

if select_backend():
    harden_simulator()
