"""Reading a V4.1 GGUF file (llama.cpp, mxxm-t or ds4 layout): metadata -> `ModelConfig`, tensors -> `WeightStore`.

The layout is told by the keys (`_detect_layout`): mxxm-t files carry explicit kv / index source
lists and their own engram key names; ds4 files HF-named keys, source lists, engram keys without
offsets or geometry (computed from the primes) and I8 engram tables, served as the E4M3_ROW264
table format (host.quants). All map to the same `ModelConfig` (its `layout` says which was read),
and the store serves each tensor by its role whatever the layout calls it. llama.cpp files converted
before 2026-09-11 carry only the engram geometry, under `deepseek4.engram.*`: the rest is rebuilt
from their tokenizer (host.engram_rebuild; `EngramConfig.rebuilt`).

ds4 tables hold E4M3 codes and E8M0 scales that ds4 refuses when NaN. Every row is checked at load
when a table is at most `E4M3_FULL_CHECK_BYTES`; a larger one (384M rows at flash size) only on a
sample of `E4M3_SAMPLE_ROWS` rows spread over it, since reading it all would take minutes. The host
dequantiser (the oracle, host-residency reads) checks every row it reads; the device row gather
cannot raise and yields NaN for such a row (stages.quants.e4m3.dequant_e4m3_row264).

The file is memory-mapped through gguf-py's `GGUFReader` (host.gguf_file: the reader, split sets,
metadata reads); a tensor's bytes are touched only when someone asks for that tensor. A split set
(llama.cpp gguf-split: `NAME-00001-of-00003.gguf` ...) is opened from any of its shards: each shard
is its own complete GGUF, mapped by its own reader, the model metadata comes from the first, and
each tensor is served from the shard that holds it. Everything the engine relies on is validated
here, once: each failure is a `ModelFormatError` (or `UnsupportedError`) naming the key or tensor,
what was expected and what was found.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGUFReader, GGUFValueType

from flashv41.host import gguf_layout as L
from flashv41.host.config import EngramConfig, LayerRole, ModelConfig
from flashv41.host.engram_rebuild import rebuild_for_old_keys
from flashv41.host.engram_tables import engram_offsets
from flashv41.host.errors import ModelFormatError, SequenceStateError, UnsupportedError
from flashv41.host.gguf_file import _Fields, open_gguf_set
from flashv41.host.gguf_moe import read_ffn_head
from flashv41.host.quants import FORMATS, GGML_I8, GGMLType, RowType, check_e4m3_row264, dequantize
from flashv41.host.vocab import NO_TOKENIZER, has_vocab


@dataclass(frozen=True)
class TensorRef:
    """One tensor as stored: name, ggml type, NumPy shape ([out, in] for a matrix) and its bytes,
    a read-only view into the memory-mapped file (uint8 [rows, row_bytes], or a typed array for
    F32 / F16)."""

    name: str
    ggml_type: GGMLType | RowType
    shape: tuple[int, ...]
    data: np.ndarray

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    def row_bytes(self) -> int:
        return FORMATS[self.ggml_type].row_bytes(self.shape[-1])

    def raw(self) -> np.ndarray:
        """The stored bytes as uint8 [rows, row_bytes] (rows = product of the outer dims)."""
        return np.ascontiguousarray(self.data).view(np.uint8).reshape(-1, self.row_bytes())

    def dequantize(self) -> np.ndarray:
        """float32 values in `shape` (exact: every supported type dequantises exactly)."""
        return dequantize(self.raw(), self.ggml_type, self.shape[-1]).reshape(self.shape)


@dataclass(frozen=True)
class ModelFile:
    """One file of a model as opened: its path and how many tensors its own table lists (a split
    set has one per shard, in shard order; a plain GGUF has one)."""

    path: Path
    n_tensors: int


class WeightStore:
    """The tensors of one GGUF file (or of every shard of a split set) by name, layer and role;
    reads nothing until asked."""

    def __init__(self, path: Path, readers: list[GGUFReader], tensors: dict[str, TensorRef],
                 files: tuple[ModelFile, ...] = (), where: dict[str, Path] | None = None,
                 layout: str = L.LLAMA_CPP):
        self.path = path  # the file holding the metadata: the first shard of a split set
        self.layout = layout  # whose names the roles are looked up under (gguf_layout.TENSOR_NAMES)
        self.files = files or (ModelFile(path, len(tensors)),)
        self._readers = readers
        self._tensors = tensors
        self._where = where or {}

    @property
    def split(self) -> bool:
        return len(self.files) > 1

    def names(self) -> list[str]:
        return list(self._tensors)

    @property
    def readers(self) -> list[GGUFReader]:
        """The open readers, one a file (shard), in shard order: their metadata fields as stored."""
        return list(self._readers)

    def file_of(self, name: str) -> Path:
        """The file (shard) whose table lists tensor `name`."""
        return self._where.get(name, self.path)

    def name_of(self, layer: int | None, role: str) -> str:
        """The file name of a role in this store's layout."""
        return L.tensor_name(layer, role, self.layout)

    def has(self, layer: int | None, role: str) -> bool:
        return self.name_of(layer, role) in self._tensors

    def get(self, layer: int | None, role: str) -> TensorRef:
        name = self.name_of(layer, role)
        if not self._readers:
            raise SequenceStateError(f"{self.path.name}: this model was closed (tensor {name} asked for)")
        try:
            return self._tensors[name]
        except KeyError:
            raise ModelFormatError(f"{self.path.name}: tensor {name} is missing") from None

    def __iter__(self):
        return iter(self._tensors.values())

    def close(self) -> None:
        """Drop this store's hold on the memory maps (the store is unusable afterwards).

        A map is released when the last array viewing it is freed. Unmapping it here would leave
        every TensorRef still held elsewhere pointing at unmapped memory: a segfault on next use.
        """
        self._tensors = {}
        self._readers = []


def _detect_layout(fields: _Fields) -> str:
    """The layout of a V4.1 file, told by its keys: "llama.cpp", "mxxm-t" or "ds4". Other architectures,
    the DSpark draft and files with the pre-2026-09-11 engram keys and no tokenizer to rebuild the rest
    from are refused, each with a message saying what the file is and what to do."""
    if not fields.has("general.architecture"):
        raise ModelFormatError(f"{fields.fname}: metadata key general.architecture is missing")
    arch = fields.string("general.architecture")
    if arch == L.DRAFT_ARCH:
        raise UnsupportedError(
            f"{fields.fname}: architecture {arch!r} is a DSpark speculative-decoding draft model (the sidecar "
            f"published beside a V4.1 model), not the model itself; open the {L.ARCH!r} model file "
            "(the first shard of its set) instead"
        )
    if arch != L.ARCH:
        raise UnsupportedError(
            f"{fields.fname}: architecture {arch!r} is not supported (flashv41 runs {L.ARCH!r}, "
            "DeepSeek-V4.1 in the llama.cpp, mxxm-t or ds4 layout)"
        )
    ds4 = [L.key(m) for m in L.DS4_MARKERS if fields.has(L.key(m))]
    if ds4:
        fields.note = f" (the file is read as the {L.DS4} layout: it has {ds4[0]})"
        return L.DS4
    old = sorted(name for name in fields.reader.fields if name.startswith(L.OLD_ENGRAM_PREFIX))
    if old and not fields.has(L.key(L.ENGRAM_KEYS["layer_ids"])) and not has_vocab(fields.reader):
        raise UnsupportedError(
            f"{fields.fname}: metadata key {old[0]} marks a file converted before 2026-09-11, whose engram "
            f"keys are incomplete and under the old {L.OLD_ENGRAM_PREFIX}* prefix; flashv41 rebuilds the missing "
            f"token map, primes, offsets, multipliers and pad id from the file's tokenizer, but {NO_TOKENIZER}; add "
            f"the {L.key('engram.*')} keys with {L.OLD_ENGRAM_REPAIR} (the vcruz305 recipe) and load the repaired file"
        )
    mxxm = [L.key(m) for m in L.MXXM_MARKERS if fields.has(L.key(m))]
    if mxxm:
        fields.note = f" (the file is read as the {L.MXXM_T} layout: it has {mxxm[0]})"
        return L.MXXM_T
    return L.LLAMA_CPP


def _read_tensors(reader: GGUFReader) -> dict[str, TensorRef]:
    out: dict[str, TensorRef] = {}
    for t in reader.tensors:
        shape = tuple(int(x) for x in reversed([int(d) for d in t.shape]))
        try:
            gtype = GGMLType(int(t.tensor_type))
        except ValueError:
            # keep it visible to `info`, refuse it only if the engine needs it (_check_tensor): the
            # raw type number stands in for the GGMLType, on purpose
            out[t.name] = TensorRef(t.name, int(t.tensor_type), shape, t.data)  # type: ignore[arg-type]
            continue
        out[t.name] = TensorRef(t.name, gtype, shape, t.data)
    return out


def _type_name(t: object) -> str:
    if isinstance(t, GGMLType):
        return t.name
    try:
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType(int(t)).name  # type: ignore[call-overload]
    except ValueError:
        return f"type {t}"


def _check_tensor(store: WeightStore, layer: int | None, role: str, shape: tuple[int, ...]) -> TensorRef:
    ref = store.get(layer, role)
    fname = store.file_of(ref.name).name
    if isinstance(ref.ggml_type, RowType) and role != L.ENGRAM_TABLE:
        raise UnsupportedError(
            f"{fname}: tensor {ref.name} has the table format {ref.ggml_type.name}, which only engram tables "
            f"({L.ENGRAM_TABLE}) may use; a matrix the engine multiplies by must be a ggml type"
        )
    if not isinstance(ref.ggml_type, (GGMLType, RowType)):
        supported = ", ".join(t.name for t in GGMLType)
        raise UnsupportedError(
            f"{fname}: tensor {ref.name} has type {_type_name(ref.ggml_type)}, "
            f"which flashv41 cannot read (supported: {supported})"
        )
    if ref.shape != shape:
        raise ModelFormatError(
            f"{fname}: tensor {ref.name} has shape {list(ref.shape)} (NumPy order), "
            f"expected {list(shape)} from the metadata"
        )
    if ref.shape[-1] % FORMATS[ref.ggml_type].block_values:
        raise ModelFormatError(
            f"{fname}: tensor {ref.name} rows of {ref.shape[-1]} values do not hold whole "
            f"{ref.ggml_type.name} blocks"
        )
    return ref


def _engram_config(fields: _Fields, store: WeightStore, n_layers: int, vocab: int,
                   layout: str = L.LLAMA_CPP) -> EngramConfig | None:
    k = {name: L.key(v) for name, v in L.engram_keys(layout).items()}
    # a file with only the old geometry keys: the rest is rebuilt from its tokenizer (host.engram_rebuild)
    old = layout == L.LLAMA_CPP and not fields.has(k["layer_ids"]) and fields.has(L.OLD_ENGRAM_KEYS["layer_ids"])
    if old:
        k = L.OLD_ENGRAM_KEYS | {name: f"the rebuilt {name}" for name in ("multipliers", "primes", "offsets",
                                                                             "token_map")}
    if not fields.has(k["layer_ids"]):
        return None
    fname = fields.fname
    layer_ids = tuple(int(v) for v in fields.array(k["layer_ids"]))
    if not layer_ids:
        return None
    if list(layer_ids) != sorted(set(layer_ids)) or layer_ids[0] < 0 or layer_ids[-1] >= n_layers:
        raise ModelFormatError(
            f"{fname}: {k['layer_ids']} = {list(layer_ids)} must be distinct, increasing layer ids "
            f"below block_count {n_layers}"
        )
    n = len(layer_ids)
    ds4_rows = None
    rebuilt = None
    if layout == L.DS4:
        heads, head_dim, max_ngram, multipliers, primes, offsets, ds4_rows = _ds4_engram_geometry(
            fields, k, store, layer_ids)
        cols = (max_ngram - 1) * heads
    else:
        heads, head_dim, max_ngram = fields.u32(k["n_heads"]), fields.u32(k["head_dim"]), fields.u32(k["max_ngram"])
        if heads < 1 or head_dim < 1 or max_ngram < 2:
            raise ModelFormatError(
                f"{fname}: engram geometry heads={heads}, head_dim={head_dim}, max_ngram_size={max_ngram} "
                f"({k['n_heads']}, {k['head_dim']}, {k['max_ngram']}; need heads >= 1, head_dim >= 1, "
                "max_ngram_size >= 2)"
            )
        cols = (max_ngram - 1) * heads
    if old:
        rows = tuple(int(store.get(layer, L.ENGRAM_TABLE).shape[0]) for layer in layer_ids)
        rebuilt = rebuild_for_old_keys(fields.reader, fname, layer_ids, max_ngram, heads, rows)
        multipliers, primes, offsets = rebuilt.multipliers, rebuilt.primes, rebuilt.offsets
    elif layout != L.DS4:
        multipliers = fields.array(k["multipliers"])
        primes = fields.array(k["primes"])
        offsets = fields.array(k["offsets"])
        for name, arr, want in ((k["multipliers"], multipliers, n * max_ngram), (k["primes"], primes, n * cols),
                                (k["offsets"], offsets, n * cols)):
            if arr.size != want:
                raise ModelFormatError(f"{fname}: {name} has {arr.size} entries, expected {want} "
                                       f"({n} layers x {want // n})")
    token_map = rebuilt.token_map if rebuilt else fields.array(k["token_map"], unsigned_max_unmapped=True)
    primes2 = primes.reshape(n, cols)
    offsets2 = offsets.reshape(n, cols)
    if (primes2 < 2).any():
        raise ModelFormatError(f"{fname}: {k['primes']} holds a value below 2")
    running = np.concatenate([np.zeros((n, 1), np.int64), np.cumsum(primes2, axis=1)[:, :-1]], axis=1)
    bad = np.argwhere(offsets2 != running)
    if bad.size:
        li, ci = bad[0]
        raise ModelFormatError(
            f"{fname}: {k['offsets']}[layer {layer_ids[li]}][{ci}] = {offsets2[li, ci]}, expected "
            f"{running[li, ci]} (offsets are running sums of the layer's primes)"
        )
    if token_map.size == 0 or token_map.min() < -1:
        raise ModelFormatError(f"{fname}: {k['token_map']} must be non-empty, with ids >= 0 or -1 (unmapped)")
    if token_map.size < vocab:
        token_map = np.concatenate([token_map, np.full(vocab - token_map.size, -1, np.int64)])
    if layout == L.MXXM_T:
        pad_id = _mxxm_pad_id(fields, k, token_map)
    elif rebuilt:
        pad_id = rebuilt.pad_id
    else:
        pad_id = fields.u32(k["pad_id"])
    max_id = max(int(token_map.max()), pad_id)
    limit = np.iinfo(np.int64).max // max(max_id, 1)
    if (multipliers < 0).any() or (multipliers > limit).any():
        raise ModelFormatError(
            f"{fname}: {k['multipliers']} holds a value whose product with compressed id {max_id} "
            "overflows int64"
        )
    needed = offsets2[:, -1] + primes2[:, -1]
    table_rows = []
    for i, layer in enumerate(layer_ids):
        table = store.get(layer, L.ENGRAM_TABLE)
        if len(table.shape) != 2 or table.shape[1] != head_dim:
            raise ModelFormatError(
                f"{fname}: tensor {table.name} has shape {list(table.shape)}, expected [rows, {head_dim}] "
                f"({k.get('head_dim', 'the first table width')} = {head_dim})"
            )
        _check_tensor(store, layer, L.ENGRAM_TABLE, table.shape)
        if table.shape[0] < needed[i]:
            raise ModelFormatError(
                f"{fname}: tensor {table.name} has {table.shape[0]} rows, but the hash of layer {layer} "
                f"reaches row {int(needed[i]) - 1} (sum of its primes)"
            )
        if ds4_rows is not None and table.shape[0] != ds4_rows[i]:
            raise ModelFormatError(f"{fname}: tensor {table.name} has {table.shape[0]} rows, but {k['rows']}[{i}] "
                                   f"= {int(ds4_rows[i])}")
        if table.ggml_type == RowType.E4M3_ROW264:
            _check_e4m3_table(table, store.file_of(table.name).name)
        table_rows.append(int(table.shape[0]))
    if layout == L.MXXM_T:
        _check_mxxm_engram_sizes(fields, k, token_map, table_rows)
    elif layout == L.DS4:
        _check_compressed_vocab(fields, k, token_map)
    return EngramConfig(
        layer_ids=layer_ids,
        n_heads=heads,
        head_dim=head_dim,
        max_ngram=max_ngram,
        multipliers=multipliers.reshape(n, max_ngram),
        primes=primes.reshape(n, max_ngram - 1, heads),
        offsets=offsets.reshape(n, max_ngram - 1, heads),
        token_map=token_map,
        pad_id=pad_id,
        table_rows=tuple(table_rows),
        rebuilt=rebuilt is not None,
    )


# ds4 tables are checked for NaN codes and scales in full up to this size, else on a sample
E4M3_FULL_CHECK_BYTES = 64 << 20
E4M3_SAMPLE_ROWS = 4096
_DS4_TABLE = re.compile(r"^blk\.[0-9]+\." + re.escape(L.TENSOR_NAMES[L.DS4][L.ENGRAM_TABLE]) + r"\.weight$")


def _ds4_tables(tensors: dict[str, TensorRef], where: dict[str, Path]) -> None:
    """ds4's engram tables, I8 [rows, 264] in the file, served as E4M3_ROW264 [rows, 256] (in place)."""
    fmt = FORMATS[RowType.E4M3_ROW264]
    for name, ref in list(tensors.items()):
        if not _DS4_TABLE.match(name) or isinstance(ref.ggml_type, GGMLType) or int(ref.ggml_type) != GGML_I8:
            continue
        if len(ref.shape) != 2 or ref.shape[1] != fmt.block_bytes:
            raise ModelFormatError(
                f"{where[name].name}: tensor {name} is I8 {list(ref.shape)} (NumPy order), but a ds4 engram table "
                f"({L.DS4_ENCODING}) is I8 [rows, {fmt.block_bytes}]: rows of {fmt.block_bytes} bytes"
            )
        tensors[name] = TensorRef(name, RowType.E4M3_ROW264, (ref.shape[0], fmt.block_values), ref.data)


def _check_e4m3_table(table: TensorRef, fname: str) -> None:
    """No NaN code or scale in an E4M3_ROW264 table: every row of a table up to E4M3_FULL_CHECK_BYTES,
    else E4M3_SAMPLE_ROWS rows spread evenly over it, the first and last among them (module docstring)."""
    raw = table.raw()
    rows = None
    if table.nbytes > E4M3_FULL_CHECK_BYTES:
        rows = np.unique(np.linspace(0, raw.shape[0] - 1, E4M3_SAMPLE_ROWS).astype(np.int64))
        raw = raw[rows]
    try:
        check_e4m3_row264(raw, rows=rows)
    except ModelFormatError as exc:
        raise ModelFormatError(f"{fname}: tensor {table.name}: {exc}") from None


def _ds4_engram_geometry(fields: _Fields, k: dict[str, str], store: WeightStore, layer_ids: tuple[int, ...]):
    """ds4 records no engram heads, n-gram size, head width or offsets: max_ngram is the multipliers
    per layer, heads the primes per layer / (max_ngram - 1), the width the tables', the offsets the
    running sums of each layer's primes, which must sum to its `engram.rows`. Returns (heads,
    head_dim, max_ngram, multipliers, primes, offsets, rows), the arrays flat int64."""
    fname = fields.fname
    encoding = fields.string(k["encoding"])
    if encoding != L.DS4_ENCODING:
        raise UnsupportedError(f"{fname}: {k['encoding']} = {encoding!r}; flashv41 reads ds4 engram tables "
                               f"encoded {L.DS4_ENCODING!r}")
    n = len(layer_ids)
    multipliers = fields.array(k["multipliers"])
    primes = fields.array(k["primes"])
    rows = fields.array(k["rows"])
    if multipliers.size % n or multipliers.size // n < 2:
        raise ModelFormatError(f"{fname}: {k['multipliers']} has {multipliers.size} entries, expected max_ngram_size "
                               f"(>= 2) of them for each of the {n} engram layers")
    max_ngram = multipliers.size // n
    per_layer = primes.size // n
    if primes.size == 0 or primes.size % n or per_layer % (max_ngram - 1):
        raise ModelFormatError(f"{fname}: {k['primes']} has {primes.size} entries, expected heads x {max_ngram - 1} "
                               f"(n-gram orders: {k['multipliers']} gives max_ngram_size {max_ngram}) for each of "
                               f"the {n} engram layers")
    heads = per_layer // (max_ngram - 1)
    if rows.size != n:
        raise ModelFormatError(f"{fname}: {k['rows']} has {rows.size} entries, expected one per engram layer ({n})")
    sums = primes.reshape(n, per_layer).sum(axis=1)
    bad = np.flatnonzero(sums != rows)
    if bad.size:
        i = int(bad[0])
        raise ModelFormatError(
            f"{fname}: the primes of engram layer {layer_ids[i]} ({k['primes']}) sum to {int(sums[i])}, but "
            f"{k['rows']}[{i}] = {int(rows[i])} (each layer's primes must sum to its table rows)"
        )
    offsets = engram_offsets(primes.reshape(n, max_ngram - 1, heads)).reshape(-1)
    head_dim = int(store.get(layer_ids[0], L.ENGRAM_TABLE).shape[-1])
    return heads, head_dim, max_ngram, multipliers, primes, offsets, rows


def _mxxm_pad_id(fields: _Fields, k: dict[str, str], token_map: np.ndarray) -> int:
    """mxxm-t records the RAW pad token id: its compressed id is the token map's entry for it."""
    raw = fields.u32(k["pad_token_id"])
    if not 0 <= raw < token_map.size:
        raise ModelFormatError(f"{fields.fname}: {k['pad_token_id']} = {raw} is outside the vocabulary "
                               f"(token ids 0..{token_map.size - 1})")
    pad_id = int(token_map[raw])
    if pad_id < 0:
        raise ModelFormatError(
            f"{fields.fname}: {k['pad_token_id']} = {raw} is a raw token id that {k['token_map']} leaves unmapped, "
            "so it has no compressed id to pad n-grams with"
        )
    return pad_id


def _check_mxxm_engram_sizes(fields: _Fields, k: dict[str, str], token_map: np.ndarray,
                             table_rows: list[int]) -> None:
    """mxxm-t's two recorded sizes against what they describe: the compressed vocabulary against the
    token map, the table rows (an array: one per engram layer) against the tables."""
    _check_compressed_vocab(fields, k, token_map)
    name = k["num_embeddings"]
    field = fields.reader.get_field(name)
    if field is not None and field.types and field.types[0] == GGUFValueType.ARRAY:
        rows = fields.array(name)
        if rows.tolist() != table_rows:
            raise ModelFormatError(f"{fields.fname}: {name} = {rows.tolist()}, but the engram tables have "
                                   f"{table_rows} rows")
    elif fields.u32(name) < 1:  # a single number: what it counts is not recorded, only its range is checked
        raise ModelFormatError(f"{fields.fname}: {name} = {fields.u32(name)}, expected a row count >= 1")


def _check_compressed_vocab(fields: _Fields, k: dict[str, str], token_map: np.ndarray) -> None:
    """The recorded compressed vocabulary size (mxxm-t, ds4) against the token map it counts."""
    compressed = fields.u32(k["compressed_vocab"])
    top = int(token_map.max())
    if compressed != top + 1:
        raise ModelFormatError(
            f"{fields.fname}: {k['compressed_vocab']} = {compressed}, but {k['token_map']} maps onto compressed "
            f"ids 0..{top} ({top + 1} of them)"
        )


def _source_layers(fields: _Fields, store: WeightStore, n: int) -> tuple[list[bool], list[bool]]:
    """Which layers are kv sources and which index sources: told by their tensors (llama.cpp), or
    listed (mxxm-t, ds4), and then the lists must agree with the tensors present, both ways."""
    kv_roles = ("attn_compressor_kv", "indexer.attn_k")  # a kv source's compressor and index keys
    idx_roles = ("indexer.attn_q_b",)
    lists = L.source_list_keys(store.layout)
    if lists is None:
        return ([store.has(i, kv_roles[0]) for i in range(n)], [store.has(i, idx_roles[0]) for i in range(n)])
    out = []
    for list_key, roles, what in ((lists[0], kv_roles, "kv source"), (lists[1], idx_roles, "index source")):
        name = L.key(list_key)
        listed = [int(v) for v in fields.array(name)]
        if listed != sorted(set(listed)) or (listed and (listed[0] < 0 or listed[-1] >= n)):
            raise ModelFormatError(f"{fields.fname}: {name} = {listed} must be distinct, increasing layer ids "
                                   f"below block_count {n}")
        for i in range(n):
            present = [store.name_of(i, r) for r in roles if store.has(i, r)]
            if i in listed and len(present) < len(roles):
                missing = next(store.name_of(i, r) for r in roles if not store.has(i, r))
                raise ModelFormatError(f"{fields.fname}: layer {i} is listed in {name} (a {what}), but tensor "
                                       f"{missing} is missing")
            if i not in listed and present:
                raise ModelFormatError(f"{fields.fname}: layer {i} has tensor {present[0]} (a {what}'s), but is not "
                                       f"listed in {name} = {listed}")
        out.append([i in listed for i in range(n)])
    return out[0], out[1]


def _roles(cfg_values: dict, store: WeightStore, engram_layers: tuple[int, ...], fname: str,
           kv: list[bool], idx: list[bool]) -> tuple[LayerRole, ...]:
    n = cfg_values["n_layers"]
    ratios = cfg_values["compress_ratios"]
    cand = cfg_values["candidate_source"]
    if 0 <= cand < n and not idx[cand]:
        raise ModelFormatError(
            f"{fname}: candidate source layer {cand} has no indexer (tensor "
            f"{store.name_of(cand, 'indexer.attn_q_b')} is missing)"
        )
    roles = []
    last_kv = last_idx = None
    for i in range(n):
        r = ratios[i]
        if r not in (0, 1, 2):
            raise UnsupportedError(f"{fname}: layer {i} has compress ratio {r}; V4.1 uses 0, 1 and 2")
        if (kv[i] or idx[i]) and r == 0:
            raise ModelFormatError(f"{fname}: layer {i} has compressor or indexer tensors but compress ratio 0")
        if kv[i] and not idx[i]:
            # index keys are made by the layer's indexer (reference: Indexer.owns_k), so a kv source
            # without one would publish a compressed cache with no index keys behind it
            raise ModelFormatError(
                f"{fname}: layer {i} is a kv source (attn_compressor_kv) without an indexer "
                f"({store.name_of(i, 'indexer.attn_q_b')} is missing)"
            )
        if kv[i]:
            last_kv = i
        if idx[i]:
            last_idx = i
        if r > 0:
            sources = (("kv source (attn_compressor_kv)", last_kv), ("index source (indexer.attn_q_b)", last_idx))
            for what, src in sources:
                if src is None:
                    raise ModelFormatError(f"{fname}: layer {i} (compress ratio {r}) has no {what} at or before it")
                if ratios[src] != r:
                    raise ModelFormatError(
                        f"{fname}: layer {i} (compress ratio {r}) reads the {what} of layer {src}, "
                        f"whose ratio is {ratios[src]}"
                    )
        roles.append(LayerRole(
            layer=i,
            ratio=r,
            kv_source=kv[i],
            index_source=idx[i],
            candidate_source=idx[i] and i == cand,
            uses_candidates=idx[i] and 0 <= cand < i and cand < n,
            engram=i in engram_layers,
        ))
    return tuple(roles)


def read_model(path: str | os.PathLike[str]) -> tuple[ModelConfig, WeightStore]:
    """Open and validate a V4.1 GGUF (a plain file, or any shard of a split set); returns its config
    and a lazily reading weight store."""
    shards = open_gguf_set(path)
    reader, p = shards[0]  # a split set's metadata is in its first shard only
    fields = _Fields(reader, p.name)
    layout = _detect_layout(fields)
    tensors: dict[str, TensorRef] = {}
    where: dict[str, Path] = {}
    files = []
    for shard, sp in shards:
        own = _read_tensors(shard)
        tensors.update(own)
        where.update(dict.fromkeys(own, sp))
        files.append(ModelFile(sp, len(own)))
    if layout == L.DS4:
        _ds4_tables(tensors, where)
    store = WeightStore(p, [r for r, _ in shards], tensors, tuple(files), where, layout)
    values, ratios_key, float_keys = _ds4_values(fields) if layout == L.DS4 else _llama_values(fields)
    embd = store.get(None, L.TOKEN_EMBD)
    values["vocab_size"] = fields.u32(L.key(L.KEY_VOCAB)) if fields.has(L.key(L.KEY_VOCAB)) else embd.shape[0]
    # before the engram tables, whose token map is padded out to the vocabulary: a damaged
    # vocab_size must not turn into a huge allocation
    if embd.shape[:1] != (values["vocab_size"],):
        raise ModelFormatError(
            f"{p.name}: tensor {embd.name} has shape {list(embd.shape)} (NumPy order), but "
            f"{L.key(L.KEY_VOCAB)} is {values['vocab_size']}"
        )
    n = values["n_layers"]
    ratios = fields.array(L.key(ratios_key))
    if ratios.size < n:
        raise ModelFormatError(
            f"{p.name}: {L.key(ratios_key)} has {ratios.size} entries, "
            f"{'num_hidden_layers' if layout == L.DS4 else 'block_count'} is {n}"
        )
    values["compress_ratios"] = tuple(int(r) for r in ratios[:n])
    kv_keys = ((L.DS4_KEY_HEAD_COUNT_KV, 1),) if layout == L.DS4 else (
        (L.KEY_HEAD_COUNT_KV, 1), (L.KEY_VALUE_LENGTH, values["head_dim"]))
    for kv_key, want in kv_keys:
        if fields.has(L.key(kv_key)) and fields.u32(L.key(kv_key)) != want:
            raise UnsupportedError(
                f"{p.name}: {L.key(kv_key)} = {fields.u32(L.key(kv_key))}, V4.1 attention needs {want}"
            )
    _check_geometry(values, p.name, float_keys)
    engram = _engram_config(fields, store, n, values["vocab_size"], layout)
    kv, idx = _source_layers(fields, store, n)
    values["roles"] = _roles(values, store, engram.layer_ids if engram else (), p.name, kv, idx)
    values.update(read_ffn_head(fields, store, values, layout))
    cfg = ModelConfig(engram=engram, layout=layout, **values)
    validate_tensors(cfg, store)
    return cfg, store


def _llama_values(fields: _Fields) -> tuple[dict, str, dict[str, str]]:
    """The config values of a llama.cpp or mxxm-t file's keys; with the compress-ratio key and the
    float keys (name -> key) that _check_geometry names."""
    values: dict = {name: fields.u32(L.key(k)) for name, k in L.U32_KEYS.items()}
    values.update({name: fields.f32(L.key(k)) for name, k in L.F32_KEYS.items()})
    for name, (k, default) in L.OPTIONAL_U32_KEYS.items():
        values[name] = fields.u32(L.key(k)) if fields.has(L.key(k)) else default
    return values, L.KEY_COMPRESS_RATIOS, L.F32_KEYS


def _ds4_values(fields: _Fields) -> tuple[dict, str, dict[str, str]]:
    """The config values of a ds4 file's HF-named keys (gguf_layout.DS4_*), cross-checked against
    the config.json string it carries where both say a number."""
    values: dict = {name: fields.u32(L.key(k)) for name, k in L.DS4_U32_KEYS.items()}
    values.update({name: float(fields.u32(L.key(k))) for name, k in L.DS4_U32_FLOAT_KEYS.items()})
    values.update({name: fields.f32(L.key(k)) for name, k in L.DS4_F32_KEYS.items()})
    for name, k in L.DS4_F32_INT_KEYS.items():
        v = fields.f32(L.key(k))
        if not (math.isfinite(v) and v == int(v) and v >= 1):
            raise ModelFormatError(f"{fields.fname}: metadata key {L.key(k)} = {v!r}, expected a whole number >= 1")
        values[name] = int(v)
    _cross_check_ds4_config(fields, values)
    floats = {**L.DS4_U32_FLOAT_KEYS, **L.DS4_F32_KEYS}
    return values, L.DS4_KEY_COMPRESS_RATIOS, floats


def _cross_check_ds4_config(fields: _Fields, values: dict) -> None:
    """`deepseek41.config`, ds4's copy of config.json (optional): valid JSON, and every integer size
    it shares with the keys equal to the key's."""
    name = L.key(L.DS4_KEY_CONFIG)
    if not fields.has(name):
        return
    try:
        config = json.loads(fields.string(name))
    except json.JSONDecodeError as exc:
        raise ModelFormatError(f"{fields.fname}: metadata key {name} is not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise ModelFormatError(f"{fields.fname}: metadata key {name} should hold a JSON object (config.json)")
    for field, k in L.DS4_U32_KEYS.items():
        said = config.get(k)
        if isinstance(said, int) and not isinstance(said, bool) and said != values[field]:
            raise ModelFormatError(f"{fields.fname}: {name} says {k} = {said}, but metadata key {L.key(k)} = "
                                   f"{values[field]}")


MAX_SINKHORN_ITERS = 1000


def _check_geometry(v: dict, fname: str, float_keys: dict[str, str] = L.F32_KEYS) -> None:
    """Size relations the math relies on (RoPE pairs, quantiser blocks, output groups)."""
    rules = [
        (v["n_layers"] >= 1, "block_count must be at least 1"),
        (v["rope_dim"] % 2 == 0 and 0 < v["rope_dim"] <= v["head_dim"],
         "rope.dimension_count must be even and <= key_length"),
        (v["rope_dim"] <= v["index_head_dim"], "rope.dimension_count must be <= attention.indexer.key_length"),
        (v["head_dim"] % 32 == 0, "attention.key_length must be a multiple of 32 (fp8 and fp4 quantiser blocks)"),
        (v["index_head_dim"] % 32 == 0, "attention.indexer.key_length must be a multiple of 32 (fp4 blocks)"),
        (v["o_groups"] >= 1 and (v["n_heads"] * v["head_dim"]) % v["o_groups"] == 0,
         "heads * key_length must split into output groups"),
        (v["window"] >= 1 and v["hc"] >= 1 and v["sinkhorn_iters"] >= 1,
         "window, hc and sinkhorn iterations must be >= 1"),
        # every mix of every step runs this many iterations (published files: 20); far more could
        # only be a damaged value, and would stall each step
        (v["sinkhorn_iters"] <= MAX_SINKHORN_ITERS,
         f"hyper_connection.sinkhorn_iterations must be at most {MAX_SINKHORN_ITERS}"),
        (v["index_topk"] >= 1 and v["candidate_block_size"] >= 1,
         "indexer top_k and candidate block size must be >= 1"),
        # the window ring and the top-k lists are allocated at these sizes; past the context they
        # could only be a damaged value
        (v["window"] <= v["context_length"] and v["index_topk"] <= v["context_length"],
         "attention.sliding_window and attention.indexer.top_k must not exceed context_length"),
    ]
    for ok, message in rules:
        if not ok:
            raise ModelFormatError(f"{fname}: {message}")
    for name, k in float_keys.items():
        # every one is a positive scale (epsilons, RoPE bases, YaRN factor and betas); a NaN, an
        # infinity or a sign flip would only surface later as NaN highways
        if not (math.isfinite(v[name]) and v[name] > 0):
            raise ModelFormatError(f"{fname}: metadata key {L.key(k)} = {v[name]!r}, expected a finite value > 0")


def dims_of(cfg: ModelConfig) -> L.Dims:
    e = cfg.engram
    return L.Dims(
        vocab=cfg.vocab_size, dim=cfg.dim, n_heads=cfg.n_heads, head_dim=cfg.head_dim, q_lora=cfg.q_lora_rank,
        o_groups=cfg.o_groups, o_lora=cfg.o_lora_rank, hc=cfg.hc, index_heads=cfg.index_heads,
        index_head_dim=cfg.index_head_dim, engram_head_dim=e.head_dim if e else 0, engram_cols=e.cols if e else 0,
    )


def validate_tensors(cfg: ModelConfig, store: WeightStore) -> None:
    """Every tensor the engine reads: present, supported type, the shape the config implies."""
    d = dims_of(cfg)
    _check_tensor(store, None, L.TOKEN_EMBD, (cfg.vocab_size, cfg.dim))
    for role in cfg.roles:
        for spec in L.layer_tensor_specs(role.ratio, role.kv_source, role.index_source, role.engram):
            _check_tensor(store, role.layer, spec.role, spec.shape(d))
