"""stages.smem's instructions against NumPy references of what the PTX does: ldmatrix.x4's lane
mapping (plain and transposed), the zero-filling 16-byte copy, and (on a GPU) cvt.rn.bf16x2.f32
against the host's bf16 rounding. On the simulator these hold the emulations the tensor-core kernels
run there; on a GPU the instructions themselves."""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda, uint32  # noqa: E402  (after conftest chose the backend)

from flashv41.host.numerics import from_bits, to_bits
from flashv41.stages import smem
from flashv41.stages.device import SIM, WARP

ROWS = 64  # 16-byte rows of the test's shared array
ALIGN = smem.ALIGN  # (a kernel takes a global's value as a constant, not a module attribute's)


@cuda.jit
def ldmatrix_kernel(rows_in, row_of_lane, trans, out):
    """One warp: shared = rows_in [ROWS, 4] words; lane l gives row row_of_lane[l] as its address and
    writes the four words it gets (of the transposed load where trans) to out[l]."""
    s = cuda.shared.array((ROWS, 4), uint32, alignment=ALIGN)
    lane = cuda.threadIdx.x
    for r in range(lane, ROWS, WARP):
        for j in range(4):
            s[r, j] = rows_in[r, j]
    cuda.syncthreads()
    if trans:
        v0, v1, v2, v3 = smem.ldmatrix_x4_trans(s, row_of_lane[lane] * 4)
    else:
        v0, v1, v2, v3 = smem.ldmatrix_x4(s, row_of_lane[lane] * 4)
    out[lane, 0] = v0
    out[lane, 1] = v1
    out[lane, 2] = v2
    out[lane, 3] = v3


def test_ldmatrix_lane_mapping():
    """ldmatrix.x4 against PTX's description, on distinct words and scattered row addresses: lane l
    gets, of matrix i, word l % 4 of the row whose address lane 8 i + l // 4 gave."""
    rng = np.random.default_rng(7)
    rows_in = rng.integers(0, 2**32, (ROWS, 4), dtype=np.uint64).astype(np.uint32)
    row_of_lane = rng.permutation(ROWS)[:WARP].astype(np.uint32)
    out = cuda.device_array((WARP, 4), np.uint32)
    ldmatrix_kernel[1, WARP](cuda.to_device(rows_in), cuda.to_device(row_of_lane), 0, out)
    lanes = np.arange(WARP)
    want = np.stack([rows_in[row_of_lane[8 * i + lanes // 4], lanes % 4] for i in range(4)], axis=1)
    np.testing.assert_array_equal(out.copy_to_host(), want)


def test_ldmatrix_trans_lane_mapping():
    """ldmatrix.x4.trans: lane l = 4 g + t gets, of matrix i (rows from lanes 8 i .. 8 i + 7), the
    b16 values at (row 2 t, column g) in its low half and (row 2 t + 1, column g) in its high half."""
    rng = np.random.default_rng(9)
    rows_in = rng.integers(0, 2**32, (ROWS, 4), dtype=np.uint64).astype(np.uint32)
    row_of_lane = rng.permutation(ROWS)[:WARP].astype(np.uint32)
    out = cuda.device_array((WARP, 4), np.uint32)
    ldmatrix_kernel[1, WARP](cuda.to_device(rows_in), cuda.to_device(row_of_lane), 1, out)
    halves = rows_in.view(np.uint16).reshape(ROWS, 8)  # [row, b16 column]
    g, t = np.arange(WARP) // 4, np.arange(WARP) % 4
    want = np.stack([halves[row_of_lane[8 * i + 2 * t], g].astype(np.uint32)
                     | (halves[row_of_lane[8 * i + 2 * t + 1], g].astype(np.uint32) << 16) for i in range(4)], axis=1)
    np.testing.assert_array_equal(out.copy_to_host(), want)


@cuda.jit
def copy_kernel(src, sizes, out):
    """Thread i copies 16 bytes of src row i (words 4 .. 7) with src-size sizes[i] into shared row i,
    then writes shared row i to out[i]."""
    s = cuda.shared.array((WARP, 4), uint32, alignment=ALIGN)
    i = cuda.threadIdx.x
    smem.cp_async16(s, i * 4, src, smem.word_address(src, i, 4), sizes[i])
    smem.cp_async_commit()
    smem.cp_async_wait_all()
    cuda.syncthreads()
    for j in range(4):
        out[i, j] = s[i, j]


def test_copy_zero_fill():
    """cp.async of 16 bytes: the source's words where src-size is 16, zeros where it is 0."""
    rng = np.random.default_rng(8)
    src = rng.integers(1, 2**32, (WARP, 12), dtype=np.uint64).astype(np.uint32)
    sizes = np.where(np.arange(WARP) % 3 == 1, 0, 16).astype(np.uint32)
    out = cuda.device_array((WARP, 4), np.uint32)
    copy_kernel[1, WARP](cuda.to_device(src), cuda.to_device(sizes), out)
    want = np.where(sizes[:, None] == 16, src[:, 4:8], 0)
    np.testing.assert_array_equal(out.copy_to_host(), want)


bf16x2 = cuda.jit(device=True)(smem.bf16x2) if SIM else smem.bf16x2


@cuda.jit
def bf16x2_kernel(values, out):
    """Thread i: values[2 i], values[2 i + 1] through the output conversion."""
    i = cuda.threadIdx.x + cuda.blockIdx.x * cuda.blockDim.x
    if 2 * i + 1 < values.shape[0]:
        out[i] = bf16x2(values[2 * i], values[2 * i + 1])


@pytest.mark.gpu
def test_output_rounding_is_f32_to_bf16s():
    """cvt.rn.bf16x2.f32 against host.numerics' bf16 rounding (f32_to_bf16's: to nearest, ties to
    even) on ties, values next to them, subnormals, overflow into inf and inf; a NaN stays a NaN."""
    rng = np.random.default_rng(13)
    bits = np.concatenate([
        rng.integers(0, 2**32, 4096, dtype=np.uint64).astype(np.uint32),  # anything
        (rng.integers(0, 2**16, 1024, dtype=np.uint32) << 16) | 0x8000,  # ties
        (rng.integers(0, 2**16, 1024, dtype=np.uint32) << 16) | 0x7FFF,  # just below them
        rng.integers(1, 2**23, 1024, dtype=np.uint32) | (rng.integers(0, 2, 1024, dtype=np.uint32) << 31),  # subnormal
        np.array([0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F8000, 0x7F800000, 0xFF800000, 0, 0x80000000], np.uint32),
    ])
    bits = bits[: bits.size // 2 * 2]
    values = bits.view(np.float32)
    out = cuda.device_array(values.size // 2, np.uint32)
    bf16x2_kernel[(values.size // 2 + 127) // 128, 128](cuda.to_device(values), out)
    got = out.copy_to_host().view(np.uint16)
    nan = np.isnan(values)
    np.testing.assert_array_equal(got[~nan], to_bits(values)[~nan])
    assert np.isnan(from_bits(got[nan])).all()
