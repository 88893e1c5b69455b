"""Benchmark rows of the whole stack's decode step (docs/performance.md P4, M1) at V4.1-Flash dimensions.

Two stacks, each a case of its own, each written once into the options' work directory (Q8_0
weights, Q2_K engram tables of TABLE_ROWS rows) and run in an Engine: a prompt of PROMPT tokens,
a few decode steps so that every graph key has its graph, then the rows below.
- `stack.decode` (rows `stack.decode.graph`, `stack.decode.python`, `stack.memory`): the flash
  preset, its six-layer schedule (every block type) with two engram layers (2.4 GB of file).
- `stack.decode.40` (rows `stack.decode.40.graph`, `stack.decode.40.python`, `stack.memory.40`):
  the flash40 preset, V4.1-Flash's real 40-layer schedule (2 window layers, ratio-2 and ratio-1
  blocks, 4 kv sources, 8 index sources, the candidate source, engram before layers 1 and 14;
  host.synth.FLASH40_SCHEDULE): 7.2 GB of file, drawn in the stored format (49 s to write on two
  cores), about 6 GB a step streams.
`--rows stack.decode` picks the six-layer stack, `--rows stack.decode.40` the 40-layer one,
`--rows 'stack.*'` both (and the batch rows below).

`stack.decode.batch` (P7, issue 19; rows `stack.decode.batch.<B>` for B in BATCHES): the flash40
stack stepping B sequences together (`Engine.decode_batch`), each prefilled with BATCH_PROMPT +
(its index mod BATCH_SPREAD) tokens of its own, so the rows of a step sit at different positions.
Wall clock of a whole step as a user makes it (the hash, uploads, the batch's graph replayed, the
download), the median of --reps steps after the warm-up calls that capture the graph; bound = the step's
weight bytes once + every sequence's cache bytes (window rows, selected compressed rows, index
keys, as the attention rows count them, at its position) and engram rows, at the copy
bandwidth. The note gives tokens per second (B tokens a step) and the step time against B = 1's.

The rows of each:
- `.graph` (P4): the device time of one decode step's graph, replayed (launch cost excluded).
  Bound = the bytes a step must stream (every layer's attention weights, the engram wkv and the
  token's table rows, the hc mixes' weights) / the copy bandwidth. The note gives tokens per
  second (one token a step).
- `.python` (P4): whole `Sequence.decode` calls as a user makes them (hash, uploads, the graph,
  the highway download), wall clock, the median of --reps calls made after the memory check's
  steps; the note gives tokens per second.
- `stack.memory` (M1): device memory per part (weights per layer, workspaces, one sequence's
  state) in the note, and the driver's free-memory figure across DECODE_STEPS graph-replayed
  steps: the bytes the steps allocated (`bytes`; 0 is the target). Not a timing: no ratio.

L2: a step streams about 1.1 GB (six layers) or 6 GB (40 layers), far past 4x the H200's L2,
so both timings run as they are and their JSON `l2` says "read from HBM". Should a step's bytes
ever fall under 4x L2 (a smaller model), the graph row evicts the L2 between replays (each replay
timed alone with its own events) and the python row evicts it, untimed, before each call; the
JSON says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from flashv41.bench.core import BenchCase, BenchContext, BenchOptions, BenchRow
from flashv41.memory import device_free_bytes

PROMPT = 512  # prefill tokens before the steps: two chunks of 256, quick on 40 layers too
BATCHES = (1, 8, 32, 64, 128)  # stack.decode.batch's batch sizes
BATCH_PROMPT = 64  # each batched sequence's prompt, plus its index modulo BATCH_SPREAD
BATCH_SPREAD = 8
DECODE_STEPS = 32
TABLE_ROWS = 3_000_000


@dataclass(frozen=True)
class Stack:
    """One stack the rows run: its case name, the synthetic preset, the suffix its row names take
    (`stack.decode{suffix}.graph`, `stack.memory{suffix}`) and its model file in the work directory."""

    case: str
    preset: str
    suffix: str
    filename: str


STACKS = (
    Stack("stack.decode", "flash", "", "flash-stack-Q8_0.gguf"),
    Stack("stack.decode.40", "flash40", ".40", "flash40-stack-Q8_0.gguf"),
)


class ModelFile(Protocol):
    """What stack_model writes a model from: a synthetic preset's name and the file's name."""

    @property
    def preset(self) -> str: ...

    @property
    def filename(self) -> str: ...


def stack_model(options: BenchOptions, stack: ModelFile = STACKS[0], **overrides: Any):
    """The stack's model (anything with a synthetic `preset` and a `filename`), written into the work
    directory the first time: Q8_0 weights, Q2_K engram tables of TABLE_ROWS rows, and `overrides`
    of host.synth.write_synthetic's keywords (the prefill rows' longer context)."""
    import flashv41
    from flashv41.host.synth import write_synthetic

    path = options.workdir / stack.filename
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        write_synthetic(path, stack.preset, weight_type="Q8_0", engram_rows=TABLE_ROWS, **overrides)
    return flashv41.load_model(path)


def step_bytes(engine) -> int:
    """What one decode step streams: attention weights, engram wkv and rows, hc mix weights."""
    cfg = engine.cfg
    total = sum(engine.attention.weight_bytes(role.layer) for role in cfg.roles)
    if engine.engram is not None:
        for w in engine.engram.layers.values():
            total += w.wkv.nbytes + engine.engram.cols * w.table.row_bytes
    total += sum(per[kind][0].nbytes for per in engine.hyper.layers for kind in ("attn", "ffn"))
    return total


def stack_case(stack: Stack = STACKS[0]) -> BenchCase:
    def run(ctx: BenchContext) -> list[BenchRow]:
        import flashv41

        model = stack_model(ctx.options, stack)
        o = ctx.options
        steps = 8 + DECODE_STEPS + o.warmup + o.reps  # every decode call below
        try:
            with flashv41.Engine(model, max_seq=PROMPT + max(256, steps + 8), max_tokens=256) as engine:
                rows = measure(ctx, model, engine, steps)
        finally:
            model.close()
        return rows

    def measure(ctx: BenchContext, model, engine, steps: int) -> list[BenchRow]:
        if not engine.graphs:
            raise RuntimeError("bench: CUDA graphs are unavailable on this machine")
        seq = engine.new_sequence()
        tokens = np.random.default_rng(6).integers(0, model.config.vocab_size, PROMPT + steps)
        seq.prefill(tokens[:PROMPT])
        ids = iter(tokens[PROMPT:])
        for _ in range(8):  # every key seen twice: its graph is captured
            seq.decode(int(next(ids)))
        before = device_free_bytes()
        for _ in range(DECODE_STEPS):
            seq.decode(int(next(ids)))
        allocated = before - device_free_bytes()
        nbytes = step_bytes(engine)
        bound = ctx.memory_bound(nbytes)
        per_token, python_plan = ctx.wall_time(lambda: seq.decode(int(next(ids))), nbytes)
        graph = seq.graphs[engine.graph_key(seq.position, False)]
        runner = engine._runner
        assert runner is not None
        median, plan = ctx.stage_time(lambda: runner.launch(graph, wait=False), nbytes, runner.numba_stream,
                                      n=4, hold_s=0.05)
        layers = len(model.config.roles)
        weights = ", ".join(f"{r.layer}:{engine.attention.weight_bytes(r.layer) / 1e6:.0f}"
                            for r in model.config.roles)
        engram = engine.engram.device_bytes if engine.engram is not None else 0
        memory = (f"attention weights MB by layer {weights}; engram (tables, wkv, workspaces) "
                  f"{engram / 1e6:.0f} MB; attention workspaces {engine.attention.workspace_bytes() / 1e6:.1f} "
                  f"MB; sequence state {seq.state.nbytes() / 1e6:.1f} MB")
        seq.release()
        s = stack.suffix
        return [BenchRow(f"stack.decode{s}.graph", median, bound, bytes=nbytes,
                         note=f"{layers} layers + engram, one step's graph replayed: {1 / median:.0f} tokens/s "
                              f"(one token a step)", l2=plan),
                BenchRow(f"stack.decode{s}.python", per_token, bound, bytes=nbytes,
                         note=f"{layers} layers, Sequence.decode wall clock: {1 / per_token:.0f} tokens/s",
                         l2=python_plan),
                BenchRow(f"stack.memory{s}", 0.0, 0.0, bytes=allocated,
                         note=f"{allocated} bytes allocated over {DECODE_STEPS} decode steps; {memory}")]

    return BenchCase(stack.case, run)


def batch_case() -> BenchCase:
    def run(ctx: BenchContext) -> list[BenchRow]:
        import flashv41
        from flashv41.bench.attention import cache_bytes

        model = stack_model(ctx.options, STACKS[1])
        cfg = model.config
        o = ctx.options
        steps = o.warmup + o.reps + 1
        rng = np.random.default_rng(9)
        rows: list[BenchRow] = []
        try:
            with flashv41.Engine(model, max_seq=BATCH_PROMPT + BATCH_SPREAD + steps + 8,
                                 max_tokens=max(BATCHES)) as engine:
                weights = step_bytes(engine)
                engram_rows = 0 if engine.engram is None else sum(
                    engine.engram.cols * w.table.row_bytes for w in engine.engram.layers.values())
                first = 0.0
                for b in BATCHES:
                    seqs = [engine.new_sequence() for _ in range(b)]
                    for i, seq in enumerate(seqs):  # at different positions: groups complete in some rows only
                        seq.prefill(rng.integers(0, cfg.vocab_size, BATCH_PROMPT + i % BATCH_SPREAD))
                    position = BATCH_PROMPT + o.warmup  # about where the timed steps run
                    per_seq = sum(cache_bytes(cfg, role, position) for role in cfg.roles) + engram_rows
                    nbytes = weights - engram_rows + b * per_seq

                    def step(seqs=seqs, b=b) -> None:
                        engine.decode_batch(seqs, rng.integers(0, cfg.vocab_size, b))

                    median, plan = ctx.wall_time(step, nbytes)
                    first = first or median
                    rows.append(BenchRow(f"stack.decode.batch.{b}", median, ctx.memory_bound(nbytes), bytes=nbytes,
                                         note=f"{len(cfg.roles)} layers, {b} sequences a step (decode_batch, "
                                              f"{'graph' if engine.graphs else 'eager'}, positions "
                                              f"{BATCH_PROMPT}..{BATCH_PROMPT + min(b, BATCH_SPREAD) - 1}): "
                                              f"{b / median:.0f} tokens/s, {median / first:.2f}x the 1-sequence step",
                                         l2=plan))
                    for seq in seqs:
                        seq.release()
        finally:
            model.close()
        return rows

    return BenchCase("stack.decode.batch", run)


def cases(options: BenchOptions) -> list[BenchCase]:
    return [stack_case(stack) for stack in STACKS] + [batch_case()]
