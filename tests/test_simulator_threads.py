"""tests/simulator_threads.py: the suite's block manager for the CUDA simulator is installed, and
keeps the simulator's contract (barriers, shared memory, exceptions naming the thread)."""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

from flashv41.stages.backend import using_simulator
from tests import conftest, simulator_threads

pytestmark = pytest.mark.skipif(not using_simulator(), reason="the CUDA simulator's block manager")


def test_installed() -> None:
    from numba.cuda.simulator import kernel

    assert conftest.SIMULATOR_THREADS and kernel.BlockManager.run is simulator_threads.run_block


@cuda.jit
def _rounds(out, rounds):
    """Each round every thread adds its left neighbour's previous value: barriers between reads
    and writes, so a thread released early reads a value of the wrong round."""
    shared = cuda.shared.array(8, np.int64)
    i = cuda.threadIdx.x
    shared[i] = i
    cuda.syncthreads()
    for _ in range(rounds):
        left = shared[(i + 7) % 8]
        cuda.syncthreads()
        shared[i] += left
        cuda.syncthreads()
    out[cuda.blockIdx.x, i] = shared[i]


def test_barriers_hold_every_round() -> None:
    want = np.arange(8, dtype=np.int64)
    for _ in range(5):
        want = want + np.roll(want, 1)
    out = np.zeros((3, 8), np.int64)
    _rounds[3, 8](out, 5)
    assert (out == want).all()


@cuda.jit
def _out_of_bounds(out):
    out[cuda.threadIdx.x + 2] = 1


def test_an_exception_names_its_thread_and_the_next_launch_runs() -> None:
    with pytest.raises(IndexError, match=r"tid=\[2, 0, 0\]"):
        _out_of_bounds[1, 4](np.zeros(4, np.int32))
    out = np.zeros((1, 8), np.int64)
    _rounds[1, 8](out, 1)
    assert out[0].tolist() == [i + (i - 1) % 8 for i in range(8)]
