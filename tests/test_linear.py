"""stages.linear against the oracle's linear (host.numerics): every weight type, every kernel, bf16
and fp32 inputs and outputs, the grouped product, through `check_linear` and tests/bounds.py's
product rules (bf16 out: at least 99% of outputs bit-equal to the oracle, the rest within the
sqrt(K) bound; fp32 out: the sqrt(K) bound). tests/test_mutants_products.py runs broken kernels
through the same `check_linear`. Run with -s to see each check's bit-equal fraction."""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda  # noqa: E402  (after conftest chose the backend)

from flashv41 import stages
from flashv41.host.numerics import bf16, from_bits, to_bits
from flashv41.host.numerics import linear as oracle_linear
from flashv41.host.quants import Q8_0_BLOCK, GGMLType, dequantize, quantize
from flashv41.stages import gemm_pipe, gemm_wgmma
from flashv41.stages.device import SIM
from flashv41.stages.linear import (  # noqa: E402
    GEMV_MAX_TOKENS,
    DeviceWeight,
    linear,
    linear_pair,
    pick_kernel,
    stream_lanes,
    stream_partials,
)
from flashv41.stages.linear_narrow import NARROW_MAX_TOKENS
from flashv41.stages.quants.q8_0 import split_q8_0  # noqa: E402
from tests.bounds import assert_bf16_product, assert_f32_product, assert_within, f32_sum_error, weight_terms
from tests.mutants import mutant

TYPES = [GGMLType.Q8_0, GGMLType.Q2_K, GGMLType.BF16, GGMLType.F16, GGMLType.F32]


def weight(rng, n, k, gtype):
    """Gaussian values of RMS k**-0.5 quantised to `gtype`: (DeviceWeight, the oracle's values)."""
    values = (rng.standard_normal((n, k)) * k**-0.5).astype(np.float32)
    stored = np.ascontiguousarray(quantize(values, gtype)).view(np.uint8).reshape(n, -1)
    return DeviceWeight.from_values("w", values, gtype), dequantize(stored, gtype, k)


def check_groups(got, x, wq, rows: int, out_bf16: bool, what: str, terms: dict) -> float:
    """got [T, N] of a product whose groups of `rows` outputs each read their own K-wide slice of
    x [T, groups * K], against the oracle (wq [N, K]), group by group, with tests/bounds.py's rules.
    `terms`: split_terms' keywords for kernels that add a weight value as two terms. Returns the
    smallest bit-equal fraction (bf16 out) or the largest error as a fraction of the bound (fp32)."""
    k = wq.shape[1]
    figures = []
    for g in range(wq.shape[0] // rows):
        xs, ws, ys = x[:, g * k:(g + 1) * k], wq[g * rows:(g + 1) * rows], got[:, g * rows:(g + 1) * rows]
        gterms = {name: v[g * rows:(g + 1) * rows] if name == "w_abs" else v for name, v in terms.items()}
        name = f"{what} group {g}" if wq.shape[0] > rows else what
        if out_bf16:
            figures.append(assert_bf16_product(ys, oracle_linear(xs, ws), xs, ws, name, **gterms))
        else:
            figures.append(assert_f32_product(ys, xs, ws, name, **gterms))
    return min(figures) if out_bf16 else max(figures)


def check_linear(w: DeviceWeight, wq: np.ndarray, tokens: int, kernel: str = "", group_rows: int = 0,
                 out_bf16: bool = True, x_f32: bool = False, seed: int = 0) -> float:
    """stages.linear.linear (`kernel`, or the one it picks) on seeded Gaussian inputs
    x [tokens, groups * K] (bf16, or fp32 when x_f32) and the weight w (wq its dequantised values),
    every group's outputs held to the oracle by `check_groups`; returns its figure."""
    groups = w.n // group_rows if group_rows else 1
    x = np.random.default_rng(seed).standard_normal((tokens, groups * w.k)).astype(np.float32)
    if not x_f32:
        x = bf16(x)
    y = cuda.device_array((tokens, w.n), np.uint16 if out_bf16 else np.float32)
    linear(cuda.to_device(x if x_f32 else to_bits(x)), w, y, tokens, group_rows=group_rows, kernel=kernel)
    got = from_bits(y.copy_to_host()) if out_bf16 else y.copy_to_host()
    picked = kernel or pick_kernel(w, not x_f32, tokens)
    terms = weight_terms(w, picked)
    what = f"{w.gtype.name} {w.layout} [{w.n}, {w.k}] {picked} T={tokens} {'bf16' if out_bf16 else 'f32'} out"
    return check_groups(got, x, wq, group_rows or w.n, out_bf16, what, terms)


@pytest.mark.parametrize("gtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("kernel,tokens", [("", 1), ("gemm", 3), ("", 19)])
def test_bf16_in_bf16_out(gtype, kernel, tokens):
    """stream (T = 1, picked), gemm (T = 3 forced, T = 19 picked on the simulator); 40 outputs of
    K = 256 a token. Simulator: 100% bit-equal for every type and kernel."""
    rng = np.random.default_rng(int(gtype) * 100 + tokens)
    w, wq = weight(rng, 40, 256, gtype)
    check_linear(w, wq, tokens, kernel, seed=tokens)


STREAM = [GGMLType.Q8_0, GGMLType.Q2_K, GGMLType.BF16]


@pytest.mark.parametrize("gtype", STREAM, ids=lambda t: t.name)
@pytest.mark.parametrize("tokens,out", [(1, "bf16"), (3, "f32"), (GEMV_MAX_TOKENS, "bf16"),
                                        (GEMV_MAX_TOKENS + 3, "bf16")])
def test_stream(gtype, tokens, out):
    """The decode kernel: each type's decoding, K split over warps (two on the simulator), tokens
    under a cap and past it (launches of GEMV_MAX_TOKENS), fp32 and bf16 out. Simulator: 100%
    bit-equal (bf16 out); fp32 out: largest error 0.3% of the bound."""
    rng = np.random.default_rng(int(gtype) * 10 + tokens)
    k = 320 if gtype == GGMLType.BF16 else 512
    w, wq = weight(rng, 6, k, gtype)
    check_linear(w, wq, tokens, "stream", out_bf16=out == "bf16", seed=tokens)


@pytest.mark.parametrize("kernel,tokens", [("gemm", 1), ("gemm", 11)])
def test_gemm_reads_split_q8_0(kernel, tokens):
    """Q8_0's split layout through the fp32 tiles (what an fp32 input or a kernel without tensor
    cores reads). Simulator: 100% bit-equal."""
    w, wq = weight(np.random.default_rng(17), 12, 128, GGMLType.Q8_0)
    check_linear(w, wq, tokens, kernel, seed=tokens)


def test_q8_0_split_layout():
    """The split layout keeps every byte: quants in block order, then the scales."""
    rng = np.random.default_rng(3)
    values = rng.standard_normal((3, 96)).astype(np.float32)
    stored = np.ascontiguousarray(quantize(values, GGMLType.Q8_0)).view(np.uint8).reshape(3, -1)
    split = split_q8_0(stored, 96)
    blocks = stored.view(Q8_0_BLOCK)  # [row, block]
    assert split.shape == stored.shape
    assert (split[:, :96].reshape(3, 3, 32) == blocks["qs"].view(np.uint8)).all()
    assert (split[:, 96:].reshape(3, 3, 2) == np.ascontiguousarray(blocks["d"]).view(np.uint8).reshape(3, 3, 2)).all()


@pytest.mark.parametrize("kernel", ["stream", "gemm"])
def test_f32_in_f32_out(kernel):
    """The hc mixes' product: fp32 highway in, fp32 mixes out (its products round too: still at most
    K roundings a term). Simulator: largest error 1.5% (stream) and 1.2% (gemm) of the bound."""
    w, wq = weight(np.random.default_rng(7), 24, 128, GGMLType.F32)
    check_linear(w, wq, 5, kernel, out_bf16=False, x_f32=True, seed=7)


@pytest.mark.parametrize("gtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("tokens,out", [(1, "bf16"), (3, "f32")])
def test_stream_f32_in(gtype, tokens, out):
    """fp32 inputs through every type's stream unit (the hc mixes read the fp32 highway so), bf16
    and fp32 out. Simulator: 100% bit-equal (bf16 out); fp32 out: largest error 0.3% of the bound."""
    rng = np.random.default_rng(int(gtype) * 10 + tokens + 5)
    w, wq = weight(rng, 6, 512, gtype)
    check_linear(w, wq, tokens, "stream", out_bf16=out == "bf16", x_f32=True, seed=tokens)


@pytest.mark.parametrize("gtype", TYPES, ids=lambda t: t.name)
def test_stream_partials(gtype):
    """The hc mixes' product (stages.hyper): fp32 x, per-slice sums of every row and a last row of
    the inputs' square sums, 11 tokens (two token groups, the second partly empty) over 3 slices of
    K. The slices' sum is held to the fp32 product bound, the square sums to the worst-case fp32
    summation bound. Simulator: largest product error 0.4% of the bound."""
    rng = np.random.default_rng(int(gtype) + 40)
    w, wq = weight(rng, 6, 512, gtype)
    tokens, slices = GEMV_MAX_TOKENS + 3, 3
    x = rng.standard_normal((tokens, w.k)).astype(np.float32)
    partial = cuda.device_array((tokens + 1, w.n + 1, slices), np.float32)
    stream_partials(cuda.to_device(x), w, partial, tokens)
    got = partial.copy_to_host()[:tokens].astype(np.float64).sum(axis=2)  # exact for three fp32 terms
    terms = weight_terms(w, "stream")
    assert_f32_product(got[:, :w.n], x, wq, f"{gtype.name} stream_partials T={tokens}", **terms)
    squares = (x.astype(np.float64) ** 2).sum(axis=1)
    assert_within(got[:, w.n], squares, f32_sum_error(squares, w.k), "square sums")


@pytest.mark.parametrize("kernel,tokens", [("stream", 2), ("gemm", 9)])
def test_grouped(kernel, tokens):
    """The attention's wo_a: G groups of R outputs, group g reading its own slice of the input.
    Simulator: 100% bit-equal in every group."""
    w, wq = weight(np.random.default_rng(11), 3 * 8, 256, GGMLType.Q8_0)
    check_linear(w, wq, tokens, kernel, group_rows=8, seed=tokens)


@pytest.mark.parametrize("gtype,extra", [(GGMLType.F16, 32), (GGMLType.F16, 64), (GGMLType.F32, 32)],
                         ids=["F16-odd-blocks", "F16", "F32"])
def test_stream_long_rows_in_groups(gtype, extra):
    """Rows of K = 1024 + extra values (slices of units that do not divide evenly), and groups of a
    row count that does not fill the kernel's blocks: every output row of every group, against the
    oracle. Simulator: 100% bit-equal."""
    rng = np.random.default_rng(int(gtype) + extra)
    w, wq = weight(rng, 2 * 5, 1024 + extra, gtype)
    check_linear(w, wq, 3, "stream", group_rows=5, seed=extra)


def test_shape_errors_are_clear():
    rng = np.random.default_rng(0)
    w, _ = weight(rng, 8, 64, GGMLType.BF16)
    x = cuda.to_device(np.zeros((2, 32), np.uint16))
    with pytest.raises(ValueError, match="linear w"):
        linear(x, w, cuda.device_array((2, 8), np.uint16), 2)



def test_stream_lanes():
    """The GPU's lanes a row group (the simulator's warps are one lane): the fewest idle lanes over
    a slice's rounds, the most lanes on a tie, never a launch of fewer than STREAM_MIN_BLOCKS
    blocks where 32 lanes a group gives more."""
    with mutant(stages.linear, LANES=32, STREAM_WARPS=8, STREAM_MIN_BLOCKS=128):
        assert stream_lanes(10, 16384, 1) == 16  # 10 units: 16 lanes, one round (8 would take two)
        assert stream_lanes(40, 16384, 1) == 8  # five rounds of 8, none idle
        assert stream_lanes(96, 12800, 1) == 32
        assert stream_lanes(40, 256, 8) == 16  # 8 lanes: 64 blocks
        assert stream_lanes(40, 64, 8) == 32
        assert stream_lanes(0, 64, 8) == 32  # K = 64 split over 8 warps: slices of no unit


def test_pick_stream_for_a_batch_without_tensor_cores():
    """A batch of 9 .. NARROW_MAX_TOKENS tokens through weights no tensor-core kernel takes (F32,
    the indexer's head weights) runs stream in launches of GEMV_MAX_TOKENS on a GPU; past that, and
    on the simulator, gemm."""
    w, _ = weight(np.random.default_rng(1), 32, 64, GGMLType.F32)
    assert pick_kernel(w, True, GEMV_MAX_TOKENS + 1) == ("gemm" if SIM else "stream")
    assert pick_kernel(w, True, NARROW_MAX_TOKENS) == ("gemm" if SIM else "stream")
    assert pick_kernel(w, True, NARROW_MAX_TOKENS + 1) == "gemm"


@pytest.mark.parametrize("capability,bf16_kernel", [((9, 0), "wgmma"), ((8, 0), "pipe"), ((8, 9), "pipe"),
                                                    ((10, 0), "pipe"), ((12, 0), "pipe")])
def test_prefill_pick_by_compute_capability(monkeypatch: pytest.MonkeyPatch, capability, bf16_kernel):
    """Past NARROW_MAX_TOKENS tokens with bf16 x on a GPU (here pretended, the compute capability
    too): BF16 weights take wgmma on compute capability 9.0 alone (sm_90a: Ampere and Ada have no
    wgmma, nor have Blackwell's targets), pipe elsewhere; Q8_0 takes pipe on every GPU; fp32 x gemm.
    (The simulator's own pick, gemm, is test_bf16_in_bf16_out's at T = 19.)"""
    monkeypatch.setattr(gemm_pipe, "SIM", False)
    monkeypatch.setattr(gemm_wgmma, "SIM", False)
    monkeypatch.setattr(gemm_wgmma, "device_capability", lambda: capability)
    rng = np.random.default_rng(2)
    (bf, _), (q8, _) = weight(rng, 32, 64, GGMLType.BF16), weight(rng, 32, 64, GGMLType.Q8_0)
    tokens = NARROW_MAX_TOKENS + 1
    assert pick_kernel(bf, True, tokens) == bf16_kernel
    assert pick_kernel(bf, True, tokens, group_rows=16) == bf16_kernel  # (a grouped product alike)
    assert pick_kernel(q8, True, tokens) == "pipe"
    assert pick_kernel(bf, False, tokens) == "gemm"


@pytest.mark.gpu
@pytest.mark.parametrize("x_f32", [False, True], ids=["bf16_x", "f32_x"])
def test_batch_of_steps_without_tensor_cores(x_f32):
    """The indexer's head weights at flash size (F32 [32, 5120]) for a batch of 20 tokens: the
    picked kernel (stream, three launches) within the oracle's product bounds, and each token's
    outputs bit for bit its own product alone (T = 1), as batched decode needs."""
    rng = np.random.default_rng(31)
    w, wq = weight(rng, 32, 5120, GGMLType.F32)
    tokens = 20
    assert pick_kernel(w, not x_f32, tokens) == "stream"
    check_linear(w, wq, tokens, out_bf16=False, x_f32=x_f32, seed=5)
    x = np.random.default_rng(5).standard_normal((tokens, w.k)).astype(np.float32)
    xd = cuda.to_device(x if x_f32 else to_bits(bf16(x)))
    batch = cuda.device_array((tokens, w.n), np.float32)
    linear(xd, w, batch, tokens)
    alone = cuda.device_array((1, w.n), np.float32)
    for t in range(tokens):
        linear(xd[t:], w, alone, 1)
        assert (alone.copy_to_host()[0].view(np.uint32) == batch.copy_to_host()[t].view(np.uint32)).all(), (
            f"token {t} of the batch differs from its product alone")


def check_pair(n: int, n2: int, k: int, gtype, tokens: int, seed: int) -> None:
    """linear_pair of two products of one bf16 input: every output bit for bit what `linear` gives
    its product alone, and within the oracle's bounds."""
    rng = np.random.default_rng(seed)
    (w, wq), (w2, wq2) = weight(rng, n, k, gtype), weight(rng, n2, k, gtype)
    x = bf16(rng.standard_normal((tokens, k)).astype(np.float32))
    xd = cuda.to_device(to_bits(x))
    pair = [cuda.device_array((tokens, m), np.uint16) for m in (n, n2)]
    linear_pair(xd, w, pair[0], w2, pair[1], tokens)
    for weight_, values, got in ((w, wq, pair[0]), (w2, wq2, pair[1])):
        alone = cuda.device_array((tokens, weight_.n), np.uint16)
        linear(xd, weight_, alone, tokens)
        assert np.array_equal(got.copy_to_host(), alone.copy_to_host()), (
            f"{gtype.name} [{weight_.n}, {k}] T={tokens}: the pair's outputs differ from the product alone")
        assert_bf16_product(from_bits(got.copy_to_host()), oracle_linear(x, values), x, values,
                            f"{gtype.name} pair [{weight_.n}, {k}] T={tokens}")


@pytest.mark.parametrize("gtype", [GGMLType.Q8_0, GGMLType.BF16, GGMLType.Q2_K], ids=lambda t: t.name)
@pytest.mark.parametrize("tokens", [1, 3])
def test_pair_is_each_product_alone(gtype, tokens):
    """Two short matrices of one input in one launch (rows 40 and 24, the second's last row group
    partly past its rows for two-row units)."""
    check_pair(40, 23 if gtype == GGMLType.Q2_K else 24, 256, gtype, tokens, seed=int(gtype) + tokens)


def test_pair_falls_back_to_two_products():
    """Different types (and more tokens than the stream kernel takes) run as two `linear` calls."""
    rng = np.random.default_rng(3)
    (w, _), (w2, _) = weight(rng, 16, 256, GGMLType.Q8_0), weight(rng, 8, 256, GGMLType.BF16)
    x = cuda.to_device(to_bits(bf16(rng.standard_normal((2, 256)).astype(np.float32))))
    y, y2 = cuda.device_array((2, 16), np.uint16), cuda.device_array((2, 8), np.uint16)
    linear_pair(x, w, y, w2, y2, 2)
    for weight_, got in ((w, y), (w2, y2)):
        alone = cuda.device_array((2, weight_.n), np.uint16)
        linear(x, weight_, alone, 2)
        assert np.array_equal(got.copy_to_host(), alone.copy_to_host())
    check_pair(16, 8, 256, GGMLType.Q8_0, GEMV_MAX_TOKENS + 3, seed=4)


@pytest.mark.gpu
@pytest.mark.parametrize("gtype", [GGMLType.Q8_0, GGMLType.BF16], ids=lambda t: t.name)
@pytest.mark.parametrize("tokens", [1, 8, 11])
def test_pair_at_flash_sizes(gtype, tokens):
    """wq_a [1280, 5120] and wkv [512, 5120] of one input in one launch, as the attention step runs
    them, at one, eight and eleven tokens (two launches of the pair)."""
    check_pair(1280, 512, 5120, gtype, tokens, seed=tokens)


# The decode GEMV (T = 1, the stream kernel) at flash sizes, every weight type the engine reads a
# matrix in: wq_b and the indexer's wq_b (K = 1280: a row group walked by 8 or 16 lanes, several a
# warp), wkv (a short matrix: eight warps a row), wo_a (eight groups of 1024 rows) and the engram's
# wkv (the largest). Oracle and bounds as everywhere here.
FLASH_DECODE = {"wq_b": (32768, 1280, 1), "idx_wq_b": (4096, 1280, 1), "wkv": (512, 5120, 1),
                "wo_a": (8 * 1024, 4096, 8), "engram_wkv": (25600, 6144, 1)}
DECODE_TYPES = [GGMLType.BF16, GGMLType.Q8_0, GGMLType.Q2_K, GGMLType.Q3_K, GGMLType.Q4_K, GGMLType.Q5_K,
                GGMLType.Q6_K, GGMLType.MXFP4]


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(FLASH_DECODE))
@pytest.mark.parametrize("gtype", DECODE_TYPES, ids=lambda t: t.name)
def test_flash_decode(gtype, name):
    """One token, and three for the K = 1280 shapes, through each flash decode shape."""
    from tests.test_linear_tc import stored_rows

    n, k, groups = FLASH_DECODE[name]
    stored = stored_rows(np.random.default_rng(int(gtype) + n + k), n, k, gtype)
    w, wq = DeviceWeight.from_stored("w", gtype, stored, k), dequantize(stored, gtype, k)
    for tokens in (1, 3) if k == 1280 else (1,):
        equal = check_linear(w, wq, tokens, "stream", group_rows=n // groups if groups > 1 else 0, seed=tokens)
        print(f"{gtype.name} {name} T={tokens}: {equal:.5f} bit-equal")
