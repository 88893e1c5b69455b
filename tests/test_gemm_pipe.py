"""stages.gemm_pipe against the oracle's linear (host.numerics): BF16 and Q8_0 weights, bf16 and
fp32 outputs, partial tiles along tokens and outputs, more K steps than shared stages (the ring of
stages wraps), the grouped product, through test_linear_tc's random weights and
test_linear.check_groups (tests/bounds.py's rules: bf16 out at least 99% of outputs bit-equal to the
oracle, every output within the sqrt(K) bound; fp32 out the bound). The intrinsics' emulations are
held to NumPy references of what the PTX does (ldmatrix's lane mapping, the zero-filling copy), the
level conversion to every int8 level's bf16, and four broken kernels (tests/mutants.py) must fail
the product checks. On the simulator the tiles are gemm_pipe's SIM ones (64 x 64, four warps of
2 x 4 fragments, two copies a thread a step as on a GPU) and K a few steps; the flash shapes run on
a GPU (4096 tokens, bench/gemv.py's SHAPES), with the output rounding's corners. Run with -s to see
each check's figure."""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda  # noqa: E402  (after conftest chose the backend)

from flashv41.bench.gemv import SHAPES
from flashv41.host.numerics import bf16, from_bits, to_bits
from flashv41.host.quants import GGMLType, dequantize
from flashv41.stages import gemm_pipe as pipe
from flashv41.stages.device import SIM
from flashv41.stages.linear import DeviceWeight, linear
from tests.mutants import edited, mutant
from tests.test_linear import check_groups
from tests.test_linear_tc import stored_rows
from tests.test_mutants_products import rejected

TYPES = [GGMLType.BF16, GGMLType.Q8_0]


def weight(n, k, gtype):
    """A random weight [n, k] (test_linear_tc's rows: Q8_0 levels over the whole int8 range) as a
    DeviceWeight, and its dequantised values."""
    stored = stored_rows(np.random.default_rng(int(gtype) + n + k), n, k, gtype)
    return DeviceWeight.from_stored("w", gtype, stored, k), dequantize(stored, gtype, k)


def check_gemm(kernel, gtype, tokens, groups, rows, width, out_bf16, seed) -> float:
    """linear(kernel=kernel) (a prefill GEMM: "pipe", or tests/test_gemm_wgmma.py's "wgmma") on
    seeded bf16 inputs [tokens, groups * width] and a random weight [groups * rows, width], every
    group held to the oracle; returns check_groups' figure."""
    w, wq = weight(groups * rows, width, gtype)
    x = bf16(np.random.default_rng(seed).standard_normal((tokens, groups * width)).astype(np.float32))
    y = cuda.device_array((tokens, groups * rows), np.uint16 if out_bf16 else np.float32)
    linear(cuda.to_device(to_bits(x)), w, y, tokens, group_rows=rows if groups > 1 else 0, kernel=kernel)
    got = from_bits(y.copy_to_host()) if out_bf16 else y.copy_to_host()
    what = f"{kernel} {gtype.name} [{groups * rows}, {width}] T={tokens} {'bf16' if out_bf16 else 'f32'} out"
    return check_groups(got, x, wq, rows, out_bf16, what, {})


def check_pipe(gtype, tokens, groups, rows, width, out_bf16, seed) -> float:
    """check_gemm of gemm_pipe."""
    return check_gemm("pipe", gtype, tokens, groups, rows, width, out_bf16, seed)


@pytest.mark.parametrize("gtype", TYPES, ids=lambda t: t.name)
def test_partial_tiles_wrapping_stages(gtype):
    """Two token tiles and two output tiles, each second one partial (T, N not multiples of the
    tile); K of STAGES + 2 steps, so the ring of stages wraps. Simulator: BF16 99.98% bit-equal (one
    output of 4968 a bf16 step off, within the bound), Q8_0 100%."""
    check_pipe(gtype, pipe.BM + 5, 1, pipe.BN + 8, (pipe.STAGES + 2) * pipe.BK, True, 1 + int(gtype))


@pytest.mark.parametrize("gtype", TYPES, ids=lambda t: t.name)
def test_grouped_f32_out(gtype):
    """The attention's wo_a: three groups of outputs, each reading its own slice of the inputs (grid
    z), fewer tokens and outputs than a tile, an odd count of K steps (Q8_0: the last scale word's
    upper half is the row's padding); fp32 out. Simulator: largest error 0.009 of the bound."""
    check_pipe(gtype, 20, 3, 24, 3 * pipe.BK, False, 5 + int(gtype))


def check_refusals(kernel: str, other: GGMLType, k: int) -> None:
    """linear(kernel=kernel) (a prefill GEMM, "pipe" or "wgmma") refuses a weight of a type it does
    not take (`other`, K = k), a BF16 weight with fp32 inputs, and input rows not of whole 16-byte
    pieces: each a ValueError naming the weight."""
    wk, _ = weight(16, k, other)
    wk.name = "blk.0.attn_q_b"
    with pytest.raises(ValueError, match=f"gemm_{kernel} blk.0.attn_q_b: {other.name}"):
        linear(cuda.to_device(np.zeros((4, k), np.uint16)), wk, cuda.device_array((4, 16), np.uint16), 4,
               kernel=kernel)
    wb, _ = weight(16, 64, GGMLType.BF16)
    wb.name = "blk.0.attn_q_a"
    with pytest.raises(ValueError, match="blk.0.attn_q_a: BF16 .* float32 inputs"):
        linear(cuda.to_device(np.zeros((4, 64), np.float32)), wb, cuda.device_array((4, 16), np.float32), 4,
               kernel=kernel)
    with pytest.raises(ValueError, match=r"blk.0.attn_q_a: x \(4, 68\)"):
        linear(cuda.to_device(np.zeros((4, 68), np.uint16)), wb, cuda.device_array((4, 16), np.uint16), 4,
               kernel=kernel)


def test_refuses_what_it_does_not_take():
    """A Q2_K weight, fp32 inputs, input rows not of whole 16-byte pieces: ValueError naming the weight."""
    check_refusals("pipe", GGMLType.Q2_K, 256)


LEVEL_BIAS = pipe.LEVEL_BIAS


level_pair = cuda.jit(device=True)(pipe.level_pair) if SIM else pipe.level_pair


@cuda.jit
def levels_kernel(words, out):
    """Thread i: word i's four int8 levels as two bf16 pair words, through the kernel's conversion."""
    i = cuda.threadIdx.x + cuda.blockIdx.x * cuda.blockDim.x
    if i < words.shape[0]:
        u = words[i] ^ LEVEL_BIAS
        out[i, 0] = level_pair(u, 0, 1)
        out[i, 1] = level_pair(u, 2, 3)


def test_every_level_converts_exactly():
    """Every int8 level q, in each byte position, becomes q's bf16 bits (exact: |q| <= 128)."""
    levels = np.arange(-128, 128, dtype=np.int8)
    words = np.stack([np.roll(levels, s) for s in range(4)], axis=1).copy().view(np.uint32).ravel()
    out = cuda.device_array((words.size, 2), np.uint32)
    levels_kernel[(words.size + 127) // 128, 128](cuda.to_device(words), out)
    got = out.copy_to_host().view(np.uint16).reshape(words.size, 4)
    want = to_bits(words.view(np.int8).reshape(-1, 4).astype(np.float32))
    np.testing.assert_array_equal(got, want)


# broken kernels, each one edit of pipe_kernel's source: each must fail the product checks, on a K
# of more steps than stages
MUTANTS = {
    "dropped step": ("for it in range(n_steps + STAGES - 1):", "for it in range(n_steps + STAGES - 2):"),
    "stage off by one": ("read = uint32(read + 1) if read < STAGES - 1 else uint32(0)",
                         "read = uint32(read + 1) if read < STAGES - 2 else uint32(0)"),
    "ldmatrix row": ("a_row = wm + (mat & 1) * 8 + (lane & 7)", "a_row = wm + (mat >> 1) * 8 + (lane & 7)"),
    "scale 1%": ("d_s[tid] = hi if step & 1 else lo", "d_s[tid] = (hi if step & 1 else lo) * float32(1.01)"),
}
MUTANT_CASES = [("dropped step", GGMLType.BF16), ("stage off by one", GGMLType.Q8_0), ("ldmatrix row", GGMLType.BF16),
                ("scale 1%", GGMLType.Q8_0)]


@pytest.mark.parametrize("kind,gtype", MUTANT_CASES, ids=lambda v: getattr(v, "name", v))
def test_mutants_rejected(kind, gtype):
    """Simulator: each rejected by the 99% rule and the sqrt(K) bound."""
    old, new = MUTANTS[kind]
    args = (gtype, 20, 1, 24, (pipe.STAGES + 1) * pipe.BK, True, 9)
    with mutant(pipe, pipe_kernel=edited(pipe, "pipe_kernel", old, new)):
        rules = rejected(check_pipe, *args)
    print(f"mutant pipe {kind} ({gtype.name}): rejected by the {rules}")


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s[0])
@pytest.mark.parametrize("gtype", TYPES, ids=lambda t: t.name)
def test_flash_shapes(shape, gtype):
    """4096 tokens through every attention and engram matrix of the flash model (wo_a grouped)."""
    _, n, k, groups = shape
    check_pipe(gtype, 4096, groups, n // groups, k, True, 11)


@pytest.mark.gpu
@pytest.mark.parametrize("gtype", TYPES, ids=lambda t: t.name)
def test_flash_partial_tiles_f32_out(gtype):
    """A token count that is not a multiple of the tile, fp32 out, wq_a's shape."""
    check_pipe(gtype, 4000, 1, 1280, 5120, False, 12)
