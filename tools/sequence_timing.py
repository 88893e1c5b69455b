"""Time what a server does with a long sequence's state: fork, checkpoint, truncate, save and load.

    python tools/sequence_timing.py                        # flash preset, a sequence at 64k positions
    python tools/sequence_timing.py --preset flash40       # V4.1-Flash's 40-layer schedule
    python tools/sequence_timing.py --fill prefill         # the state made by a real prefill (minutes)

GPU only. The model is a synthetic preset written once into --workdir (Q8_0 weights, Q2_K engram
tables of 3M rows), or --model. The sequence stands at --position (default max_seq - 8). By default
its state is made synthetically: the history says P tokens were run in calls of max_tokens, the
device state is the zeros a new sequence holds. What the rows time depends on the state's sizes,
not its values (fork and save copy the used part whatever it holds; a truncate's tokens run through
the same kernels), so the figures are those of a real sequence; --fill prefill makes a real one.

Each row is the median wall time of --reps repetitions, synchronised before and after:
- fork: `Sequence.fork()`, a new sequence's allocation and zero fill included, then the copy of the
  used part (every ring and partial group, the caches' rows of the completed groups) and the fork's
  checkpoint; `fork, the copy alone`: the copy into a sequence allocated beforehand;
- checkpoint: what a call of several tokens adds before it runs (rings and partial groups copied);
- verify call, decode step: a call of K + 1 = 5 tokens at the position and one decode step, to set
  the rows below against;
- truncate to the checkpoint: after a verify call, back to where it started (the checkpoint copied
  back, the cache rows and hash history since cleared: a draft rejected whole);
- truncate, 2 tokens run again: after a verify call, back to its first 2 tokens (the restore, then
  one call of 2 tokens: the pending token and one accepted draft token);
- save, load: `Sequence.save` to --workdir (the used part to the host, the .npz written and
  renamed) and `Engine.load_sequence` (read, checked, a new sequence allocated and uploaded).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

K = 4  # drafted tokens a verify call: K + 1 = 5 tokens, the decode step's kernels
TABLE_ROWS = 3_000_000


def timed(fn: Callable[[], object], reps: int, before: Callable[[], object] = lambda: None,
          after: Callable[[object], object] = lambda _: None) -> float:
    """Median seconds of `fn`, each call synchronised on both sides; `before` and `after` (given
    fn's result) run untimed around each."""
    from numba import cuda

    times = []
    for _ in range(reps):
        before()
        cuda.synchronize()
        start = time.perf_counter()
        out = fn()
        cuda.synchronize()
        times.append(time.perf_counter() - start)
        after(out)
    return statistics.median(times)


def fill_synthetic(seq, position: int) -> None:
    """A sequence that says it ran `position` tokens (id 0) in calls of max_tokens; its device state
    stays the zeros of a new one."""
    from flashv41.host.engram_hash import compress_tokens
    from flashv41.host.tokens import Tokens
    from flashv41.sequence_state import History

    engine = seq.engine
    step = engine.max_tokens
    starts = np.arange(0, position, step)
    calls = np.stack([starts, np.minimum(step, position - starts), np.zeros_like(starts)], axis=1)
    ids, mask = np.zeros(position, np.int64), np.ones(position, bool)
    seq.history = History.from_arrays(engine.max_seq, ids, mask, calls)
    if seq.hasher is not None:
        seq.hasher.history[:position] = compress_tokens(engine.cfg.engram, Tokens(ids, None))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--preset", default="flash", help="synthetic preset (default flash; flash40)")
    parser.add_argument("--model", type=Path, help="a model file instead of the preset")
    parser.add_argument("--max-seq", type=int, default=65536, help="the engine's max_seq (default 65536)")
    parser.add_argument("--position", type=int, help="where the sequence stands (default max_seq - 8)")
    parser.add_argument("--fill", choices=("synthetic", "prefill"), default="synthetic")
    parser.add_argument("--reps", type=int, default=9, help="repetitions a row (default 9)")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/flashv41-sequence-timing"))
    args = parser.parse_args(argv)
    position = args.position if args.position is not None else args.max_seq - 8
    if not 1 <= position <= args.max_seq - (K + 1):
        parser.error(f"--position must be 1..max_seq - {K + 1}")

    import flashv41
    from flashv41.host.synth import write_synthetic
    from flashv41.memory import format_bytes
    from flashv41.sequence_state import Checkpoint, copy_used

    args.workdir.mkdir(parents=True, exist_ok=True)
    path = args.model
    if path is None:
        path = args.workdir / f"{args.preset}-sequence-Q8_0.gguf"
        if not path.exists():
            write_synthetic(path, args.preset, weight_type="Q8_0", engram_rows=TABLE_ROWS)
    model = flashv41.load_model(path)
    try:
        with flashv41.Engine(model, max_seq=args.max_seq, max_tokens=256) as engine:
            cfg = engine.cfg
            rng = np.random.default_rng(0)
            seq = engine.new_sequence()
            if args.fill == "prefill":
                seq.prefill(rng.integers(0, cfg.vocab_size, position))
            else:
                fill_synthetic(seq, position)
            used = engine.sequence_bytes(position)
            host = position * 8 if cfg.engram is not None else 0
            device = used - host
            stream = engine.attention.stream
            print(f"model: {path.name} ({cfg.describe()}); max_seq {args.max_seq}, sequence at {position} "
                  f"({args.fill}); used state {format_bytes(device)} on the device + {format_bytes(host)} of hash "
                  f"history; a checkpoint {format_bytes(engine.checkpoint_bytes())}; median of {args.reps}")
            rows: list[tuple[str, float, str]] = []

            def row(name: str, seconds: float, note: str = "") -> None:
                rows.append((name, seconds, note))

            def rate(nbytes: int, seconds: float) -> str:
                return f"{format_bytes(nbytes)} read + written, {2 * nbytes / seconds / 1e9:.0f} GB/s"

            s = timed(seq.fork, args.reps, after=lambda f: f.release())
            row("fork", s, "allocation, zero fill, copy, checkpoint")
            target = engine.new_sequence()
            s = timed(lambda: copy_used(seq.state, target.state, position, stream), args.reps)
            row("fork, the copy alone", s, rate(device, s))
            target.release()
            checkpoint = Checkpoint(seq.state)
            s = timed(lambda: checkpoint.take(seq.state, position, stream), args.reps)
            row("checkpoint", s, rate(engine.checkpoint_bytes(), s))
            draft = rng.integers(0, cfg.vocab_size, K + 1)
            seq.prefill(draft)  # compiles, and leaves the checkpoint at the position
            seq.truncate(position)
            s = timed(lambda: seq.prefill(draft), args.reps, after=lambda _: seq.truncate(position))
            row("verify call", s, f"{K + 1} tokens")
            s = timed(lambda: seq.decode(int(draft[0])), args.reps, after=lambda _: seq.truncate(position))
            row("decode step", s)
            s = timed(lambda: seq.truncate(position), args.reps, before=lambda: seq.prefill(draft))
            row("truncate to the checkpoint", s, "restore only")
            s = timed(lambda: seq.truncate(position + 2), args.reps, before=lambda: seq.prefill(draft),
                      after=lambda _: seq.truncate(position))
            row("truncate, 2 tokens run again", s, "restore + one call of 2 tokens")
            saved = args.workdir / "sequence.npz"
            s = timed(lambda: seq.save(saved), args.reps)
            size = saved.stat().st_size
            row("save", s, f"{format_bytes(size)} file, {size / s / 1e9:.2f} GB/s")
            s = timed(lambda: engine.load_sequence(saved), args.reps, after=lambda loaded: loaded.release())
            row("load", s, f"{size / s / 1e9:.2f} GB/s")
            saved.unlink()
            print("rows (median wall time):")
            for name, seconds, note in rows:
                print(f"  {name} {'.' * (30 - len(name))} {seconds * 1e3:10.3f} ms  {note}")
            seq.release()
    finally:
        model.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
