"""Tokens out through the API: a prompt, then N greedy tokens, the model's MoE computed by an FFN
callback between the engine's layers and the head's logits read after each step.

    python examples/generate.py                              # the built-in tiny model with its MoE
    python examples/generate.py --model model.gguf -n 16     # any V4.1 GGUF with its FFN and head tensors
    python examples/generate.py --ffn cupy                   # the MoE as a CuPy (or --ffn torch) callback

The FFN is the caller's (flashv41.ffn): `--ffn host` (the default) is flashv41.HostMoE through
flashv41.host_ffn, the reference's MoE on the CPU, exact and slow on a real model; `--ffn cupy` and
`--ffn torch` write the same MoE as a device callback in CuPy or PyTorch, wrapping the engine's bf16
buffers without a copy (`__cuda_array_interface__`) and launching on the engine's stream (an
external stream of the handle it is given). Neither library is a dependency of flashv41: those two
need a GPU and the library installed. They compute in fp32 where the reference rounds to bf16, so
their tokens may part from HostMoE's at a near tie. None of the three is marked capturable, so the
engine runs its decode steps without CUDA graphs and says so once (a UserWarning on a GPU).

Without a GPU the kernels run on Numba's CUDA simulator: on the tiny model about 15-30 s on two cores.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np

import flashv41
from flashv41.cli import guarded
from flashv41.runner import backend_description, builtin_model, random_tokens


def dense_weights(moe: flashv41.HostMoE, layer: int) -> dict[str, Any]:
    """A layer's MoE weights as float32 NumPy arrays (a device callback uploads them once)."""
    w: dict[str, Any] = dict(moe.layer_weights(layer))
    for e in range(moe.cfg.n_experts):
        w[f"e{e}"] = moe.expert(layer, e)
    return w


def moe_math(xp: Any, cfg: flashv41.MoEConfig, w: dict[str, Any], x: Any, clip_max: Any, take: Any) -> Any:
    """The reference's MoE of x [T, dim] fp32 in array library xp, fp32 throughout (where the
    reference rounds to bf16, this does not): the routed experts weighed, plus the shared one."""
    def swiglu(w1: Any, w3: Any, w2: Any, scale: Any = None) -> Any:
        g, u = x @ w1.T, x @ w3.T
        if cfg.swiglu_limit > 0:
            u = -clip_max(-clip_max(u, cfg.swiglu_limit), cfg.swiglu_limit)
            g = clip_max(g, cfg.swiglu_limit)
        h = g / (1 + xp.exp(-g)) * u
        return (h if scale is None else h * scale[:, None]) @ w2.T

    s = x @ w["ffn_gate_inp"].T
    if cfg.score_func == "softmax":
        s = xp.exp(s - s.max())  # (any constant a row leaves its softmax as it is)
        s = s / s.sum(-1)[:, None]
    elif cfg.score_func == "sigmoid":
        s = 1 / (1 + xp.exp(-s))
    else:  # sqrt(softplus), softplus past 20 the input itself
        s = xp.sqrt(xp.where(s > 20, s, xp.log1p(xp.exp(clip_max(s, 20)))))
    order = xp.argsort(-(s + w["exp_probs_b"]), -1)[:, :cfg.n_active]
    chosen = take(s, order)
    if cfg.norm_topk and cfg.n_active > 1:
        chosen = chosen / (chosen.sum(-1)[:, None] + 1e-20)
    chosen = chosen * cfg.route_scale
    y = swiglu(w["ffn_gate_shexp"], w["ffn_up_shexp"], w["ffn_down_shexp"])
    for e in range(cfg.n_experts):
        y = y + swiglu(*w[f"e{e}"], (chosen * (order == e)).sum(-1))  # zero for the tokens that did not pick e
    return y


def cupy_ffn(moe: flashv41.HostMoE) -> Any:
    """The MoE as a CuPy callback on the engine's stream: bf16 bits in and out, NumPy-style."""
    import cupy

    weights = [{k: tuple(map(cupy.asarray, v)) if isinstance(v, tuple) else cupy.asarray(v)
                for k, v in dense_weights(moe, i).items()} for i in range(moe.n_layers)]

    def ffn(layer: int, x: Any, out: Any, stream: flashv41.FfnStream) -> None:
        with cupy.cuda.ExternalStream(stream.handle):
            xf = (cupy.asarray(x).astype(cupy.uint32) << 16).view(cupy.float32)  # bf16 bits -> values
            y = moe_math(cupy, moe.cfg, weights[layer], xf, cupy.minimum,
                         lambda a, i: cupy.take_along_axis(a, i, -1)).astype(cupy.float32)
            u = y.view(cupy.uint32)
            cupy.asarray(out)[...] = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(cupy.uint16)  # nearest even

    return ffn


def torch_ffn(moe: flashv41.HostMoE) -> Any:
    """The MoE as a PyTorch callback on the engine's stream (torch.cuda.ExternalStream)."""
    import torch

    weights = [{k: tuple(torch.as_tensor(a, device="cuda") for a in v) if isinstance(v, tuple)
                else torch.as_tensor(v, device="cuda") for k, v in dense_weights(moe, i).items()}
               for i in range(moe.n_layers)]

    def ffn(layer: int, x: Any, out: Any, stream: flashv41.FfnStream) -> None:
        with torch.cuda.stream(torch.cuda.ExternalStream(stream.handle)):
            xf = torch.as_tensor(x, device="cuda").view(torch.bfloat16).float()  # (__cuda_array_interface__)
            y = moe_math(torch, moe.cfg, weights[layer], xf, lambda a, m: a.clamp(max=m),
                         lambda a, i: torch.gather(a, -1, i))
            torch.as_tensor(out, device="cuda").view(torch.bfloat16).copy_(y)  # rounded to nearest even

    return ffn


def make_ffn(kind: str, moe: flashv41.HostMoE) -> Any:
    """The FFN callback of `--ffn`."""
    if kind == "host":
        return flashv41.host_ffn(moe)
    return cupy_ffn(moe) if kind == "cupy" else torch_ffn(moe)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="a V4.1 GGUF with its FFN and head tensors (default: the built-in "
                                                   "tiny model with its MoE)")
    parser.add_argument("-n", "--tokens", type=int, default=6, help="greedy tokens to generate (default 6)")
    parser.add_argument("--prompt-len", type=int, default=8, help="random prompt tokens (default 8)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random prompt (default 0)")
    parser.add_argument("--ffn", choices=("host", "cupy", "torch"), default="host",
                        help="the MoE callback: HostMoE on the CPU (default), or in CuPy or PyTorch on the GPU")
    args = parser.parse_args(argv)
    if args.tokens < 1 or args.prompt_len < 1:
        parser.error("--tokens and --prompt-len must be at least 1")
    warnings.filterwarnings("ignore", message=".*GPU under-utilization")
    print(f"kernels on: {backend_description()}")
    model = flashv41.load_model(args.model if args.model is not None else builtin_model(moe=True))
    try:
        cfg = model.config
        print(f"model: {model.path} ({cfg.describe()})")
        if cfg.moe is None or not cfg.head:
            parser.error(f"{model.path.name} has no MoE or no head tensors (flashv41 synth --moe writes a model "
                         "with them)")
        print(f"MoE: {cfg.moe.describe()}")
        moe = flashv41.HostMoE(model)
        prompt = random_tokens(cfg.vocab_size, args.prompt_len, args.seed, 0)
        engine = flashv41.Engine(model, max_seq=prompt.size + args.tokens, ffn=make_ffn(args.ffn, moe))
        try:
            seq = engine.new_sequence()
            tokens = flashv41.generate(seq, prompt, args.tokens)
            logits = seq.logits()  # the last step's, [vocab] fp32
            top = np.argsort(-logits)[:5]
            print(f"prompt: {prompt.tolist()}")
            print(f"generated ({args.ffn} FFN, greedy): {tokens.tolist()}")
            print("the last step's top logits: " + ", ".join(f"{int(t)} {logits[t]:.4f}" for t in top))
        finally:
            engine.close()
    finally:
        model.close()
    return 0


if __name__ == "__main__":
    sys.exit(guarded("generate.py", main))
