"""Error bounds the GPU tests hold kernels to, each saying what it means.

Products: `assert_bf16_product` and `assert_f32_product` hold a kernel's x [.., K] @ w[N, K]^T to
the oracle (host.numerics.linear / matmul_t: float64 sums, rounded once). Two rules:

1. bf16 output: at least BIT_EQUAL_MIN = 99% of the outputs are bit-equal to the oracle's bf16
   result. An fp32 kernel lands on the same bf16 value unless its fp32 error carries the sum across a
   bf16 rounding boundary, which happens with probability about |error| / (bf16 ulp): NumPy
   emulations of the kernels' orders on the tests' Gaussian data (sequential sums, 32 lanes and a
   butterfly, chains of k16 tensor-core steps rounding to nearest) differ on 0-0.13% of outputs at
   K = 256-8192; a chain of k16 steps that truncates (what tensor cores' additions are reported to
   do) on 0.06-0.2% at K = 1280 and 0.5-0.85% at K = 8192 (the BF16 tensor-core kernel's chain runs
   the whole K; the quantised types' restart theirs every 32 values, Q3_K's and Q6_K's every 16). A
   kernel that truncates its output, drops a term or scales by 1% moves most outputs off
   (tests/test_mutants_products.py).
2. every output, bf16 or fp32: |got - exact| <= half a bf16 ulp of got (bf16 output only) + E, with
   E = LAMBDA * sqrt(n) * u * A, `exact` the float64 product before any rounding, u = 2^-24,
   A = sum_k |x_k w_k| and n = K (for the kernels that add a value's two parts d sc q and dmin m
   apart, SPLIT_KERNELS, A = sum_k |x_k| (|d sc q| + |dmin m|) and n = 2K: those are the terms they add).
   Rounding the fp32 sum s to bf16 moves it by at most half an ulp of s, never more than half an ulp
   of the result (rounding to nearest never leaves the binade of s downwards).

Deriving LAMBDA. The kernel's fp32 sum is s = sum_k t_k (1 + theta_k), t_k = x_k w_k the exact
terms: theta_k compounds the roundings term k meets, its product (none where exact, as a bf16 x
times an int8 level) and each addition on its way to the total: at most n in any summation order.
So |s - exact| <= max_k |theta_k| * A.
- Worst case, |theta_k| <= n u / (1 - n u): linear in K. That bound let wrong kernels through: at
  K = 8192 it is larger than the effect of dropping a term, of a 1% scale, or of truncating.
- Round-to-nearest on data without structure (the tests' seeded Gaussian inputs: terms of random
  sign) makes rounding errors behave as independent, mean-zero, bounded by u. Then (Higham and
  Mary, "A new approach to probabilistic rounding error analysis", SIAM J. Sci. Comput. 41, 2019:
  its inner-product result) |s - exact| <= (exp(lambda sqrt(n) u + n u^2 / (1 - u)) - 1) A, about
  lambda sqrt(n) u A, except with probability at most 2 n exp(-lambda^2 / 2).
- LAMBDA = 8: below 2 n e^-32 = 4e-10 per output even at n = 16384 (the largest here is 2 x 6144),
  itself a pessimistic figure (every theta_k at its extreme at once). Measured on the emulations above, the
  largest error is 0.2 sqrt(n) u A rounding to nearest and 0.27 sqrt(n) u A for the truncating
  tensor-core chain (whose biased errors the theorem does not cover): 30x inside. With terms all of
  one sign a truncating chain's errors add up (3.7-27 sqrt(n) u A at K = 8192); the tests do not
  draw such data, and this bound is not claimed for it.
E grows like sqrt(K), not K: for the tests' Gaussian products it is a median 0.02 bf16 ulp of the
result at K = 256, 0.1 at K = 1280 and 0.6 at K = 8192 (90th percentile 2.6), so beside rule 1 it
still rejects any output a few ulps off, such as a wrong edge tile that touches under 1% of them.
E never exceeds the worst-case bound these tests used before, K u sum_k |x_k w_k| (f32_sum_error):
for short sums (K < LAMBDA^2 = 64; for the tests' Q2_K weights, with their split terms, K up to
about 2000) that one is the smaller, so E is the lesser of the two and no output is allowed more
than it was.

Other stages' bounds (`assert_within`, `f32_sum_error`) say what they mean where they are used.
"""

from __future__ import annotations

import numpy as np

from flashv41.host.quants import FORMATS, GGMLType, q2_k_terms, q4_k_terms, q5_k_terms

U = 2.0**-24  # float32 unit roundoff
LAMBDA = 8.0  # the high-probability factor of the sqrt(K) product bound (see the module docstring)
BIT_EQUAL_MIN = 0.99  # bf16 products: the fraction of outputs that must equal the oracle's bits
BIT_EQUAL_RULE = "99% rule"
BOUND_RULE = "sqrt(K) bound"


def bf16_ulp(x: np.ndarray) -> np.ndarray:
    """Spacing of bf16 values at |x| (8 significant bits), never below the smallest normal's."""
    mag = np.maximum(np.abs(np.asarray(x, np.float64)), 2.0**-126)
    return 2.0 ** (np.floor(np.log2(mag)) - 7)


def f32_sum_error(abs_sum: np.ndarray, k: int) -> np.ndarray:
    """Worst-case float32 summation error of k terms whose magnitudes add up to abs_sum: the bound
    for short sums, where it is tighter than the sqrt(k) one (product_error takes the lesser)."""
    return k * U * np.asarray(abs_sum, np.float64)


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


# The kernels that add a weight value of these types as its two parts d sc q and dmin m apart (the
# stream units, the tensor-core pieces, the integer tensor-core GEMV); every other kernel (gemm)
# dequantises it first.
SPLIT_KERNELS = {GGMLType.Q2_K: ("stream", "tc", "imma"), GGMLType.Q4_K: ("stream", "tc", "imma"),
                 GGMLType.Q5_K: ("stream", "tc", "imma")}
PART_TERMS = {GGMLType.Q2_K: q2_k_terms, GGMLType.Q4_K: q4_k_terms, GGMLType.Q5_K: q5_k_terms}


def part_magnitudes(gtype: GGMLType, stored: np.ndarray, k: int) -> np.ndarray:
    """|d sc q| + |dmin m| of every value of rows (uint8 [N, row_bytes]) of a type with mins
    (PART_TERMS) -> float32 [N, K]: the magnitudes of the two terms per value that SPLIT_KERNELS add."""
    rows = np.ascontiguousarray(stored).reshape(stored.shape[0], -1)
    scaled, minimum = PART_TERMS[gtype](rows)  # each exact in float32; the sum rounds once
    return (np.abs(scaled) + np.abs(minimum)).reshape(rows.shape[0], k)


def split_terms(gtype: GGMLType, stored: np.ndarray, k: int, kernel: str) -> dict:
    """Keyword arguments for the product assertions when `kernel` ("stream", "tc", "gemm") adds
    each weight value of rows `stored` as its two parts (SPLIT_KERNELS); {} otherwise."""
    if kernel not in SPLIT_KERNELS.get(gtype, ()):
        return {}
    return {"w_abs": part_magnitudes(gtype, stored, k), "n_terms": 2 * k}


# The device layouts that move a type's fields (stages.quants: "split"), as the stored block's
# field groups each layout puts one after another along a row, every block's group back to back.
SPLIT_FIELDS = {GGMLType.Q2_K: (("scales",), ("qs",), ("d", "dmin"))}


def stored_rows(gtype: GGMLType, rows: np.ndarray, k: int) -> np.ndarray:
    """The stored rows (uint8 [N, row_bytes], whole blocks) of a weight's device rows in the split
    layout of SPLIT_FIELDS: each region's slice of every block put back into its block."""
    block = FORMATS[gtype].block
    n, blocks = rows.shape[0], k // FORMATS[gtype].block_values
    parts, start = [], 0
    for fields in SPLIT_FIELDS[gtype]:
        size = sum(block[f].itemsize for f in fields)
        parts.append(rows[:, start:start + blocks * size].reshape(n, blocks, size))
        start += blocks * size
    return np.concatenate(parts, axis=2).reshape(n, -1)


def weight_terms(w, kernel: str) -> dict:
    """split_terms of a stages.linear.DeviceWeight `w` (its device rows, read back, as stored rows)."""
    rows = w.data.copy_to_host()
    if w.layout == "split" and w.gtype in SPLIT_FIELDS:
        rows = stored_rows(w.gtype, rows, w.k)
    return split_terms(w.gtype, rows, w.k, kernel)


def product_error(x: np.ndarray, w: np.ndarray, w_abs: np.ndarray | None = None, n_terms: int | None = None):
    """(exact, E): the float64 product x [.., K] @ w[N, K]^T and the bound on an fp32 kernel's
    error: the sqrt(K) one, LAMBDA sqrt(n) u sum_k |x_k| w_abs[n, k] (w_abs defaults to |w|, n to
    K), or the worst-case f32_sum_error of the K terms where that is smaller (module docstring)."""
    x64 = np.asarray(x, np.float64)
    w64 = np.asarray(w, np.float64)
    exact = x64 @ w64.T
    abs_x = np.abs(x64)
    abs_sum = abs_x @ np.abs(w64).T
    # (w_abs defaults to |w|: then the sqrt(K) bound's magnitudes are abs_sum, one product fewer)
    mag_sum = abs_sum if w_abs is None else abs_x @ np.asarray(w_abs, np.float64).T
    n = n_terms or x.shape[-1]
    probable = LAMBDA * np.sqrt(n) * U * mag_sum
    return exact, np.minimum(probable, f32_sum_error(abs_sum, x.shape[-1]))


def _worst(got64: np.ndarray, exact: np.ndarray, bound: np.ndarray) -> str:
    """The element furthest out of its bound (or, when none is, nearest to it), for failure messages."""
    err = np.abs(got64 - exact)
    i = np.unravel_index(int(np.argmax(err - bound)), err.shape)
    return (f"worst at {i}: got {got64[i]!r}, exact {exact[i]!r}, error {err[i]:.3e}, "
            f"bound {bound[i]:.3e} ({err[i] / bound[i]:.2f} of it)")


def assert_bf16_product(got: np.ndarray, ref: np.ndarray, x: np.ndarray, w: np.ndarray, what: str,
                        w_abs: np.ndarray | None = None, n_terms: int | None = None) -> float:
    """A bf16 result `got` [.., N] of x [.., K] @ w[N, K]^T against the oracle's `ref`: at least
    BIT_EQUAL_MIN of the outputs bit-equal to it, every output within half a bf16 ulp + the
    sqrt(K) bound of the exact product (module docstring). Returns the bit-equal fraction."""
    got64 = np.asarray(got, np.float64)
    exact, e = product_error(x, w, w_abs, n_terms)
    equal = got64 == np.asarray(ref, np.float64)
    fraction = float(equal.mean()) if equal.size else 1.0
    bound = 0.5 * bf16_ulp(got64) + e
    out = np.abs(got64 - exact) > bound
    print(f"{what}: {fraction:.4%} of {equal.size} outputs bit-equal to the oracle, {int(out.sum())} out of bound")
    failed = ([f"{BIT_EQUAL_RULE}: {fraction:.3%} bit-equal < {BIT_EQUAL_MIN:.0%}"] if fraction < BIT_EQUAL_MIN else [])
    failed += [f"{BOUND_RULE}: {int(out.sum())} of {out.size} out of it"] if out.any() else []
    if failed:
        raise AssertionError(f"{what}: {'; '.join(failed)}; {_worst(got64, exact, bound)}")
    return fraction


def assert_f32_product(got: np.ndarray, x: np.ndarray, w: np.ndarray, what: str,
                       w_abs: np.ndarray | None = None, n_terms: int | None = None) -> float:
    """An fp32 result `got` [.., N] of x [.., K] @ w[N, K]^T: every output within the sqrt(K) bound
    of the exact product (no bit-equality: an fp32 sum is rarely the correctly rounded one).
    Returns the largest error as a fraction of its bound."""
    got64 = np.asarray(got, np.float64)
    exact, e = product_error(x, w, w_abs, n_terms)
    e = np.maximum(e, 2.0**-149)  # an all-zero product must come out zero
    ratio = np.abs(got64 - exact) / e
    worst = float(ratio.max()) if ratio.size else 0.0
    equal = float((got64 == exact.astype(np.float32)).mean()) if ratio.size else 1.0
    print(f"{what}: largest error {worst:.3f} of the bound, {equal:.2%} of {ratio.size} equal to the rounded exact sum")
    if not worst <= 1:
        raise AssertionError(f"{what}: {BOUND_RULE}: {int((ratio > 1).sum())} of {ratio.size} out of it; "
                             f"{_worst(got64, exact, e)}")
    return worst
