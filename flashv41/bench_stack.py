"""Benchmark rows of the whole stack's decode step (PERF.md P4, M1) at V4.1-Flash dimensions.

The flash preset (its six-layer schedule, two engram layers, Q8_0 weights, a Q2_K engram table),
written once into the options' work directory, runs in an Engine: a prompt of PROMPT tokens, a
few decode steps so that every graph key has its graph, then:
- `stack.decode.graph` (P4): the device time of one decode step's graph, replayed (launch cost
  excluded). Bound = the bytes a step must stream (every layer's attention weights, the engram
  wkv and the token's table rows, the hc mixes' weights) / the copy bandwidth.
- `stack.decode.python` (P4): whole `Sequence.decode` calls as a user makes them (hash, uploads,
  the graph, the highway download), wall clock; the note gives tokens per second.
- `stack.memory` (M1): device memory per part (weights per layer, workspaces, one sequence's
  state) in the note, and the driver's free-memory figure across DECODE_STEPS graph-replayed
  steps: the bytes the steps allocated (`bytes`; 0 is the target). Not a timing: no ratio.
"""

from __future__ import annotations

import time

import numpy as np

from flashv41.bench import BenchCase, BenchContext, BenchOptions, BenchRow, device_time
from flashv41.memory import device_free_bytes

PROMPT = 512
DECODE_STEPS = 32
TABLE_ROWS = 3_000_000


def stack_model(options: BenchOptions):
    import flashv41
    from host.synth import write_synthetic

    path = options.workdir / "flash-stack-Q8_0.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        write_synthetic(path, "flash", weight_type="Q8_0", engram_rows=TABLE_ROWS)
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


def stack_case() -> BenchCase:
    def run(ctx: BenchContext) -> list[BenchRow]:
        import flashv41

        model = stack_model(ctx.options)
        o = ctx.options
        with flashv41.Engine(model, max_seq=PROMPT + 256, max_tokens=256) as engine:
            if not engine.graphs:
                raise RuntimeError("bench: CUDA graphs are unavailable on this machine")
            seq = engine.new_sequence()
            ids = np.random.default_rng(6).integers(0, model.config.vocab_size, PROMPT + 200)
            seq.prefill(ids[:PROMPT])
            for i in range(8):  # every key seen twice: its graph is captured
                seq.decode(int(ids[PROMPT + i]))
            before = device_free_bytes()
            start = time.perf_counter()
            for i in range(DECODE_STEPS):
                seq.decode(int(ids[PROMPT + 8 + i]))
            per_token = (time.perf_counter() - start) / DECODE_STEPS
            allocated = before - device_free_bytes()
            graph = seq.graphs[engine.graph_key(seq.position, False)]
            runner = engine._runner
            assert runner is not None
            median = device_time(lambda: runner.launch(graph, wait=False), o.reps, o.warmup, runner.numba_stream,
                                 n=4, hold_s=0.05)
            nbytes = step_bytes(engine)
            bound = ctx.memory_bound(nbytes)
            layers = len(model.config.roles)
            weights = ", ".join(f"{r.layer}:{engine.attention.weight_bytes(r.layer) / 1e6:.0f}"
                                for r in model.config.roles)
            engram = engine.engram.device_bytes if engine.engram is not None else 0
            memory = (f"attention weights MB by layer {weights}; engram (tables, wkv, workspaces) "
                      f"{engram / 1e6:.0f} MB; attention workspaces {engine.attention.workspace_bytes() / 1e6:.1f} "
                      f"MB; sequence state {seq.state.nbytes() / 1e6:.1f} MB")
            seq.release()
        return [BenchRow("stack.decode.graph", median, bound, bytes=nbytes,
                         note=f"{layers} layers + engram, one step's graph replayed; {1 / median:.0f} steps/s"),
                BenchRow("stack.decode.python", per_token, bound, bytes=nbytes,
                         note=f"Sequence.decode wall clock: {1 / per_token:.0f} tokens/s"),
                BenchRow("stack.memory", 0.0, 0.0, bytes=allocated,
                         note=f"{allocated} bytes allocated over {DECODE_STEPS} decode steps; {memory}")]

    return BenchCase("stack.decode", run)


def cases(options: BenchOptions) -> list[BenchCase]:
    return [stack_case()]
