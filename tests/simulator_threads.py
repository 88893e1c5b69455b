"""A quieter block manager for Numba's CUDA simulator, installed for the test suite.

The simulator runs a block's threads as Python threads, and its block manager waits for them by
polling their states in a loop that never sleeps. Python threads share one interpreter lock, so
that loop takes a large share of the CPU from the very threads it waits for: on the tiny model, a
decode step compared with the oracle spends about a third of its time there (measured with
cProfile, 2026-12-07). `run_block` does the manager's job (start the block's threads, release
them together when every live one waits at a barrier, re-raise the first exception) but waits in a
`join` with a timeout, which sleeps without the lock. The kernels, their arguments and what they
compute are untouched: only how the simulator's main thread waits changes.

`install()` swaps it in when the simulator's BlockManager and BlockThread are those it was written
for (their attributes checked on a one-block kernel with a barrier, whose result is checked too);
otherwise the simulator is left as it is.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import cuda  # (imported by tests/conftest.py after it chose the backend)

WAIT_S = 1e-4  # the longest a barrier waits for the manager to notice every thread has reached it


def run_block(manager: Any, grid_point: tuple[int, ...], *args: Any) -> None:
    """BlockManager.run's contract: run one block of the kernel to its end."""
    from numba.cuda.simulator.kernel import BlockThread

    def body() -> None:
        manager._f(*args)

    threads = [BlockThread(body, manager, grid_point, point, manager._debug)
               for point in np.ndindex(*manager._block_dim)]
    for thread in threads:
        thread.start()
    live = threads
    while live:
        _raise_first(threads)
        running = [t for t in live if not t.syncthreads_blocked]
        if running:
            running[0].join(WAIT_S)
        else:  # every live thread waits at the barrier: release them together
            for thread in live:
                thread.syncthreads_blocked = False
                thread.syncthreads_event.set()
        live = [t for t in live if t.is_alive()]
    _raise_first(threads)


def _raise_first(threads: list[Any]) -> None:
    failed = next((t for t in threads if t.exception), None)
    if failed is None:
        return
    for thread in threads:  # the others stop at their next barrier
        thread.abort = True
        thread.syncthreads_blocked = False
        thread.syncthreads_event.set()
    raise failed.exception[0].with_traceback(failed.exception[1])


def _reverse(a, out):
    """out = a reversed, through shared memory and a barrier (install's check)."""
    shared = cuda.shared.array(4, np.int32)
    i = cuda.threadIdx.x
    shared[i] = a[i]
    cuda.syncthreads()
    out[i] = shared[3 - i]


def install() -> bool:
    """Use run_block for every simulated block if it works with this Numba; whether it does."""
    from numba.cuda.simulator import kernel

    original = kernel.BlockManager.run
    kernel.BlockManager.run = run_block
    try:
        out = np.zeros(4, np.int32)
        cuda.jit(_reverse)[1, 4](np.arange(4, dtype=np.int32), out)
        if out.tolist() == [3, 2, 1, 0]:
            return True
    except Exception:  # noqa: BLE001 (any failure: this Numba's simulator is not the one run_block knows)
        pass
    kernel.BlockManager.run = original
    return False
