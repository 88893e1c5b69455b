"""The fused norm_rope_quant (stages.norm_rope_quant) against the chains it replaces, bit for bit.

Every chain the model runs (CHAINS) is checked on three kinds of rows: random ones at a realistic
scale at several positions (fp32 input too, where the chain has a norm), the quantisers' crafted
corner blocks (tests/test_attention_kernels.py: e4m3 / E2M1 ties, scale edges, signed zeros, the
amax floors), and bf16 ties made by the norm. The fused result must equal both the separate device
kernels run in turn (rms_norm, rope, act_quant / fp4_quant) and the oracle functions composed
(host.numerics.rms_norm, host.oracle.attention.rope_tail, host.numerics.act_quant / fp4_act_quant),
in place and out of place, forward and inverse. The corner rows reach the quantiser unchanged (up
to a power of two): they sit at position 0, where the rotation is the identity, and with a norm
their row carries a filler block that makes mean(x^2) a power of four, so the norm's factor is an
exact power of two (crafted_norm_rows; test_crafted_rows_are_exact checks it).

The simulator runs small shapes (the tiny preset's rope tables, rope_dim 16), one thread a block
by default, and a few forced block shapes (several threads sharing a quant block, the norm's block
sum); `gpu` tests repeat every chain at V4.1-Flash sizes and block shapes. test_mutants_rejected
shows the checks catch a dropped bf16 rounding, a position off by one, a norm factor 1% large and
a quant block's maximum left to one thread.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from numba import cuda  # noqa: E402  (after conftest chose the backend)

from flashv41.host.errors import InputError
from flashv41.host.numerics import act_quant, bf16, fp4_act_quant, from_bits, mean_square, rms_norm, rope_table, to_bits
from flashv41.host.oracle.attention import rope_tail
from flashv41.host.synth import preset
from flashv41.stages import norm_rope_quant as nrq  # noqa: E402
from flashv41.stages.device import SIM
from tests.mutants import edited, mutant
from tests.test_attention_kernels import fp4_crafted_blocks, fp8_crafted_blocks

EPS = 1e-20  # the presets' norm_eps; small enough that a mean of 4^k (k >= -15) plus it is 4^k
MAX_SEQ = 64  # rope table rows on the simulator; positions stay below MAX_SEQ - 1 (a spare row)
FLASH_MAX_SEQ = 4096


@dataclass(frozen=True)
class Chain:
    """One of the model's chains: norm or not, which rope table (None: no rope), the quantiser, and
    the heads x head dim at simulator and at V4.1-Flash size."""

    name: str
    norm: bool
    table: str | None  # "plain" (ratio-0 layers) or "compressed" (YaRN), or None
    quant: str
    heads: int
    dim: int
    flash_heads: int
    flash_dim: int

    @property
    def block(self) -> int:
        return nrq.QUANTS[self.quant][1]


CHAINS = [
    Chain("q_norm", True, None, "none", 1, 96, 1, 1280),
    Chain("kv", True, "plain", "act", 1, 64, 1, 512),
    Chain("index_keys", True, "compressed", "fp4_e8m0_32", 1, 64, 1, 128),
    Chain("latents", False, "compressed", "fp4_e4m3_16", 1, 64, 1, 512),
    Chain("index_queries", False, "compressed", "fp4_e8m0_32", 4, 64, 32, 128),
    Chain("q_rope", False, "plain", "none", 3, 64, 64, 512),
]
CHAIN = {c.name: c for c in CHAINS}


def rope_tables(preset_name: str, max_seq: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """A preset's plain and compressed (cos, sin) tables, as host.numerics.rope_tables builds them."""
    p = preset(preset_name)
    yarn = (p.rope_factor, p.rope_original_ctx, p.beta_fast, p.beta_slow)
    return {"plain": rope_table(p.rope_dim, max_seq, p.rope_theta, None),
            "compressed": rope_table(p.rope_dim, max_seq, p.compress_rope_theta, yarn)}


TABLES = rope_tables("tiny", MAX_SEQ)


# ---- inputs ------------------------------------------------------------------------------------------

def random_rows(rng, rows: int, width: int, fp32: bool = False) -> np.ndarray:
    """Normal values at a per-row scale of 2^-6 .. 2^6 (a projection's output), 5% exact zeros and
    2% negative zeros, the last row all zeros; bf16 values, or fp32 ones that are not bf16."""
    scale = np.exp2(rng.integers(-6, 7, size=(rows, 1))).astype(np.float32)
    x = rng.standard_normal((rows, width)).astype(np.float32) * scale
    x = x if fp32 else bf16(x)
    x[rng.random((rows, width)) < 0.05] = 0.0
    x[rng.random((rows, width)) < 0.02] = -0.0
    x[-1] = 0.0
    return x


def bf16_floor(v: float) -> np.float32:
    """The largest bf16 value <= v (v >= 0)."""
    bits = np.array([v], np.float32).view(np.uint32) & np.uint32(0xFFFF0000)
    value = bits.view(np.float32)[0]
    return value if value <= v else np.nextafter(value, np.float32(0))


def crafted_norm_rows(values: np.ndarray, filler: int) -> np.ndarray:
    """Rows of `values` [n, width - filler] followed by `filler` bf16 values that bring the row's sum
    of squares to width * 4^k (to far below an fp32 rounding step of the mean), so that
    mean(x^2) = 4^k in fp32 and the norm multiplies by exactly 2^-k: the values reach the next step
    as they are, times a power of two (and times the weight)."""
    n, kept = values.shape
    width = kept + filler
    rows = np.zeros((n, width), np.float32)
    rows[:, :kept] = values
    for i in range(n):
        s = float(np.sum(values[i].astype(np.float64) ** 2))
        k = max(-15, math.ceil(math.log(max(s, 1e-300) / width, 4)) + 1)
        rest = 4.0**k * width - s
        for j in range(kept, width):
            f = bf16_floor(math.sqrt(rest))
            rows[i, j] = f if j % 2 else -f
            rest = max(0.0, rest - float(f) ** 2)
    return rows


def corner_rows(chain: Chain, dim: int, heads: int) -> tuple[np.ndarray, np.ndarray | None]:
    """(x [n, heads * dim] bf16 values, weight [dim] or None): the quantiser's crafted blocks as they
    are and with their ends swapped (or, with no quantiser, bf16 ties); with a norm in crafted_norm_rows, weight 1."""
    block = chain.block
    if chain.quant == "act":
        flat = fp8_crafted_blocks()[0]
    elif chain.quant == "fp4_e8m0_32":
        flat = fp4_crafted_blocks(32)[0]
    elif chain.quant == "fp4_e4m3_16":
        flat = fp4_crafted_blocks(16)[0]
    else:
        flat = tie_values(np.random.default_rng(7), 4 * heads * dim)
    if block:  # each block again with its first and last values swapped: the amax (mostly first) then
        # sits in the block's last thread, away from the finest values (a block shared by threads)
        swapped = flat.reshape(-1, block).copy()
        swapped[:, [0, -1]] = swapped[:, [-1, 0]]
        flat = np.concatenate([flat, swapped.reshape(-1)])
    if not chain.norm:
        width = heads * dim
        flat = np.concatenate([flat, np.zeros(-flat.size % width, np.float32)])
        return flat.reshape(-1, width), None
    filler = block or 8
    kept = dim - filler
    flat = np.concatenate([flat, np.zeros(-flat.size % kept, np.float32)])
    weight = np.ones(dim, np.float32)
    return crafted_norm_rows(flat.reshape(-1, kept), filler), weight


def tie_values(rng, n: int) -> np.ndarray:
    """bf16 values of odd mantissa (1 + odd / 128) times 2^-3 .. 2^3, random signs: times 1.5 each
    is a bf16 tie."""
    m = 1 + (2 * rng.integers(0, 64, n) + 1) / 128
    v = m * np.exp2(rng.integers(-3, 4, n)) * rng.choice([-1.0, 1.0], n)
    return v.astype(np.float32)


def tie_rows(dim: int, block: int) -> tuple[np.ndarray, np.ndarray]:
    filler = block or 8
    values = tie_values(np.random.default_rng(8), 4 * (dim - filler)).reshape(4, dim - filler)
    return crafted_norm_rows(values, filler), np.full(dim, 1.5, np.float32)


# ---- the three ways to compute a chain ------------------------------------------------------------------

def oracle_chain(chain: Chain, x, weight, cos, sin, positions, inverse: bool, heads: int) -> np.ndarray:
    """The oracle functions in turn (each rounds to bf16); bf16 values [R, heads * D]."""
    y = rms_norm(x, weight, EPS) if chain.norm else x
    if cos is not None:
        y = rope_tail(y.reshape(y.shape[0], heads, -1), cos, sin, positions, inverse).reshape(y.shape[0], -1)
    if chain.quant == "act":
        y = act_quant(y)
    elif chain.quant != "none":
        y = fp4_act_quant(y, chain.block, chain.quant == "fp4_e4m3_16")
    return y


def on_device(x, weight, cos, sin, positions, fp32: bool):
    xd = cuda.to_device(x.astype(np.float32) if fp32 else to_bits(x))
    return (xd, None if weight is None else cuda.to_device(weight.astype(np.float32)),
            None if cos is None else cuda.to_device(cos), None if sin is None else cuda.to_device(sin),
            None if positions is None else cuda.to_device(positions.astype(np.int32)))


def kernels_chain(chain: Chain, x, weight, cos, sin, positions, inverse: bool, heads: int, fp32: bool) -> np.ndarray:
    """The separate device kernels in turn; bf16 bits [R, heads * D]."""
    rows = x.shape[0]
    xd, wd, cd, sd, pd = on_device(x, weight, cos, sin, positions, fp32)
    if chain.norm:
        y = cuda.device_array((rows, x.shape[1]), np.uint16)
        nrq.rms_norm(xd, wd, EPS, y, rows)
    else:
        y = xd
    if cos is not None:
        nrq.rope(y, cd, sd, pd, inverse, rows, heads)
    if chain.quant == "act":
        nrq.act_quant(y, rows)
    elif chain.quant != "none":
        nrq.fp4_quant(y, chain.block, chain.quant == "fp4_e4m3_16", rows)
    return y.copy_to_host()


SENTINEL = 0x7FC1  # a NaN pattern nothing computes: out's rows past n_rows must keep it


def fused(chain: Chain, x, weight, cos, sin, positions, inverse: bool, heads: int, fp32: bool, in_place: bool,
          threads: int = 0) -> np.ndarray:
    """norm_rope_quant in one launch; bf16 bits [R, heads * D]. Out of place, out has two spare rows
    that must stay untouched."""
    rows = x.shape[0]
    xd, wd, cd, sd, pd = on_device(x, weight, cos, sin, positions, fp32)
    out = xd if in_place else cuda.to_device(np.full((rows + 2, x.shape[1]), SENTINEL, np.uint16))
    nrq.norm_rope_quant(xd, wd, EPS if chain.norm else None, cd, sd, pd, inverse, chain.quant, rows, heads,
                        out=None if in_place else out, threads=threads)
    got = out.copy_to_host()
    if not in_place:
        assert np.all(got[rows:] == SENTINEL), f"{chain.name}: rows past n_rows written"
        sent = x.astype(np.float32) if fp32 else to_bits(x)
        assert np.array_equal(xd.copy_to_host(), sent), f"{chain.name}: x changed out of place"
    return got[:rows]


def assert_same_bits(got: np.ndarray, want: np.ndarray, what: str) -> None:
    """Bit-exact (signed zeros included); the first mismatches printed."""
    bad = np.argwhere(got != want)
    if bad.size:
        first = [tuple(int(v) for v in i) for i in bad[:5]]
        detail = [(i, float(from_bits(got[i])), float(from_bits(want[i]))) for i in first]
        raise AssertionError(f"{what}: {len(bad)} of {want.size} values differ; first (index, got, want): {detail}")


def check_case(chain: Chain, x, weight, positions, inverse: bool = False, *, heads: int, tables, fp32: bool = False,
               threads: int = 0, in_place: tuple[bool, ...] = (True, False), what: str = "") -> None:
    """The fused chain equals the separate kernels and the oracle composition, bit for bit."""
    cos, sin = tables[chain.table] if chain.table else (None, None)
    positions = positions if chain.table else None
    ref = to_bits(oracle_chain(chain, x, weight, cos, sin, positions, inverse, heads))
    label = f"{chain.name} {what} heads={heads} inverse={inverse} fp32={fp32} threads={threads}"
    assert_same_bits(kernels_chain(chain, x, weight, cos, sin, positions, inverse, heads, fp32), ref,
                     f"{label}: separate kernels vs oracle")
    for place in in_place:
        if fp32 and place:
            continue
        got = fused(chain, x, weight, cos, sin, positions, inverse, heads, fp32, place, threads)
        assert_same_bits(got, ref, f"{label} in_place={place}: fused vs the chain")


def check_chain(chain: Chain, heads: int, dim: int, tables, max_seq: int, seed: int, rows: int = 5,
                inverse: tuple[bool, ...] = (False,), threads: int = 0) -> None:
    """Random rows at several positions (the first and last table rows but one among them), fp32
    input with a norm, then the corner and tie rows at position 0."""
    rng = np.random.default_rng(seed)
    positions = np.sort(rng.integers(0, max_seq - 1, rows)).astype(np.int32)
    positions[0], positions[-1] = 0, max_seq - 2
    weight = bf16((1 + 0.2 * rng.standard_normal(dim)).astype(np.float32)) if chain.norm else None
    kw: dict[str, Any] = {"heads": heads, "tables": tables, "threads": threads}
    for inv in inverse:
        check_case(chain, random_rows(rng, rows, heads * dim), weight, positions, inv, what="random", **kw)
    if chain.norm:
        check_case(chain, random_rows(rng, rows, dim, fp32=True), weight, positions, fp32=True, what="random", **kw)
    x, w = corner_rows(chain, dim, heads)
    check_case(chain, x, w, np.zeros(x.shape[0], np.int32), what="corners", **kw)
    if chain.norm:
        x, w = tie_rows(dim, chain.block)
        check_case(chain, x, w, np.zeros(x.shape[0], np.int32), what="ties", **kw)


# ---- simulator shapes ------------------------------------------------------------------------------------

@pytest.mark.parametrize("chain", CHAINS, ids=lambda c: c.name)
def test_chain_exact(chain):
    inverse = (False, True) if chain.table and chain.quant == "none" else (False,)  # q rope and o rope
    check_chain(chain, chain.heads, chain.dim, TABLES, MAX_SEQ, seed=len(chain.name), inverse=inverse)


# forced block shapes: (chain, threads): a quant block over 1, 2, 4 or 16 threads, the norm's sum over 2 .. 32
THREAD_CASES = [("kv", 2), ("kv", 4), ("kv", 32), ("latents", 8), ("index_queries", 4), ("q_norm", 32),
                ("index_keys", 16), ("q_rope", 4)]


def check_threads(name: str, threads: int) -> None:
    """A chain on a few rows with the block shape forced (random rows forward and inverse, corners)."""
    chain = CHAIN[name]
    rng = np.random.default_rng(threads)
    positions = np.array([0, 5, MAX_SEQ - 2], np.int32)
    weight = bf16((1 + 0.2 * rng.standard_normal(chain.dim)).astype(np.float32)) if chain.norm else None
    kw: dict[str, Any] = {"heads": chain.heads, "tables": TABLES, "threads": threads}
    check_case(chain, random_rows(rng, 3, chain.heads * chain.dim), weight, positions, bool(threads % 8),
               what="random", **kw)
    x, w = corner_rows(chain, chain.dim, chain.heads)
    check_case(chain, x, w, np.zeros(x.shape[0], np.int32), what="corners", in_place=(True,), **kw)


@pytest.mark.parametrize("name,threads", THREAD_CASES)
def test_block_shapes_exact(name, threads):
    check_threads(name, threads)


def test_crafted_rows_are_exact():
    """The corner and tie rows do what the docstring says: with a norm, mean(x^2) is a power of four
    (so the norm factor a power of two), and the ties are ties."""
    for chain in CHAINS:
        if not chain.norm:
            continue
        for x, _ in (corner_rows(chain, chain.dim, 1), tie_rows(chain.dim, chain.block)):
            assert np.array_equal(x, bf16(x))
            ms = mean_square(x).astype(np.float64)
            assert np.all(np.exp2(np.round(np.log2(ms))) == ms) and np.all(np.log2(ms) % 2 == 0), chain.name
            assert np.all(np.float32(ms + np.float32(EPS)) == ms)
    v = tie_values(np.random.default_rng(0), 64) * np.float32(1.5)
    assert np.all(bf16(v) != v)
    cos, sin = TABLES["plain"]
    assert cos[0].min() == 1 and sin[0].max() == 0 == sin[0].min()  # position 0 rotates by nothing


def test_launch_shapes():
    """The default GPU shapes named in the module docstring (the simulator's: one thread)."""
    if SIM:
        assert nrq.fused_shape(512, True, 32) == (512, 1)
        return
    assert nrq.fused_shape(1280, False, 0) == (10, 128)
    assert nrq.fused_shape(512, True, 32) == (4, 128)
    assert nrq.fused_shape(512, True, 16) == (4, 128)
    assert nrq.fused_shape(128, True, 32) == (2, 64)
    assert nrq.fused_shape(64, True, 0) == (2, 32)


def test_input_errors():
    x = cuda.to_device(np.zeros((2, 64), np.uint16))
    w = cuda.to_device(np.ones(64, np.float32))
    cos, sin = (cuda.to_device(t) for t in TABLES["plain"])
    pos = cuda.to_device(np.zeros(2, np.int32))
    with pytest.raises(InputError, match="unknown quant"):
        nrq.norm_rope_quant(x, None, None, cos, sin, pos, False, "fp8", 2)
    with pytest.raises(InputError, match="heads must be 1"):
        nrq.norm_rope_quant(x, cuda.to_device(np.ones(32, np.float32)), EPS, None, None, None, False, "none", 2,
                            heads=2)
    with pytest.raises(InputError, match="fp32 x only with a norm"):
        nrq.norm_rope_quant(cuda.to_device(np.zeros((2, 64), np.float32)), None, None, cos, sin, pos, False, "act", 2,
                            out=x)
    with pytest.raises(InputError, match="in place"):
        nrq.norm_rope_quant(cuda.to_device(np.zeros((2, 64), np.float32)), w, EPS, None, None, None, False, "none", 2)
    with pytest.raises(InputError, match="uint16 or float32"):
        nrq.norm_rope_quant(cuda.to_device(np.zeros((2, 64), np.float64)), w, EPS, None, None, None, False, "none", 2)
    with pytest.raises(InputError, match="weight"):
        nrq.norm_rope_quant(x, cuda.to_device(np.ones(64, np.float64)), EPS, None, None, None, False, "none", 2)
    with pytest.raises(InputError, match="positions"):
        nrq.norm_rope_quant(x, None, None, cos, sin, cuda.to_device(np.zeros(2, np.int64)), False, "none", 2)
    with pytest.raises(InputError, match="rows requested"):
        nrq.norm_rope_quant(x, w, EPS, cos, sin, pos, False, "act", 3)
    with pytest.raises(InputError, match="blocks of 32"):
        nrq.norm_rope_quant(cuda.to_device(np.zeros((2, 48), np.uint16)), None, None, None, None, None, False, "act", 2)
    with pytest.raises(InputError, match="do not split into 3 heads"):
        nrq.norm_rope_quant(x, None, None, cos, sin, pos, False, "none", 2, heads=3)
    with pytest.raises(InputError, match="out rows"):
        narrow = cuda.to_device(np.zeros((2, 32), np.uint16))
        nrq.norm_rope_quant(x, w, EPS, None, None, None, False, "none", 2, out=narrow)
    with pytest.raises(InputError, match="do not split over 3 threads"):
        nrq.norm_rope_quant(x, w, EPS, cos, sin, pos, False, "act", 2, threads=3)


# ---- mutants: the checks above reject a wrong kernel -----------------------------------------------------

def _fused_edit(old: str, new: str) -> dict:
    return {"fused_body": edited(nrq, "fused_body", old, new)}


MUTANTS = {
    # the norm's bf16 rounding left out: rope and quant then see fp32 values
    "norm_unrounded": (lambda: _fused_edit("v[k] = round_bf16(mul_rn(weight[c0 + k], mul_rn(v[k], rs)))",
                                           "v[k] = mul_rn(weight[c0 + k], mul_rn(v[k], rs))"),
                       lambda: check_chain(CHAIN["kv"], 1, 64, TABLES, MAX_SEQ, seed=3, rows=3)),
    "position_plus_1": (lambda: _fused_edit("pos = positions[r]", "pos = positions[r] + 1"),
                        lambda: check_chain(CHAIN["latents"], 1, 64, TABLES, MAX_SEQ, seed=4, rows=3)),
    "norm_scale_1pct": (lambda: _fused_edit("rs = float32(1.0 / math.sqrt(", "rs = float32(1.01 / math.sqrt("),
                        lambda: check_chain(CHAIN["q_norm"], 1, 96, TABLES, MAX_SEQ, seed=5, rows=3)),
    # a quant block shared by threads but its maximum taken by each thread alone
    "group_max_dropped": (lambda: _fused_edit("if lanes > 1:", "if lanes > 99:"),
                          lambda: check_threads("kv", 4)),
}


@pytest.mark.parametrize("name", list(MUTANTS))
def test_mutants_rejected(name):
    replacements, check = MUTANTS[name]
    with mutant(nrq, **replacements()), pytest.raises(AssertionError, match="fused vs the chain"):
        check()


# ---- V4.1-Flash sizes on the GPU ----------------------------------------------------------------------------

FLASH_TABLES = rope_tables("flash", FLASH_MAX_SEQ) if not SIM else {}


@pytest.mark.gpu
@pytest.mark.parametrize("chain", CHAINS, ids=lambda c: c.name)
def test_flash_chain_exact(chain):
    """q_norm 1280, kv 512, index keys 128, latents 512, index queries 32 x 128, q / o rope 64 x 512."""
    inverse = (False, True) if chain.table and chain.quant == "none" else (False,)
    check_chain(chain, chain.flash_heads, chain.flash_dim, FLASH_TABLES, FLASH_MAX_SEQ, seed=20 + len(chain.name),
                rows=6, inverse=inverse)


@pytest.mark.gpu
@pytest.mark.parametrize("name,threads", [("kv", 32), ("kv", 256), ("q_norm", 256), ("q_norm", 64),
                                          ("index_queries", 32), ("latents", 256), ("q_rope", 32)])
def test_flash_block_shapes_exact(name, threads):
    chain = CHAIN[name]
    check_chain(chain, chain.flash_heads, chain.flash_dim, FLASH_TABLES, FLASH_MAX_SEQ, seed=threads, rows=3,
                threads=threads)


@pytest.mark.gpu
def test_flash_mutants_rejected():
    chain = CHAIN["kv"]
    with mutant(nrq, **_fused_edit("pos = positions[r]", "pos = positions[r] + 1")), pytest.raises(AssertionError):
        check_chain(chain, 1, chain.flash_dim, FLASH_TABLES, FLASH_MAX_SEQ, seed=1, rows=3)


def check_pair(first: Chain, second: Chain, dims: tuple[int, int], heads: tuple[int, int], tables, max_seq: int,
               rows: int, seed: int) -> None:
    """norm_rope_quant_pair of two chains over the same rows: each out bit for bit its chain's
    norm_rope_quant alone (which test_chain_exact holds to the oracle), rows past n_rows untouched."""
    rng = np.random.default_rng(seed)
    positions = cuda.to_device(rng.integers(0, max_seq - 1, rows).astype(np.int32))
    calls, outs, alone = [], [], []
    for chain, dim, h in zip((first, second), dims, heads, strict=True):
        x = cuda.to_device(to_bits(random_rows(rng, rows, h * dim)))
        weight = cuda.to_device(rng.uniform(0.5, 1.5, dim).astype(np.float32)) if chain.norm else None
        cos, sin = (None, None) if chain.table is None else (cuda.to_device(t) for t in tables[chain.table])
        out = cuda.to_device(np.full((rows + 2, h * dim), SENTINEL, np.uint16))
        calls.append(nrq.Chain(x, weight, EPS if chain.norm else None, cos, sin,
                               positions if cos is not None else None, False, chain.quant, h, out))
        outs.append(out)
        ref = cuda.device_array((rows, h * dim), np.uint16)
        nrq.norm_rope_quant(x, weight, EPS if chain.norm else None, cos, sin, positions if cos is not None else None,
                            False, chain.quant, rows, h, out=ref)
        alone.append(ref.copy_to_host())
    nrq.norm_rope_quant_pair(calls[0], calls[1], rows)
    for chain, out, want in zip((first, second), outs, alone, strict=True):
        got = out.copy_to_host()
        assert np.all(got[rows:] == SENTINEL), f"{chain.name}: rows past n_rows written"
        assert_same_bits(got[:rows], want, f"{chain.name} in a pair")


def test_pair_is_each_chain_alone():
    """The attention step's pair (q_norm, and the kv chain's norm, rope and act) in one launch, and
    a pair of one head and several (the kv chain and q rope)."""
    q, kv, q_rope = CHAIN["q_norm"], CHAIN["kv"], CHAIN["q_rope"]
    check_pair(q, kv, (q.dim, kv.dim), (1, 1), TABLES, MAX_SEQ, rows=3, seed=1)
    check_pair(kv, q_rope, (kv.dim, q_rope.dim), (1, q_rope.heads), TABLES, MAX_SEQ, rows=2, seed=2)
    keys, latents = CHAIN["index_keys"], CHAIN["latents"]
    check_pair(keys, latents, (keys.dim, latents.dim), (1, 1), TABLES, MAX_SEQ, rows=2, seed=4)


@pytest.mark.gpu
def test_flash_pair_is_each_chain_alone():
    """At flash sizes q_norm and the kv chain take 128-thread blocks each; the index keys take 64
    and the compressed rows 128, so that pair runs the keys in 128-thread blocks, half inactive."""
    tables = rope_tables("flash", FLASH_MAX_SEQ)
    q, kv = CHAIN["q_norm"], CHAIN["kv"]
    check_pair(q, kv, (q.flash_dim, kv.flash_dim), (1, 1), tables, FLASH_MAX_SEQ, rows=5, seed=3)
    keys, latents = CHAIN["index_keys"], CHAIN["latents"]
    assert nrq.fused_shape(keys.flash_dim, True, keys.block)[1] < nrq.fused_shape(latents.flash_dim, True,
                                                                                   latents.block)[1]
    check_pair(keys, latents, (keys.flash_dim, latents.flash_dim), (1, 1), tables, FLASH_MAX_SEQ, rows=4, seed=6)


def check_ring_mirror(dims: tuple[int, int], tables, window: int, positions: np.ndarray, seed: int) -> None:
    """The attention step's pair with the kv chain's rows mirrored into the window ring (a decode
    step's: Chain.ring), one shared ring and each row's own through an address table: every out is
    its chain alone, slot positions[r] % W of row r's ring holds its out row, every other slot is
    untouched."""
    from flashv41.stages.row_tables import address_table

    rng = np.random.default_rng(seed)
    rows = len(positions)
    pos = cuda.to_device(positions.astype(np.int32))
    q, kv = CHAIN["q_norm"], CHAIN["kv"]
    xs = [cuda.to_device(to_bits(random_rows(rng, rows, d))) for d in dims]
    weights = [cuda.to_device(rng.uniform(0.5, 1.5, d).astype(np.float32)) for d in dims]
    cos, sin = (cuda.to_device(t) for t in tables[kv.table])
    want = cuda.device_array((rows, dims[1]), np.uint16)
    nrq.norm_rope_quant(xs[1], weights[1], EPS, cos, sin, pos, False, kv.quant, rows, out=want)
    want_rows = want.copy_to_host()
    for shared in (True, False):
        rings = [cuda.to_device(np.full((window, dims[1]), SENTINEL, np.uint16)) for _ in range(1 if shared else rows)]
        ring = rings[0] if shared else cuda.to_device(address_table(rings))
        outs = [cuda.device_array((rows, d), np.uint16) for d in dims]
        nrq.norm_rope_quant_pair(nrq.Chain(xs[0], weights[0], EPS, None, None, None, False, q.quant, out=outs[0]),
                                 nrq.Chain(xs[1], weights[1], EPS, cos, sin, pos, False, kv.quant, out=outs[1],
                                           ring=ring, ring_table=not shared), rows)
        assert_same_bits(outs[1].copy_to_host(), want_rows, "kv chain with its ring")
        for r in range(rows):
            got = rings[0 if shared else r].copy_to_host()
            slot = positions[r] % window
            assert_same_bits(got[slot], want_rows[r], f"row {r}'s ring slot")
            others = [s for s in range(window) if s != slot and not (shared and s in positions % window)]
            assert np.all(got[others] == SENTINEL), f"row {r}: another slot of its ring written"


def test_ring_mirror():
    check_ring_mirror((CHAIN["q_norm"].dim, CHAIN["kv"].dim), TABLES, 8, np.array([5, 10, 19]), seed=6)


@pytest.mark.gpu
def test_flash_ring_mirror():
    check_ring_mirror((CHAIN["q_norm"].flash_dim, CHAIN["kv"].flash_dim), rope_tables("flash", FLASH_MAX_SEQ), 128,
                      np.array([1023, 4000, 130, 0, 77]), seed=7)


def test_ring_errors():
    """A ring of another width, or a ring without positions, is a named error."""
    x = cuda.to_device(np.zeros((2, 16), np.uint16))
    pos = cuda.to_device(np.zeros(2, np.int32))
    with pytest.raises(InputError, match=r"ring \(4, 8\) for rows of 16"):
        nrq.norm_rope_quant_pair(nrq.Chain(x, None, None, None, None, None, False, "none"),
                                 nrq.Chain(x, None, None, None, None, pos, False, "none",
                                           ring=cuda.to_device(np.zeros((4, 8), np.uint16))), 2)
    with pytest.raises(InputError, match="positions"):
        nrq.norm_rope_quant_pair(nrq.Chain(x, None, None, None, None, None, False, "none"),
                                 nrq.Chain(x, None, None, None, None, None, False, "none",
                                           ring=cuda.to_device(np.zeros((4, 16), np.uint16))), 2)
