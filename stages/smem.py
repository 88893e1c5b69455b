"""Shared-memory and asynchronous-copy instructions for the tensor-core kernels, as Numba
intrinsics on a GPU and as emulations on the simulator (the same names, the same results): 16- and
4-byte `cp.async` copies into shared memory with their commit and waits, `ldmatrix` (plain and
transposed), 16-byte shared loads and stores, paired global stores (and `store_pair`, a GEMM
epilogue's store of two outputs on either side of a group's end), `cvt.rn.bf16x2.f32`, and
`pinned` values the compilers compute once. Nothing here is a kernel: stages.gemm_pipe,
stages.gemm_wgmma and stages.sparse_fused build theirs from these (gemm_wgmma's wgmma descriptors
take their shared addresses from `_shared_word` too).

Addresses. A copy names its destination by (shared array, word) and its source by `word_address`
(a global uint32 array's element: its address on a GPU, its flat index on the simulator; WORD_UNITS
converts a count of words into those units). Shared arrays the instructions read or write whole
16-byte pieces of must be aligned (ALIGN) and their rows whole 16-byte pieces.

On the simulator the copies are plain copies (commit and wait do nothing) and ldmatrix a gather in
which every lane brings the 16 bytes at its own row address to the warp's meeting
(stages.warp_mma's) and takes back its words of the four matrices.
"""

from __future__ import annotations

from numba import cuda, uint32, uint64

from flashv41.stages import warp_mma
from flashv41.stages.device import SIM, WARP, f32_to_bf16, inlined

ALIGN = None if SIM else 128  # cp.async and ldmatrix need aligned shared rows (the simulator refuses the option)
WORD_UNITS = 1 if SIM else 4  # a word_address's units a word: the simulator's index words, the GPU's bytes

if SIM:
    def word_address(a, row, col):
        """Where a[row, col] of a global uint32 array is, for the copies: here its flat index."""
        return uint64(row * a.shape[1] + col)

    def cp_async16(dst, word, src, address, size):
        """Words word .. word + 3 of the shared array dst = the four words of src from word_address
        `address` on where size is 16, zeros where 0."""
        flat, at = dst.reshape(-1), src.reshape(-1)
        for j in range(4):
            flat[word + j] = at[address + j] if size else uint32(0)

    def cp_async4(dst, word, src, address, size):
        """Word `word` of the shared array dst = the word of src at word_address `address` where size
        is 4, zero where 0."""
        dst.reshape(-1)[word] = src.reshape(-1)[address] if size else uint32(0)

    def cp_async_commit():
        """The copies above complete at once here: nothing to group."""

    def cp_async_wait_one():
        """Nothing is in flight here."""

    def ldmatrix_x4(a, word):
        """Four 8 x 8 matrices of b16 from the shared array a: lane l brings the address of its words
        word .. word + 3 (row l % 8 of matrix l // 8) and gets, of each matrix i, word l % 4 of its
        row l // 4."""
        flat = a.reshape(-1)
        rows = warp_mma.kernel_warp_meet((flat[word], flat[word + 1], flat[word + 2], flat[word + 3], 0, 0),
                                          ldmatrix_tile)
        lane = cuda.threadIdx.x % WARP
        return (uint32(rows[lane >> 2, lane & 3]), uint32(rows[8 + (lane >> 2), lane & 3]),
                uint32(rows[16 + (lane >> 2), lane & 3]), uint32(rows[24 + (lane >> 2), lane & 3]))

    def ldmatrix_x4_trans(a, word):
        """ldmatrix .trans (stages.sparse_fused's values): as ldmatrix_x4, but lane l gets of each
        matrix i the pair (row 2 (l % 4), column l // 4) (low half), (row 2 (l % 4) + 1, column
        l // 4) (high half)."""
        flat = a.reshape(-1)
        rows = warp_mma.kernel_warp_meet((flat[word], flat[word + 1], flat[word + 2], flat[word + 3], 0, 0),
                                          ldmatrix_tile)
        lane = cuda.threadIdx.x % WARP
        g, t = lane >> 2, lane & 3
        shift = 16 * (g & 1)
        got = []
        for i in range(4):
            lo = (uint32(rows[8 * i + 2 * t, g >> 1]) >> shift) & 0xFFFF
            hi = (uint32(rows[8 * i + 2 * t + 1, g >> 1]) >> shift) & 0xFFFF
            got.append(uint32(lo | (hi << 16)))
        return got[0], got[1], got[2], got[3]

    def cp_async_wait_all():
        """Nothing is in flight here."""

    # device functions on the simulator, which then gives them its thread indices (they read the
    # lane) whichever module's kernel calls them
    ldmatrix_x4 = cuda.jit(device=True)(ldmatrix_x4)
    ldmatrix_x4_trans = cuda.jit(device=True)(ldmatrix_x4_trans)

    def store_f32x2(y, t, n, v0, v1):
        """y[t, n] = v0, y[t, n + 1] = v1 of a float32 array (one 8-byte store on a GPU: n even, rows
        of even length)."""
        y[t, n] = v0
        y[t, n + 1] = v1

    def store_bf16x2(y, t, n, word):
        """y[t, n], y[t, n + 1] = the low and high halves of word, in a bf16 (uint16) array (one
        4-byte store on a GPU: n even, rows of even length)."""
        y[t, n] = word & 0xFFFF
        y[t, n + 1] = word >> 16

    def bf16x2(v0, v1):
        """v0 and v1 rounded to the nearest bf16, ties to even, packed (v0 the low half): what
        `cvt.rn.bf16x2.f32` gives for values that are not NaN."""
        return uint32(f32_to_bf16(v0)) | (uint32(f32_to_bf16(v1)) << 16)

    def pinned(v):
        """v (uint32), computed once where it is pinned on a GPU."""
        return uint32(v)

    def pinned64(v):
        """v (uint64), computed once where it is pinned on a GPU."""
        return uint64(v)

    def ldmatrix_tile(regs):
        """The rows the lanes brought, [lane, word]: row j of matrix i is lane 8 i + j's."""
        return regs[:, :4].copy()

    def lds4(a, word):
        """Words word .. word + 3 of the shared uint32 array a (one 16-byte load on a GPU)."""
        flat = a.reshape(-1)
        return flat[word], flat[word + 1], flat[word + 2], flat[word + 3]

    def sts4(a, word, v0, v1, v2, v3):
        """Words word .. word + 3 of the shared uint32 array a = v0 .. v3 (one 16-byte store on a GPU)."""
        flat = a.reshape(-1)
        flat[word], flat[word + 1], flat[word + 2], flat[word + 3] = v0, v1, v2, v3
else:
    from llvmlite import ir
    from numba import types
    from numba.cuda import cgutils  # type: ignore[attr-defined]
    from numba.cuda.extending import intrinsic

    def _shared_word(context, builder, array_type, array, word, word_type):
        """The 32-bit `.shared` window address of word `word` of a shared array. The cast back to the
        shared space undoes Numba's cast of the array to generic, so NVVM takes the array's own
        shared symbol (no cvta), and the address is a 32-bit sum that ptxas folds constant offsets
        into."""
        data = context.make_array(array_type)(context, builder, array).data
        base = builder.ptrtoint(builder.addrspacecast(data, ir.PointerType(data.type.pointee, 3)), ir.IntType(32))
        at = context.cast(builder, word, word_type, types.uint32)
        return builder.add(base, builder.shl(at, ir.Constant(ir.IntType(32), 2)))

    @intrinsic
    def word_address(typingctx, a, row, col):
        """Where a[row, col] of a global uint32 array is, for the copies: its address (uint64)."""
        sig = types.uint64(a, row, col)

        def codegen(context, builder, signature, args):
            array_type = signature.args[0]
            array = context.make_array(array_type)(context, builder, args[0])
            index = [context.cast(builder, v, t, types.intp) for v, t in zip(args[1:], signature.args[1:], strict=True)]
            return builder.ptrtoint(cgutils.get_item_pointer(context, builder, array_type, array, index),
                                    ir.IntType(64))

        return sig, codegen

    def _copy(size: int, cache: str):
        """An intrinsic (dst, word, src, address, src_size): `cp.async.<cache>.shared.global` of `size`
        bytes from the word_address `address` (of the global array src) to word `word` of the shared
        array dst, only the first src_size (size or 0) read, the rest zero-filled."""
        text = f"cp.async.{cache}.shared.global [$0], [$1], {size}, $2;"

        @intrinsic
        def copy(typingctx, dst, word, src, address, src_size):
            sig = types.void(dst, word, src, types.uint64, src_size)

            def codegen(context, builder, signature, args):
                a = signature.args
                to = _shared_word(context, builder, a[0], args[0], args[1], a[1])
                n = context.cast(builder, args[4], a[4], types.uint32)
                fn = ir.FunctionType(ir.VoidType(), [ir.IntType(32), ir.IntType(64), ir.IntType(32)])
                builder.call(ir.InlineAsm(fn, text, "r,l,r", side_effect=True), [to, args[3], n])
                return context.get_dummy_value()

            return sig, codegen

        return copy

    cp_async16 = _copy(16, "cg")  # through L2 only: a tile is reused from L2, by other blocks
    cp_async4 = _copy(4, "ca")  # .cg copies only 16 bytes

    def _statement(text: str, clobbers: str):
        """An intrinsic of no operands: one PTX statement."""

        @intrinsic
        def statement(typingctx):
            sig = types.void()

            def codegen(context, builder, signature, args):
                builder.call(ir.InlineAsm(ir.FunctionType(ir.VoidType(), []), text, clobbers, side_effect=True), [])
                return context.get_dummy_value()

            return sig, codegen

        return statement

    # the copies issued since the last commit form one group
    cp_async_commit = _statement("cp.async.commit_group;", "")
    # all but the newest group of this thread's copies have landed (a barrier then makes every
    # thread's visible; a ring of three stages keeps one group in flight); the memory clobber keeps
    # shared loads below it
    cp_async_wait_one = _statement("cp.async.wait_group 1;", "~{memory}")
    cp_async_wait_all = _statement("cp.async.wait_group 0;", "~{memory}")  # every group landed

    def _load4(text: str):
        """An intrinsic (a, word) -> four words loaded by `text` from word `word` of a shared array."""

        @intrinsic
        def load(typingctx, a, word):
            sig = types.UniTuple(types.uint32, 4)(a, word)

            def codegen(context, builder, signature, args):
                at = _shared_word(context, builder, signature.args[0], args[0], args[1], signature.args[1])
                u32 = ir.IntType(32)
                fn = ir.FunctionType(ir.LiteralStructType([u32] * 4), [u32])
                got = builder.call(ir.InlineAsm(fn, text, "=r,=r,=r,=r,r,~{memory}", side_effect=True), [at])
                return context.make_tuple(builder, signature.return_type,
                                          [builder.extract_value(got, i) for i in range(4)])

            return sig, codegen

        return load

    # lane l gives the address of row l % 8 of matrix l // 8 (16 bytes) and gets, of each matrix i,
    # word l % 4 of its row l // 4
    ldmatrix_x4 = _load4("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {$0,$1,$2,$3}, [$4];")
    # the same, each matrix transposed: lane l gets of matrix i its rows 2 (l % 4), + 1 at column l // 4
    # (stages.sparse_fused: the rows as the values' B operand)
    ldmatrix_x4_trans = _load4("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {$0,$1,$2,$3}, [$4];")
    lds4 = _load4("ld.shared.v4.u32 {$0,$1,$2,$3}, [$4];")  # numba has no vector loads

    def _pinned(bits: int):
        """An intrinsic v -> v as an unsigned `bits`-bit integer through a `mov`, which the compilers
        take as given: the lane's ldmatrix offsets (32 bits) and the copies' global addresses (64)
        are then computed once before the K loop and kept, where otherwise each step recomputed them
        from the thread index (about 40 instructions a step)."""
        ty = types.uint32 if bits == 32 else types.uint64
        reg = "r" if bits == 32 else "l"

        @intrinsic
        def pin(typingctx, v):
            def codegen(context, builder, signature, args):
                value = context.cast(builder, args[0], signature.args[0], ty)
                fn = ir.FunctionType(ir.IntType(bits), [ir.IntType(bits)])
                return builder.call(ir.InlineAsm(fn, f"mov.u{bits} $0, $1;", f"={reg},{reg}"), [value])

            return ty(v), codegen

        return pin

    pinned = _pinned(32)
    pinned64 = _pinned(64)

    def _store_codegen(ptx: str, value_types, constraints: str):
        """Codegen of an intrinsic (y, t, n, values...): `ptx` storing the values at y[t, n] of a global
        array in one store (n even and y's rows of even length: aligned to the pair's size)."""

        def codegen(context, builder, signature, args):
            array_type = signature.args[0]
            array = context.make_array(array_type)(context, builder, args[0])
            index = [context.cast(builder, v, ty, types.intp) for v, ty in zip(args[1:3], signature.args[1:3],
                                                                                 strict=True)]
            at = builder.ptrtoint(cgutils.get_item_pointer(context, builder, array_type, array, index), ir.IntType(64))
            cast = [context.cast(builder, v, ty, want) for v, ty, want in zip(args[3:], signature.args[3:],
                                                                                value_types, strict=True)]
            fn = ir.FunctionType(ir.VoidType(), [ir.IntType(64)] + [v.type for v in cast])
            builder.call(ir.InlineAsm(fn, ptx, constraints, side_effect=True), [at, *cast])
            return context.get_dummy_value()

        return codegen

    @intrinsic
    def store_f32x2(typingctx, y, t, n, v0, v1):
        """y[t, n] = v0, y[t, n + 1] = v1 of a float32 array: one `st.global.v2.f32`."""
        return types.void(y, t, n, v0, v1), _store_codegen("st.global.v2.f32 [$0], {$1, $2};",
                                                           (types.float32, types.float32), "l,f,f,~{memory}")

    @intrinsic
    def store_bf16x2(typingctx, y, t, n, word):
        """y[t, n], y[t, n + 1] = the low and high halves of word, in a bf16 (uint16) array: one
        `st.global.b32`."""
        return types.void(y, t, n, word), _store_codegen("st.global.b32 [$0], $1;", (types.uint32,), "l,r,~{memory}")

    @intrinsic
    def bf16x2(typingctx, v0, v1):
        """`cvt.rn.bf16x2.f32`: v0 and v1 rounded to the nearest bf16, ties to even, packed (v0 the
        low half) in one instruction, where f32_to_bf16 takes about eight for each. A NaN's bits may
        differ from f32_to_bf16's: the caller sends NaN there."""
        sig = types.uint32(types.float32, types.float32)

        def codegen(context, builder, signature, args):
            f32 = ir.FloatType()
            fn = ir.FunctionType(ir.IntType(32), [f32, f32])
            return builder.call(ir.InlineAsm(fn, "cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,f,f"), list(args))

        return sig, codegen

    @intrinsic
    def sts4(typingctx, a, word, v0, v1, v2, v3):
        """Words word .. word + 3 of a shared uint32 array = v0 .. v3: one `st.shared.v4.u32`."""
        sig = types.void(a, word, v0, v1, v2, v3)

        def codegen(context, builder, signature, args):
            at = _shared_word(context, builder, signature.args[0], args[0], args[1], signature.args[1])
            values = [context.cast(builder, v, t, types.uint32) for v, t in zip(args[2:], signature.args[2:],
                                                                                 strict=True)]
            u32 = ir.IntType(32)
            fn = ir.FunctionType(ir.VoidType(), [u32] * 5)
            builder.call(ir.InlineAsm(fn, "st.shared.v4.u32 [$0], {$1,$2,$3,$4};", "r,r,r,r,r,~{memory}",
                                      side_effect=True), [at, *values])
            return context.get_dummy_value()

        return sig, codegen


@inlined
def store_pair(y, t, row0, n, group_rows, v0, v1, pairs, out_bf16):
    """A GEMM epilogue's two outputs v0, v1 of token t at output n (even) of the group that starts
    at row0: y[t, row0 + n] and y[t, row0 + n + 1], those of them below group_rows; bf16-rounded
    into a uint16 y where out_bf16 (a kernel's compile-time constant), else float32. One paired
    store where `pairs` (rows and groups of even length: the pair aligned) and both fall inside."""
    if out_bf16:
        word = bf16x2(v0, v1)
        if pairs and n + 1 < group_rows:
            store_bf16x2(y, t, row0 + n, word)
        else:
            if n < group_rows:
                y[t, row0 + n] = word & 0xFFFF
            if n + 1 < group_rows:
                y[t, row0 + n + 1] = word >> 16
    elif pairs and n + 1 < group_rows:
        store_f32x2(y, t, row0 + n, v0, v1)
    else:
        if n < group_rows:
            y[t, row0 + n] = v0
        if n + 1 < group_rows:
            y[t, row0 + n + 1] = v1
