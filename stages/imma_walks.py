"""The integer tensor-core GEMV's weight types (stages.linear_imma: one generic kernel, a walk step
and its pieces per type): each type's A registers of a walk step's block, its scales and its
minimum term (module-level pieces), and `walk_steps`, the walk step's loads and mmas for a kernel's
token pairs. The kernel and its method (digits, exactness, launch) are stages.linear_imma's.

Q4_K (IMMA_TYPES: one generic kernel, a walk step and its pieces per type). Value i of sub-block j
(32 values) of a super-block is d sc_j q_i - dmin m_j, q_i in 0..15, sc_j and m_j 6-bit
(k_scale_words), d and dmin fp16. One mma is one sub-block: byte 8 t + i of the super-block's level
run c holds q of sub-block 2 c in its low nibble and of 2 c + 1 in its high one, so a lane's two
8-byte loads a row and run give the A registers of two mmas by a mask (q4_k_levels), in the layout
above. A walk step is a super-block: four 8-byte loads and one 16-byte load (d, dmin, scales) a row.
Per sub-block and digit pair, P is exact and below 2^24 (|S_p| <= 32 x 15 x 128), so its conversion
is exact; acc += fp32(P) (d sc_j 2^(E - 29)), d sc_j exact (11 x 6 bits), times a power of two.
The minimum term, -dmin m_j sum_{k in j} x_k, comes from the block's digits: after the digits, a
second prologue pass sums each (token, block, digit pair)'s D_p + 2^8 D_p+1 over its 32 values
(pair_sum: eight dp4a a digit, exact, at most 2^20.01) and stores it times 2^(E - 29) (exact: an
integer under 2^24 times a normal power of two, never below 2^-126); the walk takes dmin m_j times
it from acc in one fused multiply-add (less_minimum). The two digit pairs' sums add up to the
block's sum of X exactly, so y = acc_lo + 2^16 acc_hi holds sum_k x_k (d sc q_k) - dmin m sum_k x_k
for the rounded X as the Q8_0 product does. A slice is whole super-blocks (no partial step).
Q5_K is Q4_K with a fifth bit: bit j of fifth-bit byte i is bit 4 of value i of sub-block j, so the
lane's 8-byte load of fifth-bit bytes 8 t .. 8 t + 7 a row gives every sub-block's, one shift and
one and-or a register (fifth_bits); the levels 0..31 are int8 as they are. |S_p| <= 32 x 31 x 128
lets P reach 2^25: its conversion rounds (once) where |P| >= 2^24, as Q8_0's may.

Q2_K. Value i of 16-value group j of a 256-value super-block is d sc_j q_i - dmin m_j, q_i in
0..3, sc_j and m_j the low and high nibbles of scale byte j, d and dmin fp16. One mma is a chunk of
32 values (groups 2 c, 2 c + 1): level byte i of the super-block's run h (32 bytes) holds value i of
chunk 4 h + s in bits 2 s, so a lane's two 8-byte loads a row (runs 0, 1) give the A registers of
all eight chunks by a shift and a mask. The lane's eight values of a chunk (stored 8 t .. 8 t + 7)
are all of group 2 c + t // 2, so each of its A registers is four levels of one group and row:
one integer multiply by that group's sc scales all four (q sc <= 45: no byte carries; sc picked
from the scale word by one byte permute), and P = S_p + 2^8 S_p+1 of those is the chunk's sum of
sc q D (|S_p| <= 32 x 45 x 128 < 2^18, |P| < 2^25.5: its conversion rounds, once, where
|P| >= 2^24). A second mma takes the minimum term: its A registers are each group's m in all four
bytes (one byte permute), so its P_m is sum_k m_j(k) (D_p + 2^8 D_p+1) over the chunk, exact and
converted exactly (|S_p| <= 32 x 15 x 128, |P_m| < 2^23.91): the groups' input sums come from the
mma itself, so Q2_K needs no prologue pass of sums (a 16-value group is half a block of digits; the
mma weighs the two halves by their m at once). The super-block cannot take one integer sum and one
scale 2^(E - 29) for its 256 values (E is each 32-value block's), so each chunk's fp32(P) and
fp32(P_m) times its 2^(E - 29) (exact) go into two fp32 sums over the super-block, one fused
multiply-add each, and the step ends with acc += d (the first) - dmin (the second) (less_minimum):
d and dmin multiply once a step, not once a chunk and token pair. A walk step is a super-block: two
8-byte loads, one 16-byte load (the scale bytes) and one 4-byte load (d, dmin) a row; a slice is
whole super-blocks. Each value's two parts are added apart, as Q4_K's: a term of the scaled part
meets its P's conversion (at most one), the step's sum (at most 8 additions) and acc's two fused
multiply-adds, a term of the minimum part the last two, within the split terms' bound below.

Q6_K. Value i of 16-value group j of a super-block is d sc_j (q_i - 32), q_i 6-bit (a low nibble of
ql, a top pair of qh), sc_j int8, d fp16. As Q2_K's, a lane's eight values of a chunk are of one
group (2 c + t // 2), and q - 32 in -32..31 is an int8 level as it is (shifts, masks and an or a
register join the two parts, then bit 5 flipped and six times it added sets bits 6 and 7 below it),
but sc (up to 128 in magnitude) cannot go into it. So each chunk takes two mmas on the same A
registers, the first with the B registers of the lanes of the chunk's second group zeroed (a lane's
B bytes are of the same values as its A bytes), the second with those of its first: an and and an
xor a B register and token pair, 566 instructions a step at T <= 2 against 630 for masking the four
A registers instead (which would cost less from T = 8 on: decode is mostly one or two tokens); per
group and digit pair P is exact
(|S_p| <= 16 x 32 x 128) and its conversion exact below 2^24 (which only a group of levels at -32
nearly throughout against digits at -128 nearly throughout passes; then rounded once), acc += fp32(P)
(d sc 2^(E - 29)), d sc exact (11 x 8 bits) and sc read by one byte permute (its sign mode) and a
conversion. (An m16n8k16 mma a group would need the B fragments of 16 values, which the digit
columns' order (lanes hold 8 t .. 8 t + 7 of a block) does not give without a shuffle; zeroing a
k32's halves moves no data.) A walk step is a super-block:
six 8-byte loads (four runs of ql, two of qh), one 16-byte load (the scales) and one 4-byte load
(the word of its d) a row; a slice is whole super-blocks. acc meets two roundings a chunk (one a
group), so a term meets at most its conversion and 2 K/32 + slices + 1 more before the bf16 one,
under the K of bounds.py's rule.

Q3_K (its pieces and their account: stages.imma_q3_k). As Q2_K's, a lane's A registers of a chunk
are four levels of one group and row with the group's scale in them, here negated: -sc q spans
-128..124 where sc q reaches 128; one mma a chunk, a step's chunks summed in fp32, acc -= d (that
sum). A walk step is a super-block: three 8-byte loads (hmask, two runs of qs), three 4-byte loads
(the scale bytes) and one 4-byte load (the word of its d) a row.

MXFP4. Value i of a block is v_i 2^(e - 128), v_i a doubled E2M1 level (-12..12), e the block's
exponent byte. A lane's word of code bytes 4 t .. 4 t + 3 holds eight values, 4 t + i (low nibbles)
and 16 + 4 t + i (high ones); one byte permute with the code nibbles as its selector looks up eight
magnitudes at once (E2M1_MAG: byte_perm reads the selector's low four nibbles, so the A registers
hold values 4 t, 16 + 4 t, 4 t + 1, 17 + 4 t and 4 t + 2, 18 + 4 t, 4 t + 3, 19 + 4 t, the order
the prologue gives the digits of MXFP4 blocks, e2m1_octet_digits). A permute cannot negate: a code
with the sign bit reads 0 there (the permute's sign mode on a table of positive bytes), so the
negative codes' magnitudes come from a second look-up of the codes with their sign bits flipped,
and each block takes two mmas, P = P_pos - P_neg (mxfp4_levels). |P| < 2^24 (|S_p| <= 32 x 12 x 128):
converted exactly, then acc += (fp32(P) 2^(E - 31)) 2^(e - 126): the first product exact (an
integer under 2^24 times a power of two of at least 2^-128, its lowest bit far above fp32's
subnormal step), the second, a normal power of two placed as bits for every e < 253 (mxfp4_scale:
no branch for the subnormal 2^(e - 128) of e = 0, 1), rounded once with the addition, into fp32's
subnormals too, as the oracle's products would be. So that the top digit pair's sums are not scaled
down by 2^16 (into subnormals for the smallest exponents), the prologue stores each block's input
scale 2^(E - 31) for each digit pair, the top one's times 2^16, and y = acc_lo + acc_hi. From
MXFP4_INF_E (253) on a value can be inf: such a block's exponent byte is made 255 at its load
(finite_exponents), whose placed bits are -0.0, and in a step that has one (one test of the
exponent words) the lanes of the top digit pairs add its values times the token's inputs one by one,
each value scaled first as the host's dequantiser does (mxfp4_inf_blocks): the oracle's inf and NaN.
No real weight has one. An MXFP4 step is four blocks, as Q8_0's, its slices may end inside one.

The other types' walk steps, counted the same way (the engram wkv's launch, T = 1; instructions a
step, weight bytes a thread a step, their ratio, and the stream kernel's GEMV walk beside it): Q4_K
321, 72 bytes (a super-block of 16 rows), 4.5 (stream 8.4); Q5_K 386, 88, 4.4 (stream 7.9); MXFP4
227 on the path of a step without inf exponents (their test included; 210 without it), 34 (four
blocks), 6.7 (stream 11.9); Q2_K 331, 42 (a super-block of 16 rows), 7.9 (stream 15.8; at T = 8 769,
18.3: the walk's work grows with the token pairs, its bytes do not); Q6_K 566, 105, 5.4 (stream 6.4;
at T = 8 1142, 10.9, the stream's 20.3); Q3_K 379, 55, 6.9 (stream 12.6; at T = 8 601, 10.9, the
stream's 39.3: one mma a chunk and token pair, against Q2_K's and Q6_K's two). 80-96 registers at
T <= 2 and 111-127 at T = 8 (Q8_0: 78, 94; Q6_K: 111, 168; Q3_K: 96, 119), no spills. (Q3_K counted
2026-12-07 with ptxas and nvdisasm 13.5 on the kernel's sm_90 PTX, the walk loop's instructions from
its head to its back branch; the same count gives Q2_K's, Q4_K's and Q6_K's figures above.) Q4_K and
Q5_K's prologue has a second pass, the block sums: about 110 instructions a (token, digit pair,
block) item.

Oracle: host.numerics.linear (bf16 out) / host.numerics.matmul_t (fp32 out) through
stages.linear_imma, with tests/bounds.py's rules (tests/test_linear_imma.py, and
tests/test_mutants_products.py's imma mutants of these pieces).
"""

from __future__ import annotations

import numpy as np
from numba import cuda, float32, int32, uint32, uint64

from flashv41.host.quants import MXFP4_DOUBLED, GGMLType
from flashv41.stages.device import (
    CHUNK,
    SIM,
    address_at,
    byte_perm,
    device,
    f16x2_f32,
    f32_from_bits,
    inlined,
    word_at,
    words2_at,
    words4_at,
)
from flashv41.stages.imma_digits import DIGIT, SLICE_BLOCKS_MAX, UNROLL, b_words, fma_f32
from flashv41.stages.imma_digits import kernel_imma as imma
from flashv41.stages.imma_q3_k import q3_k_chunk_scale, q3_k_lane_scales, q3_k_negated, q3_k_raw
from flashv41.stages.quants.mxfp4 import MXFP4_INF_E, MXFP4_PAIRS, e2m1_doubled, e8m0_half
from flashv41.stages.quants.q2_k import Q2_K_BYTES, Q2_K_D, Q2_K_GROUPS, Q2_K_HALF_QS, Q2_K_QS_BYTES
from flashv41.stages.quants.q3_k import Q3_K_D, Q3_K_PIECE, Q3_K_SCALE_BYTES
from flashv41.stages.quants.q4_k_q5_k import Q4_K_BYTES, Q4_K_QS, Q5_K_BYTES, Q5_K_QH, Q5_K_QS, k_scale_words
from flashv41.stages.quants.q6_k import Q6_K_BYTES, Q6_K_D, Q6_K_QH, Q6_K_QL, Q6_K_SCALES
from flashv41.stages.quants.units import INT8_MAGIC, INT8_SELECT, LOW_NIBBLES

FIFTH_BITS = uint32(0x10101010)  # bit 4 of each byte: a Q5_K level's fifth bit
TWO_23 = float32(8388608.0)  # k_sub_scale's 2^23
K_STEP = 8  # blocks of 32 values a Q4_K or Q5_K walk step: one super-block, its sub-blocks one mma each
# a super-block's level bytes: four runs of 32 from Q4_K_QS, run c's low nibbles sub-block 2 c, its high ones 2 c + 1
# (Q5_K's: from Q5_K_QS, its fifth bits 32 bytes from Q5_K_QH, bit j of byte i sub-block j's value i)
assert K_STEP * CHUNK == 256 and Q4_K_BYTES == Q4_K_QS + 4 * CHUNK and Q4_K_QS % 16 == 0
assert Q5_K_BYTES == Q5_K_QS + 4 * CHUNK and Q5_K_QS % 16 == 0 and Q5_K_QH % 8 == 0
assert SLICE_BLOCKS_MAX % K_STEP == 0  # a slice is whole super-blocks
Q2_K_LEVELS = uint32(0x03030303)  # a Q2_K level's two bits in each byte of a word
# a Q2_K super-block: 16 scale bytes, two runs of 32 level bytes (run c holds chunks 4 c .. 4 c + 3,
# chunk 4 c + s in bits 2 s of each byte), d and dmin in one word
assert Q2_K_GROUPS == 16 and Q2_K_HALF_QS == CHUNK and Q2_K_QS_BYTES == 2 * CHUNK and Q2_K_BYTES - Q2_K_D == 4
Q6_K_HIGH = uint32(0x30303030)  # a Q6_K level's top two bits in each byte of a word
Q6_K_SIGN = uint32(0x20202020)  # bit 5 of each byte: flipped, the level less 32 as a 6-bit signed number
# a Q6_K super-block's piece: 128 low-nibble bytes (run c of 32: chunks 4 (c // 2) + c % 2 and
# 4 (c // 2) + c % 2 + 2 in its low and high nibbles), 64 top-pair bytes (run h: chunks 4 h + s in bits
# 2 s), 16 int8 scales; the fp16 d's after every block's piece
assert (Q6_K_QL, Q6_K_QH, Q6_K_SCALES, Q6_K_D, Q6_K_BYTES) == (0, 4 * CHUNK, 6 * CHUNK, 6 * CHUNK + 16, Q6_K_D + 2)
# MXFP4: a code's doubled E2M1 magnitude is byte (code & 7) of these two words (byte_perm's table);
# a code of the other sign (bit 3 set, byte_perm's sign mode) gives 0 there
E2M1_MAG_LO, E2M1_MAG_HI = (uint32(v) for v in MXFP4_DOUBLED[:8].astype(np.uint8).view("<u4"))
E2M1_SIGN_FLIP = uint32(0x88888888)  # the sign bit of eight codes
assert (MXFP4_DOUBLED[8:] == -MXFP4_DOUBLED[:8]).all() and MXFP4_DOUBLED[:8].max() < 128 and MXFP4_PAIRS == 16
assert MXFP4_INF_E == 128 - 3 + 128  # inf_exponents' test

# the one walk piece that allocates (cuda.local) is a jitted device function on the simulator too:
# the simulator puts its cuda module only into the globals of the module whose kernel or jitted
# function it runs (the kernel is stages.linear_imma's); on a GPU it is inlined as the others are
allocating = cuda.jit(device=True) if SIM else inlined


# the weight types' pieces: the A registers of a walk step's block, its scale and its minimum term


@device
def q4_k_levels(word, high):
    """Four Q4_K levels (0..15, int8 bytes as they are) of a word of level bytes: the low nibbles
    (sub-block 2 c of the run) or the high ones (2 c + 1)."""
    return (word >> uint32(4)) & LOW_NIBBLES if high else word & LOW_NIBBLES


@device
def fifth_bits(levels, qh, j):
    """Four Q5_K levels: Q4_K's four (levels) with bit j of the four bytes of qh as their bit 4
    (0..31, int8 bytes as they are)."""
    high = qh << uint32(4 - j) if j < 4 else qh >> uint32(j - 4)
    return levels | (high & FIFTH_BITS)


@device
def k_sub_scale(d, word, i):
    """d times byte i of a word of 6-bit scales (or mins), k_scale_words': exact in float32. One
    byte permute puts the byte b under 2^23's exponent (2^23 + b), one fused multiply-add takes
    2^23 d back off its product with d (both exact: b d has at most 17 significant bits)."""
    return fma_f32(f32_from_bits(byte_perm(word, INT8_MAGIC, INT8_SELECT | uint32(i))), d, -(d * TWO_23))


@device
def less_minimum(acc, dmin_m, block_sum):
    """acc - dmin m times a block's inputs' (digit pair's) sum, which the prologue scaled: one fused
    multiply-add."""
    return acc - dmin_m * block_sum


@device
def q2_k_group(word, b):
    """sc and m of byte b of a word of Q2_K scale bytes (a group's): sc (its low nibble) as a number,
    m (its high one) in all four bytes, for an mma's A register. One byte permute each."""
    return (byte_perm(word & LOW_NIBBLES, uint32(0), uint32(0x4440) | b),
            byte_perm((word >> uint32(4)) & LOW_NIBBLES, uint32(0), b * uint32(0x1111)))


@device
def q2_k_levels(word, j, sc):
    """An A register of chunk j of a Q2_K super-block: four levels (bits 2 (j % 4) of each level
    byte of `word`, of run j // 4) times their group's scale sc in one integer multiply (q sc <= 45:
    no byte carries into the next)."""
    return ((word >> uint32(2 * (j & 3))) & Q2_K_LEVELS) * sc


@device
def q6_k_levels(low, high, j):
    """The A register of four Q6_K levels of chunk j: the low nibbles (bits 4 ((j % 4) // 2) of each
    byte of `low`, its run of ql) joined to the top pairs (bits 2 (j % 4) of `high`, its run of qh),
    less 32 as int8 bytes (bit 5 flipped, then 6 times it added: bits 6 and 7 set where it is, no
    carry leaving a byte)."""
    top = high << uint32(4 - 2 * (j & 3)) if (j & 3) < 3 else high >> uint32(2)
    x = (((low >> uint32(4 * ((j & 3) >> 1))) & LOW_NIBBLES) | (top & Q6_K_HIGH)) ^ Q6_K_SIGN
    return x + (x & Q6_K_SIGN) * uint32(6)


@device
def q6_k_scale(word, b):
    """Int8 scale byte b of a word of Q6_K scales, as float32: one byte permute (sign mode: the
    byte's top bit in the three above it) and one conversion."""
    return float32(int32(byte_perm(word, uint32(0), b | ((b | uint32(8)) * uint32(0x1110)))))


@device
def mxfp4_levels(word):
    """The A registers of a word of MXFP4 code bytes 4 t .. 4 t + 3 (byte i: value 4 t + i in its low
    nibble, 16 + 4 t + i in its high one): the levels of values (4 t, 16 + 4 t, 4 t + 1, 17 + 4 t)
    and (4 t + 2, 18 + 4 t, 4 t + 3, 19 + 4 t) (byte_perm reads its selector's low four nibbles in
    that order), as the magnitudes of the positive codes (others 0) and of the negative ones: the
    level is the first less the second, which two mmas take apart."""
    flipped = word ^ E2M1_SIGN_FLIP
    return (byte_perm(E2M1_MAG_LO, E2M1_MAG_HI, word), byte_perm(E2M1_MAG_LO, E2M1_MAG_HI, word >> uint32(16)),
            byte_perm(E2M1_MAG_LO, E2M1_MAG_HI, flipped), byte_perm(E2M1_MAG_LO, E2M1_MAG_HI, flipped >> uint32(16)))


@device
def mxfp4_scale(word, j):
    """2^(e - 126) for byte j of a word of exponent bytes made finite (finite_exponents): a normal
    power of two, placed as fp32 bits, for e < MXFP4_INF_E (the 2^-2 to 2^(e - 128) is in the
    blocks' input scales); -0.0 for e = 255, where the block is added value by value instead
    (mxfp4_inf_blocks)."""
    return f32_from_bits((((word >> uint32(8 * j)) & uint32(0xFF)) + uint32(1)) << uint32(23))


@device
def inf_bytes(word):
    """The top bit of each of the four exponent bytes of a word that is from MXFP4_INF_E (253) on: a
    byte's top bit, and its low seven bits plus 3 reaching 128 (no carry leaves a byte)."""
    return word & ((word & uint32(0x7F7F7F7F)) + uint32(0x03030303)) & uint32(0x80808080)


@device
def finite_exponents(word):
    """A word of exponent bytes with those from MXFP4_INF_E on made 255 (mxfp4_scale's zero)."""
    return word | ((inf_bytes(word) >> uint32(7)) * uint32(0xFF))


@device
def inf_exponents(word):
    """Whether any of the four exponent bytes of a word is from MXFP4_INF_E on."""
    return inf_bytes(word) != uint32(0)


@device
def mxfp4_inf_block(x32, t, word, address, b, e):
    """Token t's inputs (at word `word` of x32) times the values of block b of a row (row_address),
    each value scaled first as the host's dequantiser has it (inf where it overflows): the oracle's
    inf and NaN for a block whose exponent byte is from MXFP4_INF_E on. No real weight has one."""
    d = e8m0_half(e)
    total = float32(0)
    for i in range(4):
        codes = word_at(address, uint32(MXFP4_PAIRS) * b + uint32(4 * i))
        for j in range(2):
            lo = x32[t, word + uint32(2 * i + j)]  # inputs 4 i + 2 j, + 1
            hi = x32[t, word + uint32(8 + 2 * i + j)]  # their partners 16 up
            for h in range(2):
                c = (codes >> uint32(16 * j + 8 * h)) & uint32(0xFF)
                shift = uint32(16 * (1 - h))
                total += f32_from_bits((lo << shift) & uint32(0xFFFF0000)) * (e2m1_doubled(c & uint32(15)) * d)
                total += f32_from_bits((hi << shift) & uint32(0xFFFF0000)) * (e2m1_doubled(c >> uint32(4)) * d)
    return total


def walk_steps(gtype: GGMLType, pairs: int):
    """Weight type gtype's walk pieces for a kernel of `pairs` token pairs (stages.linear_imma's
    imma_kernel): (load, tail, block, mmas, inf_blocks), a walk step's loads, those of a slice's last,
    partial step, one block's mmas (a partial step's), a whole step's mmas, and MXFP4's blocks with
    infinite values (mxfp4_inf_blocks: the kernel calls it for MXFP4 only)."""
    part_shape = (pairs, 2, 2)  # a Q2_K step's sums: [token pair, row half, scaled or minimum]
    q3_part_shape, q3_lane_shape = (pairs, 2), (2, 2)  # a Q3_K step's sums; its lane's scales
    fifth = gtype == GGMLType.Q5_K
    k_bytes, k_qs = (Q5_K_BYTES, Q5_K_QS) if fifth else (Q4_K_BYTES, Q4_K_QS)

    @inlined
    def load_full(lo, hi, k, b, held, d, t4):
        """A walk step's loads: blocks b .. b + UNROLL - 1 of the lane's two rows (row addresses lo,
        hi), bytes 8 t4 .. 8 t4 + 7 of each (at constant offsets of one address a row), and their scales."""
        at = uint32(uint32(CHUNK) * b + uint32(8) * t4)
        lo_at = address_at(lo, at)
        hi_at = address_at(hi, at)
        for j in range(UNROLL):
            held[j, 0, 0], held[j, 0, 1] = words2_at(lo_at, uint32(CHUNK * j))
            held[j, 1, 0], held[j, 1, 1] = words2_at(hi_at, uint32(CHUNK * j))
        load_scales(lo, hi, k, b, d)

    @inlined
    def load_tail(lo, hi, k, b, last, held, d, t4):
        """load_full's loads for a slice's last, partial step: blocks past `last` load block `last`
        (a real block, its sums not used)."""
        for j in range(UNROLL):
            at = uint32(uint32(CHUNK) * min(uint32(b + uint32(j)), last) + uint32(8) * t4)
            held[j, 0, 0], held[j, 0, 1] = words2_at(lo, at)
            held[j, 1, 0], held[j, 1, 1] = words2_at(hi, at)
        load_scales(lo, hi, k, b, d)

    @inlined
    def load_scales(lo, hi, k, b, d):
        """The fp16 scales of blocks b .. b + 3 of both rows (block j's at byte K + 2 j; b a multiple of 4)."""
        at = uint32(k + uint32(2) * b)
        s01, s23 = words2_at(lo, at)
        d[0, 0], d[1, 0] = f16x2_f32(s01)
        d[2, 0], d[3, 0] = f16x2_f32(s23)
        s01, s23 = words2_at(hi, at)
        d[0, 1], d[1, 1] = f16x2_f32(s01)
        d[2, 1], d[3, 1] = f16x2_f32(s23)

    @inlined
    def block_mmas(digits, scales, held, d, acc, j, dig, sc, ctx):
        """Block j of the step against every token pair's digits (dig, sc: the lane's indices of the
        step's first block in digits and scales)."""
        for p in range(pairs):
            # B column g of token pair p: token 2 p + g // 4, digit g % 4; D columns 2 t4, 2 t4 + 1:
            # token 2 p + t4 // 2
            b_lo, b_hi = b_words(digits, dig, j, p)
            s = scales[sc + uint64(j + 2 * p * SLICE_BLOCKS_MAX)]
            c0, c1, c2, c3 = imma(held[j, 0, 0], held[j, 1, 0], held[j, 0, 1], held[j, 1, 1], b_lo, b_hi)
            acc[p, 0] += float32(int32(c0 + c1 * DIGIT)) * (d[j, 0] * s)
            acc[p, 1] += float32(int32(c2 + c3 * DIGIT)) * (d[j, 1] * s)


    @inlined
    def step_mmas(digits, scales, sums, held, d, acc, dig, sc, sm, ctx):
        """A walk step's UNROLL blocks against every token pair's digits (sums: no minimum term)."""
        for j in range(UNROLL):
            block_mmas(digits, scales, held, d, acc, j, dig, sc, ctx)


    @inlined
    def load_k(lo, hi, k, b, held, d, t4):
        """A walk step's loads: super-block b // K_STEP of the lane's two rows, bytes 8 t4 .. 8 t4 + 7
        of each of its four runs of level bytes (8-byte loads at constant offsets of one address a
        row), Q5_K's of its fifth bits (held[UNROLL]) and its first 16 bytes (d, dmin, the 12 scale
        bytes: one load a row)."""
        at = uint32(uint32(k_bytes) * (b // uint32(K_STEP)))
        lo_at = address_at(lo, at)
        hi_at = address_at(hi, at)
        for c in range(UNROLL):
            held[c, 0, 0], held[c, 0, 1] = words2_at(lo_at, uint32(k_qs + CHUNK * c) + uint32(8) * t4)
            held[c, 1, 0], held[c, 1, 1] = words2_at(hi_at, uint32(k_qs + CHUNK * c) + uint32(8) * t4)
        if fifth:
            held[UNROLL, 0, 0], held[UNROLL, 0, 1] = words2_at(lo_at, uint32(Q5_K_QH) + uint32(8) * t4)
            held[UNROLL, 1, 0], held[UNROLL, 1, 1] = words2_at(hi_at, uint32(Q5_K_QH) + uint32(8) * t4)
        d[0, 0], d[0, 1], d[0, 2], d[0, 3] = words4_at(lo_at, uint32(0))
        d[1, 0], d[1, 1], d[1, 2], d[1, 3] = words4_at(hi_at, uint32(0))

    @inlined
    def k_levels(held, c, h, w, j):
        """The A register of sub-block j (run c) of row half h, word w: Q4_K's levels, with Q5_K's fifth bit."""
        q = q4_k_levels(held[c, h, w], j & 1)
        return fifth_bits(q, held[UNROLL, h, w], j) if fifth else q

    @inlined
    def k_step_mmas(digits, scales, sums, held, d, acc, dig, sc, sm, ctx):
        """A super-block's eight sub-blocks against every token pair's digits: for sub-block j and a
        digit pair's P, acc += P (d sc_j 2^(E - X_BITS)), then acc -= dmin m_j times the pair's scaled
        sum of the block's inputs (dig, sc, sm: the lane's indices of the step's first block)."""
        d_lo, dmin_lo = f16x2_f32(d[0, 0])
        d_hi, dmin_hi = f16x2_f32(d[1, 0])
        for part in range(2):  # sub-blocks 0 .. 3, then 4 .. 7
            sc_lo, mn_lo = k_scale_words(d[0, 1], d[0, 2], d[0, 3], part)
            sc_hi, mn_hi = k_scale_words(d[1, 1], d[1, 2], d[1, 3], part)
            for i in range(4):
                j = 4 * part + i
                c = j >> 1
                a0, a1 = k_levels(held, c, 0, 0, j), k_levels(held, c, 1, 0, j)
                a2, a3 = k_levels(held, c, 0, 1, j), k_levels(held, c, 1, 1, j)
                scale_lo, scale_hi = k_sub_scale(d_lo, sc_lo, i), k_sub_scale(d_hi, sc_hi, i)
                min_lo, min_hi = k_sub_scale(dmin_lo, mn_lo, i), k_sub_scale(dmin_hi, mn_hi, i)
                for p in range(pairs):
                    b_lo, b_hi = b_words(digits, dig, j, p)
                    s = scales[sc + uint64(j + 2 * p * SLICE_BLOCKS_MAX)]
                    m = sums[sm + uint64(j + 4 * p * SLICE_BLOCKS_MAX)]
                    c0, c1, c2, c3 = imma(a0, a1, a2, a3, b_lo, b_hi)
                    acc[p, 0] = less_minimum(acc[p, 0] + float32(int32(c0 + c1 * DIGIT)) * (scale_lo * s), min_lo, m)
                    acc[p, 1] = less_minimum(acc[p, 1] + float32(int32(c2 + c3 * DIGIT)) * (scale_hi * s), min_hi, m)

    @inlined
    def load_q2_k(lo, hi, k, b, held, d, t4):
        """A walk step's loads: super-block s = b // K_STEP of the lane's two rows in the split layout,
        bytes 8 t4 .. 8 t4 + 7 of each of its two runs of level bytes (at K / 16 + 64 s), its 16
        scale bytes (at 16 s: one load) and its d and dmin (at K / 16 + K / 4 + 4 s)."""
        s = uint32(b // uint32(K_STEP))
        qs = uint32((k >> uint32(4)) + uint32(Q2_K_QS_BYTES) * s + uint32(8) * t4)
        dm = uint32((k >> uint32(4)) + (k >> uint32(2)) + uint32(4) * s)
        for c in range(2):
            held[c, 0, 0], held[c, 0, 1] = words2_at(lo, qs + uint32(CHUNK * c))
            held[c, 1, 0], held[c, 1, 1] = words2_at(hi, qs + uint32(CHUNK * c))
        d[0, 0], d[0, 1], d[0, 2], d[0, 3] = words4_at(lo, uint32(Q2_K_GROUPS) * s)
        d[1, 0], d[1, 1], d[1, 2], d[1, 3] = words4_at(hi, uint32(Q2_K_GROUPS) * s)
        d[0, 4] = word_at(lo, dm)
        d[1, 4] = word_at(hi, dm)

    @allocating
    def q2_k_step_mmas(digits, scales, sums, held, d, acc, dig, sc, sm, ctx):
        """A Q2_K super-block's eight chunks against every token pair's digits: for chunk j and a digit
        pair, the P of the levels times their groups' sc and the P of the groups' m (the minimum
        term's mma: each value's m as its level; the lane's four registers of a row all of its
        group) are summed over the super-block times 2^(E - X_BITS) (exact products: one fused
        multiply-add each a chunk), then acc += d (the first sum) - dmin (the second) (sums: unused)."""
        lane_half = ctx[6] >> uint32(1)  # a chunk's values 8 t .. 8 t + 7 are of its group 2 j + t // 2
        part = cuda.local.array(part_shape, float32)  # [token pair, row half, scaled or minimum]
        for p in range(pairs):
            for h in range(2):
                part[p, h, 0] = float32(0)
                part[p, h, 1] = float32(0)
        for j in range(K_STEP):
            c = j >> 2
            b = uint32(2 * (j & 1)) + lane_half  # the lane's scale byte of chunk j in word j // 2
            sc_lo, n_lo = q2_k_group(d[0, j >> 1], b)
            sc_hi, n_hi = q2_k_group(d[1, j >> 1], b)
            a0, a2 = q2_k_levels(held[c, 0, 0], j, sc_lo), q2_k_levels(held[c, 0, 1], j, sc_lo)
            a1, a3 = q2_k_levels(held[c, 1, 0], j, sc_hi), q2_k_levels(held[c, 1, 1], j, sc_hi)
            for p in range(pairs):
                b_lo, b_hi = b_words(digits, dig, j, p)
                s = scales[sc + uint64(j + 2 * p * SLICE_BLOCKS_MAX)]
                c0, c1, c2, c3 = imma(a0, a1, a2, a3, b_lo, b_hi)
                m0, m1, m2, m3 = imma(n_lo, n_hi, n_lo, n_hi, b_lo, b_hi)
                part[p, 0, 0] += float32(int32(c0 + c1 * DIGIT)) * s
                part[p, 1, 0] += float32(int32(c2 + c3 * DIGIT)) * s
                part[p, 0, 1] += float32(int32(m0 + m1 * DIGIT)) * s
                part[p, 1, 1] += float32(int32(m2 + m3 * DIGIT)) * s
        d_lo, dmin_lo = f16x2_f32(d[0, 4])
        d_hi, dmin_hi = f16x2_f32(d[1, 4])
        for p in range(pairs):
            acc[p, 0] = less_minimum(acc[p, 0] + d_lo * part[p, 0, 0], dmin_lo, part[p, 0, 1])
            acc[p, 1] = less_minimum(acc[p, 1] + d_hi * part[p, 1, 0], dmin_hi, part[p, 1, 1])

    @inlined
    def load_q3_k(lo, hi, k, b, held, d, t4):
        """A walk step's loads: super-block s = b // K_STEP of the lane's two rows in the split layout,
        bytes 8 t4 .. 8 t4 + 7 of its hmask and of its two runs of qs (at Q3_K_PIECE s: 8-byte loads
        at constant offsets of one address a row), its three words of scale bytes (at
        K / 256 Q3_K_PIECE + 12 s) and the word of its d (d at K / 256 Q3_K_D + 2 s)."""
        s = uint32(b // uint32(K_STEP))
        at = uint32(uint32(Q3_K_PIECE) * s + uint32(8) * t4)
        lo_at = address_at(lo, at)
        hi_at = address_at(hi, at)
        for c in range(3):  # hmask, qs run 0, qs run 1
            held[c, 0, 0], held[c, 0, 1] = words2_at(lo_at, uint32(CHUNK * c))
            held[c, 1, 0], held[c, 1, 1] = words2_at(hi_at, uint32(CHUNK * c))
        blocks = uint32(k >> uint32(8))
        sc = uint32(uint32(Q3_K_PIECE) * blocks + uint32(Q3_K_SCALE_BYTES) * s)
        sc_lo = address_at(lo, sc)
        sc_hi = address_at(hi, sc)
        for i in range(3):
            d[0, i] = word_at(sc_lo, uint32(4 * i))
            d[1, i] = word_at(sc_hi, uint32(4 * i))
        dw = uint32(uint32(Q3_K_D) * blocks + uint32(4) * (s >> uint32(1)))
        d[0, 3] = word_at(lo, dw) >> (uint32(16) * (s & uint32(1)))
        d[1, 3] = word_at(hi, dw) >> (uint32(16) * (s & uint32(1)))

    @allocating
    def q3_k_step_mmas(digits, scales, sums, held, d, acc, dig, sc, sm, ctx):
        """A Q3_K super-block's eight chunks against every token pair's digits: for chunk j and a digit
        pair, the P of -sc q (the levels times their groups' negated scales, q3_k_negated; the lane's
        four registers of a row all of its group) is summed over the super-block times
        2^(E - X_BITS) (exact products: one fused multiply-add a chunk), then acc -= d (that sum)
        (sums: unused)."""
        lane_half = ctx[6] >> uint32(1)  # a chunk's values 8 t .. 8 t + 7 are of its group 2 j + t // 2
        part = cuda.local.array(q3_part_shape, float32)  # [token pair, row half]
        lane = cuda.local.array(q3_lane_shape, uint32)  # [row half, chunks 0..3 or 4..7] the lane's scales
        for p in range(pairs):
            part[p, 0] = float32(0)
            part[p, 1] = float32(0)
        lane[0, 0], lane[0, 1] = q3_k_lane_scales(d[0, 0], d[0, 1], d[0, 2], lane_half)
        lane[1, 0], lane[1, 1] = q3_k_lane_scales(d[1, 0], d[1, 1], d[1, 2], lane_half)
        for j in range(K_STEP):
            r = 1 + (j >> 2)  # the run of qs (held[0]: the hmask)
            c_lo, c_hi = q3_k_chunk_scale(lane[0, j >> 2], j), q3_k_chunk_scale(lane[1, j >> 2], j)
            a0 = q3_k_negated(q3_k_raw(held[r, 0, 0], held[0, 0, 0], j), c_lo)
            a1 = q3_k_negated(q3_k_raw(held[r, 1, 0], held[0, 1, 0], j), c_hi)
            a2 = q3_k_negated(q3_k_raw(held[r, 0, 1], held[0, 0, 1], j), c_lo)
            a3 = q3_k_negated(q3_k_raw(held[r, 1, 1], held[0, 1, 1], j), c_hi)
            for p in range(pairs):
                b_lo, b_hi = b_words(digits, dig, j, p)
                s = scales[sc + uint64(j + 2 * p * SLICE_BLOCKS_MAX)]
                c0, c1, c2, c3 = imma(a0, a1, a2, a3, b_lo, b_hi)
                part[p, 0] += float32(int32(c0 + c1 * DIGIT)) * s
                part[p, 1] += float32(int32(c2 + c3 * DIGIT)) * s
        d_lo, _ = f16x2_f32(d[0, 3])
        d_hi, _ = f16x2_f32(d[1, 3])
        for p in range(pairs):
            acc[p, 0] -= d_lo * part[p, 0]
            acc[p, 1] -= d_hi * part[p, 1]

    @inlined
    def load_q6_k(lo, hi, k, b, held, d, t4):
        """A walk step's loads: super-block s = b // K_STEP of the lane's two rows in the split layout,
        bytes 8 t4 .. 8 t4 + 7 of each of its four runs of low-nibble bytes and two of top-pair
        bytes, its 16 scale bytes (one load) and the word of its d (d at K / 256 Q6_K_D + 2 s)."""
        s = uint32(b // uint32(K_STEP))
        at = uint32(uint32(Q6_K_D) * s)
        lo_at = address_at(lo, at)
        hi_at = address_at(hi, at)
        for c in range(6):
            held[c, 0, 0], held[c, 0, 1] = words2_at(lo_at, uint32(CHUNK * c) + uint32(8) * t4)
            held[c, 1, 0], held[c, 1, 1] = words2_at(hi_at, uint32(CHUNK * c) + uint32(8) * t4)
        d[0, 0], d[0, 1], d[0, 2], d[0, 3] = words4_at(lo_at, uint32(Q6_K_SCALES))
        d[1, 0], d[1, 1], d[1, 2], d[1, 3] = words4_at(hi_at, uint32(Q6_K_SCALES))
        dw = uint32((k >> uint32(8)) * uint32(Q6_K_D) + uint32(4) * (s >> uint32(1)))
        d[0, 4] = word_at(lo, dw) >> (uint32(16) * (s & uint32(1)))
        d[1, 4] = word_at(hi, dw) >> (uint32(16) * (s & uint32(1)))

    @inlined
    def q6_k_step_mmas(digits, scales, sums, held, d, acc, dig, sc, sm, ctx):
        """A Q6_K super-block's eight chunks against every token pair's digits: chunk j's two groups
        in two mmas (the lanes of the other group's values give zero digits: a lane's B bytes are of
        the same values as its A bytes), for each a digit pair's P, acc += P (d sc 2^(E - X_BITS))
        (sums: unused)."""
        lane_half = ctx[6] >> uint32(1)  # a chunk's values 8 t .. 8 t + 7 are of its group 2 j + t // 2
        keep = (lane_half ^ uint32(1)) * uint32(0xFFFFFFFF)  # all ones in the lanes of the chunk's first group
        d_lo, _ = f16x2_f32(d[0, 4])
        d_hi, _ = f16x2_f32(d[1, 4])
        for j in range(K_STEP):
            c = 2 * (j >> 2) + (j & 1)  # the run of ql
            h = 4 + (j >> 2)  # the run of qh
            a0 = q6_k_levels(held[c, 0, 0], held[h, 0, 0], j)
            a1 = q6_k_levels(held[c, 1, 0], held[h, 1, 0], j)
            a2 = q6_k_levels(held[c, 0, 1], held[h, 0, 1], j)
            a3 = q6_k_levels(held[c, 1, 1], held[h, 1, 1], j)
            first = uint32(2 * (j & 1))  # the byte of chunk j's first group in scale word j // 2
            scale_lo = d_lo * q6_k_scale(d[0, j >> 1], first)
            scale_hi = d_hi * q6_k_scale(d[1, j >> 1], first)
            other_lo = d_lo * q6_k_scale(d[0, j >> 1], first + uint32(1))
            other_hi = d_hi * q6_k_scale(d[1, j >> 1], first + uint32(1))
            for p in range(pairs):
                w_lo, w_hi = b_words(digits, dig, j, p)
                s = scales[sc + uint64(j + 2 * p * SLICE_BLOCKS_MAX)]
                b_lo, b_hi = w_lo & keep, w_hi & keep
                c0, c1, c2, c3 = imma(a0, a1, a2, a3, b_lo, b_hi)
                e0, e1, e2, e3 = imma(a0, a1, a2, a3, w_lo ^ b_lo, w_hi ^ b_hi)
                acc[p, 0] += float32(int32(c0 + c1 * DIGIT)) * (scale_lo * s)
                acc[p, 1] += float32(int32(c2 + c3 * DIGIT)) * (scale_hi * s)
                acc[p, 0] += float32(int32(e0 + e1 * DIGIT)) * (other_lo * s)
                acc[p, 1] += float32(int32(e2 + e3 * DIGIT)) * (other_hi * s)

    @inlined
    def load_mxfp4(lo, hi, k, b, held, d, t4):
        """A walk step's loads: code bytes 4 t4 .. 4 t4 + 3 of blocks b .. b + UNROLL - 1 of the
        lane's two rows (a word each, at constant offsets of one address a row) and the word of
        their exponent bytes (byte K / 2 + b of the row; b a multiple of 4)."""
        at = uint32(uint32(MXFP4_PAIRS) * b + uint32(4) * t4)
        lo_at = address_at(lo, at)
        hi_at = address_at(hi, at)
        for j in range(UNROLL):
            held[j, 0, 0] = word_at(lo_at, uint32(MXFP4_PAIRS * j))
            held[j, 1, 0] = word_at(hi_at, uint32(MXFP4_PAIRS * j))
        load_exponents(lo, hi, k, b, d)

    @inlined
    def tail_mxfp4(lo, hi, k, b, last, held, d, t4):
        """load_mxfp4's loads for a slice's last, partial step: blocks past `last` load block `last`."""
        for j in range(UNROLL):
            at = uint32(uint32(MXFP4_PAIRS) * min(uint32(b + uint32(j)), last) + uint32(4) * t4)
            held[j, 0, 0] = word_at(lo, at)
            held[j, 1, 0] = word_at(hi, at)
        load_exponents(lo, hi, k, b, d)

    @inlined
    def load_exponents(lo, hi, k, b, d):
        """The word of the exponent bytes of blocks b .. b + 3 of both rows (inside the row: its
        exponent bytes are padded to whole 16-byte pieces)."""
        at = uint32((k >> uint32(1)) + b)
        d[0, 0] = word_at(lo, at)
        d[1, 0] = word_at(hi, at)
        d[0, 1] = finite_exponents(d[0, 0])
        d[1, 1] = finite_exponents(d[1, 0])

    @inlined
    def mxfp4_block(digits, scales, held, d, acc, j, dig, sc, ctx):
        """Block j of the step against every token pair's digits: per digit pair P = (positive
        codes' sums) - (negative codes' sums), acc += (fp32(P) 2^(E - X_BITS + 16 pair)) 2^(e - 128);
        a block whose exponent byte is from MXFP4_INF_E on adds nothing here (mxfp4_inf_blocks)."""
        p0l, p1l, n0l, n1l = mxfp4_levels(held[j, 0, 0])
        p0h, p1h, n0h, n1h = mxfp4_levels(held[j, 1, 0])
        a_lo, a_hi = mxfp4_scale(d[0, 1], j), mxfp4_scale(d[1, 1], j)
        for p in range(pairs):
            b_lo, b_hi = b_words(digits, dig, j, p)
            s = scales[sc + uint64(j + 4 * p * SLICE_BLOCKS_MAX)]
            c0, c1, c2, c3 = imma(p0l, p0h, p1l, p1h, b_lo, b_hi)
            m0, m1, m2, m3 = imma(n0l, n0h, n1l, n1h, b_lo, b_hi)
            acc[p, 0] += (float32(int32((c0 - m0) + (c1 - m1) * DIGIT)) * s) * a_lo
            acc[p, 1] += (float32(int32((c2 - m2) + (c3 - m3) * DIGIT)) * s) * a_hi

    @inlined
    def mxfp4_inf_blocks(d, acc, blocks, ctx):
        """The step's first `blocks` blocks whose exponent byte is from MXFP4_INF_E on (no real
        weight has one; mxfp4_scale left them out): mxfp4_inf_block's sums, added by the lanes of the
        top digit pairs. Taken only where a step has one (one test of the two exponent words); a loop
        over the blocks and row halves, so that the walk's code holds it once a token pair."""
        x32, x_at, lo, hi, b0, live, t4 = ctx
        e_lo, e_hi = d[0, 0], d[1, 0]  # (d indexed by constants only: it stays in registers)
        if (t4 & uint32(1)) and (inf_exponents(e_lo) or inf_exponents(e_hi)):
            for p in range(pairs):
                t = uint32(uint32(2 * p) + (t4 >> uint32(1)))
                if t < live:
                    total_lo = float32(0)
                    total_hi = float32(0)
                    i = uint32(0)
                    while i < uint32(2) * blocks:
                        j, h = i >> uint32(1), i & uint32(1)
                        e = ((e_hi if h else e_lo) >> (uint32(8) * j)) & uint32(0xFF)
                        if e >= MXFP4_INF_E:
                            r = mxfp4_inf_block(x32, t, uint32(x_at + uint32(CHUNK // 2) * j), hi if h else lo,
                                                uint32(b0 + j), e)
                            if h:
                                total_hi += r
                            else:
                                total_lo += r
                        i += uint32(1)
                    acc[p, 0] += total_lo
                    acc[p, 1] += total_hi

    @inlined
    def mxfp4_step_mmas(digits, scales, sums, held, d, acc, dig, sc, sm, ctx):
        """A walk step's UNROLL MXFP4 blocks (sums: no minimum term)."""
        for j in range(UNROLL):
            mxfp4_block(digits, scales, held, d, acc, j, dig, sc, ctx)
        mxfp4_inf_blocks(d, acc, uint32(UNROLL), ctx)

    # each type's walk step, its loads and (Q8_0, MXFP4: slices of K may end inside a step) the tail's;
    # a Q4_K slice is whole super-blocks (K is)
    steps = {
        GGMLType.Q8_0: (load_full, load_tail, block_mmas, step_mmas),
        GGMLType.Q4_K: (load_k, load_tail, block_mmas, k_step_mmas),
        GGMLType.Q5_K: (load_k, load_tail, block_mmas, k_step_mmas),
        GGMLType.Q2_K: (load_q2_k, load_tail, block_mmas, q2_k_step_mmas),
        GGMLType.Q3_K: (load_q3_k, load_tail, block_mmas, q3_k_step_mmas),
        GGMLType.Q6_K: (load_q6_k, load_tail, block_mmas, q6_k_step_mmas),
        GGMLType.MXFP4: (load_mxfp4, tail_mxfp4, mxfp4_block, mxfp4_step_mmas)}[gtype]
    return (*steps, mxfp4_inf_blocks)
