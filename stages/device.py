"""Device helpers shared by every stage: bit casts, bf16 / fp16 conversion, 16-byte loads,
reductions. The per-type weight pieces (dequantisers, stream units, tensor-core fetches) are the
quant-type table's, stages.quants.

Formats on the device: bf16 tensors are uint16 bit patterns, fp32 tensors float32, weights the
GGUF's stored bytes (uint8 [rows, row_bytes]), whatever their type. The same kernels run on a GPU
and on Numba's CUDA simulator; where the simulator lacks something (bit casts through libdevice,
warp shuffles) the helper has a second body for it, chosen once at import.
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
from pathlib import Path
from typing import Any

import numpy as np
from numba import cuda, float32, float64, int32, uint16, uint32, uint64

from flashv41.host.errors import InputError
from flashv41.stages.backend import using_simulator

DeviceArray = Any  # a numba device array (DeviceNDArray; the simulator's FakeCUDAArray)

SIM = using_simulator()
CHUNK = 32  # values per dequantisation chunk: one Q8_0 block, an eighth of a Q2_K block
WARP = 32


def device(fn):
    """A device helper: compiled for the GPU; on the simulator a plain function, because there a
    jitted device call swaps module globals and costs about ten microseconds."""
    return fn if SIM else cuda.jit(device=True)(fn)


def inlined(fn):
    """A device helper that Numba inlines where it is called, before typing: on the GPU the kernel
    compiles as if the helper's body were written out there (no function of its own in the PTX)."""
    return fn if SIM else cuda.jit(device=True, inline="always")(fn)


if SIM:
    import struct

    _BF16_VALUES = (np.arange(1 << 16, dtype=np.uint32) << 16).view(np.float32)

    def f32_from_bits(u):
        return np.float32(struct.unpack("<f", struct.pack("<I", int(u) & 0xFFFFFFFF))[0])

    def f32_bits(x):
        return uint32(struct.unpack("<I", struct.pack("<f", float(x)))[0])

    def bf16_to_f32(bits):
        return _BF16_VALUES[int(bits)]
else:
    from numba.cuda import libdevice

    @cuda.jit(device=True)
    def f32_from_bits(u):
        return libdevice.int_as_float(int32(u))

    @cuda.jit(device=True)
    def f32_bits(x):
        return uint32(libdevice.float_as_int(x))

    @cuda.jit(device=True)
    def bf16_to_f32(bits):
        return f32_from_bits(uint32(bits) << 16)


@device
def f32_to_bf16(x):
    """Round to the nearest bf16, ties to even (NaN stays NaN); returns the uint16 pattern."""
    u = f32_bits(x)
    if (u & 0x7FFFFFFF) > 0x7F800000:
        return uint16((u >> 16) | 0x40)
    return uint16((u + 0x7FFF + ((u >> 16) & 1)) >> 16)


@device
def load_f32(x, r, c, x_bf16):
    """x[r, c] as float32, from bf16 bits (x_bf16) or a float32 array."""
    if x_bf16:
        return bf16_to_f32(x[r, c])
    return float32(x[r, c])


@device
def bf16_round(x):
    """x rounded to the nearest bf16 value, as float32."""
    return bf16_to_f32(f32_to_bf16(x))


@device
def fp16_to_f32(h):
    """An fp16 bit pattern (in the low 16 bits of h) -> float32, exactly."""
    h = uint32(h)
    sign = (h >> 15) & 1
    e = (h >> 10) & 0x1F
    m = h & 0x3FF
    if e == 0:
        v = float32(m) * float32(5.960464477539063e-08)  # m * 2^-24, exact
    elif e == 31:
        v = f32_from_bits(uint32(0x7F800000) | (m << 13))
    else:
        v = f32_from_bits(((e + 112) << 23) | (m << 13))
    return -v if sign else v


@device
def read_u16(b, row, off):
    return uint32(b[row, off]) | (uint32(b[row, off + 1]) << 8)


if SIM:
    def load_words4(a, row, i):
        """a[row, i .. i + 3] of a uint32 array, i a multiple of 4 (one 16-byte load on a GPU)."""
        return a[row, i], a[row, i + 1], a[row, i + 2], a[row, i + 3]

    def load_words2(a, row, i):
        """a[row, i], a[row, i + 1] of a uint32 array, i even (one 8-byte load on a GPU)."""
        return a[row, i], a[row, i + 1]
else:
    from llvmlite import ir
    from numba import types
    from numba.cuda import cgutils  # type: ignore[attr-defined]
    from numba.cuda.extending import intrinsic

    def vector_load(words: int):
        """An intrinsic (a, row, i) -> a[row, i .. i + words - 1] of a uint32 array as one load of
        4 * words bytes through the read-only data path (`ld.global.nc.v<words>.u32`; the address
        must be aligned to its size). Numba has no vector loads, and scalar loads cost one load
        instruction a word for the same bytes."""
        outs = ", ".join(f"${j}" for j in range(words))
        asm_text = f"ld.global.nc.v{words}.u32 {{{outs}}}, [${words}];"
        constraints = ",".join(["=r"] * words + ["l"])

        @intrinsic
        def load(typingctx, a, row, i):
            sig = types.UniTuple(types.uint32, words)(a, row, i)

            def codegen(context, builder, signature, args):
                array_type, row_type, i_type = signature.args
                array = context.make_array(array_type)(context, builder, args[0])
                index = [context.cast(builder, v, t, types.intp)
                         for v, t in zip(args[1:], (row_type, i_type), strict=True)]
                pointer = cgutils.get_item_pointer(context, builder, array_type, array, index)
                address = builder.ptrtoint(pointer, ir.IntType(64))
                word = ir.IntType(32)
                asm = ir.InlineAsm(ir.FunctionType(ir.LiteralStructType([word] * words), [ir.IntType(64)]),
                                   asm_text, constraints)
                loaded = builder.call(asm, [address])
                return context.make_tuple(builder, signature.return_type,
                                          [builder.extract_value(loaded, j) for j in range(words)])

            return sig, codegen

        return load

    load_words4 = vector_load(4)  # a[row, i .. i + 3], i a multiple of 4: one 16-byte load
    load_words2 = vector_load(2)  # a[row, i .. i + 1], i even: one 8-byte load


# Row addresses: a walk that adds its own 32-bit byte offsets to a row's address, where indexing
# a[row, i] with Numba's 64-bit index arithmetic costs five to eight integer instructions a load.
if SIM:
    def row_address(a, row):
        """Row `row` of a uint32 array, for the *_at loads (on a GPU its address as uint64; here the
        array, the row and a byte offset into it)."""
        return a, int(row), 0

    def address_at(address, offset):
        """The address `offset` bytes (unsigned, 32 bits) past a row_address: loads from it at
        constant offsets become one instruction each on a GPU (the constant in the load)."""
        a, row, base = address
        return a, row, base + int(offset)

    def _word(address, offset):
        """The word index of byte `offset` past a row_address (the array's row, that index)."""
        a, row, base = address
        return a, row, (base + int(offset)) // 4

    def words4_at(address, offset):
        """Four words at byte `offset` (a multiple of 16) of a row_address: one 16-byte load."""
        a, row, i = _word(address, offset)
        return load_words4(a, row, i)

    def f16_at(address, offset):
        """The fp16 value at byte `offset` (even) of a row_address, as float32."""
        a, row, i = _word(address, offset)
        lo, hi = f16x2_f32(a[row, i])
        return hi if (address[2] + int(offset)) % 4 else lo

    def words2_at(address, offset):
        """Two words at byte `offset` (a multiple of 8) of a row_address: one 8-byte load."""
        a, row, i = _word(address, offset)
        return load_words2(a, row, i)

    def word_at(address, offset):
        """The word at byte `offset` (a multiple of 4) of a row_address: one 4-byte load."""
        a, row, i = _word(address, offset)
        return a[row, i]
else:
    @intrinsic
    def row_address(typingctx, a, row):
        """The address of a[row, 0] as uint64 (a row_address for the *_at loads)."""
        sig = types.uint64(a, row)

        def codegen(context, builder, signature, args):
            array_type, row_type = signature.args
            array = context.make_array(array_type)(context, builder, args[0])
            index = [context.cast(builder, args[1], row_type, types.intp), context.get_constant(types.intp, 0)]
            pointer = cgutils.get_item_pointer(context, builder, array_type, array, index)
            return builder.ptrtoint(pointer, ir.IntType(64))

        return sig, codegen

    @inlined
    def address_at(address, offset):
        """The address `offset` bytes (unsigned, 32 bits) past a row_address: loads from it at
        constant offsets take the constant into the load instruction, where a 32-bit offset
        sum (which may wrap) costs a 64-bit add a load."""
        return address + uint64(offset)

    def _plus(context, builder, address, offset, offset_type):
        """address (uint64) + a byte offset of any unsigned type, in the intrinsics below."""
        return builder.add(address, context.cast(builder, offset, offset_type, types.uint64))

    @intrinsic
    def words4_at(typingctx, address, offset):
        """Four words at byte `offset` (a multiple of 16) of a row_address: one
        `ld.global.nc.v4.u32`."""
        sig = types.UniTuple(types.uint32, 4)(types.uint64, offset)

        def codegen(context, builder, signature, args):
            word = ir.IntType(32)
            asm = ir.InlineAsm(ir.FunctionType(ir.LiteralStructType([word] * 4), [ir.IntType(64)]),
                               "ld.global.nc.v4.u32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,l")
            loaded = builder.call(asm, [_plus(context, builder, args[0], args[1], signature.args[1])])
            words = [builder.extract_value(loaded, j) for j in range(4)]
            return context.make_tuple(builder, signature.return_type, words)

        return sig, codegen

    @intrinsic
    def words2_at(typingctx, address, offset):
        """Two words at byte `offset` (a multiple of 8) of a row_address: one
        `ld.global.nc.v2.u32`."""
        sig = types.UniTuple(types.uint32, 2)(types.uint64, offset)

        def codegen(context, builder, signature, args):
            word = ir.IntType(32)
            asm = ir.InlineAsm(ir.FunctionType(ir.LiteralStructType([word] * 2), [ir.IntType(64)]),
                               "ld.global.nc.v2.u32 {$0, $1}, [$2];", "=r,=r,l")
            loaded = builder.call(asm, [_plus(context, builder, args[0], args[1], signature.args[1])])
            words = [builder.extract_value(loaded, j) for j in range(2)]
            return context.make_tuple(builder, signature.return_type, words)

        return sig, codegen

    @intrinsic
    def word_at(typingctx, address, offset):
        """The word at byte `offset` (a multiple of 4) of a row_address: one `ld.global.nc.u32`."""
        sig = types.uint32(types.uint64, offset)

        def codegen(context, builder, signature, args):
            word = ir.IntType(32)
            asm = ir.InlineAsm(ir.FunctionType(word, [ir.IntType(64)]), "ld.global.nc.u32 $0, [$1];", "=r,l")
            return builder.call(asm, [_plus(context, builder, args[0], args[1], signature.args[1])])

        return sig, codegen

    @intrinsic
    def f16_at(typingctx, address, offset):
        """The fp16 value at byte `offset` (even) of a row_address as float32: one
        `ld.global.nc.b16` and one exact `cvt.f32.f16`."""
        sig = types.float32(types.uint64, offset)

        def codegen(context, builder, signature, args):
            asm = ir.InlineAsm(ir.FunctionType(ir.FloatType(), [ir.IntType(64)]),
                               "{.reg .b16 %h; ld.global.nc.b16 %h, [$1]; cvt.f32.f16 $0, %h;}", "=f,l")
            return builder.call(asm, [_plus(context, builder, args[0], args[1], signature.args[1])])

        return sig, codegen


if SIM:
    def byte_perm(a, b, selector):
        """prmt.b32: byte i of the result is byte (selector >> 4 i) & 7 of b:a (a bytes 0-3, b 4-7),
        or that byte's top bit copied into all eight where bit 3 of the selector's nibble i is set."""
        pool = (int(a) & 0xFFFFFFFF) | ((int(b) & 0xFFFFFFFF) << 32)
        out = 0
        for i in range(4):
            nibble = (int(selector) >> (4 * i)) & 15
            byte = (pool >> (8 * (nibble & 7))) & 0xFF
            if nibble & 8:
                byte = 0xFF if byte & 0x80 else 0
            out |= byte << (8 * i)
        return uint32(out)
else:
    @intrinsic
    def byte_perm(typingctx, a, b, selector):
        """`prmt.b32`: byte i of the result is byte (selector >> 4 i) & 7 of b:a (a bytes 0-3, b
        bytes 4-7), or its top bit replicated where bit 3 of nibble i is set. One integer
        instruction that moves a byte into place inside another word, where shift, mask and or
        take two or three."""
        sig = types.uint32(types.uint32, types.uint32, types.uint32)

        def codegen(context, builder, signature, args):
            word = ir.IntType(32)
            values = [context.cast(builder, v, t, types.uint32) for v, t in zip(args, signature.args, strict=True)]
            asm = ir.InlineAsm(ir.FunctionType(word, [word] * 3), "prmt.b32 $0, $1, $2, $3;", "=r,r,r,r")
            return builder.call(asm, values)

        return sig, codegen


if SIM:
    def and_or(a, b, c):
        """(a & b) | c of three 32-bit words."""
        return uint32((int(a) & int(b)) | int(c))

    def bit_select(a, b, mask):
        """The bits of b where mask is set, of a elsewhere (three 32-bit words)."""
        return uint32((int(a) & ~int(mask) | int(b) & int(mask)) & 0xFFFFFFFF)
else:
    def lop3(table: int):
        """An intrinsic f(a, b, c) of three 32-bit words that is one `lop3.b32` with lookup table
        `table` (the result's bit for a, b, c bits i, j, k is bit 4 i + 2 j + k of the table)."""
        @intrinsic
        def three_word_logic(typingctx, a, b, c):
            sig = types.uint32(types.uint32, types.uint32, types.uint32)

            def codegen(context, builder, signature, args):
                word = ir.IntType(32)
                values = [context.cast(builder, v, t, types.uint32)
                          for v, t in zip(args, signature.args, strict=True)]
                asm = ir.InlineAsm(ir.FunctionType(word, [word] * 3), f"lop3.b32 $0, $1, $2, $3, {table:#x};",
                                   "=r,r,r,r")
                return builder.call(asm, values)

            return sig, codegen

        return three_word_logic

    # (a & b) | c: ptxas, given an and and an or of two constants, emits two LOP3s, one immediate each
    and_or = lop3(0xEA)
    # the bits of b where mask is set, of a elsewhere: ptxas makes two LOP3s of the and-or or xor form
    bit_select = lop3(0xD8)


if SIM:
    _F16_VALUES = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)  # each fp16, widened

    def f16x2_f32(word):
        """The two fp16 values of a 32-bit word (low half first) as float32."""
        w = int(word) & 0xFFFFFFFF
        return _F16_VALUES[w & 0xFFFF], _F16_VALUES[w >> 16]
else:
    @intrinsic
    def f16x2_f32(typingctx, word):
        """The two fp16 values of a 32-bit word (low half first) as float32: one `cvt.f32.f16` each
        (exact), where converting on the bits (fp16_to_f32) takes a dozen integer instructions."""
        sig = types.UniTuple(types.float32, 2)(types.uint32)

        def codegen(context, builder, signature, args):
            value = context.cast(builder, args[0], signature.args[0], types.uint32)
            f32 = ir.FloatType()
            asm = ir.InlineAsm(ir.FunctionType(ir.LiteralStructType([f32, f32]), [ir.IntType(32)]),
                               "{.reg .b16 %hlo, %hhi; mov.b32 {%hlo, %hhi}, $2; cvt.f32.f16 $0, %hlo; "
                               "cvt.f32.f16 $1, %hhi;}", "=f,=f,r")
            pair = builder.call(asm, [value])
            return context.make_tuple(builder, signature.return_type,
                                      [builder.extract_value(pair, j) for j in range(2)])

        return sig, codegen


if SIM:
    @cuda.jit(device=True)
    def warp_sum(v, scratch):
        """Sum of v over the 32 lanes of the calling warp, returned to every lane. `scratch` is a
        shared float32 array with one slot per thread of the block; every thread must call."""
        tid = cuda.threadIdx.x + cuda.threadIdx.y * cuda.blockDim.x
        scratch[tid] = v
        cuda.syncthreads()
        first = tid - tid % WARP
        total = float32(0)
        for i in range(WARP):
            total += scratch[first + i]
        cuda.syncthreads()
        return total
else:
    @cuda.jit(device=True)
    def warp_sum(v, scratch):
        """Sum of v over the 32 lanes of the calling warp (butterfly shuffles), to every lane."""
        for offset in (16, 8, 4, 2, 1):
            v += cuda.shfl_xor_sync(0xFFFFFFFF, v, offset)
        return v


def lane_group_sum(lanes: int):
    """A device function: the sum of v over the calling lane's aligned group of `lanes` lanes (a
    power of two, 2 to 32; butterfly shuffles over the group's offsets only), to every lane of the
    group. Every lane of the warp must call. GPU only: the simulator's warps are one lane."""
    offsets = tuple(lanes >> i for i in range(1, lanes.bit_length()))

    @cuda.jit(device=True)
    def group_sum(v):
        for offset in offsets:
            v += cuda.shfl_xor_sync(0xFFFFFFFF, v, offset)
        return v

    return group_sum


if SIM:
    _F32_OVERFLOW = 2.0**128 - 2.0**103  # the smallest float64 that rounds to +inf in fp32

    def mul_rn(a, b):
        """a * b rounded once to fp32 (never fused into an FMA)."""
        return np.float32(np.float32(a) * np.float32(b))

    def exp_f32(x):
        """exp(x) in float64, rounded once to fp32 (the oracle's host.numerics.exp)."""
        v = math.exp(min(float(x), 709.0))
        return np.float32(np.inf) if v >= _F32_OVERFLOW else np.float32(v)

    def rint_f32(x):
        """Round to the nearest integer, ties to even."""
        return np.float32(np.rint(np.float32(x)))
else:
    from numba.cuda import libdevice

    @cuda.jit(device=True)
    def mul_rn(a, b):
        """a * b rounded once to fp32 (never fused into an FMA)."""
        return libdevice.fmul_rn(float32(a), float32(b))

    @cuda.jit(device=True)
    def exp_f32(x):
        """exp(x) in float64, rounded once to fp32 (the oracle's host.numerics.exp)."""
        return float32(math.exp(float64(x)))

    @cuda.jit(device=True)
    def rint_f32(x):
        """Round to the nearest integer, ties to even."""
        return libdevice.rintf(float32(x))


@device
def rotate_pair(a, b, c, s):
    """The pair (a, b) rotated by the angle whose cosine and sine are c and s (the inverse: -s):
    (a c - b s, a s + b c) in fp32, each product rounded before the sum (mul_rn: no FMA), as
    host.numerics.rotate computes it; the caller rounds the two to bf16."""
    return mul_rn(a, c) - mul_rn(b, s), mul_rn(a, s) + mul_rn(b, c)


KERNEL_CACHE_ENV = "FLASHV41_KERNEL_CACHE"


def kernel_cache_dir() -> Path | None:
    """Where compiled kernels are kept for later processes: a folder under FLASHV41_KERNEL_CACHE's,
    named by a hash of numba-cuda's version and of every source file of flashv41.stages and
    flashv41.host (what a kernel's code comes from), so that no kernel compiled from other code is
    ever loaded. None where the variable is unset or empty, and on the simulator."""
    root = os.environ.get(KERNEL_CACHE_ENV, "")
    if SIM or not root:
        return None
    import numba_cuda

    import flashv41.host

    digest = hashlib.sha256(numba_cuda.__version__.encode())
    for package in (Path(__file__).parent, Path(flashv41.host.__file__).parent):
        for source in sorted(package.rglob("*.py")):
            digest.update(source.relative_to(package).as_posix().encode() + b"\0" + source.read_bytes())
    return Path(root) / f"kernels-{digest.hexdigest()[:16]}"


def _kernel_cache() -> Path | None:
    """Point numba-cuda's disk cache at kernel_cache_dir() (numba-cuda's setting for the process)
    where there is one, and return it."""
    folder = kernel_cache_dir()
    if folder is None:
        return None
    from numba.cuda.core import config

    folder.mkdir(parents=True, exist_ok=True)
    config.CACHE_DIR = str(folder)
    return folder


KERNEL_CACHE_DIR = _kernel_cache()
KERNEL_CACHE = KERNEL_CACHE_DIR is not None  # whether jit_kernel's kernels are cached (tests/mutants.py turns it off)


@functools.cache
def _locked_cache():
    """numba-cuda's disk cache (what cuda.jit(cache=True) gives a kernel) with its saves made one
    process at a time: numba numbers a function's entries by reading its index and taking the next
    free number, so two processes saving two closures of one kernel factory at once could give both
    the same data file, and the index would name the other closure's kernel."""
    import fcntl

    from numba.cuda.dispatcher import CUDACache

    assert KERNEL_CACHE_DIR is not None
    lock_path = KERNEL_CACHE_DIR / "save.lock"

    class LockedCache(CUDACache):
        def save_overload(self, sig, data):
            with open(lock_path, "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                super().save_overload(sig, data)

        def _index_key(self, sig, codegen):
            key = super()._index_key(sig, codegen)
            code_hash, _ = key[3]  # (sig, magic tuple, numba-cuda version, (code, closure)[, launch config])
            return (*key[:3], (code_hash, closure_digest(self._py_func)), *key[4:])

    return LockedCache


def _intrinsic_named(name, defn):
    """What closure_digest pickles in place of an intrinsic (never called)."""
    raise NotImplementedError


def closure_digest(py_func) -> str:
    """A hash of a kernel's closure (the values its factory compiled in) that is the same in every
    process: numba's own pickles each intrinsic with the id it drew at import, so a kernel whose
    closure reaches one (through a device function's globals) got a new cache entry in every
    process and was never loaded; here an intrinsic stands for its name and definition."""
    import io

    from numba.cuda.extending import _Intrinsic  # type: ignore[attr-defined]
    from numba.cuda.serialize import NumbaPickler

    class KeyPickler(NumbaPickler):
        def reducer_override(self, obj):
            if isinstance(obj, _Intrinsic):
                return _intrinsic_named, (obj._name, obj._defn)
            return super().reducer_override(obj)

    if py_func.__closure__ is None:
        return ""
    with io.BytesIO() as buf:
        KeyPickler(buf, protocol=4).dump(tuple(cell.cell_contents for cell in py_func.__closure__))
        return hashlib.sha256(buf.getvalue()).hexdigest()


def _cached(dispatcher):
    dispatcher._cache = _locked_cache()(dispatcher.py_func)  # what enable_caching() sets, with the lock
    return dispatcher


def jit_kernel(launch_bounds: int | tuple[int, int] | None = None):
    """The decorator of every kernel: cuda.jit; on the GPU with `launch_bounds` (threads a block,
    and blocks an SM) where given, so that the compiler keeps registers x threads inside the
    register file and any block size up to it launches; and cached on disk where
    FLASHV41_KERNEL_CACHE names a folder (kernel_cache_dir: a process that launches a kernel
    compiled there before loads it instead of compiling it, about a second a kernel)."""
    if SIM:
        return cuda.jit
    jit = cuda.jit if launch_bounds is None else cuda.jit(launch_bounds=launch_bounds)  # type: ignore[call-arg]
    if not KERNEL_CACHE:
        return jit
    return lambda fn: _cached(jit(fn))


def grid_1d(n: int, block: int) -> int:
    return max(1, math.ceil(n / block))


@jit_kernel()
def _fill_kernel(flat, value):
    """flat[:] = value, a grid-stride loop (flat: a 1-D view of a contiguous array)."""
    for i in range(cuda.grid(1), flat.shape[0], cuda.gridsize(1)):
        flat[i] = value


FILL_THREADS = 64 if SIM else 256
FILL_MAX_BLOCKS = 1 if SIM else 1024  # enough to stream the largest cache at memory speed


def fill(a: DeviceArray, value: float, stream=0) -> None:
    """Every element of the contiguous device array `a` set to `value` (cast to its dtype) by a
    kernel on `stream`: clearing a cache costs a device write, not a host array of its size
    uploaded."""
    flat = a.reshape(a.size)
    if a.size:
        blocks = min(FILL_MAX_BLOCKS, grid_1d(a.size, FILL_THREADS))
        _fill_kernel[blocks, FILL_THREADS, stream](flat, a.dtype.type(value))


def check_array(a: DeviceArray, dtypes: tuple, ndim: int, what: str) -> None:
    """InputError unless `a` is an array of one of `dtypes` with `ndim` dimensions."""
    dtype = getattr(a, "dtype", None)
    shape = getattr(a, "shape", None)
    if dtype is None or shape is None or len(shape) != ndim or np.dtype(dtype) not in [np.dtype(d) for d in dtypes]:
        names = " or ".join(np.dtype(d).name for d in dtypes)
        raise InputError(f"{what}: expected a {ndim}-D {names} device array, got "
                         f"{getattr(dtype, 'name', dtype)} {shape}")


def check_rows(a: DeviceArray, n_rows: int, what: str) -> None:
    if not 0 <= n_rows <= a.shape[0]:
        raise InputError(f"{what}: {n_rows} rows requested, the array holds {a.shape[0]}")


def product_groups(what: str, x: DeviceArray, w: Any, y: DeviceArray, n_tokens: int, group_rows: int,
                   most_tokens: int | None = None) -> tuple[int, int]:
    """(groups, rows a group) of the product y[:T] = x[:T] @ w^T of a tensor-core wrapper (`what`,
    e.g. "linear_tc"; w a stages.linear.DeviceWeight, group_rows 0 for one group), or the
    ValueError naming the weight: the groups must split w's rows, x hold every group's K inputs,
    y every output row as bf16 bits or float32, both the T tokens (at most `most_tokens`)."""
    groups = w.n // group_rows if group_rows else 1
    rows = group_rows or w.n
    most = min(x.shape[0], y.shape[0], most_tokens or x.shape[0])
    if (groups * rows != w.n or x.shape[1] < groups * w.k or y.shape[1] < w.n or not 0 <= n_tokens <= most
            or np.dtype(y.dtype) not in (np.dtype(np.uint16), np.dtype(np.float32))):
        cap = f" (at most {most_tokens})" if most_tokens else ""
        raise ValueError(f"{what} {w.name}: x {x.shape}, y {y.shape} {y.dtype}, weight [{w.n}, {w.k}], "
                         f"{n_tokens} tokens{cap}, group rows {group_rows}")
    return groups, rows


SHARED_STATIC_LIMIT = 48 << 10  # the shared memory a block gets without the driver's attribute
SHARED_SM90_LIMIT = 227 << 10  # the most a block can take on sm_90 (static and dynamic)


def allow_dynamic_shared(dispatcher, argtypes: tuple, nbytes: int) -> None:
    """Let `dispatcher`'s overload for `argtypes` launch with up to `nbytes` of dynamic shared memory
    (compiling it first where it is not yet): past SHARED_STATIC_LIMIT the driver refuses a launch
    unless the kernel's CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES says so, and numba-cuda has
    no call that sets it; this takes the overload's loaded function (`library.get_cufunc()`) and
    calls the driver's cuKernelSetAttribute, as numba-cuda's own carveout setter does. Nothing on the
    simulator, which gives a launch any size."""
    if not 0 <= nbytes <= SHARED_SM90_LIMIT:
        raise ValueError(f"dynamic shared memory of {nbytes} bytes: at most {SHARED_SM90_LIMIT} a block on sm_90")
    if SIM:
        return
    from numba.cuda.cudadrv.driver import binding, driver

    kernel = dispatcher.compile(argtypes)
    cufunc = kernel.library.get_cufunc()
    attribute = binding.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    driver.cuKernelSetAttribute(attribute, nbytes, cufunc.handle, cufunc.device.id)


_SHARED_ALLOWED: dict = {}  # (dispatcher, argument types) -> the dynamic shared bytes its overload may take


def launch_dynamic_shared(kernel, grid, threads: int, stream, nbytes: int, *args) -> None:
    """kernel[grid, threads, stream, nbytes](*args), the overload for these arguments first allowed
    nbytes of dynamic shared memory (allow_dynamic_shared, once per overload and size: a mutant's
    kernel is another dispatcher, so it gets its own)."""
    if not SIM:
        from numba import typeof

        key = (kernel, tuple(typeof(a) for a in args))
        if _SHARED_ALLOWED.get(key, -1) < nbytes:
            allow_dynamic_shared(kernel, key[1], nbytes)
            _SHARED_ALLOWED[key] = nbytes
    kernel[grid, threads, stream, nbytes](*args)
