"""dev/sparse_fused2.py against stages.sparse_fused (the same products and roundings: the same bits)
and, through it, the oracle's bound: `python -m pytest dev/test_sparse_fused2.py` (outside the
suite's testpaths: a dev/ kernel). `python -m dev.test_sparse_fused2` times the two on a GPU at the
flash shape (64 heads x 512, 640 entries), 64 and 512 tokens, and a batch of 64 through tables."""

from __future__ import annotations

import time

import numpy as np
import pytest
from numba import cuda

from dev.sparse_fused2 import fused2_attention
from flashv41.stages.device import SIM
from flashv41.stages.sparse_fused import fused_attention
from tests.test_attention_kernels import (
    FLASH_SPARSE_CASE,
    SPARSE_FP32,
    check_sparse_attention,
    dev,
    host_bf16,
    sparse_inputs,
)

# the stage's test shapes (D = 64 and 128, 2 to 40 heads: one block of 32 heads with 2 real ones, a
# full one and a partial second one)
CASES = [(12, 4, 2, 64, 8, 6, 160, 132), (21, 3, 4, 64, 8, 6, 40, 20), (23, 3, 40, 64, 16, 8, 100, 70),
         (25, 2, 16, 128, 16, 8, 80, 60)]


def launch(fn, args: tuple) -> np.ndarray:
    """fn (fused_attention or fused2_attention) over oracle.attend's arguments."""
    q, ring, chunk_rows, comp, positions, selection, sinks, scale, cos, sin = dev(args, fp32=SPARSE_FP32)
    t, heads, dim = args[0].shape
    window = ring.shape[0]
    chosen = positions.reshape(t, 1) if selection is None else selection
    rope_dim = 2 * cos.shape[1]
    out = cuda.device_array((t, heads, dim), np.uint16)
    fn(q, ring, chunk_rows, comp, positions, chosen, window + (0 if selection is None else selection.shape[1]),
       sinks, scale, cos, sin, out, t, 0, rope_dim)
    return host_bf16(out)


@pytest.mark.parametrize("case", CASES + ([] if SIM else [FLASH_SPARSE_CASE]),
                         ids=lambda c: f"T{c[1]}H{c[2]}D{c[3]}E{c[4] + c[7]}")
def test_same_bits_as_the_stage(case):
    args = sparse_inputs(*case)
    assert np.array_equal(launch(fused2_attention, args), launch(fused_attention, args))


def test_stage_within_bound():
    """The stage's kernel, which the test above holds this one to, within the oracle's bound on the
    40-head case (the bound's check: tests/test_attention_kernels.check_sparse_attention)."""
    check_sparse_attention(*CASES[2], "sparse attention (fused)", split=True, cores="fused")


def time_both(tokens: int, reps: int = 5) -> None:
    args = sparse_inputs(31, tokens, 64, 512, 128, max(64, tokens), 2048, 512)
    d = dev(args, fp32=SPARSE_FP32)
    q, ring, chunk_rows, comp, positions, selection, sinks, scale, cos, sin = d
    out = cuda.device_array(args[0].shape, np.uint16)
    for name, fn in (("stage", fused_attention), ("fused2", fused2_attention)):
        def run(fn=fn):
            fn(q, ring, chunk_rows, comp, positions, selection, 640, sinks, scale, cos, sin, out, tokens, 0, 64)
        run()
        cuda.synchronize()
        best = float("inf")
        for _ in range(reps):
            start = time.perf_counter()
            run()
            cuda.synchronize()
            best = min(best, time.perf_counter() - start)
        flop = 4 * tokens * 64 * 640 * 512
        print(f"{name:7s} T={tokens}: {best * 1e6:9.1f} us, {flop / best / 1e12:6.1f} TFLOP/s")


if __name__ == "__main__":
    from flashv41.stages.backend import select_backend

    select_backend()
    for tokens in (64, 512):
        time_both(tokens)
