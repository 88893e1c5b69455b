"""The token embedding with coalesced stores (issue 44; not in the package until it has run on a
GPU and won).

stages.hyper's embed kernel gives each thread one 32-value chunk of a token's row: it dequantises
the chunk and writes its 32 values into each of the hc copies, so a warp's store instruction
touches 32 rows' worth of 128-byte lines 128 bytes apart. On the 32k prefill (H100, seventh
session) the embedding part took 52.8 ms of the events' 1.90 s (64 chunks: 825 us each, the ids'
upload included), where writing a 512-token chunk's highway (4 x 5120 fp32, 42 MB) takes 14 us.

Here a block's threads dequantise their chunks into shared memory (bf16-rounded, as the stage
does), then write the block's values out with consecutive threads on consecutive values: each
warp store is one 128-byte line a copy. The values are the stage kernel's, bit for bit
(dev/test_embed_rows.py checks it against the stage and the oracle); `python -m
dev.test_embed_rows` times the two.
"""

from __future__ import annotations

from functools import cache

from numba import cuda, float32, int32

from flashv41.stages.device import CHUNK, SIM, bf16_round, jit_kernel
from flashv41.stages.linear import DeviceWeight

THREADS = 4 if SIM else 128  # chunks a block dequantises (4,096 values on the GPU; the simulator:
# two blocks of the small preset's rows)
PITCH = CHUNK + 1  # a chunk's values in shared memory, one word of padding: no bank conflicts
SHARED_VALUES = THREADS * PITCH


@cache
def embed_rows_kernel(dequant):
    """h[t, c, :] = bf16(dequant(table[ids[t]])) for every copy c; grid (ceil(chunks / THREADS), T),
    block THREADS."""

    @jit_kernel((THREADS, 1))
    def embed_rows(ids, table, h, n_tokens, hc, chunks):
        t = cuda.blockIdx.y
        first = cuda.blockIdx.x * THREADS
        tid = cuda.threadIdx.x
        vals = cuda.shared.array(SHARED_VALUES, float32)
        buf = cuda.local.array(CHUNK, float32)
        if t < n_tokens and first + tid < chunks:
            dequant(table, int32(ids[t]), first + tid, buf)
            for i in range(CHUNK):
                vals[tid * PITCH + i] = bf16_round(buf[i])
        cuda.syncthreads()
        if t < n_tokens:
            n = min(THREADS, chunks - first) * CHUNK
            base = first * CHUNK
            for j in range(tid, n, THREADS):
                v = vals[(j // CHUNK) * PITCH + j % CHUNK]
                for c in range(hc):
                    h[t, c, base + j] = v

    return embed_rows


def embed_rows(ids, table: DeviceWeight, h, n_tokens: int, stream=0) -> None:
    """h[:n_tokens, c, :] = the bf16-rounded embedding rows of the uploaded ids (int64 [>= T]) for
    every copy c of h [>= T, hc, C]; stages.hyper.HyperStage.embed_uploaded's arguments, apart."""
    if h.shape[2] != table.k or n_tokens > min(h.shape[0], ids.shape[0]):
        raise ValueError(f"embed_rows {table.name}: h {h.shape}, ids {ids.shape}, rows of {table.k}, "
                         f"{n_tokens} tokens")
    if n_tokens == 0:
        return
    chunks = table.k // CHUNK
    embed_rows_kernel(table.dequant)[((chunks + THREADS - 1) // THREADS, n_tokens), THREADS, stream](
        ids, table.data, h, n_tokens, h.shape[1], chunks)
