"""The FFN sublayer's and the head's tensors of a synthetic model (`moe=True`, `flashv41 synth --moe`):
what host.synth writes after every layer's attention and engram tensors, so the tensors before them
are byte for byte those of the same preset and seed without it.

Per layer (host.gguf_layout MOE_TENSORS, as published files name them): `ffn_norm` (weights around
0.2), the router `ffn_gate_inp` (F32 with bf16 values, gain 2.9) and its correction bias
`exp_probs_b` (F32, N(0, 0.5^2)), the routed experts `ffn_{gate,up}_exps` [E, I, C] (gain 1.5) and
`ffn_down_exps` [E, C, I] (gain 1.05), the shared expert `ffn_*_shexp` (the same gains); then the
head: `output_norm` (weights around 1) and `output` [vocab, C] (gain 1). These are the reference's
synthetic statistics (testing.py: NORM_MEAN, PROJECTION_GAIN; N(0, (gain / sqrt(fan_in))^2)).
The matrices take the weight type (the next one down whose blocks divide the rows, as the attention
matrices), or a type map's: the experts may also be IQ2_XXS (ds4's recipe for gate and up), which no
device kernel reads and gguf-py cannot quantise, so its blocks are drawn: random codes, one fp16
scale a tensor chunk set so the values' RMS is the intended one (gguf-py's dequantisation measures
it).

The keys (host.gguf_moe): expert counts, the widths, route scale, normalisation, the scoring
function and the SwiGLU limit, under llama.cpp's names, or HF's for ds4 (also in its config JSON).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter

from flashv41.host import gguf_layout as L
from flashv41.host.gguf_moe import DS4_MOE_KEYS, MOE_KEYS
from flashv41.host.numerics import bf16
from flashv41.host.quants import FORMATS, GGMLType
from flashv41.host.synth_draw import DRAWERS, DRAWN_ONLY, _gaussian, _stored, draw_k_quant
from flashv41.host.synth_presets import Preset

NORM_MEAN = {L.FFN_NORM: 0.2, L.OUTPUT_NORM: 1.0}
GAIN = {"ffn_gate_inp": 2.9, "ffn_gate_exps": 1.5, "ffn_up_exps": 1.5, "ffn_down_exps": 1.05,
        "ffn_gate_shexp": 1.5, "ffn_up_shexp": 1.5, "ffn_down_shexp": 1.05, L.OUTPUT: 1.0}
ROUTER = "ffn_gate_inp"  # F32 with bf16 values, as the reference's gate weight
# the types only the host reads (gguf-py dequantises them; no device kernel does): a type map may
# give them to the routed experts
HOST_ONLY_TYPES = {"IQ2_XXS": GGMLQuantizationType.IQ2_XXS}
EXPERT_ROLES = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")

StoredType = GGMLType | GGMLQuantizationType
MakeFn = Callable[[np.random.Generator, tuple[int, ...]], np.ndarray]


def stored_row_bytes(gtype: object, values: int) -> int:
    """The bytes of a row of `values` values of any ggml type (FORMATS', else gguf-py's sizes)."""
    if gtype in FORMATS:
        return FORMATS[gtype].row_bytes(values)  # type: ignore[index]
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType(int(gtype))]  # type: ignore[call-overload]
    return values // block * size


def block_values(gtype: object) -> int:
    if gtype in FORMATS:
        return FORMATS[gtype].block_values  # type: ignore[index]
    return GGML_QUANT_SIZES[GGMLQuantizationType(int(gtype))][0]  # type: ignore[call-overload]


def dims(p: Preset) -> L.Dims:
    return L.Dims(vocab=p.vocab, dim=p.dim, n_heads=p.n_heads, head_dim=p.head_dim, q_lora=p.q_lora_rank,
                  o_groups=p.o_groups, o_lora=p.o_lora_rank, hc=p.hc, index_heads=p.index_heads,
                  index_head_dim=p.index_head_dim, n_experts=p.n_experts, expert_inter=p.expert_inter,
                  shared_inter=p.expert_inter)


def draw_iq2_xxs(rng: np.random.Generator, shape: tuple[int, ...], std: float) -> np.ndarray:
    """IQ2_XXS bytes [rows, row_bytes] of values of RMS about `std`: random codes, signs and
    sub-block scales, and one fp16 d for the chunk, set from gguf-py's dequantisation at d = 1."""
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType.IQ2_XXS]
    rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
    raw = rng.integers(0, 256, (rows, shape[-1] // block, size), dtype=np.uint8)
    raw[..., :2] = np.frombuffer(np.float16(1).tobytes(), np.uint8)
    from gguf import quants

    unit = np.sqrt(np.mean(np.square(quants.dequantize(raw.reshape(rows, -1), GGMLQuantizationType.IQ2_XXS),
                                     dtype=np.float64)))
    raw[..., :2] = np.frombuffer(np.float16(std / max(unit, 1e-30)).tobytes(), np.uint8)
    return raw.reshape(rows, -1)


def _make(role: str, gtype: StoredType, std: float, stored_draw: bool) -> MakeFn:
    """The stored form of a matrix of `role` (any shape: its rows are all but the last axis);
    stored_draw: Q8_0 and BF16 drawn in the stored format (host.synth_draw.DRAWERS), as the
    preset's other matrices are."""

    def make(rng: np.random.Generator, s: tuple[int, ...]) -> np.ndarray:
        flat = (int(np.prod(s[:-1])), s[-1])
        if gtype == GGMLQuantizationType.IQ2_XXS:
            out = draw_iq2_xxs(rng, flat, std)
        elif gtype in DRAWN_ONLY:
            out = draw_k_quant(gtype, rng, flat, std)  # type: ignore[arg-type]
        elif role == ROUTER:
            out = _stored(bf16(_gaussian(flat, std, rng)), gtype)  # type: ignore[arg-type]
        elif stored_draw and gtype in DRAWERS:
            out = DRAWERS[gtype](rng, flat, std)  # type: ignore[index]
        else:
            out = _stored(_gaussian(flat, std, rng), gtype)  # type: ignore[arg-type]
        return out.reshape(*s[:-1], -1) if gtype not in (GGMLType.F32, GGMLType.F16) else out.reshape(s)

    return make


def _vector(role: str) -> MakeFn:
    mean = NORM_MEAN.get(role)

    def make(rng: np.random.Generator, s: tuple[int, ...]) -> np.ndarray:
        if mean is None:
            return _gaussian(s, 0.5, rng)
        return bf16(np.float32(mean) * (1 + np.float32(0.1) * rng.standard_normal(s, dtype=np.float32)))

    return make


def plan_moe(p: Preset, weight_type: GGMLType, layout: str, type_map: dict, fit: Callable[..., Any],
             typed: Callable[..., Any]) -> list[tuple[str, tuple[int, ...], StoredType, MakeFn]]:
    """(name, shape, type, make) of every FFN and head tensor, in file order: each layer's, then the
    head. fit / typed: host.synth's type fallback and its strict type-map check."""
    d = dims(p)
    out: list[tuple[str, tuple[int, ...], StoredType, MakeFn]] = []

    def add(layer: int | None, spec: L.TensorSpec) -> None:
        name = L.tensor_name(layer, spec.role, layout)
        shape = spec.shape(d)
        if not spec.matrix:
            out.append((name, shape, GGMLType.F32, _vector(spec.role)))
            return
        gtype: Any
        if spec.role in type_map:
            gtype = typed(spec.role, name, shape, type_map[spec.role])
        elif spec.role == ROUTER:
            gtype = GGMLType.F32
        else:
            gtype = fit(weight_type, shape[-1])
        out.append((name, shape, gtype, _make(spec.role, gtype, GAIN[spec.role] / np.sqrt(shape[-1]), p.stored_draw)))

    for layer in range(p.n_layers):
        for spec in (L.FFN_NORM_TENSOR, *L.MOE_TENSORS):
            add(layer, spec)
    for spec in L.HEAD_TENSORS:
        add(None, spec)
    return out


def moe_values(p: Preset) -> dict[str, object]:
    """The MoE keys' values by host.gguf_moe's names."""
    return {"n_experts": p.n_experts, "n_active": p.n_active, "n_shared": 1, "inter_dim": p.expert_inter,
            "shared_inter_dim": p.expert_inter, "route_scale": p.route_scale, "norm_topk": True,
            "score_func": p.score_func, "swiglu_limit": p.swiglu_limit}


def write_moe_metadata(w: GGUFWriter, p: Preset, layout: str, config: dict | None = None) -> None:
    """The MoE keys: llama.cpp's names (gguf_moe.MOE_KEYS), or ds4's HF names (DS4_MOE_KEYS), which
    also go into its config JSON (`config`, before the caller writes it)."""
    keys = DS4_MOE_KEYS if layout == L.DS4 else MOE_KEYS
    for name, value in moe_values(p).items():
        if name not in keys:
            continue
        k = L.key(keys[name])
        if isinstance(value, bool):
            w.add_bool(k, value)
        elif isinstance(value, int):
            w.add_uint32(k, value)
        elif isinstance(value, float):
            w.add_float32(k, value)
        else:
            w.add_string(k, str(value))
        if config is not None:
            config[keys[name]] = value
