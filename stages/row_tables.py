"""Address tables: one launch over the tokens of many sequences, each token reading its own
sequence's arrays.

A batched decode step (stages.attention.AttentionStage.forward_batch) runs B sequences' tokens
through one kernel launch per stage, but each sequence keeps its own device arrays (window ring,
compressor state, caches), allocated when it was made. A kernel cannot take a list of arrays, so
it takes an address table instead: uint64 [B, 2], row b = (the device address of sequence b's
array, its row count), and each thread makes the view of its token's array with `u16_rows` /
`u32_rows` / `f32_rows(table, b, cols)` (a C-contiguous [rows, cols] array at that address: no
copy, the same loads as a kernel argument's). The column count is the caller's (every sequence's
array has the same columns; only the row count is the table's).

On the simulator there are no addresses: `table_row` files the array under a number in a registry
(weakly: a freed array leaves it) and the helpers look it up, so the kernels' code is the same.
The table of an array stays valid while the array lives: a sequence's arrays never move.
"""

from __future__ import annotations

import itertools
import weakref

import numpy as np
from numba import types

from flashv41.stages.device import SIM, DeviceArray

if SIM:
    _ARRAYS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
    _KEYS = itertools.count(1)

    def table_row(a: DeviceArray) -> tuple[int, int]:
        """(address, rows) of a C-contiguous device array: here a registry number."""
        key = next(_KEYS)
        _ARRAYS[key] = a
        return key, a.shape[0]

    def u16_rows(table, i, cols):
        """The uint16 [rows, cols] array of table row i."""
        return _ARRAYS[int(table[i, 0])]

    def u32_rows(table, i, cols):
        """Table row i's array as 32-bit words [rows, cols] (a bf16 array's pairs)."""
        return _ARRAYS[int(table[i, 0])].view(np.uint32)

    def f32_rows(table, i, cols):
        return _ARRAYS[int(table[i, 0])]
else:
    from numba.cuda import cgutils  # type: ignore[attr-defined]
    from numba.cuda.extending import intrinsic

    def table_row(a: DeviceArray) -> tuple[int, int]:
        """(device address, rows) of a C-contiguous device array (compile-check mode's stand-ins,
        host arrays whose kernels never run: their host address)."""
        if not a.flags["C_CONTIGUOUS"]:
            raise ValueError(f"table_row: a {a.shape} array that is not C-contiguous")
        interface = getattr(a, "__cuda_array_interface__", None) or a.__array_interface__
        return interface["data"][0], a.shape[0]

    def _rows_at(dtype):
        """An intrinsic (table, i, cols): the C-contiguous [table[i, 1], cols] array of `dtype` at
        device address table[i, 0]."""
        array_type = types.Array(dtype, 2, "C")

        @intrinsic
        def rows_at(typingctx, table, i, cols):
            sig = array_type(table, i, cols)

            def codegen(context, builder, signature, args):
                table_type, i_type, cols_type = signature.args
                rows = context.make_array(table_type)(context, builder, args[0])
                row = context.cast(builder, args[1], i_type, types.intp)

                def entry(j):
                    index = [row, context.get_constant(types.intp, j)]
                    return builder.load(cgutils.get_item_pointer(context, builder, table_type, rows, index))

                address, n_rows = (context.cast(builder, entry(j), table_type.dtype, types.intp) for j in (0, 1))
                cols = context.cast(builder, args[2], cols_type, types.intp)
                item = context.get_data_type(dtype)
                itemsize = context.get_constant(types.intp, context.get_abi_sizeof(item))
                array = context.make_array(array_type)(context, builder)
                context.populate_array(array, data=builder.inttoptr(address, item.as_pointer()),
                                       shape=cgutils.pack_array(builder, [n_rows, cols]),
                                       strides=cgutils.pack_array(builder, [builder.mul(cols, itemsize), itemsize]),
                                       itemsize=itemsize, meminfo=None)
                return array._getvalue()

            return sig, codegen

        return rows_at

    u16_rows = _rows_at(types.uint16)  # (table, i, cols): the uint16 [rows, cols] array of table row i
    u32_rows = _rows_at(types.uint32)  # table row i's array as 32-bit words (a bf16 array's pairs)
    f32_rows = _rows_at(types.float32)


def address_table(arrays: list[DeviceArray]) -> np.ndarray:
    """The host table (uint64 [len, 2]) of these arrays, one row each, in order."""
    return np.array([table_row(a) for a in arrays], dtype=np.uint64).reshape(len(arrays), 2)
