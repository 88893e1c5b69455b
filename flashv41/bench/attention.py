"""Benchmark rows of the attention layers (docs/performance.md P2, M1) at V4.1-Flash dimensions.

- `attention.decode.<type>.<block type>` (P2): one decode step of one layer of each block type (swa,
  kv_index_source_r2, consumer_r2, candidate_source_r1, consumer_r1, candidate_index_source_r1),
  launch cost excluded: the step's launches are queued behind a sleeping kernel, as a replayed
  graph would run them. Bound = the bytes of the weight matrices the step reads (every projection
  of the layer, compressor and indexer included) / the copy bandwidth.
- `attention.decode.<type>.<block type>.graph` (P2): the same step captured once as a CUDA graph
  (flashv41.graphs) and replayed, as the engine's decode runs it.
- `attention.decode.<type>.<block type>.python`: the same steps back to back as Python issues them
  (about 25 launches a layer), what the engine gets without a graph.
- `attention.decode.<type>.<block type>.part.<part>` (Q8_0 and BF16): the step's breakdown. The
  stage marks each part (a product, a norm, the sparse attention, ...; AttentionStage.trace) and an
  event recorded at each mark times the part, queued behind the sleeping kernel, the L2 evicted
  before each step. Bytes and bound are those of the weights the part streams (none: no bound);
  the note gives its share of the parts' sum. The events add about a microsecond a part, so the
  parts sum to a little more than the graph row.

The rows run an AttentionStage sized for max_seq 1,048,576 (MAX_SEQ, V4.1's context: nothing in a
step may cost what max_seq sizes) on the six-layer flash-dimension model (no engram, context
1,048,576) written once into the options' work directory in Q8_0. At position 1023 (the plain
`attention.decode.<type>` rows) the stage is prefilled to it in chunks; at 16383, 65535 and
1,048,575 (`attention.decode.<type>.16k`, `.64k`, `.1m`, Q8_0 and BF16) its rings, compressor
states and caches are filled with random rows instead (`synthetic_state`: prefilling 64k tokens
takes a minute, 1M far longer, and the step's cost does not depend on the values). The positions
are odd, so the ratio-2 kv source completes a group and does its whole work: pooling, index keys,
compressed row. The bound counts the layer's weights plus
the cache bytes the step must read (`cache_bytes`: the window and selected rows it attends, and on
an index source every index key it scores). For another weight type the layer's dense
projections (wq_a, wq_b, wkv, wo_a, wo_b, the indexer's wq_b) are swapped for random stored
blocks of that type before the prefill; the compressor, wk and proj keep the types published
files use. Memory (M1) per layer is in the notes: weights, and the stage's workspaces and one
sequence's state for the whole stack.

L2: a layer's weights are 134.5 MB and up in Q8_0 and 41.5-55 MB in Q2_K (under 4x the
H200's 50 MB L2; a Q2_K layer about fits in it), 253 MB and up in BF16 (past 4x L2). A step
cannot swap in a copy of its weights per call, so every row whose weight bytes are under 4x L2
evicts the L2 before each repetition (the read-only kernel of stages.bandwidth reading 3x L2,
which leaves only clean lines) and times each repetition alone, with its own pair of events:
behind the sleeping kernel, evict, event, step, event, evict, ...; the same for the graph
replays (on the runner's stream) and for the `.python` rows (no sleeping kernel there). The
BF16 rows are timed back to back as before. Each row's JSON `l2` says which.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import numpy as np

from flashv41.bench.core import BenchCase, BenchContext, BenchOptions, BenchRow
from flashv41.bench.engram import random_stored
from flashv41.graphs import GraphRunner
from flashv41.host.quants import GGMLType, ggml_type

DECODE_POSITION = 1023
# odd positions: the ratio-2 source completes a group; the last one is V4.1's 1M context's last position
POSITION_LABELS = {DECODE_POSITION: "1k", 16383: "16k", 65535: "64k", (1 << 20) - 1: "1m"}
MAX_SEQ = 1 << 20  # every row's stage is sized for it: a step's cost must follow the position, not this
LONG_TYPES = ("Q8_0", "BF16")  # the weight types measured at 16k, 64k and 1m too
PREFILL_CHUNK = 256
X_STD = 0.025  # the normed sublayer input's scale
MODEL: dict[str, Any] = dict(vocab=1024, engram_layers=(), context_length=MAX_SEQ)  # Preset overrides
HOLD_S = 0.02  # the sleeping kernel outlasts the queued steps' Python launch time
QUEUED = 4
BREAKDOWNS = {("Q8_0", "1k"), ("BF16", "1k"), ("Q8_0", "64k"), ("Q8_0", "1m")}  # the steps broken down per part


def attention_model(options: BenchOptions):
    """The six-layer flash-dimension model without engram, written once per work directory."""
    import flashv41
    from flashv41.host.synth import write_synthetic

    path = options.workdir / f"flash-attention-Q8_0-ctx{MODEL['context_length']}.gguf"
    if not path.exists():
        write_synthetic(path, "flash", weight_type="Q8_0", **MODEL)
    return flashv41.load_model(path)


def swap_dense(stage, gtype: GGMLType, stream) -> None:
    """Replace every layer's dense projections by random stored blocks of `gtype`, same shapes."""

    from flashv41.stages.linear import DeviceWeight

    rng = np.random.default_rng(int(gtype))

    def random_like(w: DeviceWeight) -> DeviceWeight:
        return DeviceWeight.from_stored(w.name, gtype, random_stored(w.n, w.k, gtype, rng), w.k, stream)

    for layer in stage.layers:
        for name in ("wq_a", "wq_b", "wkv", "wo_a", "wo_b"):
            setattr(layer, name, random_like(getattr(layer, name)))
        if layer.indexer is not None:
            layer.indexer.wq_b = random_like(layer.indexer.wq_b)


def breakdown(ctx: BenchContext, stage, step, layer: int, row: str, nbytes: int, stream) -> list[BenchRow]:
    """`<row>.part.<part>`: each part of the step (AttentionStage.trace names them) timed by the
    events between the marks, with the bytes of the weights it streams and its share of the sum."""

    def traced(mark) -> None:
        stage.trace = mark
        try:
            step()
        finally:
            stage.trace = None

    parts, plan = ctx.parts_time(traced, nbytes, stream)
    total = sum(parts.values())
    weights = stage.part_weights(layer)
    rows = []
    for part, seconds in parts.items():
        part_bytes = sum(w.nbytes for w in weights.get(part, []))
        rows.append(BenchRow(f"{row}.part.{part}", seconds, ctx.memory_bound(part_bytes), bytes=part_bytes,
                             note=f"{100 * seconds / total:.1f}% of the parts' {total * 1e6:.1f} us"
                                  + ("" if part_bytes else "; streams no weight (no bound)"), l2=plan))
    return rows


def synthetic_state(stage, state, position: int, rng: np.random.Generator) -> None:
    """A sequence state as if `position` tokens had been decoded: every ring, compressor state and
    cache row up to the position filled with random values of the cached kinds' scale (the step's
    cost does not depend on them; prefilling 64k tokens through the stack would take a minute)."""
    from flashv41.host.numerics import bf16, to_bits

    for layer in state.layers:
        layer.ring.copy_to_device(to_bits(bf16(rng.standard_normal(layer.ring.shape).astype(np.float32))),
                                  stream=stage.stream)
        src = layer.source
        if src is None:
            continue
        ratio = src.kv_state.shape[0]
        groups = (position + 1) // ratio
        src.kv_state.copy_to_device(rng.standard_normal(src.kv_state.shape).astype(np.float32), stream=stage.stream)
        src.score_state.copy_to_device(rng.standard_normal(src.score_state.shape).astype(np.float32),
                                       stream=stage.stream)
        for cache in (src.compressed, src.index_keys):
            rows = to_bits(bf16(rng.standard_normal((groups, cache.shape[1])).astype(np.float32)))
            cache[:groups].copy_to_device(rows, stream=stage.stream)


def cache_bytes(cfg, role, position: int) -> int:
    """The cache bytes a decode step at `position` must read besides its weights: the window rows,
    the selected compressed rows (ratio > 0) and, on an index source, every index key it scores."""
    rows = min(cfg.window, position + 1)
    if role.ratio > 0:
        rows += min(cfg.index_topk, (position + 1) // role.ratio)
    nbytes = rows * cfg.head_dim * 2
    if role.index_source:
        nbytes += (position + 1) // role.ratio * cfg.index_head_dim * 2
    return nbytes


def decode_case(wtype: str, position: int) -> BenchCase:
    gtype = ggml_type(wtype)
    label = POSITION_LABELS[position]
    name = f"attention.decode.{wtype}" + ("" if position == DECODE_POSITION else f".{label}")

    def run(ctx: BenchContext) -> list[BenchRow]:
        from numba import cuda

        from flashv41.host.numerics import bf16, to_bits
        from flashv41.stages.attention import AttentionStage

        model = attention_model(ctx.options)
        cfg = model.config
        stream = cuda.stream()
        stage = AttentionStage(model, PREFILL_CHUNK, MAX_SEQ, stream=stream)
        state = None
        try:
            if gtype != GGMLType.Q8_0:
                swap_dense(stage, gtype, stream)
            state = stage.new_state()
            rng = np.random.default_rng(4)
            x = cuda.to_device(to_bits(bf16((rng.standard_normal((PREFILL_CHUNK, cfg.dim)) * X_STD)
                                            .astype(np.float32))), stream=stream)
            out = cuda.device_array((PREFILL_CHUNK, cfg.dim), np.uint16, stream=stream)
            if position == DECODE_POSITION:  # a real prefill to the position, in chunks
                for start in range(0, position, PREFILL_CHUNK):
                    n = min(PREFILL_CHUNK, position - start)
                    shared = stage.new_shared()
                    for role in cfg.roles:
                        stage.forward(role.layer, x, out, state, shared, start, n)
            else:
                synthetic_state(stage, state, position - 1, rng)
            shared = stage.new_shared()  # the stack once at the measured position: every source published
            for role in cfg.roles:
                stage.forward(role.layer, x, out, state, shared, position, 1)
            stream.synchronize()
            memory = (f"workspaces {stage.workspace_bytes() / 1e6:.1f} MB, sequence state "
                      f"{state.nbytes() / 1e6:.1f} MB (stack)")
            how = "prefilled" if position == DECODE_POSITION else "synthetic caches"
            rows = []
            runner = GraphRunner()
            for role in cfg.roles:

                def step(layer: int = role.layer) -> None:
                    stage.forward(layer, x, out, state, shared, position, 1)

                weights = stage.weight_bytes(role.layer)
                nbytes = weights + cache_bytes(cfg, role, position)
                bound = ctx.memory_bound(nbytes)
                row = f"{name}.{role.block_type}"
                median, plan = ctx.stage_time(step, nbytes, stream, n=QUEUED, hold_s=HOLD_S)
                rows.append(BenchRow(row, median, bound, bytes=nbytes,
                                     note=f"layer {role.layer}, position {position} ({how}), max_seq {MAX_SEQ}, "
                                          f"launch cost excluded; weights {weights / 1e6:.1f} MB + caches "
                                          f"{(nbytes - weights) / 1e6:.1f} MB; {memory}", l2=plan))
                graph = runner.capture_stages([stage], step)
                try:
                    median, plan = ctx.stage_time(partial(runner.launch, graph, wait=False), nbytes,
                                                  runner.numba_stream, n=QUEUED)
                finally:
                    graph.close()
                rows.append(BenchRow(f"{row}.graph", median, bound, bytes=nbytes,
                                     note="the step as one CUDA graph, replayed", l2=plan))
                if position == DECODE_POSITION:
                    median, plan = ctx.python_time(step, nbytes, stream)
                    rows.append(BenchRow(f"{row}.python", median, bound, bytes=nbytes,
                                         note="from Python, launch cost included", l2=plan))
                if (wtype, label) in BREAKDOWNS:
                    rows += breakdown(ctx, stage, step, role.layer, row, nbytes, stream)
            return rows
        finally:
            if state is not None:
                state.free()
            stage.free()
            model.close()

    return BenchCase(name, run)


def cases(options: BenchOptions) -> list[BenchCase]:
    """One case per weight type: every block type's decode step, device-only and from Python."""
    for wtype in options.weight_types:
        ggml_type(wtype)  # an UnsupportedError naming the supported types for any other
    return [decode_case(w, p) for p in POSITION_LABELS for w in options.weight_types
            if p == DECODE_POSITION or w in LONG_TYPES]
