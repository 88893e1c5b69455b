"""Integer tensor-core decode products: y[t, n] = sum_k x[t, k] * dequant(w)[n, k] for the few tokens
of a decode step (any T, launches of MAX_TOKENS), bf16 x, Q8_0, Q2_K, Q4_K, Q5_K, Q6_K or MXFP4 weights, on
`mma.sync.m16n8k32.s32.s8.s8` with the stored levels as the mma's A operand, unconverted.

Shapes and dtypes as stages.linear.linear: x [T, K_total] bf16 bits (uint16), w a
stages.linear.DeviceWeight of Q8_0 in its split device layout (per row the K int8 levels, then the
K/32 fp16 scales d), of Q4_K or Q5_K in its stored one (144-byte super-blocks: d, dmin, 12 scale
bytes, 128 level bytes; Q5_K's 176 with 32 fifth-bit bytes before the levels) or of MXFP4 in its
split one (per row the K/32 blocks' 16 code bytes, then their exponent bytes), of Q2_K in its
split one (per row every super-block's 16 scale bytes, then their 64 level bytes, then their d and
dmin), of Q6_K in its split one (per row every super-block's ql, qh and 16 int8 scales, 208
bytes, then their fp16 d's), y [T, N] bf16 bits
(rounded to nearest even) or float32. Grouped product
(group_rows > 0, a multiple of 16): output row n reads x[:, (n // group_rows) * K :][:K].

One mma covers one Q8_0 block (32 levels q, one scale d) of 16 rows: its int32 result is that
block's exact sum of q times the B columns. Lane (g, t) = (lane >> 2, lane & 3) loads bytes
8 t .. 8 t + 7 of the block from rows g and g + 8 (8 bytes each); PTX puts a lane's A registers at
(row g, k 4 t ..), (g + 8, 4 t ..), (g, 16 + 4 t ..), (g + 8, 16 + 4 t ..) and its B registers at
(k 4 t .., column g), (k 16 + 4 t .., column g), so logical k 4 t + i is stored k 8 t + i and
logical 16 + 4 t + i is stored 8 t + 4 + i, for A and B alike (an integer sum in any order is the
same sum).

The inputs become integers. For token t and 32-value block b of x let E be the binary exponent of
the block's largest magnitude (its bf16 exponent field less 127, at least FIELD_MIN - 127) and
X_k = round(x_k * 2^(29 - E)), |X_k| <= 255 * 2^22 < 2^30: exact for every |x_k| >= 2^(E - 22) (a
bf16 value has 8 significant bits), smaller ones rounded to nearest even, off by at most 2^(E - 30).
(2^29, not 2^30: four balanced digits reach 0x7F7F7F7F, short of 255 * 2^23.) X is split into four
balanced base-256 digits D0..D3 in [-128, 127], X = D0 + 2^8 D1 + 2^16 D2 + 2^24 D3, each an int8
column of B: token j's digit p is column 4 j + p, two tokens an mma, more tokens more mmas on the
same A registers, columns of absent tokens zero. S_p = sum_k q_k D_p,k is exact (|S_p| <= 2^19).
Lane (g, t) holds columns 2 t, 2 t + 1: one token's digits p = 2 (t & 1) and p + 1, so it adds them
in int32, P = S_p + 2^8 S_p+1 (exact, |P| < 2^28), converts P to fp32 (one I2FP on sm_90: exact
below 2^24, which P passes rarely: the top pair's when its block's largest inputs meet large levels
of one sign, |S_3| <= 2^18 and typically ~2^13; the low pair's digits are zero for inputs of at least
2^(E - 6), whose bits all sit in digits 2 and 3; else rounded once) and accumulates acc += fp32(P) *
(d * 2^(E - 29)) per (row, token) in one fused multiply-add, the scale an exact product (fp16 d
times a power of two) unless it falls below fp32's normal range. (Converting each S_p exactly
instead costs two more conversions and multiply-adds, less two integer adds, a token pair and
block: 8% more of the walk's instructions for a rounding that rarely happens.) At the end
y = acc_lo + 2^16 acc_hi (digits 0, 1 and 2, 3: a lane pair's sums, exchanged through shared memory).

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

Oracle: host.numerics.linear (bf16 out) / host.numerics.matmul_t (fp32 out), with tests/bounds.py's
rules (>= 99% of bf16 outputs bit-equal to the oracle's, every output within half a bf16 ulp plus
8 sqrt(K) 2^-24 sum_k |x_k w_k| of the exact product).

Exactness. Each block's sum over its 32 values is exact for the X above. Then each output meets
these fp32 roundings: the conversion of P (one a block and digit pair, only where |P| >= 2^24), the
accumulation (one a block and digit pair along the warp's slice, at most SLICE_STEPS_MAX * UNROLL),
the digit pairs' sum (one), the slices' sums (slices - 1, in slice order) and the bf16 rounding. So
each exact term (a block and digit pair's d 2^(E - 29) P) passes through at most K/32 + slices + 1
roundings before the bf16 one, fewer than the K a term may meet under bounds.py's sqrt(K) rule, in
the same model (terms of random sign, rounded to nearest). Q4_K, Q5_K and Q2_K add each value's two
parts apart (tests/bounds.py's SPLIT_KERNELS: 2K terms of magnitudes |x| |d sc q| and |x| |dmin m|):
per sub-block and digit pair a scaled term and a minimum term, each rounded once into acc (Q5_K's
scaled term once more where its P's conversion rounds; Q2_K's terms at most 8 + 2 times in a step,
above), so a term meets at most 2 K/32 + slices + 2 roundings before the bf16 one (Q2_K: at most 2
K/256 + 9 + slices, acc meeting two a step, fewer for K >= 256), under the 2K of that bound. The
rounding of X is not of that kind: its error, at most 2^(E - 30) |w_k| for each input below 2^(E -
22) of its block's largest, is bounded by 2^-30 times the block's largest |x| times |w_k|, not by
|x_k w_k|, so bounds.py covers it only while each block's largest input meets a weight of comparable
size; it is not claimed beyond that (on the tests' Gaussian inputs a value 2^-22 below its block's
largest is about one in 10^6; tests/test_linear_imma.py also puts inputs 2^-20 of their block's
largest beside it, and holds the digits to a host reference of X). Blocks whose largest |x| is below
2^(FIELD_MIN - 7) = 2^-97 are scaled as if it were 2^-97 (their inputs rounded to multiples of
2^-127, about as fp32's subnormals would); non-finite inputs are not supported (an inf or NaN makes
its block's sums wrong). Every output's sum depends on its row and token alone, never on T or the
other tokens: the launch (`plan`) comes from the shape.

Launch (`plan`): a block is DIGIT_TILES 16-row tiles of one group (one a warp) over one slice of
K; the tiles' K is split into `slices` slices (each a whole number of walk steps of UNROLL blocks,
at most SLICE_STEPS_MAX: the shared digits' room), about enough for TARGET_WARPS warps in all, so
that every flash decode shape fills the GPU (at least 160 blocks). A lane issues a walk step's
loads (UNROLL blocks of its two rows, their scales) before its mmas. With several slices each
block writes its sums to a workspace and the last of a tile group's blocks to finish (a counter)
adds them in slice order and writes y.

The digits are made in each block's prologue, into shared memory: the block's slice of K for all
its tokens, four lanes a (token, block of 32), for the DIGIT_TILES tiles (warps) that share them;
the first walk step's loads are issued before it, so the weights stream while the digits are made.
Chosen over a separate digits kernel by SASS count (sm_90, ptxas 13.5; probes/imma_sass.py): a
lane's eight inputs cost about 200 instructions (the block's largest exponent read by each of its
four lanes, 8 x (convert, scale, round, bias), a byte transpose, four 8-byte stores), against 101
for a walk step of a tile (4 blocks x 16 rows x 32 bytes: 1.6 instructions a weight byte a thread,
where the stream kernel's Q8_0 walk takes 4.8). At T = 1 the prologue is 3-5% of a block's issued
instructions on wq_b, wo_a, wo_b and the engram wkv, 11% on wq_a and the index wq_b (slices of two
steps), 20% on wkv (of one); T = 2: 6-8%, 19%, 31%; T = 8: 7-8%, 23%, 38%. A separate kernel would
cost a launch and a dependency in the step's graph (a microsecond or two against these products'
5-50 us) and a round trip of the digits through L2; a launch's x and every scale come from device
memory either way (decode steps are replayed as graphs).

The other types' walk steps, counted the same way (the engram wkv's launch, T = 1; instructions a
step, weight bytes a thread a step, their ratio, and the stream kernel's GEMV walk beside it): Q4_K
321, 72 bytes (a super-block of 16 rows), 4.5 (stream 8.4); Q5_K 386, 88, 4.4 (stream 7.9); MXFP4
227 on the path of a step without inf exponents (their test included; 210 without it), 34 (four
blocks), 6.7 (stream 11.9); Q2_K 331, 42 (a super-block of 16 rows), 7.9 (stream 15.8; at T = 8 769,
18.3: the walk's work grows with the token pairs, its bytes do not); Q6_K 566, 105, 5.4 (stream 6.4;
at T = 8 1142, 10.9, the stream's 20.3). 80-96 registers at T <= 2 and 111-127 at T = 8 (Q8_0: 78,
94; Q6_K: 111, 168), no spills. Q4_K and Q5_K's prologue has a second pass, the block sums: about
110 instructions a (token, digit pair, block) item.

On the simulator the mma is emulated exactly (stages.warp_mma's warp meeting with an integer
tile), blocks have at most four warps and slices are short, so the tests reach every path; NumPy
rounds the accumulation's product apart from its sum there (one rounding more a term).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from functools import cache

import numpy as np
from numba import cuda, float32, int32, uint32, uint64

from flashv41.host.quants import MXFP4_DOUBLED, GGMLType
from flashv41.stages import warp_mma
from flashv41.stages.device import (
    CHUNK,
    SIM,
    WARP,
    address_at,
    byte_perm,
    device,
    f16x2_f32,
    f32_from_bits,
    f32_to_bf16,
    inlined,
    load_words2,
    load_words4,
    product_groups,
    row_address,
    word_at,
    words2_at,
    words4_at,
)
from flashv41.stages.quants.mxfp4 import MXFP4_INF_E, MXFP4_PAIRS, e2m1_doubled, e8m0_half
from flashv41.stages.quants.q2_k import Q2_K_BYTES, Q2_K_D, Q2_K_GROUPS, Q2_K_HALF_QS, Q2_K_QS_BYTES
from flashv41.stages.quants.q4_k_q5_k import Q4_K_BYTES, Q4_K_QS, Q5_K_BYTES, Q5_K_QH, Q5_K_QS, k_scale_words
from flashv41.stages.quants.q6_k import Q6_K_BYTES, Q6_K_D, Q6_K_QH, Q6_K_QL, Q6_K_SCALES
from flashv41.stages.quants.units import INT8_MAGIC, INT8_SELECT, LOW_NIBBLES

MAX_TOKENS = 8  # tokens a launch: stages.linear's GEMV_MAX_TOKENS (which imports this module)
TOKEN_CAPS = (1, 2, 4, 8)  # compiled per cap: cap / 2 mmas (token pairs) per A fragment
UNROLL = 4  # blocks of 32 values a walk step loads together (the scales: one 8-byte load a row)
X_BITS = 29  # X = round(x * 2^(X_BITS - E))
FIELD_MIN = X_BITS + 1  # the smallest exponent field a block is scaled by: 2^(E - X_BITS) stays normal
DIGIT = int32(256)  # the weight of a digit over the one below it
DIGIT_PAIR = float32(65536.0)  # the weight of digits 2, 3 over digits 0, 1
DIGIT_BIAS = 0x80808080  # X + this has the balanced digits, plus 128, as its bytes
DIGIT_FLIP = uint32(0x80808080)  # a biased byte to the signed digit
EXPONENT_LO, EXPONENT_HI = uint32(0x7F80), uint32(0x7F800000)  # the exponent bits of a word's two bf16
if SIM:  # four warps (the emulated mma's meeting), short slices: every path on the tests' small shapes
    DIGIT_TILES, TARGET_WARPS, SLICE_STEPS_MAX = 4, 8, 2
else:
    DIGIT_TILES, TARGET_WARPS, SLICE_STEPS_MAX = 8, 2048, 10
SLICE_BLOCKS_MAX = SLICE_STEPS_MAX * UNROLL  # a slice's blocks of 32 values at most (1280 values)
# a digit column's uint64 words: the slice's values, eight a word, and 32 bytes more, so that the
# 8 columns x 4 lanes of a B fragment's 8-byte loads fall on distinct banks (a column is 32 mod 128 bytes)
COLUMN_WORDS = SLICE_BLOCKS_MAX * CHUNK // 8 + 4
RED_SHAPE = (DIGIT_TILES, 2, WARP)  # [warp, row half, lane] a token pair's sums, for the digit pairs' sum
LINE = 32  # floats of a 128-byte line: each block's rows of the partial sums start one (no line shared)
BYTE_ONES = uint32(0x01010101)  # dp4a's other operand for the sum of a word's four signed bytes
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


@dataclass(frozen=True)
class ImmaType:
    """What the generic kernel needs to know of a weight type: the blocks of 32 values a walk step
    takes (its loads issued together; a super-block's make a slice whole super-blocks), and whether
    its values' minimum term takes each block's sums of digits (then made by a second prologue
    pass; Q2_K's takes an mma instead)."""

    step_blocks: int
    sums: bool


IMMA_TYPES = {GGMLType.Q8_0: ImmaType(UNROLL, False), GGMLType.Q4_K: ImmaType(K_STEP, True),
              GGMLType.Q5_K: ImmaType(K_STEP, True), GGMLType.MXFP4: ImmaType(UNROLL, False),
              GGMLType.Q2_K: ImmaType(K_STEP, False), GGMLType.Q6_K: ImmaType(K_STEP, False)}
# MXFP4: a code's doubled E2M1 magnitude is byte (code & 7) of these two words (byte_perm's table);
# a code of the other sign (bit 3 set, byte_perm's sign mode) gives 0 there
E2M1_MAG_LO, E2M1_MAG_HI = (uint32(v) for v in MXFP4_DOUBLED[:8].astype(np.uint8).view("<u4"))
E2M1_SIGN_FLIP = uint32(0x88888888)  # the sign bit of eight codes
MXFP4_BACK = float32(0.25)  # 2^(e - 128) over mxfp4_scale's 2^(e - 126), in the blocks' input scales
assert (MXFP4_DOUBLED[8:] == -MXFP4_DOUBLED[:8]).all() and MXFP4_DOUBLED[:8].max() < 128 and MXFP4_PAIRS == 16
assert MXFP4_INF_E == 128 - 3 + 128  # inf_exponents' test


def token_cap(n_tokens: int) -> int:
    """The smallest compiled token cap that holds n_tokens (<= MAX_TOKENS)."""
    return next(cap for cap in TOKEN_CAPS if n_tokens <= cap)


if SIM:
    def imma_tile(regs):
        """A @ B (int64, exact) of the 32 lanes' registers [lane, 6] (PTX m16n8k32 .s8 layout)."""
        q = np.ascontiguousarray(regs).view(np.int8).reshape(8, 4, 6, 4).astype(np.int64)  # [g, t, register, byte]
        a = np.empty((16, 32), np.int64)
        a[:8, :16], a[8:, :16] = q[:, :, 0].reshape(8, 16), q[:, :, 1].reshape(8, 16)
        a[:8, 16:], a[8:, 16:] = q[:, :, 2].reshape(8, 16), q[:, :, 3].reshape(8, 16)
        bt = np.concatenate([q[:, :, 4].reshape(8, 16), q[:, :, 5].reshape(8, 16)], axis=1)  # B^T [column, k]
        return a @ bt.T

    def imma(a0, a1, a2, a3, b0, b1):
        """The warp's 16 x 8 int32 tile D = A @ B, emulated: the lanes meet (stages.warp_mma)."""
        tid = cuda.threadIdx.x
        d = warp_mma.kernel_warp_meet((a0, a1, a2, a3, b0, b1), imma_tile)
        g, t = (tid % WARP) >> 2, tid & 3
        return int32(d[g, 2 * t]), int32(d[g, 2 * t + 1]), int32(d[g + 8, 2 * t]), int32(d[g + 8, 2 * t + 1])

    def f2i_rn(v):
        """v (float32) to int32, rounded to nearest even."""
        return int(np.rint(np.float32(v)))

    def load_l2(a, s, t, i):
        """a[s, t, i] (on a GPU read from L2: what other blocks wrote)."""
        return a[s, t, i]

    def fma_f32(a, b, c):
        """a * b + c rounded once to float32 (float64 holds the product of two float32 exactly; the
        callers' results are exact in float32, so the second rounding changes nothing)."""
        return np.float32(np.float64(a) * np.float64(b) + np.float64(c))

    def dp4a(a, b, c):
        """c plus the dot product of the four signed bytes of a and of b (int32)."""
        pa = np.array([int(a) & 0xFFFFFFFF], np.uint32).view(np.int8).astype(np.int64)
        pb = np.array([int(b) & 0xFFFFFFFF], np.uint32).view(np.int8).astype(np.int64)
        return int32(int(c) + int((pa * pb).sum()))
else:
    from llvmlite import ir
    from numba import types
    from numba.cuda import cgutils, libdevice  # type: ignore[attr-defined]
    from numba.cuda.extending import intrinsic

    @intrinsic
    def imma(typingctx, a0, a1, a2, a3, b0, b1):
        """D = A @ B on one 16 x 8 x 32 tile of int8: `mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32`
        with C = 0. Lane (g, t) holds A (row-major, four int8 a register, low byte first) at rows g
        (a0, a2) and g + 8 (a1, a3), k 4 t .. 4 t + 3 (a0, a1) and 16 + 4 t .. (a2, a3); B at column g,
        k 4 t .. (b0) and 16 + 4 t .. (b1); D at rows g (d0, d1) and g + 8 (d2, d3), columns 2 t, 2 t + 1."""
        sig = types.UniTuple(types.int32, 4)(*([types.uint32] * 6))

        def codegen(context, builder, signature, args):
            word = ir.IntType(32)
            fn = ir.FunctionType(ir.LiteralStructType([word] * 4), [word] * 10)
            asm = ir.InlineAsm(fn, "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 "
                               "{$0,$1,$2,$3}, {$4,$5,$6,$7}, {$8,$9}, {$10,$11,$12,$13};",
                               "=r,=r,=r,=r,r,r,r,r,r,r,r,r,r,r")
            d = builder.call(asm, list(args) + [ir.Constant(word, 0)] * 4)
            return context.make_tuple(builder, signature.return_type, [builder.extract_value(d, i) for i in range(4)])

        return sig, codegen

    @cuda.jit(device=True)
    def f2i_rn(v):
        """v (float32) to int32, rounded to nearest even: one F2I."""
        return libdevice.float2int_rn(v)

    @intrinsic
    def load_l2(typingctx, a, s, t, i):
        """a[s, t, i] of a float32 array, read from L2 (`ld.global.cg`): what other blocks of the launch
        wrote, never a line this SM's L1 may hold from before."""
        sig = types.float32(a, s, t, i)

        def codegen(context, builder, signature, args):
            array_type = signature.args[0]
            array = context.make_array(array_type)(context, builder, args[0])
            index = [context.cast(builder, v, ty, types.intp)
                     for v, ty in zip(args[1:], signature.args[1:], strict=True)]
            pointer = cgutils.get_item_pointer(context, builder, array_type, array, index)
            asm = ir.InlineAsm(ir.FunctionType(ir.FloatType(), [ir.IntType(64)]), "ld.global.cg.f32 $0, [$1];", "=f,l")
            return builder.call(asm, [builder.ptrtoint(pointer, ir.IntType(64))])

        return sig, codegen

    @cuda.jit(device=True)
    def fma_f32(a, b, c):
        """a * b + c rounded once (one FFMA)."""
        return cuda.fma(a, b, c)

    @intrinsic
    def dp4a(typingctx, a, b, c):
        """c plus the dot product of the four signed bytes of a and of b: one `dp4a.s32.s32`."""
        sig = types.int32(types.uint32, types.uint32, types.int32)

        def codegen(context, builder, signature, args):
            word = ir.IntType(32)
            values = [context.cast(builder, v, t, s) for v, t, s in zip(args, signature.args,
                                                                        (types.uint32, types.uint32, types.int32),
                                                                        strict=True)]
            asm = ir.InlineAsm(ir.FunctionType(word, [word] * 3), "dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r")
            return builder.call(asm, values)

        return sig, codegen


# the digits (the prologue's pieces)


@device
def field4(w0, w1, w2, w3):
    """The largest exponent field among the eight bf16 of four words."""
    lo = max(max(uint32(w0 & EXPONENT_LO), uint32(w1 & EXPONENT_LO)),
             max(uint32(w2 & EXPONENT_LO), uint32(w3 & EXPONENT_LO)))
    hi = max(max(uint32(w0 & EXPONENT_HI), uint32(w1 & EXPONENT_HI)),
             max(uint32(w2 & EXPONENT_HI), uint32(w3 & EXPONENT_HI)))
    return max(uint32(lo >> uint32(7)), uint32(hi >> uint32(23)))


@device
def block_scales(field):
    """(2^(X_BITS - E), 2^(E - X_BITS)) for a block whose largest exponent field is `field`
    (E = max(field, FIELD_MIN) - 127): what scales x to X, and what scales the block's sums back.
    Both normal fp32 powers of two, built from their bits."""
    f = max(uint32(field), uint32(FIELD_MIN))
    return f32_from_bits((uint32(127 + X_BITS + 127) - f) << 23), f32_from_bits((f - uint32(X_BITS)) << 23)


@device
def biased(v, scale):
    """X = round(v * scale) (v * scale exact: a power of two) plus DIGIT_BIAS, as a 32-bit word."""
    return uint32((f2i_rn(v * scale) + DIGIT_BIAS) & 0xFFFFFFFF)


@device
def quad_digits(wa, wb, scale):
    """The digits of the four bf16 of words wa, wb (low half first): four words, word p the digit p
    of the four values (value i in byte i), each a signed byte."""
    y0 = biased(f32_from_bits(wa << 16), scale)
    y1 = biased(f32_from_bits(wa & uint32(0xFFFF0000)), scale)
    y2 = biased(f32_from_bits(wb << 16), scale)
    y3 = biased(f32_from_bits(wb & uint32(0xFFFF0000)), scale)
    # a 4 x 4 byte transpose: bytes (digit p of value i) from [value][digit] to [digit][value]
    t0 = byte_perm(y0, y1, 0x5140)  # y0.0 y1.0 y0.1 y1.1
    t1 = byte_perm(y0, y1, 0x7362)  # y0.2 y1.2 y0.3 y1.3
    t2 = byte_perm(y2, y3, 0x5140)
    t3 = byte_perm(y2, y3, 0x7362)
    return (byte_perm(t0, t2, 0x5410) ^ DIGIT_FLIP, byte_perm(t0, t2, 0x7632) ^ DIGIT_FLIP,
            byte_perm(t1, t3, 0x5410) ^ DIGIT_FLIP, byte_perm(t1, t3, 0x7632) ^ DIGIT_FLIP)


@device
def store_octet(digits, at, w0, w1, w2, w3, scale):
    """The digits of the eight bf16 of four words into digits[at + p COLUMN_WORDS] (one uint64 each)."""
    lo0, lo1, lo2, lo3 = quad_digits(w0, w1, scale)
    hi0, hi1, hi2, hi3 = quad_digits(w2, w3, scale)
    digits[at] = uint64(lo0) | (uint64(hi0) << uint64(32))
    digits[at + uint64(COLUMN_WORDS)] = uint64(lo1) | (uint64(hi1) << uint64(32))
    digits[at + uint64(2 * COLUMN_WORDS)] = uint64(lo2) | (uint64(hi2) << uint64(32))
    digits[at + uint64(3 * COLUMN_WORDS)] = uint64(lo3) | (uint64(hi3) << uint64(32))


@device
def block_scale(x32, t, word):
    """block_scales of token t's block of 32 inputs at word `word` of x32 (bf16 pairs). Each of the
    block's four lanes reads the whole block for its largest exponent (three of its four loads are L1
    hits)."""
    a0, a1, a2, a3 = load_words4(x32, t, word)
    b0, b1, b2, b3 = load_words4(x32, t, uint32(word + uint32(4)))
    c0, c1, c2, c3 = load_words4(x32, t, uint32(word + uint32(8)))
    e0, e1, e2, e3 = load_words4(x32, t, uint32(word + uint32(12)))
    field = max(max(field4(a0, a1, a2, a3), field4(b0, b1, b2, b3)),
                max(field4(c0, c1, c2, c3), field4(e0, e1, e2, e3)))
    return block_scales(field)


@device
def octet_digits(x32, t, word, q, digits, at, scales, s_at):
    """Inputs 8 q .. 8 q + 7 of token t's block of 32 at word `word` of x32 (bf16 pairs): their four
    digit columns' bytes into digits[at + p COLUMN_WORDS] (p = 0..3, a uint64 each); the block's
    scale 2^(E - X_BITS) into scales[s_at] by the lane of q = 0 (block_scale)."""
    scale, back = block_scale(x32, t, word)
    if q == 0:
        scales[s_at] = back
    w0, w1, w2, w3 = load_words4(x32, t, uint32(word + uint32(4) * q))
    store_octet(digits, at, w0, w1, w2, w3, scale)


@device
def e2m1_octet_digits(x32, t, word, q, digits, at, scales, s_at):
    """octet_digits in MXFP4's order (mxfp4_levels'): lane q's word of a digit column holds the
    digits of inputs 4 q, 16 + 4 q, 4 q + 1, 17 + 4 q, then 4 q + 2, 18 + 4 q, 4 q + 3, 19 + 4 q.
    The scale back times MXFP4_BACK goes to scales[s_at] (lane 0) and, times 2^16 more, to
    scales[s_at + SLICE_BLOCKS_MAX] (lane 1): each digit pair's own, so that the top pair's sums
    carry their weight in y."""
    scale, back = block_scale(x32, t, word)
    if q == 0:
        scales[s_at] = back * MXFP4_BACK
    if q == 1:
        scales[s_at + uint64(SLICE_BLOCKS_MAX)] = back * (MXFP4_BACK * DIGIT_PAIR)
    lo0, lo1 = load_words2(x32, t, uint32(word + uint32(2) * q))  # inputs 4 q .. 4 q + 3
    hi0, hi1 = load_words2(x32, t, uint32(word + uint32(8) + uint32(2) * q))  # 16 + 4 q ..
    store_octet(digits, at, byte_perm(lo0, hi0, 0x5410), byte_perm(lo0, hi0, 0x7632),
                byte_perm(lo1, hi1, 0x5410), byte_perm(lo1, hi1, 0x7632), scale)


@device
def zero_digits(digits, at, scales, s_at, q):
    """octet_digits' stores for an absent token: zero digits, a zero scale."""
    for p in range(4):
        digits[at + uint64(p * COLUMN_WORDS)] = uint64(0)
    if q == 0:
        scales[s_at] = float32(0)


@device
def word_halves(v):
    """A uint64 word of the digits as its two uint32 halves (low, high): four int8 digits each."""
    return uint32(v & uint64(0xFFFFFFFF)), uint32(v >> uint64(32))


@device
def b_words(digits, dig, j, p):
    """The B registers (b0, b1) of token pair p for block j of a walk step: the lane's 8-byte word of
    its digit column, a lane's column base at digits[dig]."""
    return word_halves(digits[dig + uint64(4 * j + 8 * p * COLUMN_WORDS)])


@device
def pair_sum(digits, at):
    """The sum over a block of 32 values of D_p + 2^8 D_p+1, digit p's column's words at
    digits[at ..], digit p + 1's a column further (exact: at most 32 x 32896 in magnitude)."""
    low = int32(0)
    high = int32(0)
    for i in range(4):
        lo, hi = word_halves(digits[at + uint64(i)])
        low = dp4a(lo, BYTE_ONES, dp4a(hi, BYTE_ONES, low))
        lo, hi = word_halves(digits[at + uint64(COLUMN_WORDS + i)])
        high = dp4a(lo, BYTE_ONES, dp4a(hi, BYTE_ONES, high))
    return int32(low + high * DIGIT)


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


@cache
def imma_kernel(gtype: GGMLType, cap: int, out_bf16: bool):
    """A block: DIGIT_TILES tiles of 16 rows of one group (a warp each) over one slice of K, for up
    to `cap` tokens, weights of type gtype (IMMA_TYPES); grid = (tile groups x slices,), block =
    32 x warps threads."""
    kind = IMMA_TYPES[gtype]
    step_blocks, block_sums = kind.step_blocks, kind.sums
    pairs = max(cap, 2) // 2  # mmas a block of A meets: two tokens each
    # flat shared arrays, indexed by uint64 offsets from a lane's base (constant offsets fold into the loads)
    digits_shape = 8 * pairs * COLUMN_WORDS  # [column 4 token + digit][8 values] int8 digits, eight a word
    mx = gtype == GGMLType.MXFP4
    # [token][block] 2^(E - X_BITS); MXFP4: [token][digit pair][block] 2^(E - X_BITS + 16 pair)
    scales_shape = (4 if mx else 2) * pairs * SLICE_BLOCKS_MAX
    pair_weight = float32(1) if mx else DIGIT_PAIR  # the top digit pair's sums' weight in y
    # [token][digit pair][block] 2^(E - X_BITS) times the block's sum of the pair's D_p + 2^8 D_p+1
    sums_shape = 4 * pairs * SLICE_BLOCKS_MAX if block_sums else 1
    acc_shape = (pairs, 2)  # [token pair, row half]
    part_shape = (pairs, 2, 2)  # a Q2_K step's sums: [token pair, row half, scaled or minimum]
    fifth = gtype == GGMLType.Q5_K
    k_bytes, k_qs = (Q5_K_BYTES, Q5_K_QS) if fifth else (Q4_K_BYTES, Q4_K_QS)
    # [block (Q4_K, Q5_K, Q2_K: run of level bytes; Q5_K's fifth bits after them), row half, word] a
    # walk step's levels
    held_shape = (6 if gtype == GGMLType.Q6_K else UNROLL + fifth, 2, 2)  # Q6_K: four runs of ql, two of qh
    # Q8_0: [block, row half] the step's scales; Q4_K: [row half, word] its super-block's first 16
    # bytes; MXFP4: [row half, 0] the word of the step's exponent bytes
    d_shape, d_type = ((UNROLL, 2), float32) if gtype == GGMLType.Q8_0 else ((2, 4), uint32)
    if gtype in (GGMLType.Q2_K, GGMLType.Q6_K):  # [row half, word] its 16 scale bytes, then its d (and dmin)
        d_shape = (2, 5)
    sum_items = 4 * pairs * SLICE_BLOCKS_MAX  # (token, digit pair, block) items of the sums

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

    @inlined
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
    walk_load, walk_tail, walk_block, walk_mmas = {
        GGMLType.Q8_0: (load_full, load_tail, block_mmas, step_mmas),
        GGMLType.Q4_K: (load_k, load_tail, block_mmas, k_step_mmas),
        GGMLType.Q5_K: (load_k, load_tail, block_mmas, k_step_mmas),
        GGMLType.Q2_K: (load_q2_k, load_tail, block_mmas, q2_k_step_mmas),
        GGMLType.Q6_K: (load_q6_k, load_tail, block_mmas, q6_k_step_mmas),
        GGMLType.MXFP4: (load_mxfp4, tail_mxfp4, mxfp4_block, mxfp4_step_mmas)}[gtype]
    partial_steps = step_blocks == UNROLL  # (a K-quant's slice is whole super-blocks)
    digits_of = e2m1_octet_digits if gtype == GGMLType.MXFP4 else octet_digits

    @cuda.jit if SIM else cuda.jit(launch_bounds=(WARP * DIGIT_TILES, 1))  # type: ignore[call-arg]
    def imma_gemv(x, w, y, partials, counters, n_tokens, group_rows, k, per_group, slices, slice_blocks):
        digits = cuda.shared.array(digits_shape, uint64)
        scales = cuda.shared.array(scales_shape, float32)
        sums = cuda.shared.array(sums_shape, float32)
        red = cuda.shared.array(RED_SHAPE, float32)
        last_flag = cuda.shared.array(1, int32)
        x32 = x.view(np.uint32)  # [T, K_total / 2] bf16 pairs
        w32 = w.view(np.uint32)
        tid = uint32(cuda.threadIdx.x)
        threads = uint32(cuda.blockDim.x)
        warps = uint32(threads // uint32(WARP))
        warp, lane = uint32(tid // uint32(WARP)), uint32(tid % uint32(WARP))
        g, t4 = uint32(lane >> uint32(2)), uint32(lane & uint32(3))
        rows = uint32(group_rows)
        kk = uint32(k)
        kb = uint32(kk // uint32(CHUNK))
        block = uint32(cuda.blockIdx.x)
        n_slices = uint32(slices)
        tile_group = uint32(block // n_slices)  # a group's blocks side by side: its slices finish together
        slice_ = uint32(block % n_slices)
        group = uint32(tile_group // uint32(per_group))
        tile0 = uint32((tile_group % uint32(per_group)) * warps)  # the block's first tile within its group
        first = uint32((tile0 + warp) * uint32(16))  # the warp's first row within its group
        b_start = uint32(slice_ * uint32(slice_blocks))
        b_end = uint32(min(b_start + uint32(slice_blocks), kb))
        nb = uint32(b_end - b_start)
        row0 = uint32(group * rows)
        last_row = uint32(rows - uint32(1))
        lo = row_address(w32, row0 + min(first + g, last_row))  # (past the group: a real row, not stored)
        hi = row_address(w32, row0 + min(first + g + uint32(8), last_row))
        acc = cuda.local.array(acc_shape, float32)
        held = cuda.local.array(held_shape, uint32)
        d = cuda.local.array(d_shape, d_type)
        for p in range(pairs):
            acc[p, 0] = float32(0)
            acc[p, 1] = float32(0)
        # the first step's loads, in flight while the digits are made
        if not partial_steps or b_start + uint32(step_blocks) <= b_end:
            walk_load(lo, hi, kk, b_start, held, d, t4)
        else:
            walk_tail(lo, hi, kk, b_start, uint32(b_end - uint32(1)), held, d, t4)
        half = uint32(CHUNK // 2)  # input words a block
        x_word = uint32(group * (kk >> uint32(1)) + b_start * half)  # the slice's first input word
        live = uint32(n_tokens)
        # the digits: four lanes a (token, block) item, eight inputs each
        for item in range(tid, uint32(2 * pairs * SLICE_BLOCKS_MAX * 4), threads):
            q = uint32(uint32(item) & uint32(3))
            ts = uint32(uint32(item) >> uint32(2))  # token * SLICE_BLOCKS_MAX + slot
            t = uint32(ts // uint32(SLICE_BLOCKS_MAX))  # (a constant divisor: no division)
            slot = uint32(ts % uint32(SLICE_BLOCKS_MAX))
            at = uint64(t) * uint64(4 * COLUMN_WORDS) + uint64(4) * uint64(slot) + uint64(q)
            # the block's scale back (MXFP4: the low digit pair's; the top pair's a row of blocks on)
            s_at = uint64(ts) + (uint64(t) * uint64(SLICE_BLOCKS_MAX) if mx else uint64(0))
            if slot < nb:
                if t < live:
                    digits_of(x32, t, uint32(x_word + slot * half), q, digits, at, scales, s_at)
                else:
                    zero_digits(digits, at, scales, s_at, q)
                    if mx and q == 1:
                        scales[s_at + uint64(SLICE_BLOCKS_MAX)] = float32(0)
        cuda.syncthreads()
        if block_sums:  # each block's inputs' sum, a digit pair at a time, scaled (exact: module docstring)
            for item in range(tid, uint32(sum_items), threads):
                slot = uint32(uint32(item) % uint32(SLICE_BLOCKS_MAX))
                th = uint32(uint32(item) // uint32(SLICE_BLOCKS_MAX))  # 2 token + digit pair
                if slot < nb:
                    t = uint32(th >> uint32(1))
                    at = uint64(uint32(2) * th) * uint64(COLUMN_WORDS) + uint64(4) * uint64(slot)
                    sums[item] = float32(pair_sum(digits, at)) * scales[uint64(t) * uint64(SLICE_BLOCKS_MAX) + slot]
            cuda.syncthreads()
        lane_dig = uint64(g) * uint64(COLUMN_WORDS) + uint64(t4)  # B column g, the lane's 8 bytes of block 0
        # its D columns' token's block 0 scale (MXFP4: that of its digit pair)
        lane_sc = uint64(t4 if mx else t4 >> uint32(1)) * uint64(SLICE_BLOCKS_MAX)
        lane_sm = uint64(t4) * uint64(SLICE_BLOCKS_MAX)  # and its digit pair's block 0 sum
        b0 = b_start
        while b0 + uint32(step_blocks) <= b_end:
            if b0 != b_start:
                walk_load(lo, hi, kk, b0, held, d, t4)
            step = uint64(b0 - b_start)
            ctx = (x32, uint32(x_word + uint32(step) * half), lo, hi, b0, live, t4)  # (MXFP4's inf blocks)
            walk_mmas(digits, scales, sums, held, d, acc, lane_dig + uint64(4) * step, lane_sc + step, lane_sm + step,
                      ctx)
            b0 = uint32(b0 + uint32(step_blocks))
        if partial_steps and b0 < b_end:
            if b0 != b_start:
                walk_tail(lo, hi, kk, b0, uint32(b_end - uint32(1)), held, d, t4)
            step = uint64(b0 - b_start)
            ctx = (x32, uint32(x_word + uint32(step) * half), lo, hi, b0, live, t4)
            for j in range(UNROLL):
                if b0 + uint32(j) < b_end:
                    walk_block(digits, scales, held, d, acc, j, lane_dig + uint64(4) * step, lane_sc + step, ctx)
            if mx:
                mxfp4_inf_blocks(d, acc, uint32(b_end - b0), ctx)
        # out: lane (g, t) holds rows g, g + 8 and token 2 p + t // 2's digits 2 (t % 2), + 1; a lane
        # of the pair's sum takes row i = lane % 16 and token 2 p + lane // 16
        i = uint32(lane % uint32(16))
        h = uint32(i >> uint32(3))
        src = uint32(uint32(4) * (i % uint32(8)) + uint32(2) * (lane >> uint32(4)))
        n = uint32(first + i)
        # the floats a block's rows take in each partial row (Plan.region), and this lane's output's
        region = uint32((warps * uint32(16) + uint32(LINE - 1)) // uint32(LINE) * uint32(LINE))
        at = uint32(tile_group * region + warp * uint32(16) + i)
        for p in range(pairs):
            red[warp, 0, lane] = acc[p, 0]
            red[warp, 1, lane] = acc[p, 1]
            cuda.syncthreads()
            v = red[warp, h, src] + pair_weight * red[warp, h, src + uint32(1)]
            t = uint32(uint32(2 * p) + (lane >> uint32(4)))
            if t < live:
                if n_slices == 1:
                    if n < rows:
                        if out_bf16:
                            y[t, row0 + n] = f32_to_bf16(v)
                        else:
                            y[t, row0 + n] = v
                else:
                    partials[slice_, t, at] = v
            cuda.syncthreads()
        if n_slices == 1:
            return
        # the last of the tile group's blocks adds the slices' sums in slice order, read from L2
        cuda.threadfence()
        cuda.syncthreads()
        if tid == 0:
            last_flag[0] = int32(cuda.atomic.add(counters, tile_group, 1) == slices - 1)
            cuda.threadfence()
        cuda.syncthreads()
        if last_flag[0]:
            span = uint32(warps * uint32(16))
            for out in range(tid, span * uint32(cap), threads):
                t = uint32(uint32(out) // span)
                r = uint32(uint32(out) % span)
                n = uint32(tile0 * uint32(16) + r)
                at = uint32(tile_group * region + r)
                if t < live and n < rows:
                    total = load_l2(partials, 0, t, at)
                    for s in range(1, slices):
                        total += load_l2(partials, s, t, at)
                    if out_bf16:
                        y[t, row0 + n] = f32_to_bf16(total)
                    else:
                        y[t, row0 + n] = total
            if tid == 0:
                counters[tile_group] = 0  # ready for the next launch (a replayed graph's)

    return imma_gemv


@dataclass(frozen=True)
class Plan:
    """How a product of `groups` groups of `rows` outputs and K inputs is launched (`plan`)."""

    warps: int  # tiles of 16 rows a block, one a warp: they share the block's digits
    per_group: int  # blocks a group's tiles take
    slices: int  # slices of K a tile's sums are split over, added in slice order
    slice_blocks: int  # blocks of 32 values a slice (a whole number of walk steps)
    tile_groups: int  # blocks a slice: groups * per_group

    @property
    def region(self) -> int:
        """Floats a block's rows take in each partial row (whole 128-byte lines)."""
        return -(-self.warps * 16 // LINE) * LINE


def plan(rows: int, k: int, groups: int, step_blocks: int = UNROLL) -> Plan:
    """The launch of a product, from its shape alone (never the token count: a token's sums must not
    depend on its batch): DIGIT_TILES tiles a block (fewer in a group of fewer), and K split into the
    fewest slices, at most SLICE_BLOCKS_MAX blocks of 32 each, that give TARGET_WARPS warps (or one
    walk step of step_blocks blocks each), then rounded to slices of whole steps (which keeps at least
    half the warps). On the flash shapes with Q8_0's steps of four blocks (slices x steps each, blocks,
    warps): wq_a 20 x 2, 200, 1600; wkv 40 x 1, 160, 1280; wq_b 1 x 10, 256, 2048; wo_a 4 x 8, 256,
    2048; wo_b 7 x 10, 280, 2240; the index wq_b 5 x 2, 160, 1280; the engram wkv 5 x 10, 1000, 8000:
    at least 160 blocks of 8 warps for 132 SMs. Q4_K's steps (a super-block) halve the slices of wq_a
    (10 x 2), wkv (20 x 1) and the index wq_b (5 x 1): 100, 80 and 160 blocks."""
    tiles = -(-rows // 16)
    warps = min(DIGIT_TILES, tiles)
    per_group = -(-tiles // warps)
    steps = -(-(k // CHUNK) // step_blocks)
    steps_max = SLICE_BLOCKS_MAX // step_blocks
    slices = -(-steps // steps_max)
    while slices < steps and groups * per_group * slices * warps < TARGET_WARPS:
        slices += 1
    per_slice = -(-steps // slices)
    return Plan(warps, per_group, -(-steps // per_slice), per_slice * step_blocks, groups * per_group)


@dataclass
class Workspace:
    """A product's partial sums (float32 [slices, MAX_TOKENS, tile_groups * region]) and its tile
    groups' counters of finished slices (int32 [tile_groups], zero between launches)."""

    partials: object
    counters: object


_WORKSPACES: dict[tuple[int, Plan] | None, Workspace] = {}  # by (id of the DeviceWeight, plan), dropped with it


def workspace(w, p: Plan) -> Workspace:
    """The workspace of weight w's product under plan p (allocated at its first launch, which must
    therefore come before a graph capture, as its compilation does; products of one slice share a
    dummy that they never touch)."""
    key = (id(w), p) if p.slices > 1 else None
    ws = _WORKSPACES.get(key)
    if ws is None:
        shape = (p.slices, MAX_TOKENS, p.tile_groups * p.region) if key else (1, 1, 1)
        ws = Workspace(cuda.device_array(shape, np.float32),
                       cuda.to_device(np.zeros(p.tile_groups if key else 1, np.int32)))
        _WORKSPACES[key] = ws
        if key:
            weakref.finalize(w, _WORKSPACES.pop, key, None)
    return ws


def takes(w, x_dtype, group_rows: int = 0) -> bool:
    """Whether linear_imma takes this weight, input dtype and grouping."""
    kind = IMMA_TYPES.get(w.gtype)
    values = CHUNK * (kind.step_blocks if kind and kind.step_blocks == K_STEP else 1)  # a K-quant's: whole super-blocks
    return kind is not None and np.dtype(x_dtype) == np.uint16 and w.k % values == 0 and group_rows % 16 == 0


def linear_imma(x, w, y, n_tokens: int, group_rows: int = 0, stream=0) -> None:
    """y[:n_tokens] = x[:n_tokens] @ w^T on the integer tensor cores, in launches of MAX_TOKENS
    tokens (y's dtype picks bf16 or fp32 out). group_rows > 0: grouped product, output row n reads
    x[:, (n // group_rows) * K : ... + K]. Raises ValueError for what it does not take."""
    if not takes(w, x.dtype, group_rows):
        blocks = ", ".join(t.name for t, kind in IMMA_TYPES.items() if kind.step_blocks != K_STEP)
        supers = ", ".join(t.name for t, kind in IMMA_TYPES.items() if kind.step_blocks == K_STEP)
        raise ValueError(f"linear_imma {w.name}: {w.gtype.name} weight [{w.n}, {w.k}] with {x.dtype} inputs in "
                         f"groups of {group_rows} rows is not supported (bf16 inputs; {blocks} weights with K a "
                         f"multiple of {CHUNK}, or {supers} of {K_STEP * CHUNK}; groups of a multiple of 16 rows)")
    groups, rows = product_groups("linear_imma", x, w, y, n_tokens, group_rows)
    if n_tokens == 0:
        return
    p = plan(rows, w.k, groups, IMMA_TYPES[w.gtype].step_blocks)
    ws = workspace(w, p)
    for t0 in range(0, n_tokens, MAX_TOKENS):
        live = min(MAX_TOKENS, n_tokens - t0)
        xt, yt = (x, y) if t0 == 0 else (x[t0:], y[t0:])
        imma_kernel(w.gtype, token_cap(live), y.dtype == np.uint16)[p.tile_groups * p.slices, WARP * p.warps, stream](
            xt, w.data, yt, ws.partials, ws.counters, live, rows, w.k, p.per_group, p.slices, p.slice_blocks)
