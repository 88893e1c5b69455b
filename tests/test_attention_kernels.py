"""The attention stages' kernels against their oracle functions (host.numerics, host.oracle.attention).

Exact (bit for bit, given the same inputs): RMSNorm, RoPE, act_quant, fp4_quant (stages.norm_rope_quant
says why), the compressor pooling and the kv-source caches, index scores, selections and candidate
blocks, the entry lists. Within a derived bound and nearly all bit-equal: sparse attention, both
its paths (sparse_bound and SPARSE_EQUAL_MIN say why). Simulator shapes here; `gpu` tests repeat
the heavy kernels at V4.1-Flash sizes. The `check_...` functions are what tests/test_mutants_attention.py holds
broken kernels to: each must reject every mutant of its kernel there.

A wrapper takes its oracle function's arguments in the same order, then its device-only ones
(output, row count, workspace, stream), so each check builds the argument tuple once and passes it
to both: as it is to the oracle, through `dev` (each array onto the device, bf16 values as their
bits) to the wrapper.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from numba import cuda  # noqa: E402  (after conftest chose the backend)

from flashv41.host.config import LayerRole
from flashv41.host.errors import InputError
from flashv41.host.numerics import (
    FP4_MAX_INV,
    FP8_MAX_INV,
    act_quant,
    bf16,
    e4m3,
    fp4_act_quant,
    from_bits,
    pow2_ceil_scale,
    rms_norm,
    rope_tables,
    to_bits,
)
from flashv41.host.oracle import attention as oracle
from flashv41.model import load_model
from flashv41.stages import indexer, kv_sources  # noqa: E402
from flashv41.stages import norm_rope_quant as nrq  # noqa: E402
from flashv41.stages import sparse_attention as sa  # noqa: E402
from flashv41.stages.device import SIM  # noqa: E402
from flashv41.stages.linear import DeviceWeight  # noqa: E402
from flashv41.stages.sparse_attention import (  # noqa: E402
    SPLIT_BATCH_TOKENS,
    SPLIT_MAX_TOKENS,
    SparseWorkspace,
    sparse_attention,
    split_cores,
)
from tests.bounds import assert_within, bf16_ulp


def dev_bf16(x: np.ndarray):
    return cuda.to_device(to_bits(x))


def dev(args: tuple, fp32: tuple[int, ...] = ()) -> tuple:
    """An oracle function's arguments as its wrapper takes them: each float array onto the device as
    bf16 bits, or as fp32 where its index is in `fp32`; integer arrays as int32; the rest as they are."""
    def one(i: int, a):
        if not isinstance(a, np.ndarray):
            return a
        if a.dtype.kind in "iu":
            return cuda.to_device(a.astype(np.int32))
        return cuda.to_device(a.astype(np.float32)) if i in fp32 else dev_bf16(a)

    return tuple(one(i, a) for i, a in enumerate(args))


def host_bf16(a) -> np.ndarray:
    return from_bits(a.copy_to_host())


def assert_bits_equal(got_bits: np.ndarray, ref_values: np.ndarray, what: str) -> None:
    """Bit-exact (signed zeros included); the first mismatches are printed."""
    ref_bits = to_bits(ref_values)
    bad = np.argwhere(got_bits != ref_bits)
    if bad.size:
        first = [tuple(int(v) for v in i) for i in bad[:5]]
        detail = [(i, float(from_bits(got_bits[i])), float(ref_values[i])) for i in first]
        raise AssertionError(f"{what}: {len(bad)} of {ref_bits.size} values differ; "
                             f"first (index, got, oracle): {detail}")


@pytest.fixture(scope="module")
def tiny_cfg(tiny_path):
    model = load_model(tiny_path)
    yield model.config
    model.close()


def random_rows(rng, rows: int, width: int) -> np.ndarray:
    """bf16 rows of normal values, each row at its own scale (2^-40 .. 2^40), some exact zeros."""
    scale = np.exp2(rng.integers(-40, 41, size=(rows, 1))).astype(np.float32)
    x = rng.standard_normal((rows, width)).astype(np.float32) * scale
    x[rng.random((rows, width)) < 0.05] = 0.0
    x[rng.random((rows, width)) < 0.02] = -0.0
    return bf16(x)


# ---- RMSNorm, RoPE ---------------------------------------------------------------------------------

def check_rms_norm(dtype, threads: int = 0) -> None:
    """rms_norm of random rows (bf16, or fp32 values that are not bf16) against host.numerics.rms_norm,
    bit-exact."""
    rng = np.random.default_rng(1)
    rows, width = 6, 96
    x = random_rows(rng, rows, width)
    if dtype == np.float32:
        x = x * np.float32(1 + 2.0**-12)  # fp32 values that are not bf16
    weight = bf16(rng.standard_normal(width).astype(np.float32))
    args = (x, weight, 1e-6)
    out = cuda.device_array((rows + 2, width), np.uint16)
    nrq.rms_norm(*dev(args, fp32=(1,) if dtype == np.uint16 else (0, 1)), out, rows, threads=threads)
    assert_bits_equal(out.copy_to_host()[:rows], rms_norm(*args), f"rms_norm {np.dtype(dtype).name}")


@pytest.mark.parametrize("threads", [0, 2, 4])
@pytest.mark.parametrize("dtype", [np.uint16, np.float32])
def test_rms_norm_exact(dtype, threads):
    check_rms_norm(dtype, threads)


def test_rms_norm_in_place():
    rng = np.random.default_rng(2)
    x = random_rows(rng, 3, 64)
    weight = bf16(rng.random(64).astype(np.float32))
    args = (x, weight, 1e-20)
    xd, wd, eps = dev(args, fp32=(1,))
    nrq.rms_norm(xd, wd, eps, xd, 3)
    assert_bits_equal(xd.copy_to_host(), rms_norm(*args), "rms_norm in place")


ROPE_POSITIONS = np.array([0, 1, 2, 77, 150, 198, 199], np.int32)


def check_rope(cfg, heads: int, compressed: bool, max_seq: int = 200) -> None:
    """Forward and inverse rotation of each head's tail at ROPE_POSITIONS (the first and the last
    rows of the default table among them) against oracle.rope_tail, bit-exact."""
    rng = np.random.default_rng(3 + heads)
    head_dim = 32
    tables = rope_tables(cfg, max_seq)
    cos, sin = tables.compressed if compressed else tables.plain
    positions = ROPE_POSITIONS
    rows = positions.size
    x = bf16(rng.standard_normal((rows, heads, head_dim)).astype(np.float32))
    for inverse in (False, True):
        args = (x, cos, sin, positions, inverse)
        xd = dev_bf16(x.reshape(rows, -1))  # a token's heads side by side in one device row
        nrq.rope(xd, *dev(args[1:], fp32=(0, 1)), rows, heads)
        ref = oracle.rope_tail(*args)
        assert_bits_equal(xd.copy_to_host().reshape(rows, heads, head_dim), ref, f"rope inverse={inverse}")


@pytest.mark.parametrize("compressed", [False, True])
@pytest.mark.parametrize("heads", [1, 3])
def test_rope_exact(tiny_cfg, heads, compressed):
    check_rope(tiny_cfg, heads, compressed)


# ---- quantisers --------------------------------------------------------------------------------------

def scale_boundary_blocks(limit: float, block: int, fine: list[float], powers: tuple[int, ...]) -> list[np.ndarray]:
    """Blocks at the edge of a power-of-two scale (scale = 2^ceil(log2(amax / limit))): amax is
    `limit` times a power of two (amax / limit exactly that power: where a ceil and a floor + 1
    differ) or one bf16 step either side of it (0.45-0.52% off, so a limit 1% off lands on the other
    side), and the rest of the block the `fine` values, the format's finest steps, which quantise
    differently at twice the scale. Random rows hardly show a scale one step off (the formats are
    scale-free but for their subnormal and saturating ends); these show it, and a 1% one."""
    step = 2.0 ** (np.floor(np.log2(limit)) - 7)
    rest = [fine[i % len(fine)] * (-1) ** i for i in range(block - 1)]
    return [np.array([amax] + rest, np.float32) * np.float32(2.0**p)
            for p in powers for amax in (limit, limit - step, limit + step)]


def fp8_crafted_blocks() -> np.ndarray:
    """Blocks of 32 that hit every corner of act_quant: ties between e4m3 neighbours (normal and
    subnormal), the amax floor, exact power-of-two scales, signed zeros, huge and tiny magnitudes,
    and scale_boundary_blocks (subnormal multiples of 2^-9 under an amax at 448 x 2^k)."""
    ties = [1.0625, 1.1875, -1.3125, 1.9375, 3.0 + 1 / 8, 448.0, 416.0 + 16, 2.0**-7 + 2.0**-10,
            3 * 2.0**-10, 5 * 2.0**-10, -7 * 2.0**-10, 2.0**-12, -0.0, 0.0, 240.0, 232.0]
    base = np.array(ties + [0.5 * (i + 1) for i in range(16)], np.float32)
    blocks = [base, base * 2.0**-20, base * 2.0**30, -base, np.zeros(32, np.float32),
              np.full(32, 1e-6, np.float32), np.full(32, -3e-38, np.float32)]
    blocks += scale_boundary_blocks(448.0, 32, [k * 2.0**-9 for k in range(1, 32)], (0, -20, 30))
    return bf16(np.stack(blocks).reshape(1, -1))


def fp4_crafted_blocks(block: int) -> np.ndarray:
    """E2M1 midpoints and neighbours times an exact scale, saturation after an e4m3 scale rounds
    down (amax / 6 = 1.0625 -> 1.0, so |x / s| reaches 6.375 and clips), signed zeros, tiny blocks,
    and scale_boundary_blocks (multiples of 0.25, ties among them, under an amax at 6 x 2^k)."""
    mids = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.75, -2.5, 0.5, 3.0, -0.0, 0.0, 5.5, 0.125, 6.0]
    rows = []
    for scale in (1.0, 1.25, 2.0**-5, 2.0**12):
        v = np.array((mids * 2)[:block], np.float32) * np.float32(scale)
        rows.append(v)
    sat = np.linspace(-6.375, 6.375, block).astype(np.float32)
    sat[0] = 6.375
    rows += [sat, np.zeros(block, np.float32), np.full(block, 1e-30, np.float32)]
    rows += scale_boundary_blocks(6.0, block, [0.25 * k for k in range(1, 24)], (0, -5, 12))
    return bf16(np.concatenate(rows)[None, :])


def check_act_quant() -> None:
    """act_quant of random rows and of the crafted blocks against host.numerics.act_quant, bit-exact."""
    rng = np.random.default_rng(4)
    for x in (random_rows(rng, 9, 128), fp8_crafted_blocks()):
        args = (x,)
        (xd,) = dev(args)
        nrq.act_quant(xd, x.shape[0])
        assert_bits_equal(xd.copy_to_host(), act_quant(*args), "act_quant")


def check_fp4_quant(block: int, e4m3_scale: bool) -> None:
    """fp4_quant of random rows and of the crafted blocks against host.numerics.fp4_act_quant, bit-exact."""
    rng = np.random.default_rng(5 + block)
    for x in (random_rows(rng, 9, 128), fp4_crafted_blocks(block)):
        args = (x, block, e4m3_scale)
        xd, *rest = dev(args)
        nrq.fp4_quant(xd, *rest, x.shape[0])
        assert_bits_equal(xd.copy_to_host(), fp4_act_quant(*args), f"fp4 {block}")


def test_act_quant_exact():
    check_act_quant()


@pytest.mark.parametrize("block,e4m3_scale", [(16, True), (32, False)])
def test_fp4_quant_exact(block, e4m3_scale):
    check_fp4_quant(block, e4m3_scale)


def test_crafted_inputs_hit_the_corners():
    """The crafted blocks above really contain ties, saturation and scale edges (else they test nothing)."""
    x = fp8_crafted_blocks()[0, :32]
    q = e4m3(x)
    assert np.any(q != x) and np.any(np.abs(x) == 448)
    v = fp4_crafted_blocks(16)[0, 64:80]  # the saturating block
    assert np.abs(v).max() / e4m3(np.abs(v).max() / 6) > 6
    for row, inv in ((fp8_crafted_blocks(), FP8_MAX_INV), (fp4_crafted_blocks(32), FP4_MAX_INV)):
        # the 9 scale_boundary_blocks, last: per power (at the edge, a step below, a step above)
        amax = np.abs(row[0, -9 * 32:].reshape(3, 3, 32)).max(axis=-1)
        scale = pow2_ceil_scale(amax, inv)
        assert np.all(pow2_ceil_scale(amax[:, 0], inv) == amax[:, 0] * inv)  # exactly a power of two
        assert np.all(pow2_ceil_scale(amax[:, 1], np.float32(inv * 1.01)) != scale[:, 1])
        assert np.all(pow2_ceil_scale(amax[:, 2], np.float32(inv * 0.99)) != scale[:, 2])


def test_quantiser_shape_errors():
    x = cuda.to_device(np.zeros((2, 40), np.uint16))
    with pytest.raises(InputError, match="blocks of 32"):
        nrq.act_quant(x, 2)
    with pytest.raises(InputError, match="rows requested"):
        nrq.fp4_quant(cuda.to_device(np.zeros((2, 32), np.uint16)), 16, True, 3)
    with pytest.raises(InputError, match="uint16"):
        nrq.rms_norm(cuda.to_device(np.zeros((2, 32), np.float64)), cuda.to_device(np.ones(32, np.float32)), 1e-6,
                     cuda.device_array((2, 32), np.uint16), 2)


# ---- kv sources ----------------------------------------------------------------------------------------

def test_completed_groups():
    for ratio in (1, 2, 3, 4):
        for start in range(12):
            for n in range(1, 9):
                ends = [p // ratio for p in range(start, start + n) if p % ratio == ratio - 1]
                g0, count = kv_sources.completed_groups(start, n, ratio)
                assert count == len(ends) and (not ends or ends[0] == g0), (ratio, start, n)


def one_hot(rows: int, cols: int, shift: int, scale: float) -> np.ndarray:
    """Rows that each pick one input (times a power of two): a projection every implementation
    computes exactly, so the stages after it see the oracle's very inputs."""
    w = np.zeros((rows, cols), np.float32)
    w[np.arange(rows), (np.arange(rows) * 7 + shift) % cols] = scale
    return w


@pytest.mark.parametrize("ratio", [1, 2, 4])
def test_kv_source_exact_across_calls(tiny_cfg, ratio):
    """compress + publish against oracle.compress + oracle.publish, chunk after chunk (groups split
    across calls, calls that complete none), with projections that are exact everywhere: latents,
    group positions, state, both caches bit-exact."""
    cfg = tiny_cfg
    rng = np.random.default_rng(6 + ratio)
    c, d, idd = cfg.dim, cfg.head_dim, cfg.index_head_dim
    max_seq, max_tokens = 40, 8
    role = LayerRole(1, ratio, True, True, False, False, False)
    w = oracle.AttentionWeights(*([None] * 9), comp_kv=one_hot(d, c, 0, 1.0),
                                comp_gate=one_hot(d, c, 3, 4.0) if ratio > 1 else None,
                                comp_norm=bf16(rng.random(d).astype(np.float32) + 0.5), wk=one_hot(idd, d, 1, 2.0),
                                k_norm=bf16(rng.random(idd).astype(np.float32) + 0.5))
    gtype = "F32" if ratio > 1 else "BF16"
    dw = kv_sources.KvSourceWeights(
        DeviceWeight.from_values("kv", w.comp_kv, gtype),
        DeviceWeight.from_values("gate", w.comp_gate, gtype) if w.comp_gate is not None else None,
        cuda.to_device(w.comp_norm), DeviceWeight.from_values("wk", w.wk, "BF16"), cuda.to_device(w.k_norm))
    tables = rope_tables(cfg, max_seq)
    cos, sin = tables.compressed
    dcos, dsin = cuda.to_device(cos), cuda.to_device(sin)
    ostate = oracle.LayerState.create(cfg, role, max_seq)
    state = kv_sources.KvSourceState.allocate(ratio, d, idd, max_seq)
    ws = kv_sources.KvSourceWorkspace.allocate(max_tokens, d, idd)
    start = 0
    for n in (3, 1, 2, 5, 1, 8, 1):
        x = bf16(rng.standard_normal((n, c)).astype(np.float32))
        positions = cuda.to_device(np.arange(start, start + n, dtype=np.int32))
        latents, groups = oracle.compress(cfg, role, w, ostate, x, start)
        dlatents, dgroups = kv_sources.compress(cfg, role, dw, state, dev_bf16(x), start, ws, positions, n)
        count = dgroups.count
        assert count == groups.size and (count == 0 or dgroups.first == groups[0])
        assert_bits_equal(dlatents.copy_to_host()[:count], latents, f"latents at {start}")
        assert np.array_equal(dgroups.positions.copy_to_host()[:count], groups * ratio)
        oracle.publish(cfg, role, w, ostate, latents, groups, cos, sin)
        kv_sources.publish(cfg, role, dw, state, dlatents, dgroups, dcos, dsin, ws, positions)
        if ratio > 1:
            assert np.array_equal(state.kv_state.copy_to_host(), ostate.kv_state)
            assert np.array_equal(state.score_state.copy_to_host(), ostate.score_state)
        assert_bits_equal(state.index_keys.copy_to_host(), ostate.index_keys, f"index keys after {start + n}")
        assert_bits_equal(state.compressed.copy_to_host(), ostate.compressed, f"compressed after {start + n}")
        start += n


def test_pooling_exact_on_random_projections():
    """The pooling kernel alone on arbitrary fp32 projections (wide score ranges, so the softmax
    weights are far from even) against oracle.pool_group."""
    rng = np.random.default_rng(8)
    ratio, d, n = 2, 48, 6
    kv = rng.standard_normal((n, d)).astype(np.float32)
    score = (rng.standard_normal((n, d)) * 30).astype(np.float32)
    state = kv_sources.KvSourceState.allocate(ratio, d, 32, 8)
    pooled = cuda.device_array((n, d), np.uint16)
    gpos = cuda.device_array(n, np.int32)
    kv_sources.pool_groups(cuda.to_device(kv), cuda.to_device(score), state, pooled, gpos,
                           cuda.to_device(np.arange(n, dtype=np.int32)), n, n // ratio)
    ref = np.stack([oracle.pool_group(kv[g * ratio:(g + 1) * ratio], score[g * ratio:(g + 1) * ratio])
                    for g in range(n // ratio)])
    assert_bits_equal(pooled.copy_to_host()[:n // ratio], bf16(ref), "pooled groups")


# ---- indexer -------------------------------------------------------------------------------------------

def check_index_scores(tiny_cfg, seed, heads, dim, t, width, spare, c, tile=(0, 0), cores=""):
    """index_queries + index_scores (on `cores`, index_scores' argument) against oracle.index_queries
    + oracle.index_scores, every query and score bit-exact. The projections are one-hot (exact in
    any implementation), so both sides score the very same fp4 queries; key 2 is all zero (every
    dot zero); the kernel's key cache has `spare` rows past the width (the oracle's ends there)."""
    rng = np.random.default_rng(seed)
    qr = bf16(rng.standard_normal((t, heads * dim)).astype(np.float32))
    x = bf16(rng.standard_normal((t, c)).astype(np.float32))
    keys = fp4_act_quant(bf16(rng.standard_normal((width + spare, dim)).astype(np.float32)), 32, False)
    keys[2] = 0.0
    w = oracle.AttentionWeights(*([None] * 9), idx_wq_b=np.eye(heads * dim, dtype=np.float32),
                                idx_proj=one_hot(heads, c, 5, 1.0))
    positions = np.arange(width - t, width)
    cos, sin = rope_tables(tiny_cfg, max(64, width)).compressed
    args = (w, x, qr, cos, sin, positions)
    ref_iq, ref_hw = oracle.index_queries(*args)
    iw = indexer.IndexerWeights(DeviceWeight.from_values("wq_b", w.idx_wq_b, "BF16"),
                                DeviceWeight.from_values("proj", w.idx_proj, "F32"))
    iq = cuda.device_array((t, heads * dim), np.uint16)
    hw = cuda.device_array((t, heads), np.uint16)
    dargs = dev(args[1:], fp32=(2, 3))
    indexer.index_queries(iw, *dargs, iq, hw, t)
    assert_bits_equal(iq.copy_to_host(), ref_iq.reshape(t, -1), "index queries")
    assert_bits_equal(hw.copy_to_host(), ref_hw, "index head weights")
    scale = dim ** -0.5 * heads ** -0.5
    ref = oracle.index_scores(ref_iq, ref_hw, keys[:width], scale)
    score = cuda.device_array((t, width + spare), np.uint16)
    indexer.index_scores(iq, hw, dev_bf16(keys), scale, score, t, dargs[-1], 1, width, tile=tile, cores=cores)
    got = host_bf16(score)[:, :width]
    assert np.array_equal(got, ref), f"{int((got != ref).sum())} scores differ"
    assert (ref == 0).any() and (ref > 0).any()


@pytest.mark.parametrize("tile", [(0, 0), (2, 3)])
def test_index_scores_exact(tiny_cfg, tile):
    check_index_scores(tiny_cfg, 9, heads=3, dim=64, t=5, width=13, spare=3, c=32, tile=tile)


@pytest.mark.slow
def test_index_scores_tensor_cores_exact(tiny_cfg):
    """The tensor-core kernel on the emulated mma: two fragments of heads, three key tiles (the last
    one partial), two tokens."""
    check_index_scores(tiny_cfg, 10, heads=16, dim=64, t=2, width=37, spare=3, c=32, cores="tc")


def test_index_scores_cores_refused(tiny_cfg):
    """A shape the tensor-core kernel cannot take, or an unknown core name, is a named error."""
    with pytest.raises(InputError, match="multiple of 8"):
        indexer.score_cores(3, 64, "tc")
    with pytest.raises(InputError, match="not one of"):
        indexer.score_cores(32, 128, "gpu")
    assert indexer.score_cores(3, 64) == "cuda"


def score_patterns(rng, t: int, width: int) -> dict[str, np.ndarray]:
    """Random scores and tie-heavy ones: a handful of values (signed zeros among them), one value
    everywhere, negative-only rows, scores rising with the position (the newest visible positions
    rank first, so the selection's edge is the visible width itself), and infinities: -inf and
    +inf among a few values, every other row all -inf."""
    few = np.array([-2.0, -0.5, -0.0, 0.0, 0.5, 1.0, 3.0], np.float32)
    rising = bf16((np.arange(width, dtype=np.float32) + 1) * np.float32(4 / max(width, 1)))
    inf = np.array([-np.inf, -np.inf, -1.0, 2.0, np.inf], np.float32)[rng.integers(0, 5, (t, width))]
    inf[::2] = -np.inf
    return {
        "infinite": inf,
        "random": bf16(rng.standard_normal((t, width)).astype(np.float32)),
        "ties": few[rng.integers(0, few.size, (t, width))],
        "constant": np.full((t, width), 0.25, np.float32),
        "negative": -bf16(rng.random((t, width)).astype(np.float32) * 0.01 + 1),
        "rising": np.broadcast_to(rising, (t, width)).copy(),
    }


SELECT_CASES = [  # (ratio, start, T, topk, block, topk_blocks)
    (1, 10, 6, 4, 2, 3),  # the tiny preset
    (2, 0, 7, 4, 2, 3),  # queries that see no group yet
    (2, 30, 5, 8, 4, 2),  # top-k cut inside many ties; few candidate blocks
    (1, 3, 4, 16, 3, 8),  # k above the visible count; ragged last block
]
FLASH_SELECT_CASE = (1, 32768 - 4, 4, 512, 8, 2048)  # top-512 of 32768, 8-position blocks (top 2048)
SPARE_SCORE = 100.0  # beyond the width: above every pattern's score, so a kernel that reads there picks it
# the selection's paths: the one-block kernel, the split path as it launches, and in 3 slices a row
# (the simulator's default launches few slices for several rows)
SELECT_PATHS = ({"split": False}, {"split": True}, {"split": True, "slices": 3})


def check_select(cfg, case, seed: int | None = None, paths: tuple[dict, ...] = SELECT_PATHS) -> None:
    """Candidate source, a later index source respecting its mask, and a plain index source, each
    against oracle.select on the same scores, on each of `paths` (select's arguments): selections
    and masks exactly equal (the kernel's mask in blocks, each block's flag standing for its
    positions). The kernel's score rows run 3 columns past the width, at SPARE_SCORE (the oracle
    sees only the width): it must not read them."""
    for path in paths:
        check_select_path(cfg, case, seed, path)


def check_select_path(cfg, case, seed: int | None, path: dict) -> None:
    ratio, start, t, topk, block, topk_blocks = case
    cfg = dataclasses.replace(cfg, index_topk=topk, candidate_block_size=block, candidate_topk_blocks=topk_blocks)
    rng = np.random.default_rng(10 + start if seed is None else seed)
    positions = np.arange(start, start + t)
    width = (start + t) // ratio
    nb = -(-width // block)
    for name, scores in score_patterns(rng, t, width).items():
        candidates = None
        cand = cuda.to_device(np.full((t, nb + 2), 7, np.uint8))
        for source, uses in ((True, False), (False, True), (False, False)):
            role = LayerRole(3, ratio, False, True, source, uses, False)
            other = score_patterns(rng, t, width)["ties"] if uses else scores
            ref, candidates = oracle.select(cfg, role, other, positions, candidates)
            padded = np.concatenate([other, np.full((t, 3), SPARE_SCORE, np.float32)], axis=1)
            sel = cuda.to_device(np.full((t, topk), 99, np.int32))
            indexer.select(*dev((cfg, role, padded, positions)), cand, sel, t, **path)
            assert np.array_equal(sel.copy_to_host(), ref), f"{path} {name} source={source} uses={uses}"
            if source:
                mask = np.repeat(cand.copy_to_host()[:, :nb].astype(bool), block, axis=1)[:, :width]
                assert np.array_equal(mask, candidates), f"{path} {name}: candidate blocks"


@pytest.mark.parametrize("path", SELECT_PATHS, ids=str)
@pytest.mark.parametrize("case", SELECT_CASES, ids=lambda c: f"r{c[0]}s{c[1]}T{c[2]}k{c[3]}b{c[4]}x{c[5]}")
def test_select_exact(tiny_cfg, case, path):
    check_select(tiny_cfg, case, paths=(path,))


@pytest.mark.parametrize("path", [{"split": False, "threads": 2, "radix_bits": 8},
                                  {"split": False, "threads": 4, "radix_bits": 4},
                                  {"split": True, "threads": 2, "slices": 2},
                                  {"split": True, "threads": 4, "slices": 5}], ids=str)
def test_select_other_shapes(tiny_cfg, path):
    """Both paths with several threads a block (segments, block scans), the one-block kernel with
    the GPU's 8-bit radix, the split path over slices shorter and longer than a thread's share."""
    cfg = dataclasses.replace(tiny_cfg, index_topk=5, candidate_block_size=3, candidate_topk_blocks=2)
    rng = np.random.default_rng(11)
    t, start, ratio = 3, 17, 1
    positions = np.arange(start, start + t)
    width = start + t
    scores = score_patterns(rng, t, width)["ties"]
    candidates = None
    cand = cuda.device_array((t, 8), np.uint8)
    for source, uses in ((True, False), (False, True)):
        role = LayerRole(3, ratio, False, True, source, uses, False)
        args = (cfg, role, scores, positions)
        ref, candidates = oracle.select(*args, candidates)
        sel = cuda.device_array((t, 5), np.int32)
        indexer.select(*dev(args), cand, sel, t, **path)
        assert np.array_equal(sel.copy_to_host(), ref)


def check_select_batch(cfg, visible: np.ndarray, topk: int, block: int, topk_blocks: int, path: dict,
                       seed: int = 12) -> None:
    """select with own_rows over a batch of sequences' tokens (row b sees visible[b] groups, ratio 1):
    the candidate source, then a source respecting its mask, each row against oracle.select of that
    row alone (its own width), selections and candidate blocks exactly equal, on tie-heavy scores."""
    cfg = dataclasses.replace(cfg, index_topk=topk, candidate_block_size=block, candidate_topk_blocks=topk_blocks)
    rng = np.random.default_rng(seed)
    rows, width = visible.size, int(visible.max())
    positions = (visible - 1).astype(np.int32)
    nb = -(-width // block)
    cand = cuda.to_device(np.full((rows, nb + 2), 7, np.uint8))
    alone: list = [None] * rows
    for source, uses in ((True, False), (False, True)):
        role = LayerRole(3, 1, False, True, source, uses, False)
        scores = score_patterns(rng, rows, width)["ties"]
        sel = cuda.to_device(np.full((rows, topk), 99, np.int32))
        indexer.select(*dev((cfg, role, scores, positions)), cand, sel, rows, own_rows=True, **path)
        got, blocks = sel.copy_to_host(), cand.copy_to_host()
        for b in range(rows):
            w = int(visible[b])
            ref, alone[b] = oracle.select(cfg, role, scores[b:b + 1, :w], positions[b:b + 1], alone[b])
            assert np.array_equal(got[b], ref[0]), f"{path} row {b} (width {w}): {source=}"
            if source:
                mask = np.repeat(blocks[b, :-(-w // block)].astype(bool), block)[:w]
                assert np.array_equal(mask, alone[b][0]), f"{path} row {b}: candidate blocks"


@pytest.mark.parametrize("path", SELECT_PATHS, ids=str)
def test_select_batch_exact(tiny_cfg, path):
    """A batch of 5 rows of their own widths (one sees a single group), fewer visible than k on some."""
    check_select_batch(tiny_cfg, np.array([1, 9, 23, 4, 17]), 6, 3, 2, path)


# ---- entries and sparse attention ---------------------------------------------------------------------

def _entries_of(positions, first, selection, entries, window, chunk_rows, n_entries, own_rows):
    """entries[t, j] = entry_at(..., t, j, ...): the kernels' entry lists laid out, a thread each."""
    t, j = cuda.grid(2)
    if t < entries.shape[0] and j < entries.shape[1]:
        entries[t, j] = sa.entry_at(positions, first, selection, t, j, window, chunk_rows, n_entries, own_rows)


def entry_lists(positions, selection, window: int, chunk_capacity: int, own_rows: bool = False,
                first: np.ndarray | None = None) -> np.ndarray:
    """The lists the sparse kernels make (stages.sparse_entries.entry_at), one column past E (which
    must read -1), through a kernel compiled afresh each call (so a mutant of entry_at is the one run).
    first: the whole chunk's positions where positions and selection are a sub-chunk's rows (None:
    positions, the whole chunk)."""
    t = len(positions)
    k = 0 if selection is None else selection.shape[1]
    chosen = np.zeros((t, 1), np.int64) if selection is None else selection
    entries = cuda.device_array((t, window + k + 1), np.int32)
    cuda.jit(_entries_of)[(t, window + k + 1), 1](*dev((positions, positions if first is None else first, chosen)),
                                                   entries, window, chunk_capacity, window + k, own_rows)
    got = entries.copy_to_host()
    assert np.all(got[:, -1] == -1), "entry_at past the list"
    return got[:, :-1]


def check_entries(start: int, t: int) -> None:
    """entry_at against oracle.build_entries, exactly, with a selection (-1 padded) and without; the
    chunk rows' capacity above T, as the stage's workspace has it; and with own_rows (a batch: token
    t at position start + t its sequence's only one, in chunk row t) against the oracle's list of
    that token alone, its chunk row moved to t; and each sub-chunk's (its tokens' rows of positions and
    selection, the whole chunk's positions as `first`) against its rows of the chunk's lists. (That
    the oracle's entries name the right positions is tests/test_oracle_attention.py's business.)"""
    window, cap, k = 8, 12, 3
    positions = np.arange(start, start + t)
    selection = np.where(np.arange(k)[None, :] < 2, np.arange(t)[:, None] + np.arange(k)[None, :], -1)
    for chosen in (selection, None):
        args = (positions, chosen, window, cap)
        got, want = entry_lists(*args), oracle.build_entries(*args)
        assert np.array_equal(got, want), f"entries from {start}, T {t}: got {got.tolist()}, oracle {want.tolist()}"
        for t0 in range(1, t):
            part = entry_lists(positions[t0:], None if chosen is None else chosen[t0:], window, cap, first=positions)
            assert np.array_equal(part, want[t0:]), f"entries from {start}, T {t}, sub-chunk from token {t0}: got " \
                f"{part.tolist()}, oracle {want[t0:].tolist()}"
        got = entry_lists(*args, own_rows=True)
        for i in range(t):
            alone = oracle.build_entries(positions[i:i + 1], None if chosen is None else chosen[i:i + 1], window, cap)
            alone[:, :window] += np.where(alone[:, :window] >= window, i, 0)
            assert np.array_equal(got[i], alone[0]), f"own rows, token {i} at {start + i}: {got[i].tolist()}"


ENTRY_CASES = [(0, 5), (6, 4), (13, 1), (20, 12)]  # (start, T)


@pytest.mark.parametrize("start,t", ENTRY_CASES)
def test_entries_exact(start, t):
    check_entries(start, t)


def attention_inputs(rng, t: int, heads: int, dim: int, window: int, chunk: int, groups: int, selected: int):
    """q (bf16), rows as the layer makes them (fp8 window rows, fp4 compressed rows), the queries'
    positions and selections [T, selected], and sinks.

    The T queries are a chunk's (T <= chunk rows) that starts 3 windows in: each one's window is
    every ring slot but the chunk's newer positions' and the chunk rows up to its own, so every
    window row weighs in and a dropped one shows. Selections, by query: 0, 2 (and every 4 from
    there): `selected` - 1 .. - 3 distinct groups ascending, -1 padded; 1: none (the window alone);
    3: arbitrary (repeats, and skips between groups). Sinks: each head's at its queries' mean
    log-sum-exp of the scores plus U(-3, 2), so the sink takes 5-88% of the denominator, and leaving
    it out moves every output.
    """
    q = bf16((rng.standard_normal((t, heads, dim)) * 2).astype(np.float32))
    ring = act_quant(bf16(rng.standard_normal((window, dim)).astype(np.float32)))
    chunk_rows = act_quant(bf16(rng.standard_normal((chunk, dim)).astype(np.float32)))
    comp = fp4_act_quant(bf16(rng.standard_normal((groups, dim)).astype(np.float32)), 16, True)
    assert t <= chunk, "the queries' window rows are chunk rows"
    positions = 3 * window + 5 + np.arange(t)
    selection = np.full((t, selected), -1, np.int64)
    for i in range(t):
        if i % 4 == 3:
            selection[i] = rng.integers(-1, groups, selected)
        elif i % 4 != 1:
            k = selected - 1 - i % 3
            selection[i, :k] = np.sort(rng.choice(groups, k, replace=False))
    entries = oracle.build_entries(positions, selection, window, chunk)
    valid = entries >= 0
    rows = np.concatenate([ring, chunk_rows, comp])
    k_rows = rows[np.where(valid, entries, 0)].astype(np.float64)
    s = np.einsum("thd,ted->the", q.astype(np.float64), k_rows) * dim ** -0.5
    s = np.where(valid[:, None, :], s, -np.inf)
    m = s.max(axis=-1)
    lse = (m + np.log(np.exp(s - m[..., None]).sum(axis=-1))).mean(axis=0)
    sinks = (lse + rng.uniform(-3, 2, heads)).astype(np.float32)
    return q, ring, chunk_rows, comp, positions, selection, sinks


def sparse_bound(q, rows, entries, sinks, scale, ref) -> np.ndarray:
    """What fp32 accumulation may change, elementwise.

    The kernel's score s_j = q . k_j sums D products in fp32: |ds| <= delta = scale * D * 2^-24 *
    max_j sum_d |q_d k_jd| (+ the shared fp32 rounding of the scale product). The max moves by as
    much, so p_j = exp(s_j - max) moves by a relative eps <= 2 delta + 2^-22. Rounding p_j to bf16 can
    then fall on the other side of a rounding boundary: one bf16 step, <= 2^-7 p_j. The value sums
    (64 fp32 terms per block, two roundings per block in the rescale) add < 2^-16 relative, the
    denominator the same. With A_d = sum_j p_j |v_jd| / S (weights of the final softmax, sink in S):
    |do_d| <= (2^-7 + eps + 2^-16) A_d + (eps + 2^-16) |o_d| + one bf16 ulp of o_d (the output rounding).
    """
    valid = entries >= 0
    k = rows[np.where(valid, entries, 0)].astype(np.float64) * valid[..., None]  # [T, E, D]
    q64 = q.astype(np.float64)
    s = np.einsum("thd,ted->the", q64, k) * scale
    mag = np.einsum("thd,ted->the", np.abs(q64), np.abs(k))
    delta = scale * q.shape[-1] * 2.0**-24 * mag.max() + 2.0**-24 * np.abs(s).max()
    eps = 2 * delta + 2.0**-22
    s = np.where(valid[:, None, :], s, -np.inf)
    m = np.maximum(s.max(axis=-1), sinks[None, :])
    p = np.exp(s - m[..., None])
    denom = p.sum(-1) + np.exp(sinks[None, :] - m)
    weighted = np.einsum("the,ted->thd", p, np.abs(k)) / denom[..., None]
    return (2.0**-7 + eps + 2.0**-16) * weighted + (eps + 2.0**-16) * np.abs(ref) + bf16_ulp(ref)


# Sparse attention: at least this share of the outputs equals the oracle's
# bits. An fp32 kernel differs from the float64 oracle only where its error carries a value (or one
# p_j) across a bf16 rounding boundary. Measured: the simulator 100% at the CI shape and 99.97% at
# the flash shape (64 heads x 512, 640 entries); a NumPy emulation of the GPU kernel's order (32
# lanes over D with FMAs, the butterfly, sequential FMA value sums per block) 100% at the CI shape
# on 60 seeds and 99.977% at the flash shape (23 of 98304 values). The mutants that the bound lets
# through (tests/test_mutants_attention.py) keep at most 62%: p or the output truncated (50-60%),
# the output 1% off (0%). The split path gives the same bits as the one-block-a-head kernel on the
# simulator; on a GPU its share has yet to be measured (its q . k sums D, and its value sums a
# block's entries, in another fp32 order).
SPARSE_EQUAL_MIN = 0.99
SPARSE_CASE = (12, 4, 2, 64, 8, 6, 160, 132)  # seed, T, H, D, W, chunk rows, groups, selected (E = 140)
FLASH_SPARSE_CASE = (14, 4, 64, 512, 128, 64, 1024, 512)  # 64 heads x 512, window 128 + top-512
# More shapes for both paths: T = 3 with 28 entries (fewer than a block of 64; no arbitrary row),
# T = 5 with exactly one block of 64 (the fifth query's list again the layer's)
SPARSE_CASES = [SPARSE_CASE, (21, 3, 4, 64, 8, 6, 40, 20), (22, 5, 2, 32, 16, 8, 100, 48)]


def rope_angles(rng, n_positions: int, rope_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin fp32 [n_positions, rope_dim / 2] of random angles (a RoPE table's layout)."""
    angle = rng.uniform(-np.pi, np.pi, (n_positions, rope_dim // 2))
    return np.cos(angle).astype(np.float32), np.sin(angle).astype(np.float32)


def sparse_inputs(seed, t, heads, dim, window, chunk, groups, selected) -> tuple:
    """attention_inputs of a case, its scale and a RoPE table for its positions (and one past them)
    over the last dim / 8 dims of a head: the arguments of oracle.attend."""
    rng = np.random.default_rng(seed)
    inputs = attention_inputs(rng, t, heads, dim, window, chunk, groups, selected)
    cos, sin = rope_angles(rng, int(inputs[4].max()) + 2, dim // 8)
    return (*inputs, dim ** -0.5, cos, sin)


SPARSE_FP32 = (6, 8, 9)  # the arguments of oracle.attend that go to the device as fp32: sinks, cos, sin


def case_entries(args: tuple) -> np.ndarray:
    """The entry lists [T, E] of oracle.attend's arguments (what its sparse_attention reads)."""
    _, ring, chunk_rows, _, positions, selection, *_ = args
    return oracle.build_entries(positions, selection, ring.shape[0], chunk_rows.shape[0])


def run_sparse(args: tuple, threads: int = 0, split: bool = False, cores: str = "", tokens: int = 0) -> np.ndarray:
    """sparse_attention over oracle.attend's arguments: the one-block-a-head kernel, or with split the
    split path (its kernels on the cores `cores`, "" the default), through a workspace of `tokens`
    tokens (the call then runs in sub-chunks of that many) or, with tokens 0, of room to spare (a
    token more than the call); 70 entries more than the call either way."""
    q = args[0]
    t, heads, dim = q.shape
    ws = SparseWorkspace.allocate(tokens or t + 1, heads, dim, case_entries(args).shape[1] + 70,
                                  most=SPLIT_BATCH_TOKENS) if split else None
    out = cuda.device_array((t, heads, dim), np.uint16)
    sparse_attention(*dev(args, fp32=SPARSE_FP32), out, t, threads=threads, workspace=ws, cores=cores)
    return host_bf16(out)


def rotated_bound(bound: np.ndarray, cos: np.ndarray, sin: np.ndarray, positions: np.ndarray,
                  ref: np.ndarray, o_ref: np.ndarray) -> np.ndarray:
    """What a bound on the output o before its inverse RoPE allows after it: a rotated pair
    (a c + b s, b c - a s) moves by at most |c| da + |s| db, plus the fp32 products' and sums'
    roundings (2^-22 of the terms) and the bf16 rounding of either side (one ulp of the larger)."""
    rd = 2 * cos.shape[1]
    c = np.abs(cos[positions])[:, None, :].astype(np.float64)
    s = np.abs(sin[positions])[:, None, :].astype(np.float64)
    da, db = bound[..., -rd::2], bound[..., -rd + 1::2]
    size = np.abs(o_ref[..., -rd::2]) + np.abs(o_ref[..., -rd + 1::2]) + da + db
    out = bound.astype(np.float64).copy()
    for i, moved in ((0, c * da + s * db), (1, s * da + c * db)):
        e = moved + 2.0**-22 * size
        r = ref[..., -rd + i::2]
        out[..., -rd + i::2] = e + bf16_ulp(np.abs(r) + e + bf16_ulp(r))
    return out


def sparse_reference(args: tuple) -> tuple[np.ndarray, np.ndarray]:
    """oracle.attend of the arguments, and what fp32 accumulation may change of it: sparse_bound on
    the output before its inverse RoPE (of the rotated queries), rotated_bound after."""
    q, ring, chunk_rows, comp, positions, _, sinks, scale, cos, sin = args
    q_rotated = oracle.rope_tail(q, cos, sin, positions)
    o_ref = oracle.attend(q_rotated, *args[1:8], None, None)
    rows = np.concatenate([ring, chunk_rows, comp])
    bound = sparse_bound(q_rotated, rows, case_entries(args), sinks, scale, o_ref)
    ref = oracle.attend(*args)
    return ref, rotated_bound(bound, cos, sin, positions, ref, o_ref)


def check_sparse_attention(seed, t, heads, dim, window, chunk, groups, selected, what, threads=0, split=False,
                           cores="", tokens=0, window_only=False):
    """attention_inputs through the kernel (the split path with `split`, on the cores `cores`, in
    sub-chunks of `tokens` tokens where given) and the oracle (attend): every value within
    sparse_bound, and at least SPARSE_EQUAL_MIN of them bit-equal. window_only: without the
    selection (the window alone, as a ratio-0 layer). Returns (got, ref)."""
    args = sparse_inputs(seed, t, heads, dim, window, chunk, groups, selected)
    if window_only:
        args = (*args[:5], None, *args[6:])
    ref, bound = sparse_reference(args)
    got = run_sparse(args, threads, split, cores, tokens)
    assert_within(got, ref, bound, what)
    equal = float(np.mean(got == ref))
    assert equal >= SPARSE_EQUAL_MIN, f"{what}: {equal:.2%} of values bit-equal < {SPARSE_EQUAL_MIN:.0%}"
    return got, ref


@pytest.mark.parametrize("split", [False, True], ids=["one_block", "split"])
@pytest.mark.parametrize("threads", [0, 2])
@pytest.mark.parametrize("case", SPARSE_CASES, ids=lambda c: f"T{c[1]}H{c[2]}D{c[3]}E{c[4] + c[7]}")
def test_sparse_attention_within_bound(case, threads, split):
    """Both paths (the split path's kernels: the CUDA cores; test_sparse_fused_* has the fused one)."""
    check_sparse_attention(*case, f"sparse attention ({'split' if split else 'one block a head'})", threads, split,
                           "cuda" if split else "")


def test_sparse_cores_choice():
    """The default with a workspace: the CUDA cores for up to SPLIT_MAX_TOKENS tokens and on the
    simulator; on a GPU past that the fused kernel where head_dim is whole 64-dim blocks (a prefill
    chunk or a batch alike), the CUDA cores for another head_dim. An unknown name (tc, the split
    path's tensor cores, which the fused kernel displaced, included), fused for another head_dim: an
    InputError."""
    assert split_cores(512, SPLIT_MAX_TOKENS) == "cuda"
    assert split_cores(512, SPLIT_MAX_TOKENS + 1) == ("cuda" if SIM else "fused")
    assert split_cores(64, SPLIT_BATCH_TOKENS) == ("cuda" if SIM else "fused")
    assert split_cores(96, SPLIT_BATCH_TOKENS) == "cuda"
    assert split_cores(512, 1, "cuda") == "cuda"
    assert split_cores(512, 1, "fused") == "fused"
    for name in ("fast", "tc"):
        with pytest.raises(InputError, match="not one of"):
            split_cores(512, 1, name)
    with pytest.raises(InputError, match="multiple of 64"):
        split_cores(96, 1, "fused")


# the fused kernel's shapes (D a multiple of 64): the suite's two, 20 heads (a second group of 16 with
# four real heads), D = 128 (two fragment pairs a warp)
FUSED_CASES = [SPARSE_CASES[0], SPARSE_CASES[1], (23, 3, 20, 64, 16, 8, 100, 70), (25, 2, 16, 128, 16, 8, 80, 60)]


@pytest.mark.parametrize("case", FUSED_CASES, ids=lambda c: f"T{c[1]}H{c[2]}D{c[3]}E{c[4] + c[7]}")
def test_sparse_fused_within_bound(case):
    """The fused kernel (stages.sparse_fused, the GPU's default for a prefill chunk; on the simulator
    the emulated mma and ldmatrix). Simulator: 100% bit-equal to the oracle."""
    check_sparse_attention(*case, "sparse attention (fused)", split=True, cores="fused")


def test_sparse_fused_window_only():
    """Without a selection: the window's entries alone (a ratio-0 layer), a window of 64."""
    check_sparse_attention(24, 4, 2, 64, 64, 8, 10, 4, "sparse attention (fused, window only)", split=True,
                           cores="fused", window_only=True)


def check_split_matches_one_block(case) -> None:
    """The two paths against each other. They compute the same recurrence in the same roundings but
    for the fp32 orders of q . k over D and of a block's value sums: on the simulator (lanes of one,
    one run of entries) not even those, so they must agree bit for bit; on a GPU each is within
    sparse_bound of the oracle, so within twice it of each other."""
    args = sparse_inputs(*case)
    split, one = run_sparse(args, split=True), run_sparse(args)
    if SIM:
        assert_bits_equal(to_bits(split), one, "split path against the one-block-a-head kernel")
        return
    assert_within(split, one, 2 * sparse_reference(args)[1], "split path against the one-block-a-head kernel")


@pytest.mark.parametrize("case", SPARSE_CASES, ids=lambda c: f"T{c[1]}H{c[2]}D{c[3]}E{c[4] + c[7]}")
def test_sparse_split_matches_one_block(case):
    check_split_matches_one_block(case)


FOLD_CASE = (23, 8, 4, 64, 8, 8, 40, 20)  # seed, T (the split path's most), H, D, W, chunk rows, groups, selected


def unfused_sparse(args: tuple, split: bool, cores: str) -> np.ndarray:
    """What the folded rotations replace: norm_rope_quant.rope of the queries, the attention without
    a table (run_sparse), then the rope's inverse of its output."""
    t, heads, dim = args[0].shape
    table = (*dev(args[8:10], fp32=(0, 1)), cuda.to_device(args[4].astype(np.int32)))
    q = dev_bf16(args[0].reshape(t, heads * dim))
    nrq.rope(q, *table, False, t, heads)
    q_rotated = host_bf16(q).reshape(t, heads, dim)
    o = dev_bf16(run_sparse((q_rotated, *args[1:8], None, None), split=split, cores=cores).reshape(t, heads * dim))
    nrq.rope(o, *table, True, t, heads)
    return host_bf16(o).reshape(t, heads, dim)


@pytest.mark.parametrize("t", [1, 3, 8])
@pytest.mark.parametrize("path", ["one_block", "split_cuda", "split_fused"])
def test_sparse_fold_matches_unfused(path, t):
    """The queries' RoPE where the scores load them (sparse_kernel, split_score_kernel, fused_kernel)
    and the output's inverse RoPE in the kernels that write it (sparse_kernel,
    split_combine_kernel) give the bits of the launches they replace, on every path."""
    split = path != "one_block"
    cores = path.removeprefix("split_") if split else ""
    args = sparse_inputs(FOLD_CASE[0], t, *FOLD_CASE[2:])
    assert_bits_equal(to_bits(run_sparse(args, split=split, cores=cores)), unfused_sparse(args, split, cores),
                      f"folded against unfused ({path}, T {t})")


def test_sparse_workspace_capacity():
    """At most SPLIT_MAX_TOKENS tokens by default, SPLIT_BATCH_TOKENS where prefill chunks or batched
    steps share it; a call of more tokens than the workspace holds runs in sub-chunks of its tokens,
    on the cores chosen for the whole call (T = 3 here: the CUDA cores). On the simulator that gives
    the bits of one sub-chunk; on a GPU, whose CUDA-core values kernel takes its block shape from the
    token count, within twice the bound of them (as check_split_matches_one_block)."""
    assert SparseWorkspace.allocate(100, 2, 64, 140).tokens == SPLIT_MAX_TOKENS
    assert SparseWorkspace.allocate(100, 2, 64, 140, most=1000).tokens == SPLIT_BATCH_TOKENS
    ws = SparseWorkspace.allocate(2, 4, 64, 28)
    assert ws.tokens == 2 and ws.nbytes == sum(getattr(ws, f.name).nbytes for f in dataclasses.fields(ws))
    args = sparse_inputs(*SPARSE_CASES[1])  # T = 3
    out = cuda.device_array((3, 4, 64), np.uint16)
    sparse_attention(*dev(args, fp32=SPARSE_FP32), out, 3, workspace=ws)
    whole = run_sparse(args, split=True)
    if SIM:
        assert_bits_equal(out.copy_to_host(), whole, "sub-chunks of 2 tokens against one")
    else:
        assert_within(host_bf16(out), whole, 2 * sparse_reference(args)[1], "sub-chunks of 2 tokens against one")


# Prefill chunks longer than the workspace: (seed, T, H, D, W, chunk rows, groups, selected, the workspace's
# tokens). From 3 windows in (attention_inputs), so the first tokens' windows reach into the ring and the later
# sub-chunks' into the chunk rows of the earlier ones (the ring holds other positions' rows in those slots, so a
# row read from the wrong place shows): T = 10 in sub-chunks of 4, 4, 2 over 28 entries; T = 11 in sub-chunks of
# 3 (the last of 2), 12 chunk rows (more than the chunk's), 78 entries (two blocks of 64).
SUBCHUNK_CASES = [(31, 10, 2, 64, 8, 10, 40, 20, 4), (32, 11, 2, 64, 8, 12, 160, 70, 3)]
SUBCHUNK_MMA_CASE = (33, 9, 2, 64, 8, 9, 40, 20, 4)  # the emulated mma is slow: sub-chunks 4, 4, 1 over 28 entries


def check_sparse_subchunks(case, what, cores, window_only=False):
    """check_sparse_attention of a SUBCHUNK_CASES case on the split path, in sub-chunks of its tokens."""
    *inputs, tokens = case
    return check_sparse_attention(*inputs, what, split=True, cores=cores, tokens=tokens, window_only=window_only)


@pytest.mark.parametrize("window_only", [False, True], ids=["selection", "window_only"])
@pytest.mark.parametrize("case", SUBCHUNK_CASES, ids=lambda c: f"T{c[1]}by{c[8]}E{c[4] + c[7]}")
def test_sparse_subchunks_within_bound(case, window_only):
    """A prefill chunk longer than the workspace, with the selection and without one, on the CUDA
    cores (the simulator's default)."""
    check_sparse_subchunks(case, "sparse attention (sub-chunks)", "cuda", window_only)


@pytest.mark.parametrize("window_only", [False, True], ids=["selection", "window_only"])
def test_sparse_subchunks_fused_within_bound(window_only):
    """A chunk longer than the workspace on the fused kernel (the GPU's default for a chunk past
    SPLIT_MAX_TOKENS), which takes the whole chunk in one launch: its later tokens read the earlier
    ones' window rows from the chunk rows."""
    check_sparse_subchunks(SUBCHUNK_CASES[0], "sparse attention (sub-chunks, fused)", "fused", window_only)


@pytest.mark.parametrize("cores,case", [("", SUBCHUNK_CASES[1]), ("fused", SUBCHUNK_MMA_CASE)],
                         ids=["default", "fused"])
def test_sparse_subchunk_bits_ignore_the_cut(cores, case):
    """A chunk past SPLIT_MAX_TOKENS in sub-chunks of 2 and of 5 tokens gives every token the bits of the
    chunk in one: all of them on the cores chosen for the whole chunk (by default the fused kernel on a
    GPU, a block a token whatever the count; on the simulator the CUDA cores, whose one-lane blocks
    keep the first path's order)."""
    args = sparse_inputs(*case[:8])
    whole = run_sparse(args, split=True, cores=cores)
    for tokens in (2, 5):
        assert_bits_equal(to_bits(run_sparse(args, split=True, cores=cores, tokens=tokens)), whole,
                          f"sub-chunks of {tokens} tokens against one ({cores or 'default'} cores)")


def test_sparse_attention_shape_errors():
    q = cuda.device_array((2, 2, 64), np.uint16)
    rows = cuda.device_array((8, 64), np.uint16)
    with pytest.raises(InputError, match="do not agree"):
        sparse_attention(q, rows, rows, cuda.device_array((4, 32), np.uint16), cuda.device_array(2, np.int32), None,
                         cuda.to_device(np.zeros(2, np.float32)), 0.1, None, None, q, 2)


def test_sparse_workspace_shape_errors():
    """A workspace for fewer entries, other heads or head_dim, or of another dtype: InputError naming
    the array; and none for a head_dim the split path cannot read in 16-byte units."""
    q = cuda.device_array((2, 2, 64), np.uint16)
    rows = cuda.device_array((8, 64), np.uint16)
    positions = cuda.to_device(np.arange(2, dtype=np.int32))
    selection = cuda.device_array((2, 132), np.int32)  # 140 entries with the 8 window slots
    sinks = cuda.to_device(np.zeros(2, np.float32))

    def call(ws):
        sparse_attention(q, rows, rows, rows, positions, selection, sinks, 0.1, None, None, q, 2, workspace=ws)

    with pytest.raises(InputError, match=r"SparseWorkspace\.scores: \(2, 2, 64\)"):
        call(SparseWorkspace.allocate(2, 2, 64, 64))  # 64 entries, not 140
    with pytest.raises(InputError, match=r"SparseWorkspace\.scores: \(2, 4, 140\)"):
        call(SparseWorkspace.allocate(2, 4, 64, 140))  # 4 heads
    with pytest.raises(InputError, match=r"SparseWorkspace\.pv: \(2, 3, 2, 32\)"):
        call(SparseWorkspace.allocate(2, 2, 32, 140))  # head_dim 32
    ws = SparseWorkspace.allocate(2, 2, 64, 140)
    with pytest.raises(InputError, match=r"SparseWorkspace\.block_sum: expected a 3-D float32"):
        call(dataclasses.replace(ws, block_sum=cuda.device_array((2, 3, 2), np.float64)))
    with pytest.raises(InputError, match=r"SparseWorkspace\.rescale: \(2, 2, 2\)"):
        call(dataclasses.replace(ws, rescale=cuda.device_array((2, 2, 2), np.float32)))  # 2 blocks, not 3
    with pytest.raises(InputError, match="multiple of 8"):
        SparseWorkspace.allocate(2, 2, 60, 140)
    q60, rows60 = cuda.device_array((2, 2, 60), np.uint16), cuda.device_array((8, 60), np.uint16)
    with pytest.raises(InputError, match="multiple of 8"):
        sparse_attention(q60, rows60, rows60, rows60, positions, selection, sinks, 0.1, None, None, q60, 2,
                         workspace=ws)


# ---- V4.1-Flash sizes on the GPU -----------------------------------------------------------------------

@pytest.mark.gpu
def test_flash_select_exact(tiny_cfg):
    """Top-512 of 32768 scores with 8-position candidate blocks (top 2048), every score pattern."""
    check_select(tiny_cfg, FLASH_SELECT_CASE, seed=13)


# the flash top-k at decode: (visible width, T); widths 1k .. 64k, one token and eight
FLASH_DECODE_SELECT = [(1024, 1), (1024, 8), (16384, 1), (16384, 8), (65536, 1), (65536, 8)]
# the paths at flash sizes, the split one also launched for the whole cache (a captured graph's width)
FLASH_SELECT_PATHS = (*SELECT_PATHS, {"split": True, "width": 131072})


@pytest.mark.gpu
@pytest.mark.parametrize("width,t", FLASH_DECODE_SELECT)
def test_flash_select_decode_exact(tiny_cfg, width, t):
    """Top-512 with 8-position blocks (top 2048) of T rows ending at the width: candidate source,
    masked and plain sources, every score pattern, on each path."""
    check_select(tiny_cfg, (1, width - t, t, 512, 8, 2048), seed=14, paths=FLASH_SELECT_PATHS)


@pytest.mark.gpu
def test_flash_select_batch_exact(tiny_cfg):
    """own_rows: a batch of 32 sequences at widths 1 .. 65536 (1k, 16k and 64k among them)."""
    rng = np.random.default_rng(15)
    visible = np.concatenate([[1024, 16384, 65536, 1, 511, 512, 513], rng.integers(1, 65537, 25)])
    for path in FLASH_SELECT_PATHS:
        check_select_batch(tiny_cfg, visible, 512, 8, 2048, path)


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["one_block", "split_cuda", "split_fused"])
def test_flash_sparse_attention_within_bound(path):
    """64 heads x 512, a 128-slot window plus top-512 entries (ten blocks of 64), T = 4: the
    one-block-a-head kernel, the split path, the fused kernel."""
    split = path != "one_block"
    cores = path.removeprefix("split_") if split else ""
    got, ref = check_sparse_attention(*FLASH_SPARSE_CASE, "sparse attention (flash)", split=split, cores=cores)
    print(f"\nflash sparse attention ({path}): {np.mean(got == ref):.4f} of values equal, max error "
          f"{np.abs(got - ref).max():.3e}")


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 3, 8])
@pytest.mark.parametrize("path", ["one_block", "split_cuda", "split_fused"])
def test_flash_sparse_fold_matches_unfused(path, t):
    """64 heads x 512 (the rope on the last 64 dims), a 128-slot window plus top-512 entries: the
    folded rotations against the launches they replace, bit for bit, in the GPU's block shapes (the
    one-block kernel's pairs across threads, the combine's thread per pair, the fused kernel's words)."""
    split = path != "one_block"
    cores = path.removeprefix("split_") if split else ""
    args = sparse_inputs(FLASH_SPARSE_CASE[0], t, *FLASH_SPARSE_CASE[2:])
    assert_bits_equal(to_bits(run_sparse(args, split=split, cores=cores)), unfused_sparse(args, split, cores),
                      f"flash folded against unfused ({path}, T {t})")


@pytest.mark.gpu
def test_flash_sparse_split_matches_one_block():
    check_split_matches_one_block(FLASH_SPARSE_CASE)


# a prefill chunk of 150 tokens from position 389 (3 windows in) through the engine's workspace of 64 tokens:
# sub-chunks of 64, 64, 22, the first tokens' windows reaching into the ring
FLASH_SUBCHUNK_CASE = (17, 150, 64, 512, 128, 160, 1024, 512, SPLIT_BATCH_TOKENS)


@pytest.mark.gpu
@pytest.mark.parametrize("cores", ["fused", "cuda"])
def test_flash_sparse_subchunks_within_bound(cores):
    """64 heads x 512, window 128 + top-512: the prefill chunk on the fused kernel (the GPU's default
    past SPLIT_MAX_TOKENS, the whole chunk in one launch), and in sub-chunks on the split path's
    CUDA cores."""
    assert split_cores(512, FLASH_SUBCHUNK_CASE[1]) == "fused"
    got, ref = check_sparse_subchunks(FLASH_SUBCHUNK_CASE, f"sparse attention (flash, sub-chunks, {cores})", cores)
    print(f"\nflash sparse attention (sub-chunks, {cores}): {np.mean(got == ref):.4f} of values equal, max error "
          f"{np.abs(got - ref).max():.3e}")


@pytest.mark.gpu
def test_flash_sparse_subchunk_bits_ignore_the_cut():
    """The flash prefill chunk in sub-chunks of 64 (the engine's) and of 50 tokens: the same bits."""
    args = sparse_inputs(*FLASH_SUBCHUNK_CASE[:8])
    engine = run_sparse(args, split=True, tokens=SPLIT_BATCH_TOKENS)
    assert_bits_equal(to_bits(run_sparse(args, split=True, tokens=50)), engine, "flash: sub-chunks of 50 against 64")


@pytest.mark.gpu
@pytest.mark.parametrize("cores", ["tc", "cuda"])
def test_flash_index_scores_exact(tiny_cfg, cores):
    """32 heads x 128 against 4096 keys, on either kernel."""
    check_index_scores(tiny_cfg, 15, heads=32, dim=128, t=3, width=4096, spare=0, c=64, cores=cores)


@pytest.mark.gpu
@pytest.mark.parametrize("t, width", [(1, 65536), (8, 16383)])
def test_flash_index_scores_long_exact(tiny_cfg, t, width):
    """The tensor-core kernel (the GPU's default) at decode over 64k keys, and 8 tokens over a width
    that ends in a partial tile."""
    check_index_scores(tiny_cfg, 16, heads=32, dim=128, t=t, width=width, spare=5, c=64)

