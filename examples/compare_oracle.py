"""Hold the engine to the NumPy oracle layer by layer: a prefill and a few decode steps, every call
compared with `flashv41.check.compare_call`, one table row per layer and call. Exits 1 if any layer
disagrees beyond the bounds in flashv41/check.py.

    python examples/compare_oracle.py                      # the built-in tiny model
    python examples/compare_oracle.py --model model.gguf   # any DeepSeek-V4.1 GGUF
    python examples/compare_oracle.py --prompt-len 16 --steps 5

Without a GPU the kernels run on Numba's CUDA simulator (about 15 s for the tiny model with the
defaults). Each call starts both sides from identical points: the oracle's attention state is set to
the engine's before the call, and each oracle layer starts from the engine's input to that layer, so
a row measures that layer alone. The columns: cosine and relative RMS error of the layer's output
highway against the oracle's, the largest absolute difference, and whether a quantisation flip (a
last-bit difference landing on a rounding boundary: a different selected row, candidate block or
quantised cache row) happened at that layer or before it in the call, which loosens the cosine bound.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import numpy as np

import flashv41
from flashv41.check import COSINE, FLIP_COSINE, REL_RMS, LayerAgreement, compare_call
from flashv41.runner import open_model, random_tokens
from flashv41.runtime import backend_name
from host.oracle import Oracle

HEADER = f"{'call':<20} {'layer':>5}  {'role':<26} {'cosine':>12} {'rel rms':>9} {'max |err|':>9}  {'flip':<4}  ok"


def row(call: str, role: flashv41.LayerRole, a: LayerAgreement) -> str:
    name = role.block_type + ("+engram" if role.engram else "")
    verdict = "ok" if a.ok else "FAIL" + ("" if a.ids_match else " (engram row ids differ)")
    return (f"{call:<20} {a.layer:>5}  {name:<26} {a.cosine:12.9f} {a.rel_rms:9.2e} {a.max_error:9.2e}  "
            f"{'yes' if a.flip else 'no':<4}  {verdict}")


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
    model = open_model(args.model)
    try:
        cfg = model.config
        prompt = random_tokens(cfg.vocab_size, args.prompt_len, args.seed, 0)
        steps = random_tokens(cfg.vocab_size, args.steps, args.seed, 1)
        max_seq = prompt.size + steps.size
        print(f"model: {model.path} ({cfg.describe()})")
        print(f"kernels on: {backend_name()}")
        print(f"bounds: cosine >= {COSINE} and rel rms <= {REL_RMS}, or cosine >= {FLIP_COSINE} after a flip; "
              "engram row ids equal")
        oracle = Oracle(model, max_seq=max_seq)
        # one chunk per call: captures (which the comparison reads) keep the last chunk only
        with flashv41.Engine(model, max_seq=max_seq, max_tokens=prompt.size) as engine:
            seq, ref = engine.new_sequence(), oracle.new_sequence()
            calls = [(f"prefill {prompt.size}", prompt)]
            calls += [(f"decode at {prompt.size + i}", np.array([tok])) for i, tok in enumerate(steps)]
            print(HEADER)
            failed = 0
            for call, ids in calls:
                _, layers = compare_call(seq, ref, ids)
                for role, agreement in zip(cfg.roles, layers, strict=True):
                    print(row(call, role, agreement))
                    failed += not agreement.ok
            seq.release()
            ref.release()
    finally:
        model.close()
    checked = len(calls) * cfg.n_layers
    if failed:
        print(f"DISAGREEMENT: {failed} of {checked} layer comparisons beyond the bounds")
        return 1
    print(f"every layer agrees ({cfg.n_layers} layers x {len(calls)} calls)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
