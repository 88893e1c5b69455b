"""dev/sparse_fused.py against the oracle, as tests/test_attention_kernels.py holds the package's
sparse attention: every value within sparse_bound (rotated_bound after the inverse RoPE), at least
SPARSE_EQUAL_MIN of them bit-equal. `python -m pytest dev/test_sparse_fused.py` (outside the suite's
testpaths: a dev/ kernel). On the simulator the shapes of D = 64; on a GPU the flash shape too, and
a timing beside the split path (`python -m dev.test_sparse_fused`)."""

from __future__ import annotations

import time

import numpy as np
import pytest
from numba import cuda

from dev.sparse_fused import sparse_fused
from flashv41.stages.device import SIM
from flashv41.stages.sparse_attention import SPLIT_BATCH_TOKENS, SparseWorkspace, sparse_attention
from tests.bounds import assert_within
from tests.test_attention_kernels import (
    FLASH_SPARSE_CASE,
    SPARSE_CASE,
    SPARSE_EQUAL_MIN,
    SPARSE_FP32,
    case_entries,
    dev,
    host_bf16,
    sparse_inputs,
    sparse_reference,
)

# seed, T, H, D, W, chunk rows, groups, selected: the suite's (E = 140, three blocks, the last part
# full), one list shorter than a block (E = 28), 20 heads (a second group of 16 with 4 real heads),
# D = 128 (two fragment pairs a warp), and a window of 64 with no selection at all
CASES = [SPARSE_CASE, (21, 3, 4, 64, 8, 6, 40, 20), (23, 3, 20, 64, 16, 8, 100, 70), (25, 2, 16, 128, 16, 8, 80, 60)]
GPU_CASES = [FLASH_SPARSE_CASE, (31, 64, 64, 512, 128, 64, 2048, 512)]


def run_fused(args: tuple) -> np.ndarray:
    q = args[0]
    out = cuda.device_array(q.shape, np.uint16)
    sparse_fused(*dev(args, fp32=SPARSE_FP32), out, q.shape[0])
    return host_bf16(out)


def check(args: tuple, what: str) -> None:
    ref, bound = sparse_reference(args)
    got = run_fused(args)
    assert_within(got, ref, bound, what)
    equal = float(np.mean(got == ref))
    assert equal >= SPARSE_EQUAL_MIN, f"{what}: {equal:.2%} of values bit-equal < {SPARSE_EQUAL_MIN:.0%}"


@pytest.mark.parametrize("case", CASES + ([] if SIM else GPU_CASES),
                         ids=lambda c: f"T{c[1]}H{c[2]}D{c[3]}E{c[4] + c[7]}")
def test_fused_within_bound(case):
    check(sparse_inputs(*case), "fused sparse attention")


def test_fused_window_only():
    """Without a selection: the window's entries alone (a ratio-0 layer)."""
    args = sparse_inputs(24, 4, 2, 64, 64, 8, 10, 4)
    check((*args[:5], None, *args[6:]), "fused sparse attention, window only")


def test_fused_catches_a_dropped_block():
    """The check above rejects a kernel that leaves out the last entry block (its list cut to the
    first 64 entries): the bound is not loose enough to let that through."""
    args = sparse_inputs(*SPARSE_CASE)
    assert case_entries(args).shape[1] > 64
    ref, bound = sparse_reference(args)
    cut = (*args[:5], args[5][:, : 64 - args[1].shape[0]], *args[6:])  # 64 entries: the window and the first groups
    got = run_fused(cut)
    with pytest.raises(AssertionError):
        assert_within(got, ref, bound, "fused sparse attention over one block")


def time_both(case=(31, 64, 64, 512, 128, 64, 2048, 512), reps: int = 5) -> None:
    """Seconds of the fused kernel and of the split path (tensor cores) on one case, on a GPU."""
    args = sparse_inputs(*case)
    d = dev(args, fp32=SPARSE_FP32)
    q = args[0]
    t, heads, dim = q.shape
    out = cuda.device_array(q.shape, np.uint16)
    ws = SparseWorkspace.allocate(SPLIT_BATCH_TOKENS, heads, dim, case_entries(args).shape[1], most=SPLIT_BATCH_TOKENS)
    runs = {"fused": lambda: sparse_fused(*d, out, t),
            "split tc": lambda: sparse_attention(*d, out, t, workspace=ws, cores="tc")}
    for name, run in runs.items():
        run()
        cuda.synchronize()
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            run()
            cuda.synchronize()
            times.append(time.perf_counter() - start)
        entries = case_entries(args).shape[1]
        flop = 4 * t * heads * entries * dim
        best = min(times)
        print(f"{name:9s} T={t} H={heads} D={dim} E={entries}: {best * 1e6:9.1f} us, {flop / best / 1e12:6.1f} TFLOP/s")


if __name__ == "__main__":
    from flashv41.stages.backend import select_backend

    select_backend()
    for tokens in (64, 256):
        time_both((31, tokens, 64, 512, 128, max(64, tokens), 2048, 512))
