"""The synthetic models' tensors in their stored form (host.synth writes them): Gaussian values
quantised (`_stored`), Q2_K tables drawn straight in the stored format (`_q2k_table`: quantising
hundreds of millions of values would take minutes), the stored-format drawers of Q8_0 and BF16, and
the K-quants' drawers (Q3_K .. Q6_K have no quantiser: `draw_k_quant`, random valid super-blocks of
the intended RMS).

A preset with `stored_draw` (flash40; any preset with `stored_draw=True` among the overrides) draws
its Q8_0 and BF16 matrices and tables in the stored format too, from inverse-CDF tables indexed by
uniform 16-bit draws, in threads: `draw_q8_0` gives blocks distributed as `quantize_q8_0` of the
same Gaussian values (the block's largest |value| from its distribution, d = fp16(amax / 127), a
level of +-127 in each block, the others from the truncated normal given amax), `draw_bf16` the
bf16 codes of those values. Same statistics, other bytes than the quantised path: flash40's 7.2 GB
took 49 s to write on two cores (7 s a GB, the file writes included), against about 75 s a GB for
quantising alone. Every other preset's bytes are those of the quantised path. Other weight types
(Q2_K's matrices, MXFP4) are quantised as before, stored_draw or not: slow at flash40's size.

Oracle: host.quants (quantize, dequantize): the drawn blocks' statistics are held to those of the
quantised path (tests/test_synth.py).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from statistics import NormalDist

import numpy as np

from flashv41.host.quants import FORMATS, GGMLType, RowType, quantize, random_blocks


def _gaussian(shape: tuple[int, ...], std: float, rng: np.random.Generator) -> np.ndarray:
    return (rng.standard_normal(shape, dtype=np.float32) * np.float32(std)).astype(np.float32)


def _stored(values: np.ndarray, gtype: GGMLType) -> np.ndarray:
    if values.ndim == 1:
        return quantize(values[None, :], gtype).reshape(-1) if gtype != GGMLType.F32 else values
    return quantize(values, gtype)


def _q2k_table(rows: int, width: int, rng: np.random.Generator) -> np.ndarray:
    """Q2_K rows drawn in the stored format, values of RMS about 0.9 (like quantised N(0, 1))."""
    fmt = FORMATS[GGMLType.Q2_K]
    nb = rows * width // fmt.block_values
    blocks = np.zeros(nb, dtype=fmt.block)
    sc = rng.integers(8, 16, size=blocks["scales"].shape, dtype=np.uint8)
    mn = rng.integers(8, 16, size=blocks["scales"].shape, dtype=np.uint8)
    blocks["scales"] = sc | (mn << 4)
    blocks["qs"] = rng.integers(0, 256, size=blocks["qs"].shape, dtype=np.uint8)
    blocks["d"] = np.float16(0.8 / 11.5)
    blocks["dmin"] = np.float16(1.2 / 11.5)
    return blocks.view(np.uint8).reshape(rows, -1)


# The stored-format drawers (Preset.stored_draw). Quantising Gaussian values costs about 75 ns a
# value in NumPy (9 minutes for flash40's 7.2 GB of Q8_0 on one core); these index inverse-CDF
# tables with uniform 16-bit draws instead (about 6 ns a value, and in up to DRAW_PARTS threads).
UNIFORM_STEPS = 1 << 16  # the tables are indexed by a uniform uint16: probabilities in steps of 2^-16
Q8_0_AMAX_STEPS = 4096  # the quantiles of a block's largest |value| that its scale is drawn from
Q8_0_LEVEL_BINS = 64  # bins of those quantiles, each with its own table of the other levels
Q8_0_TOP = 127  # the level of a block's largest |value|: d = amax / 127
# A chunk is drawn in parts of whole rows, each from its own generator seeded by the chunk's: up to
# DRAW_PARTS parts of at least DRAW_PART_VALUES values, a number told by the chunk's shape alone, so
# the bytes are the same however many threads draw them, and a Q8_0 and a BF16 tensor of one shape
# take the same draws from the file's generator (the tensors after them are the same either way).
DRAW_PARTS = 16
DRAW_PART_VALUES = 1 << 20


def _threads() -> int:
    """Threads that draw a chunk's parts: the cores this process may run on, up to DRAW_PARTS."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, min(DRAW_PARTS, cores))


def _in_parts(rng: np.random.Generator, shape: tuple[int, ...], row_bytes: int,
              draw: Callable[[np.random.Generator, np.ndarray], None]) -> np.ndarray:
    """uint8 [rows, row_bytes] of a tensor of `shape`: `draw(generator, out)` fills runs of whole
    rows of it (the parts, of about equal rows), each with a generator seeded from `rng`; in
    threads when there are several (NumPy's random draws and indexing release the GIL)."""
    rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
    out = np.empty((rows, row_bytes), np.uint8)
    parts = max(1, min(DRAW_PARTS, rows, rows * shape[-1] // DRAW_PART_VALUES))
    seeds = rng.integers(0, 1 << 63, parts)
    bounds = np.linspace(0, rows, parts + 1).astype(np.int64)
    runs = [(np.random.default_rng(int(seed)), out[a:b]) for seed, a, b in zip(seeds, bounds[:-1], bounds[1:],
                                                                                 strict=True)]
    if parts == 1:
        draw(*runs[0])
        return out
    with ThreadPoolExecutor(_threads()) as pool:
        for done in [pool.submit(draw, g, part) for g, part in runs]:
            done.result()
    return out


@lru_cache(maxsize=1)
def _normal_quantiles() -> np.ndarray:
    """float64 [UNIFORM_STEPS]: the N(0, 1) quantile at the middle of each uint16 step."""
    nd = NormalDist()
    return np.array([nd.inv_cdf((u + 0.5) / UNIFORM_STEPS) for u in range(UNIFORM_STEPS)])


def draw_bf16(rng: np.random.Generator, shape: tuple[int, ...], std: float) -> np.ndarray:
    """BF16 bytes [rows, 2k] of N(0, std^2) values, drawn through a 2^16-entry inverse-CDF table of
    their bf16 codes (quantiles at the steps' middles: the tails past 4.3 std are cut, which takes
    0.05% off the variance)."""
    codes = quantize(_normal_quantiles().astype(np.float32) * np.float32(std), GGMLType.BF16).view(np.uint16)[0]

    def draw(g: np.random.Generator, out: np.ndarray) -> None:
        u = g.integers(0, UNIFORM_STEPS, out.size // 2, dtype=np.uint16)
        np.take(codes, u, out=out.reshape(-1).view(np.uint16), mode="clip")

    return _in_parts(rng, shape, 2 * shape[-1], draw)


@lru_cache(maxsize=1)
def q8_0_draw_tables() -> tuple[np.ndarray, np.ndarray]:
    """What `draw_q8_0` draws from, for values of std 1.

    amax float64 [Q8_0_AMAX_STEPS]: quantiles (j + 0.5) / steps of A = max |z| over a block's 32
    N(0, 1) values (P(A <= a) = (2 Phi(a) - 1)^32). levels int8 [Q8_0_LEVEL_BINS, UNIFORM_STEPS]:
    per bin of consecutive amax quantiles, the inverse CDF of one of the block's other levels,
    round(z * 127 / A) with z ~ N(0, 1) truncated to |z| < A, A the bin's middle quantile.
    """
    nd = NormalDist()
    n = FORMATS[GGMLType.Q8_0].block_values
    amax = np.array([nd.inv_cdf((1 + ((j + 0.5) / Q8_0_AMAX_STEPS) ** (1 / n)) / 2)
                     for j in range(Q8_0_AMAX_STEPS)])
    per_bin = Q8_0_AMAX_STEPS // Q8_0_LEVEL_BINS
    levels = np.arange(-Q8_0_TOP, Q8_0_TOP + 1)
    u = (np.arange(UNIFORM_STEPS) + 0.5) / UNIFORM_STEPS
    tables = np.empty((Q8_0_LEVEL_BINS, UNIFORM_STEPS), np.int8)
    for b in range(Q8_0_LEVEL_BINS):
        a = amax[b * per_bin + per_bin // 2]
        # P(level <= l): the truncated normal's mass below the level's upper rounding edge
        upper = np.minimum((levels + 0.5) * a / Q8_0_TOP, a)
        cdf = (np.array([nd.cdf(x) for x in upper]) - nd.cdf(-a)) / (nd.cdf(a) - nd.cdf(-a))
        tables[b] = levels[np.minimum(np.searchsorted(cdf, u, side="right"), levels.size - 1)]
    return amax, tables


def draw_q8_0(rng: np.random.Generator, shape: tuple[int, ...], std: float) -> np.ndarray:
    """Q8_0 bytes [rows, row_bytes] distributed as `quantize_q8_0` of N(0, std^2) values, drawn
    in the stored format. Per block: its largest |z| A from Q8_0_AMAX_STEPS quantiles, so
    d = fp16(std * A / 127); one level, at a random place, +-127; the other 31 from the inverse-CDF
    table of A's bin (q8_0_draw_tables). Blocks are drawn bin by bin and then shuffled."""
    amax, tables = q8_0_draw_tables()
    block = FORMATS[GGMLType.Q8_0].block
    per_bin = Q8_0_AMAX_STEPS // Q8_0_LEVEL_BINS
    scale = np.float64(std) / Q8_0_TOP

    def draw(g: np.random.Generator, out: np.ndarray) -> None:
        nb = out.size // block.itemsize
        counts = g.multinomial(nb, np.full(Q8_0_LEVEL_BINS, 1 / Q8_0_LEVEL_BINS))
        j = np.repeat(np.arange(Q8_0_LEVEL_BINS) * per_bin, counts) + g.integers(0, per_bin, nb)
        drawn = np.empty(nb, block)
        drawn["d"] = (scale * amax[j]).astype(np.float16)
        qs = drawn["qs"]  # int8 [nb, 32]
        u = g.integers(0, UNIFORM_STEPS, qs.shape, dtype=np.uint16)
        start = 0
        for b, count in enumerate(counts):
            qs[start:start + count] = tables[b][u[start:start + count]]
            start += count
        top = np.where(g.integers(0, 2, nb, dtype=np.int8) == 1, np.int8(Q8_0_TOP), np.int8(-Q8_0_TOP))
        qs[np.arange(nb), g.integers(0, qs.shape[1], nb)] = top
        np.take(drawn, g.permutation(nb), out=out.reshape(-1).view(block), mode="clip")

    return _in_parts(rng, shape, FORMATS[GGMLType.Q8_0].row_bytes(shape[-1]), draw)


def q8_0_drawn_mean_square() -> float:
    """E[value^2] / std^2 of what draw_q8_0 draws (fp16 rounding of d aside), from its tables:
    d^2 (127^2 + 31 E[level^2 | bin]) / 32 averaged over the amax quantiles."""
    amax, tables = q8_0_draw_tables()
    per_bin = Q8_0_AMAX_STEPS // Q8_0_LEVEL_BINS
    level_ms = np.square(tables.astype(np.float64)).mean(axis=1)[np.arange(Q8_0_AMAX_STEPS) // per_bin]
    n = FORMATS[GGMLType.Q8_0].block_values
    return float(np.mean(np.square(amax / Q8_0_TOP) * (Q8_0_TOP**2 + (n - 1) * level_ms) / n))


DRAWERS: dict[GGMLType | RowType, Callable[[np.random.Generator, tuple[int, ...], float], np.ndarray]] = {
    GGMLType.Q8_0: draw_q8_0,
    GGMLType.BF16: draw_bf16,
}


# The K-quants flashv41 reads but cannot quantise (Q3_K .. Q6_K: no quantiser here or in gguf-py)
# are drawn as random valid super-blocks: host.quants.random_blocks' uniform levels and high bits,
# the sub-scales then drawn in the upper half of their range (a random sign where the type's scales
# are signed), the mins of Q4_K / Q5_K equal to their scales with dmin = d * the levels' middle (each
# sub-block centred, as a fitted minimum centres it), and d set so that the values' mean square is
# std^2: E[y^2] = d^2 E[scale^2] E[(level - middle)^2], the three independent.
# type: (smallest, largest |sub-scale| drawn, levels' range after the centring dmin takes off)
K_DRAWN: dict[GGMLType, tuple[int, int, tuple[float, float]]] = {
    GGMLType.Q3_K: (16, 31, (-4, 3)),  # y = d (sc - 32) q, q in -4..3, sc - 32 in -32..31
    GGMLType.Q4_K: (32, 63, (-7.5, 7.5)),  # y = (d sc) q - dmin m, q in 0..15, sc and m in 0..63
    GGMLType.Q5_K: (32, 63, (-15.5, 15.5)),  # Q4_K's with q in 0..31
    GGMLType.Q6_K: (64, 127, (-32, 31)),  # y = (d sc) (q - 32), q in 0..63, sc an int8
}


def _k_unit(gtype: GGMLType) -> float:
    """E[scale^2] E[level^2] of what draw_k_quant draws, d = 1 (both uniform over integer steps)."""
    lo, hi, (first, last) = K_DRAWN[gtype]
    scales = np.arange(lo, hi + 1, dtype=np.float64)
    levels = np.arange(first, last + 1, dtype=np.float64)
    return float(np.mean(scales**2) * np.mean(levels**2))


def _pack_k_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Q4_K / Q5_K: eight 6-bit scales and mins [..., 8] each -> the 12 scale bytes [..., 12] that
    host.quants.k_scale_min reads back: bytes 0-3 and 4-7 the low six bits of scales and mins 0-3
    with the top two of those 4-7, bytes 8-11 the low nibbles of scales and mins 4-7."""
    out = np.empty((*sc.shape[:-1], 12), np.uint8)
    out[..., 0:4] = (sc[..., :4] & 63) | ((sc[..., 4:] >> 4) << 6)
    out[..., 4:8] = (mn[..., :4] & 63) | ((mn[..., 4:] >> 4) << 6)
    out[..., 8:12] = (sc[..., 4:] & 15) | ((mn[..., 4:] & 15) << 4)
    return out


def _pack_q3_k_scales(u: np.ndarray) -> np.ndarray:
    """Q3_K: sixteen 6-bit stored scales [..., 16] (scale + 32) -> the 12 scale bytes [..., 12]:
    bytes 0-7 the low nibbles of scales 0-7 and (high nibble) 8-15, byte 8 + i the top two bits of
    scales i, i + 4, i + 8, i + 12 from its low bits up (host.quants.dequantize_q3_k's reading)."""
    out = np.empty((*u.shape[:-1], 12), np.uint8)
    out[..., 0:8] = (u[..., :8] & 15) | ((u[..., 8:] & 15) << 4)
    top = (u >> 4) & 3
    out[..., 8:12] = top[..., 0:4] | (top[..., 4:8] << 2) | (top[..., 8:12] << 4) | (top[..., 12:16] << 6)
    return out


def draw_k_quant(gtype: GGMLType, rng: np.random.Generator, shape: tuple[int, ...], std: float) -> np.ndarray:
    """Random valid Q3_K / Q4_K / Q5_K / Q6_K bytes [rows, row_bytes] of a tensor of `shape` whose
    values have mean about 0 and RMS about `std` (K_DRAWN above says how)."""
    fmt = FORMATS[gtype]
    rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
    raw = random_blocks(gtype, rows, shape[-1], rng)
    blocks = raw.view(fmt.block)  # [rows, blocks a row]
    lo, hi, (first, _) = K_DRAWN[gtype]
    sub = fmt.block_values // (32 if gtype in (GGMLType.Q4_K, GGMLType.Q5_K) else 16)
    magnitude = rng.integers(lo, hi + 1, (*blocks.shape, sub))
    d = np.float16(std / np.sqrt(_k_unit(gtype)))
    if gtype == GGMLType.Q3_K:
        signed = np.where(rng.integers(0, 2, magnitude.shape) == 1, magnitude, -magnitude)
        blocks["scales"] = _pack_q3_k_scales((signed + 32).astype(np.uint8))
    elif gtype == GGMLType.Q6_K:
        blocks["scales"] = np.where(rng.integers(0, 2, magnitude.shape) == 1, magnitude, -magnitude)
    else:
        sc = magnitude.astype(np.uint8)
        blocks["scales"] = _pack_k_scales(sc, sc)
        blocks["dmin"] = np.float16(-first * np.float32(d))
    blocks["d"] = d
    return raw


DRAWN_ONLY = tuple(K_DRAWN)  # types written only by drawing (their quantisers raise UnsupportedError)
