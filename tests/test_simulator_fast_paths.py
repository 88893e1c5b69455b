"""tests/simulator_fast_paths.py: the suite's shorter cast and element paths through the CUDA
simulator are installed, and give what the simulator's own paths give (values, dtypes, errors,
sub-arrays that write through, records)."""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda, float32, int8, uint16, uint32

from flashv41.stages.backend import using_simulator
from tests import conftest, simulator_fast_paths

pytestmark = pytest.mark.skipif(not using_simulator(), reason="the CUDA simulator's paths")


def test_installed() -> None:
    from numba.core.types import abstract
    from numba.cuda.simulator.cudadrv import devicearray

    assert conftest.SIMULATOR_FAST_PATHS
    assert abstract.Type.__call__ is simulator_fast_paths.fast_call
    assert devicearray.FakeWithinKernelCUDAArray.__getitem__ is simulator_fast_paths.getitem
    assert devicearray.FakeCUDAArray.__getitem__ is simulator_fast_paths.inner_getitem


@pytest.mark.parametrize("value", [0, 7, 2**31 + 5, -3, 1.75, -0.5, np.float64(3.5), np.uint64(2**40 + 9),
                                   np.int16(-2), True, np.float32(1e-3)])
@pytest.mark.parametrize("numba_type", [uint32, int8, uint16, float32], ids=str)
def test_casts_as_the_original(numba_type, value) -> None:
    """The same value and dtype, or the same error, as the original Type.__call__."""
    original = simulator_fast_paths._ORIGINAL["call"]
    try:
        want = original(numba_type, value)
    except Exception as e:  # noqa: BLE001 (whatever it raises, the fast path raises too)
        with pytest.raises(type(e)):
            simulator_fast_paths.fast_call(numba_type, value)
        return
    got = simulator_fast_paths.fast_call(numba_type, value)
    assert type(got) is type(want) and (got == want or (np.isnan(got) and np.isnan(want)))


def test_a_signature_is_still_a_signature() -> None:
    assert str(uint32(float32, uint32)) == str(simulator_fast_paths._ORIGINAL["call"](uint32, float32, uint32))


@cuda.jit
def _rows_and_records(a, recs, out):
    i = cuda.threadIdx.x
    row = a[i]  # a sub-array: a write to it lands in a
    row[0] = row[1] + uint32(100)
    rec = recs[i]
    out[i] = rec["x"] * float32(2) + float32(rec["n"])


def test_sub_arrays_write_through_and_records_read() -> None:
    a = np.arange(8, dtype=np.uint32).reshape(4, 2)
    recs = np.zeros(4, dtype=[("x", np.float32), ("n", np.int32)])
    recs["x"], recs["n"] = [0.5, 1.5, 2.5, 3.5], [1, 2, 3, 4]
    out = np.zeros(4, np.float32)
    _rows_and_records[1, 4](a, recs, out)
    assert a[:, 0].tolist() == [101, 103, 105, 107]
    assert out.tolist() == [2.0, 5.0, 8.0, 11.0]


@cuda.jit
def _views(a, out):
    i = cuda.threadIdx.x
    halves = a.view(np.uint16)  # a view made in the kernel
    row = halves[i]  # a row of it
    out[i] = uint32(row[0]) + uint32(row[3])


def test_views_made_in_a_kernel_read_and_slice() -> None:
    a = np.arange(8, dtype=np.uint32).reshape(4, 2) * np.uint32(65537)  # each half the word's index
    out = np.zeros(4, np.uint32)
    _views[1, 4](a, out)
    assert out.tolist() == [2 * i + 2 * i + 1 for i in range(4)]


def test_out_of_bounds_still_raises() -> None:
    @cuda.jit
    def past_the_end(out):
        out[cuda.threadIdx.x + 3] = 1

    with pytest.raises(IndexError):
        past_the_end[1, 2](np.zeros(4, np.int32))
