"""dev/gemm_pipe_dyn.py against the oracle, as tests/test_gemm_pipe.py holds the package's pipe
(its weights and check_groups' rules: bf16 out >= 99% bit-equal, every output within the sqrt(K)
bound; fp32 out the bound): BF16 and Q8_0, partial tiles, K of stages + 2 steps (the ring wraps),
grouped, for 2, 3 and 4 stages. `python -m pytest dev/test_gemm_pipe_dyn.py`."""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

from dev import gemm_pipe_dyn as dyn
from flashv41.host.numerics import bf16, from_bits, to_bits
from flashv41.host.quants import GGMLType
from flashv41.stages import gemm_pipe as pipe
from tests.test_gemm_pipe import weight
from tests.test_linear import check_groups

TYPES = [GGMLType.BF16, GGMLType.Q8_0]


def check(gtype, stages, tokens, groups, rows, width, out_bf16, seed) -> float:
    w, wq = weight(groups * rows, width, gtype)
    x = bf16(np.random.default_rng(seed).standard_normal((tokens, groups * width)).astype(np.float32))
    y = cuda.device_array((tokens, groups * rows), np.uint16 if out_bf16 else np.float32)
    dyn.gemm_pipe_dyn(cuda.to_device(to_bits(x)), w, y, tokens, rows if groups > 1 else 0, stages=stages)
    got = from_bits(y.copy_to_host()) if out_bf16 else y.copy_to_host()
    what = f"pipe_dyn {stages} stages {gtype.name} [{groups * rows}, {width}] T={tokens}"
    return check_groups(got, x, wq, rows, out_bf16, what, {})


@pytest.mark.parametrize("stages", [2, 3, 4])
@pytest.mark.parametrize("gtype", TYPES, ids=lambda t: t.name)
def test_partial_tiles_wrapping_stages(gtype, stages):
    check(gtype, stages, pipe.BM + 5, 1, pipe.BN + 8, (stages + 2) * pipe.BK, True, 1 + int(gtype))


@pytest.mark.parametrize("gtype", TYPES, ids=lambda t: t.name)
def test_grouped_f32_out(gtype):
    check(gtype, 4, 20, 3, 24, 3 * pipe.BK, False, 5 + int(gtype))


def test_the_carve_fits_and_grows_by_stage():
    """Each array starts 128-byte aligned; a stage more adds a stage's tiles; four BF16 stages are
    the 64 KiB (+ a few words) the static limit refused."""
    for quant in (False, True):
        offsets, _ = dyn.layout(quant, 4)
        assert all(o % dyn.ALIGN_WORDS == 0 for o in offsets)
        grown = dyn.shared_bytes(quant, 4) - dyn.shared_bytes(quant, 3)
        assert grown >= 4 * (pipe.A_STAGE + (pipe.Q_STAGE + pipe.BN if quant else pipe.B_STAGE))
    if not pipe.SIM:
        assert dyn.shared_bytes(False, 4) > 48 << 10
    with pytest.raises(ValueError, match="at least 2"):
        dyn.pipe_kernel_dyn(False, True, 1)
