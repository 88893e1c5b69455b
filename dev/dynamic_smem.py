"""Dynamic shared memory past 48 KiB from numba-cuda (issue 44's first step; not in the package).

A kernel may use at most 48 KiB of shared memory unless the driver is told, per kernel, that it
may take more: the function attribute CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES (up to 227
KiB a block on sm_90, static and dynamic together). numba-cuda launches with any dynamic size
(`kernel[grid, block, stream, nbytes]`, the memory read through `cuda.shared.array(0, dtype)`), but
has no call that sets the attribute. Its own carveout setter shows the way: compile the overload
for the launch's argument types, take its loaded function (`library.get_cufunc()`, a CUkernel
handle) and call the driver's `cuKernelSetAttribute` with the attribute, the size and the device.

`allow_dynamic_shared(dispatcher, argtypes, nbytes)` does that (now stages.device's, which
stages.sparse_fused uses); on the simulator it does nothing. `probe(nbytes)` launches a kernel
whose every block fills `nbytes` of dynamic shared memory with its own words, reads them back in
another thread's order after a barrier, and sums them: on a GPU, a launch past 48 KiB without the
attribute is refused by the driver, and with it the sums must be exact.

What it was for (stages.gemm_pipe, BF16 4096-token products on an H100 at 227-345 TFLOP/s,
0.31-0.47x cuBLAS): deeper cp.async rings and larger tiles. A copy of the pipe kernel with its rings
in dynamic shared memory ran at 3, 4 and 5 stages on an H100 on 2026-12-07, bit-equal and no faster
(docs/performance-log.md), and left dev/ (git history keeps it); 128 x 256 tiles, which halve the B
traffic a flop, are not tried. dev/test_dynamic_smem.py shows that the attribute takes.
"""

from __future__ import annotations

import numpy as np
from numba import cuda, int64, uint32

from flashv41.stages.device import SHARED_SM90_LIMIT, SHARED_STATIC_LIMIT, allow_dynamic_shared

STATIC_LIMIT = SHARED_STATIC_LIMIT
SM90_LIMIT = SHARED_SM90_LIMIT
PROBE_THREADS = 256


@cuda.jit
def _probe_kernel(words, sums):
    """Block b writes words[i] + b into each of `words.size` dynamic shared words, then (after a
    barrier) each thread sums the words another thread wrote; sums[b] = the block's total."""
    smem = cuda.shared.array(0, uint32)
    n = words.shape[0]
    tid = cuda.threadIdx.x
    b = cuda.blockIdx.x
    for i in range(tid, n, cuda.blockDim.x):
        smem[i] = words[i] + uint32(b)
    cuda.syncthreads()
    other = (tid + 1) % cuda.blockDim.x  # read the words the next thread wrote
    total = int64(0)
    for i in range(other, n, cuda.blockDim.x):
        total += int64(smem[i])
    cuda.atomic.add(sums, b, total)


def probe(nbytes: int, blocks: int = 4, allow: bool = True) -> np.ndarray:
    """The probe kernel over `nbytes` of dynamic shared memory a block (a multiple of 4), `blocks`
    blocks, the attribute set first when `allow`: each block's sum (compare with `expected`)."""
    words = np.arange(nbytes // 4, dtype=np.uint32)
    d_words = cuda.to_device(words)
    d_sums = cuda.to_device(np.zeros(blocks, np.int64))
    if allow:
        from numba import typeof

        allow_dynamic_shared(_probe_kernel, (typeof(d_words), typeof(d_sums)), nbytes)
    _probe_kernel[blocks, PROBE_THREADS, 0, nbytes](d_words, d_sums)
    return d_sums.copy_to_host()


def expected(nbytes: int, blocks: int = 4) -> np.ndarray:
    n = nbytes // 4
    base = n * (n - 1) // 2
    return np.array([base + n * b for b in range(blocks)], np.int64)
