"""Synthetic V4.1 models: complete GGUF files in the llama.cpp, mxxm-t or ds4 layout with seeded random weights.

The weights follow the released checkpoint's statistics as the reference tests measure them:
embedding RMS 0.12, norm weights around a per-norm mean with 10% spread, projections
N(0, (gain / sqrt(fan_in))^2) with the reference's per-name gains, other 1-D parameters
N(0, 0.5^2). Engram tables hold rows of RMS about 1; Q2_K tables are drawn straight in the stored
format (quantising hundreds of millions of values would take minutes).

The stored form of each tensor (quantised Gaussian values, or drawn straight in the stored format:
Q2_K tables, `stored_draw` presets' Q8_0 and BF16, Q3_K .. Q6_K) is host.synth_draw's.

Types: the weight type (`weight_type`) goes to the attention matrices, the engram projection and
the embedding, the table type to the engram tables; any ggml type flashv41 reads may be either. A
type map (`type_map={role: type}`, `flashv41 synth --type-map role=TYPE,...`) sets any matrix role
or the table (TYPE_MAP_ROLES) to any type, strictly: rows that do not hold whole blocks are an
error, where the weight type falls back to Q8_0, then BF16. Q3_K, Q4_K, Q5_K and Q6_K have no
quantiser: their tensors are drawn as random valid super-blocks of the intended RMS
(host.synth_draw.draw_k_quant), whatever the preset.

Presets (host.synth_presets, which says what each is): `tiny`, `small`, `tiny256`, `flash`,
`flash40`, `flash-realtables`.

Holes (`holes`, any preset: "tables", or "matrices" for the tables and every tensor of two or more
dimensions; the 1-D norms, sinks and hc bases are always drawn): a hole tensor's data is seeked past,
not written (the padding around it is written as for any tensor, and a file ending in a hole is
extended to its size), so the file has its full size while the filesystem stores no blocks for it.
Holes read as zero bytes, and zero bytes are a valid tensor of zeros in every type flashv41 reads (a
Q2_K or Q8_0 block with d = 0; E4M3 code 0 with scale 2^-127, no NaN). The generator draws nothing for
a hole, so the drawn tensors after one differ from those of the same preset written in full. Where
a filesystem keeps no holes the file is written in full size on disk.

The layout changes only keys and names (mxxm-t: source lists, its engram keys with the raw pad
id and a u32 token map, its three tensor names): the same preset and seed give the same tensors,
byte for byte, in either layout. ds4 (HF-named keys, general.alignment 16384, source lists, engram
rows / compressed vocabulary instead of offsets and geometry, its three tensor names) stores its
tables as I8 rows of E4M3 codes and E8M0 scales (host.quants E4M3_ROW264): the Gaussian values a
Q8_0 or BF16 table of the same seed holds, quantised, so every other tensor is byte for byte that of
the llama.cpp file with `table_type="BF16"` (or Q8_0). Its other tensors keep the llama.cpp
writer's types (real ds4 files have an F16 engram_kv: any readable type loads the same way).

Files are written tensor by tensor (never the whole model in memory), with progress callbacks,
under a temporary name that becomes the file's only when the last byte is written: a failed or
interrupted write leaves nothing behind. `shards=N` writes a split set as llama.cpp's gguf-split
does (`NAME-00001-of-0000N.gguf` ...: the model metadata in the first shard, the split keys in
every shard, the tensors in file order over the shards in runs of about equal bytes), into a
temporary folder beside the target whose shards move into place once all are written.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter

from flashv41.host import gguf_layout as L
from flashv41.host import synth_moe
from flashv41.host.engram_rebuild import compressed_token_map
from flashv41.host.engram_tables import engram_multipliers, engram_offsets, engram_primes, stub_token_map
from flashv41.host.errors import InputError, UnsupportedError
from flashv41.host.gguf_file import shard_name
from flashv41.host.numerics import bf16
from flashv41.host.progress import Progress
from flashv41.host.quants import FORMATS, GGMLType, RowType, dequantize, ggml_type
from flashv41.host.synth_draw import DRAWERS, _gaussian, _q2k_table, _stored, draw_bf16, draw_k_quant

# re-exported (`X as X`): callers take the presets and DRAWN_ONLY from host.synth
from flashv41.host.synth_draw import DRAWN_ONLY as DRAWN_ONLY
from flashv41.host.synth_moe import HOST_ONLY_TYPES, block_values, plan_moe, stored_row_bytes, write_moe_metadata
from flashv41.host.synth_presets import FLASH40_SCHEDULE as FLASH40_SCHEDULE
from flashv41.host.synth_presets import HOLES, Preset, preset
from flashv41.host.synth_presets import PRESETS as PRESETS
from flashv41.host.synth_presets import REAL_ENGRAM_VOCAB as REAL_ENGRAM_VOCAB
from flashv41.host.synth_presets import REAL_TABLE_ROWS as REAL_TABLE_ROWS
from flashv41.host.vocab import synthetic_vocab, write_vocab

# Per-norm mean of the weights, and per-projection gain over fan_in^-0.5 (the reference's testing.py).
NORM_MEAN = {
    "attn_norm": 0.025,
    "attn_q_a_norm": 0.97,
    "attn_kv_a_norm": 0.4,
    "attn_compressor_norm": 0.6,
    "indexer.k_norm": 0.5,
}
GAIN = {"attn_q_a": 1.6, "attn_q_b": 0.95, "attn_kv": 1.8, "attn_output_a": 1.6, "attn_output_b": 1.9,
        "attn_compressor_kv": 1.8, "engram_wkv": 1.8, "indexer.attn_q_b": 0.95}
EMBED_STD = 0.12

# Matrices that take the model's weight type; the others keep the types published files use.
WEIGHT_TYPED = ("attn_q_a", "attn_q_b", "attn_kv", "attn_output_a", "attn_output_b", "indexer.attn_q_b",
                "engram_wkv", L.TOKEN_EMBD)
BF16_TYPED = ("attn_compressor_kv", "attn_compressor_gate", "indexer.attn_k")
# F32 tensors whose values the reference holds in bf16 (norm weights, the indexer's head weights,
# the engram gate weights): stored F32 with bf16 values, as a converted checkpoint has them.
BF16_VALUED = (*NORM_MEAN, "indexer.proj", "engram_q", "engram_k")


MakeFn = Callable[[np.random.Generator, tuple[int, ...]], np.ndarray]  # (rng, shape) -> the stored form


@dataclass(frozen=True)
class PlannedTensor:
    name: str
    shape: tuple[int, ...]  # NumPy order
    gtype: GGMLType | RowType  # (or a type only the host reads: host.synth_moe.HOST_ONLY_TYPES)
    make: MakeFn

    @property
    def nbytes(self) -> int:
        rows = int(np.prod(self.shape[:-1])) if len(self.shape) > 1 else 1
        return rows * stored_row_bytes(self.gtype, self.shape[-1])


def _fit_type(want: GGMLType | RowType, inner: int) -> GGMLType | RowType:
    """The requested type, or the next one down whose blocks divide the row (as llama-quantize does)."""
    for t in (want, GGMLType.Q8_0, GGMLType.BF16):
        if inner % FORMATS[t].block_values == 0:
            return t
    return GGMLType.BF16


def _typed(role: str, name: str, shape: tuple[int, ...], gtype: GGMLType | RowType) -> GGMLType | RowType:
    """A type map's type for tensor `name` of `role`, once its rows are known to hold whole blocks."""
    values = block_values(gtype)
    if shape[-1] % values:
        raise UnsupportedError(
            f"type map {role}={gtype.name}: tensor {name} {list(shape)} has rows of {shape[-1]} values, which do "
            f"not hold whole {gtype.name} blocks of {values} values (no file written)")
    return gtype


def plan_tensors(p: Preset, weight_type: GGMLType, table_type: GGMLType | RowType, table_rows: list[int],
                 layout: str = L.LLAMA_CPP,
                 type_map: Mapping[str, GGMLType | RowType] | None = None) -> list[PlannedTensor]:
    """Every tensor of the model, in file order, with how to make it (named as `layout` names it).
    type_map: role -> type (resolve_type_map's), over weight_type / table_type and the fixed types;
    a tensor of a mapped role whose rows do not hold whole blocks of its type is an UnsupportedError."""
    type_map = type_map or {}
    dims = L.Dims(vocab=p.vocab, dim=p.dim, n_heads=p.n_heads, head_dim=p.head_dim, q_lora=p.q_lora_rank,
                  o_groups=p.o_groups, o_lora=p.o_lora_rank, hc=p.hc, index_heads=p.index_heads,
                  index_head_dim=p.index_head_dim, engram_head_dim=p.engram_head_dim,
                  engram_cols=(p.max_ngram - 1) * p.engram_heads)
    out: list[PlannedTensor] = []

    def add(layer: int | None, role: str, shape: tuple[int, ...], matrix: bool) -> None:
        name = L.tensor_name(layer, role, layout)
        if not matrix:
            mean = NORM_MEAN.get(role)
            make: MakeFn
            if mean is not None:
                def make_norm(rng, s, m=mean):
                    return bf16(np.float32(m) * (1 + np.float32(0.1) * rng.standard_normal(s, dtype=np.float32)))
                make = make_norm
            else:
                def make_vector(rng, s):
                    return _gaussian(s, 0.5, rng)
                make = make_vector
            out.append(PlannedTensor(name, shape, GGMLType.F32, make))
            return
        if role == L.TOKEN_EMBD:
            std = EMBED_STD
        else:
            std = GAIN.get(role, 1.0) / np.sqrt(shape[-1])
        gtype: GGMLType | RowType
        if role in type_map:
            gtype = _typed(role, name, shape, type_map[role])
        elif role in WEIGHT_TYPED:
            gtype = _fit_type(weight_type, shape[-1])
        elif role in BF16_TYPED:
            gtype = GGMLType.BF16
        else:
            gtype = GGMLType.F32
        if gtype in DRAWN_ONLY:
            def make_matrix(rng, s, sd=std, t=gtype):
                return draw_k_quant(t, rng, s, sd)
        elif role in BF16_VALUED:
            def make_matrix(rng, s, sd=std, t=gtype):
                return _stored(bf16(_gaussian(s, sd, rng)), t)
        elif p.stored_draw and gtype in DRAWERS:
            def make_matrix(rng, s, sd=std, draw=DRAWERS[gtype]):
                return draw(rng, s, sd)
        else:
            def make_matrix(rng, s, sd=std, t=gtype):
                return _stored(_gaussian(s, sd, rng), t)
        out.append(PlannedTensor(name, shape, gtype, make_matrix))

    add(None, L.TOKEN_EMBD, (p.vocab, p.dim), True)
    for layer in range(p.n_layers):
        ratio = p.compress_ratios[layer]
        engram = layer in p.engram_layers
        for spec in L.layer_tensor_specs(ratio, layer in p.kv_sources, layer in p.index_sources, engram):
            add(layer, spec.role, spec.shape(dims), spec.matrix)
        if engram:
            rows = table_rows[p.engram_layers.index(layer)]
            shape = (rows, p.engram_head_dim)
            name = L.tensor_name(layer, L.ENGRAM_TABLE, layout)
            if L.ENGRAM_TABLE in type_map:
                t = _typed(L.ENGRAM_TABLE, name, shape, type_map[L.ENGRAM_TABLE])
            else:
                t = _fit_type(table_type, p.engram_head_dim)
            make_table: MakeFn
            if t in DRAWN_ONLY:
                def make_drawn_k(rng, s, tt=t):
                    return draw_k_quant(tt, rng, s, 1.0)
                make_table = make_drawn_k
            elif t == GGMLType.Q2_K:
                def make_q2k(rng, s):
                    return _q2k_table(s[0], s[1], rng)
                make_table = make_q2k
            elif p.stored_draw and t in DRAWERS:
                def make_drawn(rng, s, draw=DRAWERS[t]):
                    return draw(rng, s, 1.0)
                make_table = make_drawn
            elif p.stored_draw and t == RowType.E4M3_ROW264:
                # ds4's codes of the values a drawn BF16 table holds: the draws of the llama.cpp
                # file's table, so every other tensor is that file's, as without stored_draw
                def make_ds4(rng, s):
                    return _stored(dequantize(draw_bf16(rng, s, 1.0), GGMLType.BF16, s[-1]), RowType.E4M3_ROW264)
                make_table = make_ds4
            else:
                def make_stored(rng, s, tt=t):
                    return _stored(_gaussian(s, 1.0, rng), tt)
                make_table = make_stored
            out.append(PlannedTensor(name, shape, t, make_table))
    if p.moe:  # after every layer's tensors, so those are the bytes of the file without them
        out += [PlannedTensor(name, shape, gtype, make)  # type: ignore[arg-type]
                for name, shape, gtype, make in plan_moe(p, weight_type, layout, dict(type_map), _fit_type, _typed)]
    return out


def _write_metadata(w: GGUFWriter, p: Preset, primes: np.ndarray, offsets: np.ndarray,
                    multipliers: np.ndarray, token_map: np.ndarray, pad_id: int, table_rows: list[int],
                    layout: str = L.LLAMA_CPP) -> None:
    if layout == L.DS4:
        _write_ds4_metadata(w, p, primes, multipliers, token_map, pad_id, table_rows)
        return
    u32 = {"n_layers": p.n_layers, "context_length": p.context_length, "dim": p.dim, "n_heads": p.n_heads,
           "head_dim": p.head_dim, "rope_dim": p.rope_dim, "q_lora_rank": p.q_lora_rank, "window": p.window,
           "index_heads": p.index_heads, "index_head_dim": p.index_head_dim, "index_topk": p.index_topk,
           "o_groups": p.o_groups, "o_lora_rank": p.o_lora_rank, "hc": p.hc, "sinkhorn_iters": p.sinkhorn_iters,
           "rope_original_ctx": p.rope_original_ctx}
    for name, k in L.U32_KEYS.items():
        w.add_uint32(L.key(k), int(u32[name]))
    f32 = {"norm_eps": p.norm_eps, "rope_theta": p.rope_theta, "compress_rope_theta": p.compress_rope_theta,
           "hc_eps": p.hc_eps, "rope_factor": p.rope_factor, "beta_fast": p.beta_fast, "beta_slow": p.beta_slow}
    for name, k in L.F32_KEYS.items():
        w.add_float32(L.key(k), float(f32[name]))
    w.add_uint32(L.key(L.KEY_VOCAB), p.vocab)
    w.add_uint32(L.key(L.KEY_HEAD_COUNT_KV), 1)
    w.add_uint32(L.key(L.KEY_VALUE_LENGTH), p.head_dim)
    w.add_string(L.key(L.KEY_ROPE_SCALING_TYPE), "yarn")
    # like the published files, the ratio list carries the MTP layers' entries too
    w.add_array(L.key(L.KEY_COMPRESS_RATIOS), [int(r) for r in p.compress_ratios] + [0])
    cand = {"candidate_source": p.candidate_source, "candidate_block_size": p.candidate_block_size,
            "candidate_topk_blocks": p.candidate_topk_blocks}
    for name, (k, _default) in L.OPTIONAL_U32_KEYS.items():
        w.add_uint32(L.key(k), int(cand[name]))
    if p.moe:
        write_moe_metadata(w, p, layout)
    if layout == L.MXXM_T:
        _write_mxxm_metadata(w, p, primes, offsets, multipliers, token_map, table_rows)
    elif p.engram_layers:
        E = {name: L.key(v) for name, v in L.ENGRAM_KEYS.items()}
        w.add_array(E["layer_ids"], [int(i) for i in p.engram_layers])
        w.add_uint32(E["n_heads"], p.engram_heads)
        w.add_uint32(E["head_dim"], p.engram_head_dim)
        w.add_uint32(E["max_ngram"], p.max_ngram)
        for name, arr in (("multipliers", multipliers), ("primes", primes), ("offsets", offsets)):
            w.add_key_value(E[name], [int(v) for v in arr.reshape(-1)], GGUFValueType.ARRAY,
                            sub_type=GGUFValueType.UINT64)
        w.add_key_value(E["token_map"], [int(v) for v in token_map], GGUFValueType.ARRAY,
                        sub_type=GGUFValueType.INT32)
        w.add_uint32(E["pad_id"], int(pad_id))


def _write_mxxm_metadata(w: GGUFWriter, p: Preset, primes: np.ndarray, offsets: np.ndarray,
                         multipliers: np.ndarray, token_map: np.ndarray, table_rows: list[int]) -> None:
    """mxxm-t's own keys: the source lists, and the engram keys under its names, with the RAW pad
    token id and a u32 token map (unmapped ids as 0xFFFFFFFF)."""
    def array(name: str, values, sub_type: GGUFValueType) -> None:
        w.add_key_value(L.key(name), [int(v) for v in values], GGUFValueType.ARRAY, sub_type=sub_type)

    array(L.KEY_KV_SOURCES, p.kv_sources, GGUFValueType.UINT32)
    array(L.KEY_INDEX_SOURCES, p.index_sources, GGUFValueType.UINT32)
    if not p.engram_layers:
        return
    E = {name: L.key(v) for name, v in L.MXXM_ENGRAM_KEYS.items()}
    array("engram.layer_ids", p.engram_layers, GGUFValueType.UINT32)
    w.add_uint32(E["n_heads"], p.engram_heads)
    w.add_uint32(E["head_dim"], p.engram_head_dim)
    w.add_uint32(E["max_ngram"], p.max_ngram)
    w.add_uint32(E["pad_token_id"], p.engram_pad_token)
    w.add_uint32(E["compressed_vocab"], int(token_map.max()) + 1)
    array("engram.num_embeddings", table_rows, GGUFValueType.UINT64)
    for name in ("primes", "offsets"):
        array(f"engram.{name}", (primes if name == "primes" else offsets).reshape(-1), GGUFValueType.UINT64)
    array("engram.multipliers", multipliers.reshape(-1), GGUFValueType.INT64)
    array("engram.token_map", np.where(token_map < 0, np.iinfo(np.uint32).max, token_map), GGUFValueType.UINT32)


def _write_ds4_metadata(w: GGUFWriter, p: Preset, primes: np.ndarray, multipliers: np.ndarray,
                        token_map: np.ndarray, pad_id: int, table_rows: list[int]) -> None:
    """ds4's keys (gguf_layout.DS4_*): HF config names, u32 rope thetas, an f32 original context, u32
    arrays without the `attention.` prefix, and config.json as a string."""
    u32 = {"n_layers": p.n_layers, "context_length": p.context_length, "dim": p.dim, "n_heads": p.n_heads,
           "head_dim": p.head_dim, "rope_dim": p.rope_dim, "q_lora_rank": p.q_lora_rank, "window": p.window,
           "index_heads": p.index_heads, "index_head_dim": p.index_head_dim, "index_topk": p.index_topk,
           "o_groups": p.o_groups, "o_lora_rank": p.o_lora_rank, "hc": p.hc, "sinkhorn_iters": p.sinkhorn_iters,
           "candidate_source": p.candidate_source, "candidate_block_size": p.candidate_block_size,
           "candidate_topk_blocks": p.candidate_topk_blocks}
    config: dict = {"architectures": ["DeepseekV41ForCausalLM"], "vocab_size": p.vocab}
    w.add_uint32(L.key(L.KEY_VOCAB), p.vocab)
    for name, k in L.DS4_U32_KEYS.items():
        w.add_uint32(L.key(k), int(u32[name]))
        config[k] = int(u32[name])
    for name, k in L.DS4_U32_FLOAT_KEYS.items():
        value = getattr(p, name)
        if value != int(value):
            raise InputError(f"{name} = {value}: the ds4 layout stores it as an integer ({L.key(k)}, u32)")
        w.add_uint32(L.key(k), int(value))
        config[k] = float(value)
    for name, k in {**L.DS4_F32_KEYS, **L.DS4_F32_INT_KEYS}.items():
        w.add_float32(L.key(k), float(getattr(p, name)))
        config[k] = getattr(p, name)
    w.add_uint32(L.key(L.DS4_KEY_HEAD_COUNT_KV), 1)
    config[L.DS4_KEY_HEAD_COUNT_KV] = 1

    def array(name: str, values, sub_type: GGUFValueType = GGUFValueType.UINT32) -> None:
        w.add_key_value(L.key(name), [int(v) for v in values], GGUFValueType.ARRAY, sub_type=sub_type)

    array(L.DS4_KEY_COMPRESS_RATIOS, [*p.compress_ratios, 0])  # with the MTP layer's entry, as published
    array(L.DS4_KV_SOURCES, p.kv_sources)
    array(L.DS4_INDEX_SOURCES, p.index_sources)
    config[L.DS4_KEY_COMPRESS_RATIOS] = [*p.compress_ratios, 0]
    if p.moe:
        write_moe_metadata(w, p, L.DS4, config)
    w.add_string(L.key(L.DS4_KEY_CONFIG), json.dumps(config))
    if not p.engram_layers:
        return
    if primes.size and int(primes.max()) > np.iinfo(np.uint32).max:
        raise InputError("the ds4 layout stores engram primes as u32: these tables are too large for it")
    E = {name: L.key(v) for name, v in L.DS4_ENGRAM_KEYS.items()}
    w.add_string(E["encoding"], L.DS4_ENCODING)
    array("engram.layer_ids", p.engram_layers)
    array("engram.rows", table_rows)
    w.add_uint32(E["compressed_vocab"], int(token_map.max()) + 1)
    w.add_uint32(E["pad_id"], int(pad_id))
    array("engram.token_map", np.where(token_map < 0, np.iinfo(np.uint32).max, token_map))
    array("engram.primes", primes.reshape(-1))
    array("engram.multipliers", multipliers.reshape(-1), GGUFValueType.UINT64)


# The roles a type map may set: the embedding, every matrix of a layer, the engram table (named as
# llama.cpp names them; a layout's own name of a role is taken too). The 1-D tensors (norms, sinks,
# hc bases and scales) stay F32, as in published files.
_SPECS = (*L.ATTENTION_TENSORS, *L.KV_SOURCE_TENSORS, L.COMPRESSOR_GATE, *L.INDEX_SOURCE_TENSORS, *L.ENGRAM_TENSORS,
          L.FFN_NORM_TENSOR, *L.MOE_TENSORS, *L.HEAD_TENSORS)
TYPE_MAP_ROLES = (L.TOKEN_EMBD, *(s.role for s in _SPECS if s.matrix), L.ENGRAM_TABLE)
VECTOR_ROLES = tuple(s.role for s in _SPECS if not s.matrix)
ROLE_ALIASES = {name: role for names in L.TENSOR_NAMES.values() for role, name in names.items() if name != role}
# the types a synthetic file's matrices and tables may take (E4M3_ROW264: ds4's tables only)
WRITABLE_TYPES = tuple(t.name for t in GGMLType)


def parse_type_map(text: str) -> dict[str, str]:
    """`role=TYPE,role=TYPE` -> {role: TYPE}; InputError naming the item that is not `role=TYPE`
    or a role given twice (the names themselves are checked by resolve_type_map)."""
    out: dict[str, str] = {}
    items = text.split(",")
    for i, item in enumerate(items, 1):
        role, eq, type_name = (part.strip() for part in item.partition("="))
        if not eq or not role or not type_name:
            raise InputError(f"type map {text!r}: item {i}, {item.strip()!r}, is not role=TYPE "
                             f"(e.g. attn_q_b=Q4_K,engram_embd=Q8_0)")
        if role in out:
            raise InputError(f"type map {text!r}: role {role!r} is given twice")
        out[role] = type_name
    return out


def resolve_type_map(type_map: Mapping[str, str | GGMLType | RowType], layout: str = L.LLAMA_CPP
                     ) -> dict[str, GGMLType | RowType]:
    """A type map's roles (TYPE_MAP_ROLES, or a layout's name of one: ROLE_ALIASES) and types
    checked and resolved, {role: type}: InputError for a role that is unknown, a vector's, given
    twice (under two names), or a ds4 table of another format than E4M3_ROW264; UnsupportedError
    for a type flashv41 cannot write (or E4M3_ROW264 outside the ds4 layout's tables)."""
    out: dict[str, GGMLType | RowType] = {}
    for given, value in type_map.items():
        role = ROLE_ALIASES.get(given, given)
        if role in VECTOR_ROLES:
            raise InputError(f"type map {given}={value}: {given} is a vector (stored F32, as in published files); "
                             f"a type map sets the matrices and the engram table: {', '.join(TYPE_MAP_ROLES)}")
        if role not in TYPE_MAP_ROLES:
            raise InputError(f"type map {given}={value}: unknown role {given!r} (roles: {', '.join(TYPE_MAP_ROLES)}; "
                             f"or a layout's name of one: {', '.join(ROLE_ALIASES)})")
        if role in out:
            raise InputError(f"type map {given}={value}: role {role} is given twice")
        name = value.name if isinstance(value, (GGMLType, RowType)) else str(value).upper()
        if layout == L.DS4 and role == L.ENGRAM_TABLE:
            if name != RowType.E4M3_ROW264.name:
                raise InputError(f"type map {given}={value}: the ds4 layout's engram tables are "
                                 f"{RowType.E4M3_ROW264.name} ({L.DS4_ENCODING}) only")
            out[role] = RowType.E4M3_ROW264
            continue
        if name in HOST_ONLY_TYPES:
            if role not in synth_moe.EXPERT_ROLES:
                raise UnsupportedError(f"type map {given}={value}: {name} is read by the host only, so only the "
                                       f"routed experts ({', '.join(synth_moe.EXPERT_ROLES)}) may take it")
            out[role] = HOST_ONLY_TYPES[name]  # type: ignore[assignment]
            continue
        if name == RowType.E4M3_ROW264.name:
            raise UnsupportedError(f"type map {given}={value}: {name} is the ds4 layout's engram table format "
                                   f"(--layout ds4 writes its tables so); types here: {', '.join(WRITABLE_TYPES)}")
        if name not in WRITABLE_TYPES:
            raise UnsupportedError(f"type map {given}={value}: unknown type {value!r} "
                                   f"(types: {', '.join(WRITABLE_TYPES)})")
        out[role] = GGMLType[name]
    return out


ProgressFn = Callable[[str, int, int], None]


def _raw_dtype(gtype: GGMLType | RowType) -> GGMLQuantizationType | None:
    if gtype == RowType.E4M3_ROW264:
        return GGMLQuantizationType.I8  # ds4 tables: I8 [rows, 264] in the file
    return None if gtype in (GGMLType.F32, GGMLType.F16) else GGMLQuantizationType(int(gtype))


def _byte_shape(t: PlannedTensor) -> tuple[tuple[int, ...], np.dtype]:
    if t.gtype == GGMLType.F32:
        return t.shape, np.dtype(np.float32)
    if t.gtype == GGMLType.F16:
        return t.shape, np.dtype(np.float16)
    rows = t.shape[:-1] if len(t.shape) > 1 else (1,)
    return (*rows, stored_row_bytes(t.gtype, t.shape[-1])), np.dtype(np.uint8)


def _chunks(t: PlannedTensor, rng: np.random.Generator, max_values: int) -> Iterator[np.ndarray]:
    """The stored form of `t` in row chunks, so a large tensor never sits in memory twice."""
    if len(t.shape) == 1 or int(np.prod(t.shape)) <= max_values:
        yield t.make(rng, t.shape)
        return
    rows_per = max(1, max_values // t.shape[-1])
    for start in range(0, t.shape[0], rows_per):
        yield t.make(rng, (min(rows_per, t.shape[0] - start), *t.shape[1:]))


def _roles_of(p: Preset) -> set[str]:
    """The tensor roles a model of preset `p` has."""
    roles = {L.TOKEN_EMBD}
    for layer, ratio in enumerate(p.compress_ratios):
        engram = layer in p.engram_layers
        specs = L.layer_tensor_specs(ratio, layer in p.kv_sources, layer in p.index_sources, engram)
        roles.update(spec.role for spec in specs)
        if engram:
            roles.add(L.ENGRAM_TABLE)
    if p.moe:
        roles.update(s.role for s in (L.FFN_NORM_TENSOR, *L.MOE_TENSORS, *L.HEAD_TENSORS))
    return roles


def shard_paths(path: str | os.PathLike[str], shards: int) -> list[Path]:
    """The files `write_synthetic(path, shards=shards)` writes: `path` itself for one shard; else
    NAME-00001-of-0000N.gguf ... beside it, NAME being `path`'s name without its last suffix
    (-o model.gguf --shards 3: model-00001-of-00003.gguf, model-00002-of-00003.gguf, model-00003-of-00003.gguf)."""
    out = Path(path)
    if shards == 1:
        return [out]
    return [out.with_name(shard_name(out.stem, i, shards)) for i in range(shards)]


def split_plan(sizes: list[int], shards: int) -> list[int]:
    """The shard of each tensor (given their bytes, in file order): runs in order, of about equal
    bytes, none empty. A tensor goes to the shard its middle byte falls in."""
    total = max(sum(sizes), 1)
    out: list[int] = []
    before = 0
    for i, n in enumerate(sizes):
        want = (2 * before + n) * shards // (2 * total)
        last = out[-1] if out else 0
        # never skip a shard (at most one past the last), never leave fewer tensors than shards to fill
        low = max(last, shards - (len(sizes) - i))
        out.append(0 if not out else min(max(want, low), last + 1))
        before += n
    return out


def write_synthetic(path: str | os.PathLike[str], preset_name: str = "tiny", weight_type: str = "Q8_0",
                    table_type: str | None = None, seed: int = 0, progress: ProgressFn | None = None,
                    shards: int = 1, layout: str = L.LLAMA_CPP, type_map: Mapping[str, str] | None = None,
                    **overrides) -> Path:
    """Write a complete synthetic V4.1 model; returns its path (the first shard's for a split set).

    weight_type: type of the dense attention matrices, the engram projection and the embedding
    (any of WRITABLE_TYPES; a matrix whose rows do not hold whole blocks falls back to Q8_0, then BF16).
    Q3_K .. Q6_K are drawn as random valid super-blocks (draw_k_quant), the others quantised.
    table_type: the engram tables' type (default: the preset's, Q2_K where rows are 256 wide).
    type_map: {role: type} for any tensor role (TYPE_MAP_ROLES: token_embd, attn_q_a, ..., hc_attn_fn,
    engram_wkv, engram_embd; or a layout's name of one), over weight_type, table_type and the fixed
    types (BF16 compressor and index-key matrices, F32 hc mixes and gates). Strict: a mapped tensor
    whose rows do not hold whole blocks of its type is an UnsupportedError, as are an unknown type
    and a role this preset has no tensor of; nothing is written then. No type map: the bytes are
    those of a file written before type maps existed.
    shards: 1 writes one plain GGUF at `path`; N > 1 a gguf-split set of N files named as
    `shard_paths` says.
    layout: "llama.cpp" (default), "mxxm-t" or "ds4": the keys and tensor names written (same tensors;
    ds4's tables E4M3_ROW264, table_type None or "E4M3_ROW264", rows of 256 values).
    overrides: any Preset field, or `engram_rows` (`stored_draw=True`: the Q8_0 and BF16 matrices and
    tables drawn in the stored format, as flash40's are; other bytes, the same statistics).
    """
    if layout not in L.LAYOUTS:
        raise InputError(f"unknown layout {layout!r} (known: {', '.join(L.LAYOUTS)})")
    p = preset(preset_name, **overrides)
    wt = ggml_type(weight_type)
    if layout == L.DS4:
        table_rows_format = FORMATS[RowType.E4M3_ROW264]
        if table_type is not None and str(table_type).upper() != RowType.E4M3_ROW264.name:
            raise InputError(f"table type {table_type}: the ds4 layout's engram tables are "
                             f"{RowType.E4M3_ROW264.name} ({L.DS4_ENCODING}) only")
        if p.engram_layers and p.engram_head_dim != table_rows_format.block_values:
            raise UnsupportedError(f"preset {preset_name!r} has engram rows of {p.engram_head_dim} values; the ds4 "
                                   f"layout's rows hold {table_rows_format.block_values}")
        tt: GGMLType | RowType = RowType.E4M3_ROW264
    else:
        tt = ggml_type(table_type or p.default_table_type)
    for t, what in ((wt, "weight type"), (tt, "table type")):
        if t not in FORMATS:
            raise UnsupportedError(f"{what} {t.name} cannot be written")
    if p.holes not in HOLES:
        raise InputError(f"holes {p.holes!r}: one of {', '.join(repr(h) for h in HOLES)}")
    mapped = resolve_type_map(type_map or {}, layout)
    table_values = FORMATS[tt].block_values
    if L.ENGRAM_TABLE not in mapped and p.engram_head_dim % table_values:
        raise UnsupportedError(
            f"preset {preset_name!r} has engram rows of {p.engram_head_dim} values; a {tt.name} table needs "
            f"rows of whole {table_values}-value blocks (use --table-type Q8_0 or BF16)"
        )
    n_e = len(p.engram_layers)
    primes = engram_primes(n_e, p.max_ngram, p.engram_heads, p.engram_vocab_size)
    offsets = engram_offsets(primes)
    vocab = synthetic_vocab(p.vocab)
    if p.engram_map == "tokenizer" and vocab is not None:  # preset() checked that there is a vocabulary
        token_map, compressed = compressed_token_map(vocab)
    else:
        token_map, compressed = stub_token_map(p.vocab, p.unmapped_tail)
    multipliers = engram_multipliers(p.engram_layers, p.max_ngram, compressed)
    pad_id = int(token_map[p.engram_pad_token])
    table_rows = [int(primes[i].sum()) for i in range(n_e)]
    absent = [role for role in mapped if role not in _roles_of(p)]
    if absent:
        raise InputError(f"type map {absent[0]}={mapped[absent[0]].name}: preset {preset_name!r} has no "
                         f"{absent[0]} tensor (its layers' roles do not carry one)")
    plan = plan_tensors(p, wt, tt, table_rows, layout, mapped)
    if not isinstance(shards, int) or not 1 <= shards <= min(len(plan), 99999):
        raise InputError(f"shards {shards!r}: preset {preset_name!r} has {len(plan)} tensors, so 1 to "
                         f"{min(len(plan), 99999)} shards (at least one tensor in each)")

    out = Path(path)
    if out.is_dir():
        raise InputError(f"{out} is a directory: name the file to write")
    if not out.parent.is_dir():
        missing = "is not a directory" if out.parent.exists() else "does not exist"
        raise InputError(f"cannot write {out}: the folder {out.parent} {missing}")
    targets = shard_paths(out, shards)
    if shards == 1:
        tmp_dir = None
        tmp = out.with_name(out.name + ".partial")
    else:
        # gguf-py's writer names the shards itself (stem-00001-of-0000N.gguf, as shard_paths does):
        # written in a folder of their own, they move into place only once all are complete
        tmp_dir = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
        tmp = tmp_dir / out.name
    writer = GGUFWriter(tmp, L.ARCH)
    if layout == L.DS4:
        writer.add_custom_alignment(L.DS4_ALIGNMENT)
    try:
        writer.add_name(f"flashv41 synthetic {preset_name}")
        _write_metadata(writer, p, primes, offsets, multipliers, token_map, pad_id, table_rows, layout)
        if vocab is not None:  # a vocabulary of 258 tokens or more (the tiny preset's 128 carries none)
            write_vocab(writer, vocab)
        placed = split_plan([planned.nbytes for planned in plan], shards)
        for planned, shard in zip(plan, placed, strict=True):
            if shard == len(writer.tensors):
                writer.tensors.append({})  # what GGUFWriter does itself on reaching a split limit
            shape, dtype = _byte_shape(planned)
            writer.add_tensor_info(planned.name, shape, dtype, planned.nbytes, raw_dtype=_raw_dtype(planned.gtype))
        assert len(writer.tensors) == shards
        writer.write_header_to_file()  # with several shards, also the split keys of each
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        total = sum(planned.nbytes for planned in plan)
        done = 0
        rng = np.random.default_rng(seed)
        assert writer.fout is not None
        holes = _hole_names(p, plan, layout)
        for planned, shard in zip(plan, placed, strict=True):
            fout = writer.fout[shard]
            if planned.name in holes:
                # a hole: seek past the data (the padding before it written as for any tensor)
                writer.write_padding(fout, fout.tell())
                fout.seek(planned.nbytes, os.SEEK_CUR)
                done += planned.nbytes
                if progress is not None:
                    progress(planned.name, done, total)
                writer.write_padding(fout, planned.nbytes)
                writer.tensors[shard].pop(planned.name)
                continue
            first = True
            # MXFP4's quantiser holds 16 candidate errors a value: smaller chunks keep it to 64 MiB
            max_values = 1 << 20 if planned.gtype == GGMLType.MXFP4 else 1 << 24
            for chunk in _chunks(planned, rng, max_values=max_values):
                if first:
                    writer.write_padding(fout, fout.tell())
                    first = False
                chunk.tofile(fout)
                done += chunk.nbytes
                if progress is not None:
                    progress(planned.name, done, total)
            writer.write_padding(fout, planned.nbytes)
            writer.tensors[shard].pop(planned.name)
        if holes:
            # a hole at a file's end with no padding after it: the size is set by extending the file
            for fout in writer.fout:
                fout.truncate()
        writer.close()
        if tmp_dir is None:
            os.replace(tmp, out)
        else:
            for target in targets:
                os.replace(tmp_dir / target.name, target)
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
    finally:
        if tmp_dir is not None:
            shutil.rmtree(tmp_dir, ignore_errors=True)
    return targets[0]


def _hole_names(p: Preset, plan: list[PlannedTensor], layout: str) -> set[str]:
    """The names of the tensors `p.holes` writes as holes."""
    if not p.holes:
        return set()
    tables = {L.tensor_name(layer, L.ENGRAM_TABLE, layout) for layer in p.engram_layers}
    return {t.name for t in plan if t.name in tables or (p.holes == "matrices" and len(t.shape) > 1)}


def binary_unit(nbytes: int) -> tuple[str, int]:
    """The binary unit a size of `nbytes` reads best in, as (name, bytes per unit): KiB, MiB or GiB."""
    for name, size in (("GiB", 1 << 30), ("MiB", 1 << 20)):
        if nbytes >= size:
            return name, size
    return "KiB", 1 << 10


@contextmanager
def progress_bar(desc: str) -> Iterator[ProgressFn]:
    """A progress callback for `write_synthetic` that shows the bytes written under `desc`
    (host.progress.Progress, in the binary unit of the total); the bar is cleared on leaving."""
    shown: list[Progress] = []
    written = [0]

    def report(name: str, done: int, total: int) -> None:
        if not shown:
            unit, scale = binary_unit(total)
            shown.append(Progress(desc, total, unit, unit, scale=scale, decimals=1))
        shown[0].update(done - written[0])
        written[0] = done

    try:
        yield report
    finally:
        if shown:
            shown[0].close()
