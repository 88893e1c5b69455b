"""Error bounds the GPU tests hold kernels to, each saying what it means.

The oracle accumulates every reduction in float64 and rounds once; a kernel accumulates in float32
in its own order. Summing K terms in float32, in any order, is off by at most
K * 2^-24 * sum_k |term_k| (the classic recursive-summation bound, generous for tree orders).
A bf16 output then adds its rounding: two values within e of each other round to bf16 values at
most e + one bf16 ulp apart.
"""

from __future__ import annotations

import numpy as np


def bf16_ulp(x: np.ndarray) -> np.ndarray:
    """Spacing of bf16 values at |x| (8 significant bits), never below the smallest normal's."""
    mag = np.maximum(np.abs(np.asarray(x, np.float64)), 2.0**-126)
    return 2.0 ** (np.floor(np.log2(mag)) - 7)


def f32_sum_error(abs_sum: np.ndarray, k: int) -> np.ndarray:
    """Worst-case float32 summation error of k terms whose magnitudes add up to abs_sum."""
    return k * 2.0**-24 * np.asarray(abs_sum, np.float64)


def assert_within(got: np.ndarray, ref: np.ndarray, bound: np.ndarray, what: str) -> None:
    """|got - ref| <= bound elementwise; on failure, report the worst element."""
    got64 = np.asarray(got, np.float64)
    ref64 = np.asarray(ref, np.float64)
    err = np.abs(got64 - ref64)
    excess = err - np.broadcast_to(bound, err.shape)
    if not (excess <= 0).all():
        i = np.unravel_index(int(np.argmax(excess)), err.shape)
        limit = np.broadcast_to(bound, err.shape)[i]
        raise AssertionError(
            f"{what}: {int((excess > 0).sum())} of {err.size} values out of bound; worst at {i}: "
            f"got {got64[i]!r}, oracle {ref64[i]!r}, error {err[i]:.3e} > bound {limit:.3e}"
        )


def assert_bf16_product(got: np.ndarray, ref: np.ndarray, x: np.ndarray, w: np.ndarray, what: str) -> None:
    """A bf16 result of x [.., K] @ w[N, K]^T against the oracle's: fp32 summation + one bf16 ulp."""
    abs_sum = np.abs(np.asarray(x, np.float64)) @ np.abs(np.asarray(w, np.float64)).T
    bound = f32_sum_error(abs_sum, x.shape[-1]) + bf16_ulp(np.maximum(np.abs(got), np.abs(ref)))
    assert_within(got, ref, bound, what)
