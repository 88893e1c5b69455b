"""The GPU stages (`flashv41.stages`): one module of Numba CUDA kernels and a host wrapper per
pipeline stage, the device helpers they share (`device`) and the backend choice (`backend`).

Importing this package selects the backend (a real GPU or the CUDA simulator) before numba.cuda
is first imported. It imports `flashv41.host` only.
"""

if __name__ != "flashv41.stages":
    raise ImportError("the GPU stages install as flashv41.stages: import flashv41.stages, not stages")

from flashv41.stages.backend import harden_simulator, select_backend  # noqa: E402 (after the guard)

if select_backend():
    harden_simulator()
