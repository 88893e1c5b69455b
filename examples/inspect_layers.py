"""Look inside the layer stack: one prompt through the engine with captures on, then per layer its
role, the highway's RMS after the layer, the attention output's RMS, the engram gate's mean (engram
layers) and the compressed positions one query selected (layers with compressed attention).

    python examples/inspect_layers.py                      # the built-in tiny model
    python examples/inspect_layers.py --model model.gguf   # any DeepSeek-V4.1 GGUF
    python examples/inspect_layers.py --prompt-len 16 --query -1

Without a GPU the kernels run on Numba's CUDA simulator: about 10-20 s for the tiny model on two
cores, the prefill's progress on stderr. The
prompt is `--prompt-len` seeded random token ids, run as one call (`max_tokens` is the prompt's
length) because captures keep the last chunk only. Captures hold, per layer, host copies of the
intermediates (`h_out` [T, hc, dim], `attn_out` [T, dim], `engram_gate` [T, hc], `selection` [T, topk]
with -1 padding, ...); `--query` picks the query of the call whose selection is shown (0 = the first).
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import numpy as np

import flashv41
from flashv41.cli import guarded
from flashv41.runner import backend_description, open_model, prefill_progress, random_tokens


def rms(a: np.ndarray) -> float:
    x = np.asarray(a, np.float64)
    return float(np.sqrt(np.mean(x * x)))


def layer_lines(model: flashv41.Model, captures: list[dict], query: int) -> list[str]:
    """One line per layer from the captures of a call; `query` indexes the call's tokens."""
    header = f"{'layer':>5}  {'role':<26} {'h rms':>9} {'attn rms':>9} {'gate mean':>9}"
    lines = [f"{header}  compressed positions selected by query {query}"]
    for role, cap in zip(model.config.roles, captures, strict=True):
        gate = f"{float(np.mean(cap['engram_gate'])):9.4f}" if "engram_gate" in cap else f"{'-':>9}"
        if "selection" in cap:
            chosen = cap["selection"][query]
            selected = "[" + ", ".join(str(int(g)) for g in chosen[chosen >= 0]) + "]"
        else:
            selected = "- (window only)"
        name = role.block_type + ("+engram" if role.engram else "")
        lines.append(f"{role.layer:>5}  {name:<26} {rms(cap['h_out']):9.4f} {rms(cap['attn_out']):9.4f} {gate}  "
                     f"{selected}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="a DeepSeek-V4.1 GGUF (default: the built-in tiny model)")
    parser.add_argument("--prompt-len", type=int, default=8, help="prompt tokens (default 8)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random prompt (default 0)")
    parser.add_argument("--query", type=int, default=0, help="which query's selection to show (default 0; -1 = last)")
    args = parser.parse_args(argv)
    if args.prompt_len < 1:
        parser.error("--prompt-len must be at least 1")
    if not -args.prompt_len <= args.query < args.prompt_len:
        parser.error(f"--query {args.query} is outside a prompt of {args.prompt_len} tokens")

    # a small model launches small grids, and on a GPU Numba warns about each one's occupancy
    warnings.filterwarnings("ignore", message=".*GPU under-utilization")
    print(f"kernels on: {backend_description()}")  # before anything slow
    model = open_model(args.model)
    try:
        cfg = model.config
        prompt = random_tokens(cfg.vocab_size, args.prompt_len, args.seed, 0)
        print(f"model: {model.path} ({cfg.describe()})")
        print(f"prompt: {prompt.size} tokens (seed {args.seed})")
        with flashv41.Engine(model, max_seq=prompt.size, max_tokens=prompt.size) as engine:
            seq = engine.new_sequence()
            with prefill_progress(engine, prompt.size):  # on stderr, layer by layer
                h = seq.prefill(prompt, capture=True)
            for line in layer_lines(model, seq.captures, args.query % prompt.size):
                print(line)
            print(f"final highway [{', '.join(str(n) for n in h.shape)}]: rms {rms(h):.4f}")
            seq.release()
    finally:
        model.close()
    return 0


if __name__ == "__main__":
    # errors as the flashv41 command shows them: a missing or bad model file is one line (exit 2)
    sys.exit(guarded("inspect_layers.py", main))
