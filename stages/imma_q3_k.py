"""The integer tensor-core GEMV's Q3_K pieces (stages.imma_walks' walk step takes them; the kernel
and its method, digits, exactness and launch, are stages.linear_imma's).

Q3_K. Value i of 16-value group j of a 256-value super-block is d sc_j q_i: q_i = q'_i - 4 in
-4..3, q'_i the stored 3-bit level (two bits of qs, the third a bit of hmask), sc_j = c_j - 32 in
-32..31, c_j the stored 6-bit scale (a low nibble of scale bytes 0..7, a top pair of bytes 8..11),
d fp16. One mma is a chunk of 32 values (groups 2 c, 2 c + 1): byte i of qs run c // 4 (32 bytes)
holds value i of chunk c in bits 2 (c % 4), bit c of hmask byte i its third bit, so a lane's three
8-byte loads a row (hmask, qs runs 0 and 1) give the raw levels of all eight chunks by two shifts
and two masks a register (q3_k_raw). As Q2_K's, the lane's eight values of a chunk (stored 8 t ..
8 t + 7) are all of group 2 c + t // 2, so each of its A registers is four levels of one group and
row, and the group's scale can go into them: sc q spans -124..128, one past int8, but its negative
-sc q = (32 - c) (q' - 4) spans -128..124, an int8 level. One integer multiply-add of the word of
four raw levels makes (32 - c) q' + 4 c = 128 - sc q in each byte (0..252: no carry leaves a byte,
no borrow enters one, so the word's value is that of its bytes), and an xor takes the 128 off as a
signed byte (q3_k_negated). So each chunk takes one mma a token pair, its P the chunk's sum of
-sc q D, exact in int32: |S_p| <= 32 x 128 x 128 = 2^19 (reached only by a chunk of sc = -32 and
q = -4 throughout against digits of -128), |P| <= 32 x 128 x 32896 < 2^27.01 (the top pair's
below 2^26.02: |D_3| <= 64). Its conversion is exact below 2^24 and rounds once above, as Q8_0's
may (its levels span the same bytes): only where a chunk's large products meet its block's largest
inputs. The scales c of a step: the lane's eight groups' low nibbles and top pairs are picked from
a row's three scale words by two byte permutes (one selector: bytes t // 2, 2 + t // 2, 4 + t // 2,
6 + t // 2), then put together, one c a byte, for chunks 0..3 and for 4..7 (q3_k_lane_scales);
chunk c's is read by one byte permute (q3_k_chunk_scale). As Q2_K's, each chunk's fp32(P) times its
2^(E - 29) (exact: an integer times a normal power of two) goes into an fp32 sum over the
super-block (one fused multiply-add a chunk, token pair and row), and the step ends with acc -= d
(that sum) (one fused multiply-add; Q3_K has no minimum term), d converted once a step. A walk step
is a super-block: three 8-byte loads (bytes 8 t .. 8 t + 7 of hmask and of the two qs runs), three
4-byte loads (the 12 scale bytes, only 4-byte aligned in the split layout) and one 4-byte load (the
word of its d) a row; a slice is whole super-blocks.

Roundings. A term meets its P's conversion (at most one), the step's sum (at most 8 additions),
acc's fused multiply-add (one a step along the slice: at most K/256), the digit pairs' sum (one) and
the slices' (slices - 1): at most K/256 + slices + 9 before the bf16 one. A slice is at least one
super-block, so that is at most K/128 + 9, under the K roundings of tests/bounds.py's sqrt(K) rule
for every K of whole super-blocks (11 at K = 256). Each value enters as one term d sc q, as the
oracle's (exact in fp32: 11 x 6 x 3 bits), so the bound is the plain one (no split terms).

The two other schemes, counted the same way (instructions a step, the engram wkv's launch;
stages.imma_walks' last paragraph has Q3_K's: 379 at T = 1, 601 at T = 8). Splitting sc = 8 a + b
(a in -4..3, b in 0..7) into two int8 products a q, b q on the same B: each A register's
multiply-add and xor twice (64 more a step), two scales a chunk and row to pick (about 48 more),
and a second mma and three integer operations a chunk and token pair for S = 8 S_a + S_b (56 more
a step at T = 1, 224 at T = 8): about 550 and 940. Q6_K's scheme (the levels q alone as A, made as
dearly as Q3_K's A registers: two shifts, two masks and a sign extension; each chunk's two groups in
two mmas with the other group's B bytes zeroed; the scales converted and applied in fp32 a group):
Q6_K's own step has that shape, 566 and 1142 instructions. Both cost more at every T: the
negation's one mma a chunk and token pair is what they lack.

Oracle: host.numerics.linear / matmul_t through stages.linear_imma (tests/test_linear_imma.py), and
tests/test_mutants_products.py's imma mutants of these pieces.
"""

from __future__ import annotations

from numba import int64, uint32

from flashv41.stages.device import CHUNK, byte_perm, device
from flashv41.stages.imma_digits import DIGIT_FLIP
from flashv41.stages.quants.q3_k import Q3_K_BYTES, Q3_K_D, Q3_K_HMASK, Q3_K_LOW_SCALES, Q3_K_PIECE, Q3_K_QS
from flashv41.stages.quants.units import LOW_NIBBLES

Q3_K_LOW_BITS = uint32(0x03030303)  # a level's two qs bits in each byte of a word
Q3_K_HIGH_BIT = uint32(0x04040404)  # its hmask bit, put at bit 2 of each byte
Q3_K_TOP_PAIRS = uint32(0x30303030)  # a 6-bit scale's top pair, at bits 4-5 of each byte
Q3_K_ZERO = 32  # a stored 6-bit scale less this is sc
Q3_K_OFFSET = uint32(0x04040404)  # times c: 4 c in each byte, (32 - c) q' + 4 c = 128 - sc q
Q3_K_LANE_SELECT = uint32(0x6420)  # byte_perm's bytes 0, 2, 4, 6, plus t // 2 in each nibble
# a super-block's piece: hmask (32 bytes), then qs (two runs of 32: run r holds chunks 4 r .. 4 r + 3,
# chunk 4 r + s in bits 2 s of each byte); after every block's piece their 12 scale bytes (scale
# bytes 0..7 the low nibbles of groups j and 8 + j, 8..11 the top pairs of j, 4 + j, 8 + j, 12 + j),
# then their fp16 d's
assert (Q3_K_HMASK, Q3_K_QS, Q3_K_PIECE, Q3_K_D, Q3_K_BYTES) == (0, CHUNK, 3 * CHUNK, 3 * CHUNK + 12, Q3_K_D + 2)
assert Q3_K_LOW_SCALES == 8


@device
def q3_k_raw(qs, hm, j):
    """Four raw Q3_K levels q' = q + 4 (0..7, a byte each) of chunk j: bits 2 (j % 4) of each byte
    of `qs` (a word of its run of qs) as bits 0-1, bit j of each byte of `hm` (the word of hmask
    bytes of the same values) as bit 2."""
    high = hm << uint32(2 - j) if j < 2 else hm >> uint32(j - 2)
    return ((qs >> uint32(2 * (j & 3))) & Q3_K_LOW_BITS) | (high & Q3_K_HIGH_BIT)


@device
def q3_k_negated(raw, c):
    """An A register of four values of one group: -sc q = (32 - c) (q' - 4) for the raw levels q' of
    `raw` and the group's stored scale c (0..63), as int8 bytes. (32 - c) raw + 4 c in each byte is
    128 - sc q, in 0..252: one integer multiply-add of the word (whose value is that of its bytes,
    under 2^32: the signed arithmetic never wraps), then the xor takes the 128 off as a signed byte."""
    biased = (int64(Q3_K_ZERO) - int64(c)) * int64(raw) + int64(c * Q3_K_OFFSET)
    return uint32(biased) ^ DIGIT_FLIP


@device
def q3_k_lane_scales(w0, w1, w2, lane_half):
    """The stored 6-bit scales c of a lane's eight groups 2 j + t // 2 (lane_half = t // 2), one for
    each chunk j, from a row's three words of scale bytes: c of chunk j in byte j % 4 of the first
    word (j < 4) or of the second. Group 2 j + h's low nibble is nibble j // 4 of scale byte
    2 (j % 4) + h, its top pair bits 2 (j // 2) of byte 8 + 2 (j % 2) + h: one byte permute picks
    the four low-nibble bytes, one the top-pair bytes and those shifted down by 2 (byte j % 4 holds
    chunk j's pair at bits 0-1 for j < 4, at bits 4-5 for j >= 4)."""
    select = Q3_K_LANE_SELECT + lane_half * uint32(0x1111)
    low = byte_perm(w0, w1, select)
    top = byte_perm(w2, w2 >> uint32(2), select)
    return ((low & LOW_NIBBLES) | ((top << uint32(4)) & Q3_K_TOP_PAIRS),
            ((low >> uint32(4)) & LOW_NIBBLES) | (top & Q3_K_TOP_PAIRS))


@device
def q3_k_chunk_scale(word, j):
    """Chunk j's stored scale c of a word of q3_k_lane_scales (byte j % 4), as a number: one byte
    permute."""
    return byte_perm(word, uint32(0), uint32(0x4440) | uint32(j & 3))
