"""Prefill a prompt, then a loop of decode steps, timed: milliseconds per step, tokens per second and
where a step's time goes, stage by stage. Then the sequence is released and the engine closed.

    python examples/decode_loop.py                          # the built-in tiny model
    python examples/decode_loop.py --model model.gguf       # any DeepSeek-V4.1 GGUF
    python examples/decode_loop.py --steps 64 --no-profile  # throughput without stage timing

Without a GPU the kernels run on Numba's CUDA simulator: with the defaults on the tiny model, a
prefill of 8-15 s and 1.5-3 s a step, about 20-40 s in all on two cores (the more the machine is
shared, the longer); simulator times say nothing about a GPU's. Progress shows on stderr. This example
times the layers with a zero FFN output and reads no logits: each step feeds the next of a seeded
random token stream, the same as `flashv41 run` (examples/generate.py samples greedy tokens).

The prefill, the engine's first call, includes compiling the kernels on a GPU (tens of seconds),
and the first decode step compiles the one-token ones, so that step is timed on its own; the steps
after it give the steady-state figures. With stage timing on (the default, `Engine(profile=True)`),
every stage runs between two device synchronisations, which adds a little to each step; the stage
table covers the steady-state steps only.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

import flashv41
from flashv41.cli import guarded
from flashv41.host.progress import Progress
from flashv41.runner import backend_description, open_model, prefill_progress, random_tokens, stage_table


def report(step_s: list[float], position: int, stage_seconds: dict[str, float] | None) -> None:
    """Print the decode timings: the first step alone, then the steady state and its stages."""
    print(f"decode: first step {step_s[0] * 1e3:.2f} ms at position {position} (on a GPU it compiles the "
          "one-token kernels)")
    steady = step_s[1:] or step_s
    mean = statistics.fmean(steady)
    n = len(steady)
    print(f"decode: {n} step{'s' if n != 1 else ''}, {mean * 1e3:.2f} ms per step (median "
          f"{statistics.median(steady) * 1e3:.2f}, min {min(steady) * 1e3:.2f}, max {max(steady) * 1e3:.2f}), "
          f"{1 / mean:.1f} tokens/s"
          + (" with stage timing on" if stage_seconds is not None else ""))
    if stage_seconds is not None:
        print(f"stage times per decode step (mean of {n}):")
        for line in stage_table({name: sec / n for name, sec in stage_seconds.items()}):
            print(line)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="a DeepSeek-V4.1 GGUF (default: the built-in tiny model)")
    parser.add_argument("--prompt-len", type=int, default=8, help="prompt tokens (default 8)")
    parser.add_argument("--steps", type=int, default=8, help="decode steps (default 8)")
    parser.add_argument("--max-tokens", type=int, default=256, help="tokens per forward call, the prefill's "
                        "chunk size (default 256)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random tokens (default 0)")
    parser.add_argument("--no-profile", action="store_true", help="no per-stage timing (no extra synchronisation)")
    args = parser.parse_args(argv)
    if args.prompt_len < 1 or args.steps < 1 or args.max_tokens < 1:
        parser.error("--prompt-len, --steps and --max-tokens must be at least 1")

    # a small model launches small grids, and on a GPU Numba warns about each one's occupancy
    warnings.filterwarnings("ignore", message=".*GPU under-utilization")
    print(f"kernels on: {backend_description()}")  # before anything slow: the simulator takes seconds a step
    model = open_model(args.model)
    try:
        cfg = model.config
        prompt = random_tokens(cfg.vocab_size, args.prompt_len, args.seed, 0)
        tokens = random_tokens(cfg.vocab_size, args.steps, args.seed, 1)
        max_seq = prompt.size + tokens.size
        print(f"model: {model.path} ({cfg.describe()})")
        engine = flashv41.Engine(model, max_seq=max_seq, max_tokens=min(args.max_tokens, max_seq),
                                 profile=not args.no_profile)
        try:
            seq = engine.new_sequence()
            with prefill_progress(engine, prompt.size):  # on stderr, layer by layer
                start = time.perf_counter()
                seq.prefill(prompt)
                prefill_s = time.perf_counter() - start
            print(f"prefill: {prompt.size} tokens in {prefill_s * 1e3:.1f} ms ({prompt.size / prefill_s:.1f} tokens/s; "
                  "on a GPU the first call compiles the kernels)")

            engine.stage_seconds.clear()  # the stage table covers decode steps only
            step_s = []
            with Progress("decode", tokens.size, "step", "steps") as progress:  # on stderr, outside the timing
                for i, token in enumerate(tokens):
                    if i == 1:
                        engine.stage_seconds.clear()  # and only the steady-state ones when there are any
                    start = time.perf_counter()
                    h = seq.decode(int(token))  # [1, hc, dim]: its download waits for the step to finish
                    step_s.append(time.perf_counter() - start)
                    progress.update()
            report(step_s, prompt.size, engine.stage_seconds if engine.profile else None)
            print(f"final highway [{', '.join(str(n) for n in h.shape)}] at position {seq.position - 1}")
            seq.release()  # frees the sequence's caches; the engine could start another
        finally:
            engine.close()  # frees every remaining sequence and the engine's device memory
        print(f"released the sequence (released={seq.released}) and closed the engine (closed={engine.closed})")
    finally:
        model.close()
    return 0


if __name__ == "__main__":
    # errors as the flashv41 command shows them: a missing or bad model file is one line (exit 2)
    sys.exit(guarded("decode_loop.py", main))
