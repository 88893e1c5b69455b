"""Compile-check mode: compile every kernel the tests launch for a real GPU (sm_90), on a machine
without one.

The simulator runs kernels as Python, so it accepts code that Numba's CUDA compiler rejects
(untyped values, NumPy calls, shapes that are not compile-time constants). With
`FLASHV41_COMPILE_CHECK=1 python -m pytest`, the CUDA target is used instead of the simulator with
a stand-in device of compute capability 9.0: each launch is typed, lowered and compiled to PTX
through NVVM, but not run; device arrays are NumPy arrays. Results are therefore meaningless, so
test failures other than compile errors are reported as skips; a Numba typing, lowering or NVVM
error fails the test. Needs libNVVM (the CUDA toolkit, or `pip install "numba-cuda[cu13]"`).
"""

from __future__ import annotations

import os

import numpy as np

ENV = "FLASHV41_COMPILE_CHECK"


def enabled() -> bool:
    return os.environ.get(ENV, "") not in ("", "0")


class FakeDeviceArray(np.ndarray):
    """A NumPy array standing in for a device array."""

    def copy_to_host(self, ary=None, stream=0):
        host = np.asarray(self).copy()
        if ary is not None:
            ary[...] = host
            return ary
        return host

    def copy_to_device(self, ary, stream=0):
        self[...] = np.asarray(ary)

    def split(self, section, stream=0):
        return [self[i:i + section] for i in range(0, len(self), section)]

    @property
    def nbytes(self):  # type: ignore[override]
        return np.asarray(self).nbytes


def _fake(arr) -> FakeDeviceArray:
    return np.ascontiguousarray(arr).view(FakeDeviceArray)


class _FakeDevice:
    compute_capability = (9, 0)
    name = b"compile-check sm_90"
    id = 0
    MULTIPROCESSOR_COUNT = 132  # an H200's (grids sized per SM)


class _FakeStream:
    handle = 0

    def synchronize(self):
        return None


class _FakeEvent:
    def record(self, stream=0):
        return None

    def synchronize(self):
        return None

    def elapsed_time(self, other):
        return 0.0


def _probe() -> None:
    """Compile one small kernel to sm_90 PTX, so that a machine that cannot compile at all (no
    libNVVM, or no libNVRTC, which numba-cuda asks for the architectures it supports) is one
    clear error at start-up, not every test reported as a skip."""
    from numba import cuda, float32

    def probe(a):
        a[0] = 1.0

    try:
        cuda.compile_ptx(probe, (float32[:],), cc=(9, 0))
    except Exception as e:
        raise RuntimeError(
            f"{ENV}: this machine cannot compile kernels for sm_90 ({type(e).__name__}: {str(e).strip()}). "
            "Compile-check mode needs libNVVM and libNVRTC: the CUDA toolkit, or `pip install \"numba-cuda[cu13]\"`; "
            "where the libraries are installed but not found, put their folder on LD_LIBRARY_PATH") from e


def install() -> None:
    """Switch numba.cuda to compile-only launches and NumPy-backed device arrays."""
    os.environ["NUMBA_ENABLE_CUDASIM"] = "0"
    _probe()
    import numba.cuda.api as api
    import numba.cuda.cudadrv.devices as devices
    import numba.cuda.dispatcher as dispatcher
    from numba import cuda, typeof

    device = _FakeDevice()
    context = type("FakeContext", (), {"device": device})()
    devices.get_context = lambda devnum=None: context
    dispatcher.get_current_device = lambda: device
    api.get_current_device = lambda: device
    cuda.get_current_device = lambda: device

    compiled: set = set()
    # with FLASHV41_KERNEL_CACHE set (stages.device.kernel_cache_dir), a kernel goes through the
    # dispatcher's compile, the disk cache's path (its index key pickles the closure's values; the
    # kernel is saved with its sm_90a cubin, or loaded): binding makes the cubin, with no context. The
    # arch-specific target is what numba-cuda compiles for on Hopper (its code library's _ensure_cc),
    # and what stages.gemm_wgmma's wgmma needs
    dispatcher._Kernel.bind = lambda kernel: kernel._codelibrary.get_cubin(cc=(*_FakeDevice.compute_capability, "a"))

    def launch(self, args, launch_config):
        argtypes = tuple(typeof(a) for a in args)
        if (self, argtypes) not in compiled:
            if isinstance(self._cache, dispatcher.NullCache):
                # typing, lowering and NVVM to PTX happen here; binding to a context is what a real launch adds
                dispatcher._Kernel(self.py_func, argtypes, **self.targetoptions)
            else:
                self.compile(argtypes)
            compiled.add((self, argtypes))

    dispatcher.CUDADispatcher.call = launch
    # the dynamic shared memory a kernel may take is an attribute of its loaded function, which
    # needs a context: here such a kernel is compiled, then launched (compiled) as any other
    from flashv41.stages import device as stage_device

    def allow_dynamic_shared(kernel, argtypes, nbytes):
        kernel.compile(argtypes)

    stage_device.allow_dynamic_shared = allow_dynamic_shared  # (launch_dynamic_shared calls it there)
    cuda.to_device = lambda ary, stream=0, copy=True, to=None: _fake(ary)
    cuda.device_array = lambda shape, dtype=np.float64, strides=None, order="C", stream=0: _fake(
        np.zeros(shape, dtype=dtype))
    cuda.device_array_like = lambda ary, stream=0: _fake(np.zeros_like(ary))
    cuda.pinned_array = lambda shape, dtype=np.float64, strides=None, order="C": np.zeros(shape, dtype=dtype)
    cuda.stream = lambda: _FakeStream()
    cuda.default_stream = lambda: _FakeStream()
    cuda.event = lambda timing=True: _FakeEvent()
    cuda.synchronize = lambda: None


def is_compile_error(exc: BaseException) -> bool:
    """Numba typing / lowering errors and NVVM failures: what this mode is looking for (numba-cuda
    raises its own copies of numba's error classes, numba.cuda.core.errors, so they go by name)."""
    names = ("TypingError", "LoweringError", "UnsupportedError", "NvvmError", "NvvmSupportError", "LinkerError")
    if any(c.__name__ in names and c.__module__.startswith("numba") for c in type(exc).__mro__):
        return True
    # a compiler library that cannot be loaded (cuda.pathfinder's error): nothing was compiled
    return type(exc).__name__ == "DynamicLibNotFoundError"
