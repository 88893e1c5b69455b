"""Hold the engine to the NumPy oracle layer by layer: a prefill and a few decode steps, every call
compared with `flashv41.check.compare_call`, one table row per layer and call. Exits 1 if any layer
disagrees beyond the bounds in flashv41/check.py.

    python examples/compare_oracle.py                      # the built-in tiny model
    python examples/compare_oracle.py --model model.gguf   # any DeepSeek-V4.1 GGUF
    python examples/compare_oracle.py --prompt-len 16 --steps 5

Without a GPU the kernels run on Numba's CUDA simulator: about 30-60 s for the tiny model with the
defaults on two cores (the oracle runs twice: per call and chained), the progress on stderr. Each
call starts both sides from identical points: the oracle's attention state is set to the engine's
before the call, each oracle layer starts from the engine's input to that layer, and wherever the two
make a discrete choice differently (a quantisation flip: a last-bit difference landing on a rounding
boundary gives another fp8 / fp4 code, candidate block or selected row) the oracle goes on with the
engine's, so a row measures that layer alone, at the full bound. The columns: cosine and relative RMS
error of the layer's output highway against the oracle's, the largest absolute difference, and the
flips the layer had (values that differed, of those compared). A call fails if any layer is beyond
the bounds or a kind of choice flipped in more than 1% of its values (flashv41/check.py). Then the
whole run against an oracle sequence that ran the same calls from position 0 on its own (nothing
taken from the engine: what starting each call from the engine's state cannot see, a state gone
wrong between calls): cosine, relative RMS and largest error of the output highways, held to the
bound flashv41/check.py derives where no flip was counted.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import numpy as np

import flashv41
from flashv41.check import COSINE, MAX_FLIP_SHARE, REL_RMS, Chain, Flips, LayerAgreement, compare_call
from flashv41.cli import guarded
from flashv41.host.oracle import Oracle
from flashv41.host.progress import Progress
from flashv41.runner import backend_description, open_model, random_tokens

HEADER = (f"{'call':<20} {'layer':>5}  {'role':<26} {'cosine':>12} {'rel rms':>9} {'max |err|':>9}  "
          f"{'flips':>11}  ok")


def row(call: str, role: flashv41.LayerRole, a: LayerAgreement) -> str:
    name = role.block_type + ("+engram" if role.engram else "")
    why = [words for agrees, words in ((a.ids_match, "engram row ids differ"), (a.rows_match, "engram rows differ"),
                                       (a.selection_match, "attended selection differs")) if not agrees]
    verdict = "ok" if a.close else "FAIL" + "".join(f" ({words})" for words in why)
    flips = f"{a.flips.total}/{sum(a.flips.units.values())}"
    return (f"{call:<20} {a.layer:>5}  {name:<26} {a.cosine:12.9f} {a.rel_rms:9.2e} {a.max_error:9.2e}  "
            f"{flips:>11}  {verdict}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="a DeepSeek-V4.1 GGUF (default: the built-in tiny model)")
    parser.add_argument("--prompt-len", type=int, default=8, help="prompt tokens, prefilled in one call (default 8)")
    parser.add_argument("--steps", type=int, default=3, help="decode steps after the prompt (default 3)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random tokens (default 0)")
    args = parser.parse_args(argv)
    if args.prompt_len < 1 or args.steps < 0:
        parser.error("--prompt-len must be at least 1 and --steps at least 0")

    # a small model launches small grids, and on a GPU Numba warns about each one's occupancy
    warnings.filterwarnings("ignore", message=".*GPU under-utilization")
    print(f"kernels on: {backend_description()}")  # before anything slow: the simulator takes seconds a call
    model = open_model(args.model)
    try:
        cfg = model.config
        prompt = random_tokens(cfg.vocab_size, args.prompt_len, args.seed, 0)
        steps = random_tokens(cfg.vocab_size, args.steps, args.seed, 1)
        max_seq = prompt.size + steps.size
        print(f"model: {model.path} ({cfg.describe()})")
        print(f"bounds: cosine >= {COSINE} and rel rms <= {REL_RMS} per layer; engram row ids, engram rows and "
              f"attended selections equal; flips of each kind <= {MAX_FLIP_SHARE:.0%} of a call's values (or one)")
        oracle = Oracle(model, max_seq=max_seq)
        # one chunk per call: captures (which the comparison reads) keep the last chunk only
        with flashv41.Engine(model, max_seq=max_seq, max_tokens=prompt.size) as engine:
            seq, ref = engine.new_sequence(), oracle.new_sequence()
            chain = Chain(oracle.new_sequence(), cfg.n_layers)
            calls = [(f"prefill {prompt.size}", prompt)]
            calls += [(f"decode at {prompt.size + i}", np.array([tok])) for i, tok in enumerate(steps)]
            print(HEADER)
            failed = 0
            run = Flips()
            with Progress("engine and oracle", len(calls), "call", "calls") as progress:
                for name, ids in calls:
                    _, call = compare_call(seq, ref, ids, chain=chain)
                    progress.update()
                    with progress.paused():  # the rows print above the bar (which is on stderr)
                        for role, agreement in zip(cfg.roles, call.layers, strict=True):
                            print(row(name, role, agreement))
                            failed += not agreement.close
                        if not call.flips.rare:
                            print(f"{name}: FAIL: flips not rare: {call.flips.describe()}")
                            failed += 1
                    run.add(call.flips)
            seq.release()
            ref.release()
            print(f"flips over the run (the engine's choices the oracle went on with): {run.describe()}")
            if not run.rare:
                print("FAIL: flips over the run are not rare")
                failed += 1
            chained = chain.agreement()
            print(chained.describe())
            if not chained.ok:
                print("FAIL: the whole run left the oracle beyond its bound")
                failed += 1
    finally:
        model.close()
    checked = len(calls) * cfg.n_layers
    if failed:
        print(f"DISAGREEMENT: {failed} of {checked} layer comparisons (or calls' flip counts, or the chained run) "
              f"beyond the bounds")
        return 1
    print(f"every layer agrees ({cfg.n_layers} layers x {len(calls)} calls)")
    return 0


if __name__ == "__main__":
    # errors as the flashv41 command shows them: a missing or bad model file is one line (exit 2)
    sys.exit(guarded("compare_oracle.py", main))
