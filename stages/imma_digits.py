"""The integer tensor-core GEMV's primitives and its inputs' digits (stages.linear_imma's module
docstring says what the digits are and why): the integer mma (`imma`, m16n8k32 .s8, an intrinsic on
a GPU and the warp's meeting on the simulator; kernels call `kernel_imma`), the other instructions
the kernel emits by hand (f2i_rn, load_l2, fma_f32, dp4a), the walk's geometry (UNROLL blocks a
step, SLICE_BLOCKS_MAX a slice, COLUMN_WORDS a digit column) and the prologue's pieces that turn a
block of 32 bf16 inputs into four columns of balanced base-256 digits and its scale.

Oracle: tests/test_linear_imma.py holds the digits to a host reference of X and the products to
host.numerics.linear through tests/bounds.py's rules.
"""

from __future__ import annotations

import numpy as np
from numba import cuda, float32, int32, uint32, uint64

from flashv41.stages import warp_mma
from flashv41.stages.device import CHUNK, SIM, WARP, byte_perm, device, f32_from_bits, load_words2, load_words4

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
BYTE_ONES = uint32(0x01010101)  # dp4a's other operand for the sum of a word's four signed bytes
MXFP4_BACK = float32(0.25)  # 2^(e - 128) over mxfp4_scale's 2^(e - 126), in the blocks' input scales


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

# imma as the kernels call it (warp_mma.kernel_mma's way): on the simulator a device function, which
# gets this module's simulated `cuda` (the thread indices) when a kernel of another module calls it
kernel_imma = cuda.jit(device=True)(imma) if SIM else imma


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
