"""Shared pieces of the reliability tests (tests/test_reliability_*.py, tests/test_long_run.py).

TWO_LAYER_TINY: the tiny preset cut to two layers (a ratio-2 kv + index source and a ratio-1
candidate source, both with engram; window 4; 32-value engram rows in Q8_0 tables), for the tests
that make many engine calls. On the simulator its decode step costs about 1 s where the full
six-layer tiny's costs about 2.5 s (measured on two cores: the engram projection of 256-value
Q2_K rows is a 160 x 512 gemv, ~1 s a layer under the simulator), and a window of 4 wraps twice
as often. It keeps what the error paths and the long runs need: the engram hash with unmapped
raw ids (the stub map's last two, 126 and 127) and masked tokens, both compressor ratios, the
indexer and the candidate blocks.
"""

from __future__ import annotations

import gc

import numpy as np

from flashv41.memory import device_free_bytes

TWO_LAYER_TINY = dict(compress_ratios=(2, 1), kv_sources=(0, 1), index_sources=(0, 1), candidate_source=1,
                      engram_layers=(0, 1), engram_head_dim=32, table_type="Q8_0", window=4, context_length=4096)
UNMAPPED = (126, 127)  # the tiny stub token map leaves its last two raw ids unmapped (-1)


def live_device_bytes() -> int:
    """Bytes of device memory that live Python objects still hold, on the CUDA simulator: every
    simulated device array's underlying NumPy buffer, counted once however many views share it
    (the simulator has no driver figure: its get_memory_info reports infinity)."""
    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

    gc.collect()
    buffers: dict[int, int] = {}
    for obj in gc.get_objects():
        if isinstance(obj, FakeCUDAArray):
            base = obj._ary
            while isinstance(base.base, np.ndarray):
                base = base.base
            buffers[id(base)] = int(base.nbytes)
    return sum(buffers.values())


def free_device_bytes() -> int:
    """The driver's free device memory on a real GPU, after numba's deferred frees are flushed."""
    gc.collect()
    return device_free_bytes()
