"""Reading the FFN sublayer's and the head's part of a V4.1 GGUF: the MoE keys -> `MoEConfig`, and
every FFN / head tensor checked against them.

What the engine and flashv41.HostMoE read (host.gguf_layout: FFN_NORM_TENSOR, MOE_TENSORS,
HEAD_TENSORS): every layer's `ffn_norm` (an FFN callback's input is normed with it), the router
(`ffn_gate_inp` [E, C], its correction bias `exp_probs_b` [E]), the routed experts
(`ffn_{gate,up}_exps` [E, I, C], `ffn_down_exps` [E, C, I]), the shared expert (`ffn_*_shexp`) and
the head (`output_norm` [C], `output` [vocab, C]). Each group is optional (a file without them
loads as before: the FFN then runs as a zero output and there are no logits), but a group is whole
or absent, in every layer alike: a partial one is a ModelFormatError naming the first missing
tensor. The MoE tensors may be of any type gguf-py dequantises (IQ2_XXS, MXFP4, Q2_K ...: only the
host reads them); `output` is a matrix the engine multiplies by, so one of the device's types.

The MoE keys (`MOE_KEYS`; ds4: `DS4_MOE_KEYS`, HF config names, then the `deepseek41.config`
JSON it carries): the expert count and the hidden widths are read from the tensors and checked
against the keys where a key says them; the experts a token takes (`expert_used_count` /
`num_experts_per_tok`) must be recorded; the scoring function, route scale, normalisation and
SwiGLU limit take V4.1's values (host.config V41_*) where the file is silent, and
`MoEConfig.defaults` names those. V4.1 routes every layer by its gate (the reference has no hash
routing, `tid2eid`, in any layer) and has one shared expert.
"""

from __future__ import annotations

import json
import math
from functools import cache

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf import quants as gguf_quants

from flashv41.host import gguf_layout as L
from flashv41.host.config import SCORE_FUNCS, V41_ROUTE_SCALE, V41_SCORE_FUNC, V41_SWIGLU_LIMIT, MoEConfig
from flashv41.host.errors import ModelFormatError, UnsupportedError
from flashv41.host.gguf_file import _Fields
from flashv41.host.quants import RowType

# llama.cpp / mxxm-t keys (gguf-py's Keys.LLM names), arch-relative
MOE_KEYS = {
    "n_experts": "expert_count",
    "n_active": "expert_used_count",
    "n_shared": "expert_shared_count",
    "inter_dim": "expert_feed_forward_length",
    "shared_inter_dim": "expert_shared_feed_forward_length",
    "route_scale": "expert_weights_scale",
    "norm_topk": "expert_weights_norm",
    "score_func": "expert_scoring_func",  # a string, as V4.1 converters write it
    "gating_func": "expert_gating_func",  # gguf-py's u32 ExpertGatingFuncType: 1 softmax, 2 sigmoid
    "swiglu_limit": "swiglu_limit",
    "swiglu_clamp": "swiglu_clamp_exp",  # gguf-py's per-layer array (its first entry is read)
}
DS4_MOE_KEYS = {
    "n_experts": "n_routed_experts",
    "n_active": "num_experts_per_tok",
    "n_shared": "n_shared_experts",
    "inter_dim": "moe_intermediate_size",
    "route_scale": "routed_scaling_factor",
    "norm_topk": "norm_topk_prob",
    "score_func": "scoring_func",
    "swiglu_limit": "swiglu_limit",
}
GATING_FUNCS = {1: "softmax", 2: "sigmoid"}
_FLOATS = (GGUFValueType.FLOAT32, GGUFValueType.FLOAT64)


def moe_keys(layout: str) -> dict[str, str]:
    return DS4_MOE_KEYS if layout == L.DS4 else MOE_KEYS


@cache
def host_readable(qtype: int) -> bool:
    """Whether gguf-py dequantises ggml type `qtype` (tried on one zero block)."""
    try:
        q = GGMLQuantizationType(qtype)
    except ValueError:
        return False
    if q not in GGML_QUANT_SIZES:
        return False
    block, size = GGML_QUANT_SIZES[q]
    try:
        gguf_quants.dequantize(np.zeros((1, size), np.uint8), q)
    except (NotImplementedError, ValueError, KeyError):
        return False
    return True


def host_dequantize(data: np.ndarray, qtype: int) -> np.ndarray:
    """Stored rows (a tensor's data or a slice of it: uint8 [..., row_bytes], or F32 / F16 values)
    -> float32 [..., values], through gguf-py for every type (bit-exact to ggml's dequantisers)."""
    q = GGMLQuantizationType(int(qtype))
    if q == GGMLQuantizationType.F32:
        return np.asarray(data, np.float32)
    if q == GGMLQuantizationType.F16:
        return np.asarray(data, np.float16).astype(np.float32)
    return np.asarray(gguf_quants.dequantize(np.ascontiguousarray(data), q), np.float32)


def _check_host_tensor(store, layer: int | None, role: str, shape: tuple[int, ...]) -> None:
    """A tensor only the host reads: present, of a type gguf-py dequantises, shaped as `shape`."""
    ref = store.get(layer, role)
    fname = store.file_of(ref.name).name
    t = ref.ggml_type
    if isinstance(t, RowType) or not host_readable(int(t)):
        name = t.name if isinstance(t, RowType) else _qtype_name(int(t))
        raise UnsupportedError(f"{fname}: tensor {ref.name} has type {name}, which gguf-py cannot dequantise")
    if ref.shape != shape:
        raise ModelFormatError(f"{fname}: tensor {ref.name} has shape {list(ref.shape)} (NumPy order), expected "
                               f"{list(shape)} from the metadata and the router")
    block = GGML_QUANT_SIZES[GGMLQuantizationType(int(t))][0]
    if shape[-1] % block:
        raise ModelFormatError(f"{fname}: tensor {ref.name} rows of {shape[-1]} values do not hold whole "
                               f"{_qtype_name(int(t))} blocks of {block}")


def _qtype_name(t: int) -> str:
    try:
        return GGMLQuantizationType(t).name
    except ValueError:
        return f"type {t}"


def _whole(store, n: int, roles: tuple[str, ...], what: str) -> bool:
    """Whether every layer carries every role of a group (True), none does (False); a partial group
    is a ModelFormatError naming the first missing tensor."""
    present = [(i, r) for i in range(n) for r in roles if store.has(i, r)]
    if not present:
        return False
    if len(present) < n * len(roles):
        i, r = next((i, r) for i in range(n) for r in roles if not store.has(i, r))
        have = store.name_of(*present[0])
        raise ModelFormatError(f"{store.path.name}: tensor {store.name_of(i, r)} is missing, but the file has "
                               f"{have} ({what} are in every layer or in none)")
    return True


def read_ffn_head(fields: _Fields, store, values: dict, layout: str) -> dict:
    """`ffn_norm`, `moe` and `head` of the ModelConfig (host.config) from a file's keys and tensors,
    every tensor of the three groups checked (module docstring)."""
    from flashv41.host.gguf_model import _check_tensor  # (gguf_model imports this module)

    n, dim, vocab = values["n_layers"], values["dim"], values["vocab_size"]
    d = L.Dims(vocab=vocab, dim=dim, n_heads=0, head_dim=0, q_lora=0, o_groups=1, o_lora=0, hc=0, index_heads=0,
               index_head_dim=0)
    ffn_norm = _whole(store, n, (L.FFN_NORM,), "the FFN norms")
    if ffn_norm:
        for i in range(n):
            _check_tensor(store, i, L.FFN_NORM, (dim,))
    head_roles = [s.role for s in L.HEAD_TENSORS]
    held = [r for r in head_roles if store.has(None, r)]
    if held and len(held) < len(head_roles):
        missing = next(r for r in head_roles if r not in held)
        raise ModelFormatError(f"{store.path.name}: tensor {store.name_of(None, missing)} is missing, but the "
                               f"file has {store.name_of(None, held[0])} (the head needs both)")
    for spec in L.HEAD_TENSORS if held else ():
        _check_tensor(store, None, spec.role, spec.shape(d))
    moe = None
    if _whole(store, n, tuple(s.role for s in L.MOE_TENSORS), "the MoE tensors"):
        if not ffn_norm:
            raise ModelFormatError(f"{store.path.name}: tensor {store.name_of(0, L.FFN_NORM)} is missing, but the "
                                   f"file has the MoE tensors (the MoE's input is normed with it)")
        moe = _moe_config(fields, store, n, dim, layout)
    return {"ffn_norm": ffn_norm, "moe": moe, "head": bool(held)}


def _moe_config(fields: _Fields, store, n: int, dim: int, layout: str) -> MoEConfig:
    fname = fields.fname
    keys = {name: L.key(k) for name, k in moe_keys(layout).items()}
    said = _Said(fields, layout)
    gate = store.get(0, "ffn_gate_inp")
    experts_in = store.get(0, "ffn_gate_exps")
    shared = store.get(0, "ffn_gate_shexp")
    if len(gate.shape) != 2 or len(experts_in.shape) != 3 or len(shared.shape) != 2:
        raise ModelFormatError(f"{fname}: tensors {gate.name} {list(gate.shape)}, {experts_in.name} "
                               f"{list(experts_in.shape)} and {shared.name} {list(shared.shape)} should be "
                               "[experts, dim], [experts, hidden, dim] and [hidden, dim]")
    n_experts, inter, shared_inter = gate.shape[0], experts_in.shape[1], shared.shape[0]
    for name, found in (("n_experts", n_experts), ("inter_dim", inter), ("shared_inter_dim", shared_inter)):
        recorded = said.integer(name)
        if recorded is not None and recorded != found:
            raise ModelFormatError(f"{fname}: metadata key {keys[name]} = {recorded}, but the MoE tensors have "
                                   f"{found} (tensor {gate.name if name == 'n_experts' else experts_in.name})")
    n_shared = said.integer("n_shared")
    if n_shared is not None and n_shared != 1:
        raise UnsupportedError(f"{fname}: metadata key {keys['n_shared']} = {n_shared}; V4.1 has one shared expert")
    n_active = said.integer("n_active")
    if n_active is None:
        raise ModelFormatError(f"{fname}: metadata key {keys['n_active']} (the experts a token takes) is missing")
    if not 1 <= n_active <= n_experts:
        raise ModelFormatError(f"{fname}: metadata key {keys['n_active']} = {n_active}, expected 1 to the "
                               f"{n_experts} experts")
    defaults: list[str] = []

    def told(value, v41, name: str):
        """The file's value, else V4.1's (noted in `defaults`)."""
        if value is None:
            defaults.append(name)
            return v41
        return value

    score = told(said.score_func(), V41_SCORE_FUNC, "score_func")
    route_scale = told(said.number("route_scale"), V41_ROUTE_SCALE, "route_scale")
    limit = told(said.number("swiglu_limit"), V41_SWIGLU_LIMIT, "swiglu_limit")
    norm = told(said.boolean("norm_topk"), True, "norm_topk")
    if not (math.isfinite(route_scale) and route_scale > 0) or not (math.isfinite(limit) and limit >= 0):
        raise ModelFormatError(f"{fname}: route scale {route_scale!r} must be finite and > 0, swiglu limit "
                               f"{limit!r} finite and >= 0 ({keys['route_scale']}, {keys['swiglu_limit']})")
    d = L.Dims(vocab=0, dim=dim, n_heads=0, head_dim=0, q_lora=0, o_groups=1, o_lora=0, hc=0, index_heads=0,
               index_head_dim=0, n_experts=n_experts, expert_inter=inter, shared_inter=shared_inter)
    for i in range(n):
        for spec in L.MOE_TENSORS:
            _check_host_tensor(store, i, spec.role, spec.shape(d))
    return MoEConfig(n_experts, n_active, inter, shared_inter, score, float(route_scale), bool(norm), float(limit),
                     tuple(defaults))


class _Said:
    """What a file records of one MoE value: its key (MOE_KEYS / DS4_MOE_KEYS), else (ds4) the
    config.json it carries; None where neither says."""

    def __init__(self, fields: _Fields, layout: str):
        self.fields = fields
        self.keys = moe_keys(layout)
        self.config: dict = {}
        name = L.key(L.DS4_KEY_CONFIG)
        if layout == L.DS4 and fields.has(name):
            try:
                config = json.loads(fields.string(name))
            except json.JSONDecodeError:
                config = {}  # the config string's own check (host.gguf_model) names it
            self.config = config.get("text_config", config) if isinstance(config, dict) else {}

    def _key(self, name: str) -> str | None:
        k = self.keys.get(name)
        return None if k is None or not self.fields.has(L.key(k)) else L.key(k)

    def _json(self, name: str) -> object:
        k = self.keys.get(name)
        return None if k is None else self.config.get(k)

    def integer(self, name: str) -> int | None:
        k = self._key(name)
        if k is not None:
            return self.fields.u32(k)
        v = self._json(name)
        return v if isinstance(v, int) and not isinstance(v, bool) else None

    def number(self, name: str) -> float | None:
        k = self._key(name)
        if k is not None:
            return self.fields.f32(k)
        clamp = self._key("swiglu_clamp") if name == "swiglu_limit" else None
        field = None if clamp is None else self.fields.reader.get_field(clamp)
        if field is not None:
            parts = [float(np.asarray(field.parts[i]).reshape(-1)[0]) for i in field.data]
            if not parts or len(set(parts)) != 1:
                raise ModelFormatError(f"{self.fields.fname}: metadata key {clamp} = {parts}: V4.1 clamps every "
                                       "layer alike")
            return parts[0]
        v = self._json(name)
        return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None

    def boolean(self, name: str) -> bool | None:
        k = self._key(name)
        if k is not None:
            return bool(self.fields.scalar(k, (GGUFValueType.BOOL,)))
        v = self._json(name)
        return v if isinstance(v, bool) else None

    def score_func(self) -> str | None:
        k = self._key("score_func")
        value: object = self.fields.string(k) if k is not None else self._json("score_func")
        gating = self._key("gating_func")
        if value is None and gating is not None:
            code = self.fields.u32(gating)
            if code not in GATING_FUNCS:
                raise UnsupportedError(
                    f"{self.fields.fname}: metadata key {gating} = {code}, not a gating function "
                    f"flashv41 knows ({', '.join(f'{c} {f}' for c, f in GATING_FUNCS.items())}; V4.1's "
                    f"sqrtsoftplus is recorded as {L.key(MOE_KEYS['score_func'])} or left out)")
            value = GATING_FUNCS[code]
        if value is not None and value not in SCORE_FUNCS:
            raise UnsupportedError(f"{self.fields.fname}: expert scoring function {value!r}, expected one of "
                                   f"{', '.join(SCORE_FUNCS)}")
        return None if value is None else str(value)
