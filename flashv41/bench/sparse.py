"""Benchmark rows of the sparse attention alone, each kernel family beside the others, at the flash
shape (64 heads x 512 dims, the rope on the last 64, a window of 128 and the top 512 of 2048
compressed rows: 640 entries a query).

- `sparse.prefill.fused.<T>`: sparse_attention of a prefill chunk of T = 64 or 512 tokens (the
  engine's chunk) through the engine's workspace, on the fused kernel (the GPU's default past eight
  tokens).
- `sparse.batch.<cores>.<B>`: sparse_attention_tables of a batched decode step of B = 16, 32, 64
  and 128 sequences, each with its own ring and compressed rows, on the fused kernel (a batch's
  default past eight); and of B = 1, 2, 4 and 8 (a sequence's decode step, and the batches whose
  steps keep each sequence's bits alone) on the split path's CUDA cores (their default) and on the
  fused kernel: the figures behind split_cores' choice (on an H100, 2026-12-07: the CUDA cores
  faster up to 4, the fused kernel 1.4x at 8, where the CUDA cores stay for the bits). The split
  path's tensor cores, which the fused kernel displaced, had rows here until then (1.4-4.5x the
  fused kernel's time at 16-128 steps, 4.0-4.2x in a prefill chunk).

Bound: the products' FLOPs (2 x 2 x heads x D a query and entry) at the tensor cores' bf16 peak
(PEAK_TFLOPS): the ratio says how far from the tensor cores a kernel is. The rows, every query's
entries and the outputs are under 4x L2 only for the smallest rows; the L2 plan is the usual one.
"""

from __future__ import annotations

import numpy as np

from flashv41.bench.core import PEAK_TFLOPS, BenchCase, BenchContext, BenchOptions, BenchRow

HEADS, DIM, ROPE, WINDOW, GROUPS, SELECTED = 64, 512, 64, 128, 2048, 512
PREFILL_TOKENS = (64, 512)
BATCHES = (16, 32, 64, 128)
SMALL_BATCHES = (1, 2, 4, 8)  # up to SPLIT_MAX_TOKENS: the split path's CUDA cores by default
SMALL_CORES = ("cuda", "fused")


def _bf16_rows(rng: np.random.Generator, shape: tuple[int, ...]):
    from numba import cuda

    from flashv41.host.numerics import bf16, to_bits

    return cuda.to_device(to_bits(bf16(rng.standard_normal(shape).astype(np.float32))))


def _inputs(rng: np.random.Generator, positions: np.ndarray):
    """q for the queries at `positions`, the positions, each query's selection of SELECTED distinct
    groups, the sinks and a RoPE table (device arrays)."""
    from numba import cuda

    t = len(positions)
    q = _bf16_rows(rng, (t, HEADS, DIM))
    selection = np.stack([np.sort(rng.choice(GROUPS, SELECTED, replace=False)) for _ in range(t)]).astype(np.int32)
    sinks = cuda.to_device(rng.standard_normal(HEADS).astype(np.float32))
    angle = rng.uniform(-np.pi, np.pi, (int(positions.max()) + 1, ROPE // 2))
    cos, sin = (cuda.to_device(f(angle).astype(np.float32)) for f in (np.cos, np.sin))
    return q, cuda.to_device(positions.astype(np.int32)), cuda.to_device(selection), sinks, cos, sin


def _row(name: str, median: float, t: int, plan, what: str) -> BenchRow:
    flops = 4 * t * HEADS * (WINDOW + SELECTED) * DIM
    bound = flops / (PEAK_TFLOPS * 1e12)
    return BenchRow(name, median, bound, flops=flops, l2=plan,
                    note=f"{what}, {HEADS} heads x {DIM}, {WINDOW + SELECTED} entries: "
                         f"{flops / median / 1e12:.1f} TFLOP/s")


def prefill_case(cores: str, t: int) -> BenchCase:
    name = f"sparse.prefill.{cores}.{t}"

    def run(ctx: BenchContext) -> list[BenchRow]:
        from numba import cuda

        from flashv41.stages.sparse_attention import SPLIT_BATCH_TOKENS, SparseWorkspace, sparse_attention

        rng = np.random.default_rng(3)
        # from 3 windows in: the first queries' windows reach into the ring
        q, positions, selection, sinks, cos, sin = _inputs(rng, 3 * WINDOW + np.arange(t))
        ring, chunk, comp = (_bf16_rows(rng, (n, DIM)) for n in (WINDOW, t, GROUPS))
        out = cuda.device_array((t, HEADS, DIM), np.uint16)
        ws = SparseWorkspace.allocate(t, HEADS, DIM, WINDOW + SELECTED, most=SPLIT_BATCH_TOKENS)
        stream = cuda.stream()

        def step() -> None:
            sparse_attention(q, ring, chunk, comp, positions, selection, sinks, DIM ** -0.5, cos, sin, out, t,
                             stream, workspace=ws, cores=cores)

        data = 2 * (2 * t * HEADS * DIM + (WINDOW + t + GROUPS) * DIM)
        median, plan = ctx.stage_time(step, data, stream)
        return [_row(name, median, t, plan, f"a prefill chunk of {t} tokens, {cores}")]

    return BenchCase(name, run)


def batch_case(cores: str, b: int) -> BenchCase:
    name = f"sparse.batch.{cores}.{b}"

    def run(ctx: BenchContext) -> list[BenchRow]:
        from numba import cuda

        from flashv41.stages.row_tables import address_table
        from flashv41.stages.sparse_attention import SPLIT_BATCH_TOKENS, SparseWorkspace, sparse_attention_tables

        rng = np.random.default_rng(4)
        # each sequence at its own position, past its 2048 groups' (a ratio of 4)
        q, positions, selection, sinks, cos, sin = _inputs(rng, rng.integers(4 * GROUPS, 5 * GROUPS, b))
        rings = [_bf16_rows(rng, (WINDOW, DIM)) for _ in range(b)]
        comps = [_bf16_rows(rng, (GROUPS, DIM)) for _ in range(b)]
        chunk = _bf16_rows(rng, (b, DIM))
        ring_table, comp_table = (cuda.to_device(address_table(a)) for a in (rings, comps))
        out = cuda.device_array((b, HEADS, DIM), np.uint16)
        ws = SparseWorkspace.allocate(b, HEADS, DIM, WINDOW + SELECTED, most=SPLIT_BATCH_TOKENS)
        stream = cuda.stream()

        def step() -> None:
            sparse_attention_tables(q, ring_table, chunk, comp_table, positions, selection, WINDOW, sinks,
                                    DIM ** -0.5, cos, sin, out, b, stream, workspace=ws, cores=cores)

        data = 2 * (2 * b * HEADS * DIM + b * (WINDOW + SELECTED) * DIM)
        median, plan = ctx.stage_time(step, data, stream)
        return [_row(name, median, b, plan, f"a batched decode step of {b} sequences, {cores}")]

    return BenchCase(name, run)


def cases(options: BenchOptions) -> list[BenchCase]:
    return [*(prefill_case("fused", t) for t in PREFILL_TOKENS),
            *(batch_case(c, b) for b in SMALL_BATCHES for c in SMALL_CORES),
            *(batch_case("fused", b) for b in BATCHES)]
