"""Memory-bandwidth probes and the L2 evictor of `flashv41 bench`.

Three kernels over uint32 buffers of shape [1, W] (W a multiple of 4: the kernels move 16-byte
vectors, so every buffer is 16-byte aligned and a whole number of vectors long):
- `copy_words(src, dst)`: dst = src, 16-byte loads (`ld.global.nc.v4.u32`) and 16-byte stores
  (`st.global.v4.u32`), a grid-stride loop with UNROLL vectors in flight per thread. Its
  bandwidth counts the bytes read plus the bytes written.
- `read_words(src, sink)`: reads every word of src with the same loads and keeps a running xor in
  registers; the thread writes `sink[0]` only if that xor is NEVER, which a zero-filled buffer
  never gives (its xor is 0), so nothing is written, yet the compiler cannot drop the loads.
  Its bandwidth counts the bytes read. The same kernel evicts the L2 between timed repetitions
  (`L2Evictor`): reading, not writing, leaves only clean lines behind, so no write-back of the
  evictor's data lands inside the next timed region.
- `fill_words(dst, value)`: every word of dst = value (zero-fills the probe buffers).

There is no oracle function: the tests hold the kernels to NumPy (copy equal, xor untouched) on
the simulator, and compile them for sm_90 in compile-check mode.
"""

from __future__ import annotations

import numpy as np
from numba import cuda, int64, uint32

from flashv41.stages.device import SIM, DeviceArray, jit_kernel, load_words4

THREADS = 256
BLOCKS_PER_SM = 8  # 2048 resident threads an SM: the most a Hopper SM holds
FALLBACK_SMS = 132  # an H200's SMs, when the device does not say (compile-check mode)
UNROLL = 4  # 16-byte vectors in flight per thread per loop step
NEVER = 0xFFFFFFFF  # the read kernel's xor of a zero-filled buffer is 0, never this

# On a GPU the kernels promise ptxas THREADS-thread blocks, BLOCKS_PER_SM of them resident per SM
# (at most 32 registers a thread): the whole grid is then one wave, and no block of a second wave
# streams its share alone at the end.
probe_kernel = jit_kernel((THREADS, BLOCKS_PER_SM))


if SIM:
    def store_words4(a, row, i, w0, w1, w2, w3):
        """a[row, i .. i + 3] = w0 .. w3 of a uint32 array, i a multiple of 4 (one 16-byte store
        on a GPU)."""
        a[row, i] = w0
        a[row, i + 1] = w1
        a[row, i + 2] = w2
        a[row, i + 3] = w3
else:
    from llvmlite import ir
    from numba import types
    from numba.cuda import cgutils  # type: ignore[attr-defined]
    from numba.cuda.extending import intrinsic

    @intrinsic
    def store_words4(typingctx, a, row, i, w0, w1, w2, w3):
        """a[row, i .. i + 3] = w0 .. w3 of a uint32 array as one 16-byte store
        (`st.global.v4.u32`; the address must be 16-byte aligned): the store matching
        stages.device.load_words4, since Numba has no vector stores."""
        sig = types.void(a, row, i, w0, w1, w2, w3)

        def codegen(context, builder, signature, args):
            array_type, row_type, i_type = signature.args[:3]
            array = context.make_array(array_type)(context, builder, args[0])
            index = [context.cast(builder, v, t, types.intp)
                     for v, t in zip(args[1:3], (row_type, i_type), strict=True)]
            pointer = cgutils.get_item_pointer(context, builder, array_type, array, index)
            address = builder.ptrtoint(pointer, ir.IntType(64))
            words = [context.cast(builder, v, t, types.uint32)
                     for v, t in zip(args[3:], signature.args[3:], strict=True)]
            word = ir.IntType(32)
            # side_effect: the store's result is in memory, not in a value LLVM could see used
            store = ir.InlineAsm(ir.FunctionType(ir.VoidType(), [ir.IntType(64)] + [word] * 4),
                                 "st.global.v4.u32 [$0], {$1, $2, $3, $4};", "l,r,r,r,r", side_effect=True)
            builder.call(store, [address, *words])
            return context.get_dummy_value()

        return sig, codegen


@probe_kernel
def copy_kernel(src, dst, vectors):
    """dst[0, :4 * vectors] = src[0, :4 * vectors]; src, dst uint32 [1, W]. Thread t copies
    vectors t, t + S, t + 2S, ... (S threads in the grid), UNROLL of them loaded before any is
    stored, so that each thread has UNROLL loads in flight."""
    step = int64(cuda.gridsize(1))
    v = int64(cuda.grid(1))
    while v + (UNROLL - 1) * step < vectors:
        a0, a1, a2, a3 = load_words4(src, 0, 4 * v)
        b0, b1, b2, b3 = load_words4(src, 0, 4 * (v + step))
        c0, c1, c2, c3 = load_words4(src, 0, 4 * (v + 2 * step))
        d0, d1, d2, d3 = load_words4(src, 0, 4 * (v + 3 * step))
        store_words4(dst, 0, 4 * v, a0, a1, a2, a3)
        store_words4(dst, 0, 4 * (v + step), b0, b1, b2, b3)
        store_words4(dst, 0, 4 * (v + 2 * step), c0, c1, c2, c3)
        store_words4(dst, 0, 4 * (v + 3 * step), d0, d1, d2, d3)
        v += UNROLL * step
    while v < vectors:  # the last partial round: one vector at a time
        a0, a1, a2, a3 = load_words4(src, 0, 4 * v)
        store_words4(dst, 0, 4 * v, a0, a1, a2, a3)
        v += step


@probe_kernel
def read_kernel(src, vectors, sink):
    """Read src[0, :4 * vectors] (uint32 [1, W]) in the copy kernel's order, xor every word into
    a register; sink (uint32 [1]) is written only by a thread whose xor is NEVER."""
    step = int64(cuda.gridsize(1))
    v = int64(cuda.grid(1))
    acc = uint32(0)
    while v + (UNROLL - 1) * step < vectors:
        a0, a1, a2, a3 = load_words4(src, 0, 4 * v)
        b0, b1, b2, b3 = load_words4(src, 0, 4 * (v + step))
        c0, c1, c2, c3 = load_words4(src, 0, 4 * (v + 2 * step))
        d0, d1, d2, d3 = load_words4(src, 0, 4 * (v + 3 * step))
        acc = uint32(acc ^ a0 ^ a1 ^ a2 ^ a3)  # 32-bit xors, one vector at a time (Numba widens longer chains)
        acc = uint32(acc ^ b0 ^ b1 ^ b2 ^ b3)
        acc = uint32(acc ^ c0 ^ c1 ^ c2 ^ c3)
        acc = uint32(acc ^ d0 ^ d1 ^ d2 ^ d3)
        v += UNROLL * step
    while v < vectors:
        a0, a1, a2, a3 = load_words4(src, 0, 4 * v)
        acc = uint32(acc ^ a0 ^ a1 ^ a2 ^ a3)
        v += step
    if acc == uint32(NEVER):
        sink[0] = acc


@probe_kernel
def fill_kernel(dst, vectors, value):
    """dst[0, :4 * vectors] = value (uint32 [1, W])."""
    step = int64(cuda.gridsize(1))
    v = int64(cuda.grid(1))
    word = uint32(value)
    while v < vectors:
        store_words4(dst, 0, 4 * v, word, word, word, word)
        v += step


def grid_blocks() -> int:
    """Blocks that fill the GPU (BLOCKS_PER_SM per SM); 2 on the simulator, where each block is a
    thread pool and the buffers are small."""
    if SIM:
        return 2
    try:
        sms = int(cuda.get_current_device().MULTIPROCESSOR_COUNT)
    except AttributeError:  # the stand-in device of compile-check mode
        sms = FALLBACK_SMS
    return sms * BLOCKS_PER_SM


def _vectors(a: DeviceArray) -> int:
    if a.dtype != np.uint32 or a.ndim != 2 or a.shape[0] != 1 or a.shape[1] % 4:
        raise ValueError(f"bandwidth: want a uint32 [1, W] buffer, W a multiple of 4, got {a.dtype} {a.shape}")
    return int(a.shape[1]) // 4


def threads() -> int:
    """Threads a block: one warp on the simulator."""
    return 32 if SIM else THREADS


def copy_words(src: DeviceArray, dst: DeviceArray, stream=0, blocks: int = 0) -> None:
    """dst = src (uint32 [1, W] each) with the copy kernel, on `stream`."""
    vectors = _vectors(src)
    if dst.shape != src.shape or dst.dtype != src.dtype:
        raise ValueError(f"bandwidth: copy {src.dtype} {src.shape} into {dst.dtype} {dst.shape}")
    copy_kernel[blocks or grid_blocks(), threads(), stream](src, dst, vectors)


def read_words(src: DeviceArray, sink: DeviceArray, stream=0, blocks: int = 0) -> None:
    """Read every word of src (uint32 [1, W]) with the read kernel, on `stream`; sink uint32 [1]."""
    read_kernel[blocks or grid_blocks(), threads(), stream](src, _vectors(src), sink)


def fill_words(dst: DeviceArray, value: int, stream=0, blocks: int = 0) -> None:
    """Every word of dst (uint32 [1, W]) = value, on `stream`."""
    fill_kernel[blocks or grid_blocks(), threads(), stream](dst, _vectors(dst), np.uint32(value))


def words_buffer(nbytes: int, stream=0) -> DeviceArray:
    """A zero-filled uint32 [1, nbytes / 4] device buffer, nbytes rounded up to 16 bytes."""
    words = (nbytes + 15) // 16 * 4
    buf = cuda.device_array((1, words), np.uint32, stream=stream)
    fill_words(buf, 0, stream)
    return buf


class L2Evictor:
    """Evicts the L2 by reading a zero-filled buffer of `nbytes` (choose >= 2x the L2) with the
    read kernel: afterwards the L2 holds only the evictor's clean lines, so the next timed call
    reads its own data from HBM and no dirty line of the evictor is written back during it."""

    def __init__(self, nbytes: int, stream=0) -> None:
        self.buffer = words_buffer(nbytes, stream)  # uint32 [1, nbytes / 4], zeros
        self.sink = cuda.device_array(1, np.uint32, stream=stream)  # [1], never written
        self.nbytes = int(self.buffer.shape[1]) * 4

    def evict(self, stream=0) -> None:
        """Queue one eviction on `stream`."""
        read_words(self.buffer, self.sink, stream)

    def free(self) -> None:
        """Drop the buffer (idempotent); evict() fails afterwards."""
        self.buffer = self.sink = None
