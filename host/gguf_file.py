"""GGUF files as host.gguf_model reads them: gguf-py's reader, made to name what a damaged file
breaks (`_Reader`), a file or a split set opened and checked (`open_gguf`, `open_gguf_set`: llama.cpp
gguf-split's `NAME-00001-of-00003.gguf` ..., from any of its shards), the shard names, and typed reads
of the metadata keys (`_Fields`). What the keys and tensors mean for a V4.1 model is host.gguf_model's.

Each failure is a `ModelFormatError` (or `UnsupportedError`) naming the file, the key or tensor,
what was expected and what was found. Oracle: gguf-py's own reader and writer
(tests/test_reliability_gguf.py, test_gguf_splits.py, test_gguf_load.py).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType

from flashv41.host.errors import FlashError, InputError, ModelFormatError, UnsupportedError
from flashv41.host.quants import GGMLType


class _PastTheEnd(ValueError):
    """A header read past the end of the file: the file is truncated, or a count in it is damaged."""

    def __init__(self, end: int, size: int) -> None:
        super().__init__(f"byte {end} of a {size}-byte file")
        self.end, self.size = end, size


class _Reader(GGUFReader):
    """gguf-py's reader, naming the tensor whose data runs past the end of a truncated file (gguf-py
    itself fails there with a bare reshape error), refusing a metadata array whose length runs
    past the end of the file (gguf-py reads an array one element at a time, and a numeric element
    read past the end is empty rather than an error, so a damaged length of 2^40 would loop that
    many times, growing a list, instead of failing), and reading a numeric array in one view: the
    same parts gguf-py builds (one 1-element array an entry), without its one memory-map view an
    entry, which made a damaged length of some 47,000 entries that still fit in the file take
    about two seconds to refuse. An array of strings (a tokenizer's vocabulary and merges) is sliced
    string by string here too: the same parts, a real V4.1 vocabulary's header read in 2.3 s
    instead of 6.0."""

    def _get(self, offset: int, dtype, count: int = 1, override_order=None):
        """gguf-py's read of `count` values at `offset`, refusing one that runs past the end of the
        file (gguf-py itself returns a short array there, which fails later in a NumPy view)."""
        end = int(offset) + int(np.dtype(dtype).itemsize) * int(count)
        if end > int(self.data.shape[0]):
            raise _PastTheEnd(end, int(self.data.shape[0]))
        return super()._get(offset, dtype, count, override_order)

    def _get_field_parts(self, orig_offs: int, raw_type: int):
        if raw_type == GGUFValueType.ARRAY:
            item_type, length = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
            if item_type.size and length.size:
                left = int(self.data.shape[0]) - (orig_offs + 12)
                if int(length[0]) * _min_item_bytes(self, int(item_type[0])) > left:
                    raise ModelFormatError(
                        f"{Path(str(self.data.filename)).name}: metadata array at byte {orig_offs} has "
                        f"{int(length[0])} entries, more than the {left} bytes left in the file can hold"
                    )
                scalar = _scalar_type(self, int(item_type[0]))
                if scalar is not None:
                    return self._numeric_array(orig_offs, item_type, length, scalar)
                if int(item_type[0]) == GGUFValueType.STRING:
                    return self._string_array(orig_offs, item_type, length)
        return super()._get_field_parts(orig_offs, raw_type)

    def _string_array(self, orig_offs: int, item_type, length):
        """gguf-py's (size, parts, data indices, types) of a metadata array of strings at orig_offs:
        per string its 1-element length and its bytes, each a view of the map as gguf-py's own read
        makes them, but sliced directly (gguf-py goes through its general reader twice a string:
        about 10 s for the vocabulary and merges of a real tokenizer, a million parts)."""
        n = int(length[0])
        size = int(self.data.shape[0])
        lengths = length.dtype  # gguf-py's uint64 in the file's byte order
        parts = [item_type, length]
        offs = orig_offs + 12
        for _ in range(n):
            if offs + 8 > size:
                raise _PastTheEnd(offs + 8, size)
            slen = self.data[offs:offs + 8].view(lengths)
            end = offs + 8 + int(slen[0])
            if end > size:
                raise _PastTheEnd(end, size)
            parts += [slen, self.data[offs + 8:end]]
            offs = end
        types = [GGUFValueType.ARRAY] + ([GGUFValueType.STRING] if n else [])
        return offs - orig_offs, parts, list(range(3, 2 + 2 * n, 2)), types

    def _numeric_array(self, orig_offs: int, item_type, length, scalar):
        """gguf-py's (size, parts, data indices, types) of a metadata array of numbers at orig_offs
        (its item type and length read, its entries checked to fit in the file)."""
        n = int(length[0])
        items = np.asarray(self._get(orig_offs + 12, scalar, n))  # a view of the map, not a copy
        parts = [item_type, length, *(items[i:i + 1] for i in range(n))]
        types = [GGUFValueType.ARRAY] + ([GGUFValueType(int(item_type[0]))] if n else [])
        return 12 + int(items.nbytes), parts, list(range(2, 2 + n)), types

    def _build_tensors(self, start_offs: int, fields: list) -> None:
        try:
            super()._build_tensors(start_offs, fields)
        except ValueError:
            size = int(self.data.shape[0])
            fname = Path(str(self.data.filename)).name
            for field in fields:
                # the tensor-info layout gguf-py's own _build_tensors unpacks
                _, name, _, dims, raw_type, offset = field.parts
                tname = bytes(name).decode(errors="replace")
                try:
                    block_values, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(int(raw_type[0]))]
                except (ValueError, KeyError):
                    raise UnsupportedError(
                        f"{fname}: tensor {tname} has ggml type number {int(raw_type[0])}, which gguf-py does "
                        f"not know (flashv41 reads {', '.join(t.name for t in GGMLType)})"
                    ) from None
                end = int(start_offs + offset[0]) + int(np.prod(dims)) * block_bytes // block_values
                if end > size:
                    raise ModelFormatError(
                        f"{fname}: tensor {tname} is truncated: its data ends at byte {end}, the file has {size}"
                    ) from None
            raise


def _scalar_type(reader: GGUFReader, raw_type: int):
    """The NumPy type of a numeric metadata value type, or None (a string, an array, a type gguf-py
    does not know)."""
    try:
        return reader.gguf_scalar_to_np.get(GGUFValueType(raw_type))
    except ValueError:
        return None


def _min_item_bytes(reader: GGUFReader, raw_type: int) -> int:
    """The fewest bytes one metadata array entry of this type takes (1 for a type gguf-py will
    refuse on its own): a scalar's size, a string's 8-byte length, an array's 12-byte header."""
    scalar = _scalar_type(reader, raw_type)
    if scalar is not None:
        return int(np.dtype(scalar).itemsize)
    if raw_type == GGUFValueType.STRING:
        return 8
    return 12 if raw_type == GGUFValueType.ARRAY else 1


def open_gguf(path: str | os.PathLike[str]) -> tuple[GGUFReader, Path]:
    if not isinstance(path, (str, os.PathLike)):
        raise InputError(f"a model is opened from the path of its GGUF file, got {type(path).__name__} {path!r}")
    if str(path) == "":
        raise InputError("a model is opened from the path of its GGUF file, got an empty path")
    p = Path(path)
    if p.is_dir():
        raise ModelFormatError(f"{p} is a directory, not a GGUF model file")
    if not p.is_file():
        raise ModelFormatError(f"{p}: no such file")
    with open(p, "rb") as f:
        head = f.read(16)
    if head[:4] != b"GGUF":
        raise ModelFormatError(f"{p.name}: {_not_gguf(head, p.stat().st_size)}")
    try:
        return _Reader(p, "r"), p
    except FlashError:
        raise
    except _PastTheEnd as exc:
        raise ModelFormatError(f"{p.name}: the file ends inside its GGUF header ({exc.size} bytes, the header "
                               f"reads on to byte {exc.end}): it is truncated (an interrupted download or "
                               "copy?) or its header is damaged") from None
    except KeyError as exc:  # gguf-py: "Duplicate <key> already in list at offset <n>"
        said = str(exc.args[0]) if exc.args else ""
        twice = re.fullmatch(r"Duplicate (.*) already in list at offset (\d+)", said)
        where = f"key {twice[1]!r} appears twice, the second at byte {twice[2]}" if twice else said
        raise ModelFormatError(f"{p.name}: damaged GGUF header: metadata {where}") from None
    except Exception as exc:  # gguf-py raises plain ValueError / IndexError on damaged headers
        version = re.match(r"Sorry, file appears to be version (\d+)", str(exc))
        if version:
            raise ModelFormatError(f"{p.name}: GGUF version {version[1]}, which gguf-py cannot read (it reads "
                                   "versions 2 and 3): the header is damaged, or a newer GGUF writer made the "
                                   "file") from None
        raise ModelFormatError(f"{p.name}: damaged GGUF header (gguf-py could not read it: {exc})") from exc


def _not_gguf(head: bytes, size: int) -> str:
    """Why a file whose first bytes are `head` is not a GGUF file, in words (and what it may be)."""
    if size == 0:
        return "the file is empty (0 bytes), not a GGUF model"
    if size < 4:
        return f"the file has only {size} bytes, too few for a GGUF model (which starts with the 4 bytes 'GGUF')"
    what = ""
    if head[8:10] == b'{"':
        what = "; it looks like a safetensors file (flashv41 reads GGUF only)"
    elif head[:2] == b"PK":
        what = "; it looks like a zip archive (a PyTorch checkpoint?), and flashv41 reads GGUF only"
    elif all(32 <= b < 127 or b in b"\t\r\n" for b in head):
        what = "; it looks like a text file"
    return f"not a GGUF file: it starts with {head[:4]!r} where a GGUF file starts with 'GGUF'{what}"


# llama.cpp gguf-split: shard i (0-based) of n is NAME-{i+1:05d}-of-{n:05d}.gguf, and every shard
# carries these three keys (u16, u16, i32); only the first carries the model's metadata
SPLIT_NO, SPLIT_COUNT, SPLIT_TENSORS = "split.no", "split.count", "split.tensors.count"
_SHARD_NAME = re.compile(r"^(?P<stem>.*)-(?P<no>[0-9]{5})-of-(?P<count>[0-9]{5})\.gguf$")
_INT_TYPES = (GGUFValueType.UINT8, GGUFValueType.INT8, GGUFValueType.UINT16, GGUFValueType.INT16,
              GGUFValueType.UINT32, GGUFValueType.INT32, GGUFValueType.UINT64, GGUFValueType.INT64)


def shard_name(stem: str, no: int, count: int) -> str:
    """The file name of shard `no` (0-based) of `count`: `shard_name("m", 0, 3)` is m-00001-of-00003.gguf."""
    return f"{stem}-{no + 1:05d}-of-{count:05d}.gguf"


def parse_shard_name(name: str) -> tuple[str, int, int] | None:
    """(stem, shard number 0-based, shard count) of a gguf-split file name, or None if it is not one."""
    m = _SHARD_NAME.match(name)
    if m is None:
        return None
    return m["stem"], int(m["no"]) - 1, int(m["count"])


def _split_keys(reader: GGUFReader, fname: str) -> tuple[int, int, int] | None:
    """(split.no, split.count, split.tensors.count) of one file, or None if it has none of them."""
    fields = _Fields(reader, fname)
    keys = (SPLIT_NO, SPLIT_COUNT, SPLIT_TENSORS)
    present = [k for k in keys if fields.has(k)]
    if not present:
        return None
    if len(present) < len(keys):
        missing = next(k for k in keys if k not in present)
        raise ModelFormatError(f"{fname}: metadata key {missing} is missing (the file has {present[0]}: a split shard)")
    no, count, total = (int(fields.scalar(k, _INT_TYPES)) for k in keys)
    return no, count, total


def open_gguf_set(path: str | os.PathLike[str]) -> list[tuple[GGUFReader, Path]]:
    """Every file of the model at `path`, in shard order: [(reader, path)] for a plain GGUF, each
    shard of a split set whichever of them `path` names (the others are found beside it by name).

    The set must be whole and one: every shard present, each one's split.no and split.count those
    of its name, the same split.tensors.count in all, no tensor in two shards, and as many tensors
    in all as split.tensors.count says.
    """
    reader, p = open_gguf(path)
    named = parse_shard_name(p.name)
    keys = _split_keys(reader, p.name)
    if named is None:
        if keys is None or keys[:2] == (0, 1):
            return [(reader, p)]
        raise ModelFormatError(
            f"{p.name}: {SPLIT_COUNT} = {keys[1]} makes it a shard of a split set, but its name does not end in "
            "-NNNNN-of-NNNNN.gguf, the names its other shards are found by"
        )
    stem, no, count = named
    if not 0 <= no < count:
        raise ModelFormatError(f"{p.name}: shard number {no + 1} in the name is outside 1..{count}")
    _check_shard(p, keys, no, count)  # the file named first, before looking for the others
    readers: list[tuple[GGUFReader, Path]] = []
    totals: list[int] = []
    for i in range(count):
        if i == no:
            shard, sp, skeys = reader, p, keys
        else:
            sp = p.with_name(shard_name(stem, i, count))
            if not sp.is_file():
                raise ModelFormatError(f"{sp.name} is missing: shard {i + 1} of the {count}-shard set of {p.name} "
                                       f"(looked in {p.parent})")
            shard, sp = open_gguf(sp)
            skeys = _split_keys(shard, sp.name)
        totals.append(_check_shard(sp, skeys, i, count))
        readers.append((shard, sp))
    first, total = readers[0][1], totals[0]
    for (_, sp), says in zip(readers, totals, strict=True):
        if says != total:
            raise ModelFormatError(f"{sp.name}: {SPLIT_TENSORS} = {says}, but the first shard {first.name} says "
                                   f"{total}: a shard of another set")
    seen: dict[str, Path] = {}
    for shard, sp in readers:
        for t in shard.tensors:
            if t.name in seen:
                raise ModelFormatError(f"{sp.name}: tensor {t.name} is also in {seen[t.name].name} "
                                       "(shards of two different sets?)")
            seen[t.name] = sp
    if len(seen) != total:
        raise ModelFormatError(
            f"{first.name}: the {count} shards hold {len(seen)} tensors, but {SPLIT_TENSORS} = {total} "
            "(a shard of another set, or a shard rewritten)"
        )
    return readers


def _check_shard(sp: Path, keys: tuple[int, int, int] | None, i: int, count: int) -> int:
    """One shard's split keys against its place in the set (its name); returns its split.tensors.count."""
    if keys is None:
        raise ModelFormatError(f"{sp.name}: named like shard {i + 1} of {count} of a split set, but it has no "
                               f"split keys ({SPLIT_NO}, {SPLIT_COUNT}, {SPLIT_TENSORS})")
    no, n, total = keys
    if n != count:
        raise ModelFormatError(f"{sp.name}: {SPLIT_COUNT} = {n}, but the set (its name) has {count} shards")
    if no != i:
        raise ModelFormatError(f"{sp.name}: {SPLIT_NO} = {no} (shard {no + 1}), but its name makes it shard {i + 1} "
                               f"({SPLIT_NO} = {i})")
    return total


class _Fields:
    """Typed access to the metadata of one reader, with errors that name the key."""

    def __init__(self, reader: GGUFReader, fname: str):
        self.reader = reader
        self.fname = fname
        self.note = ""  # appended to a missing key's message (the layout the file was read as)

    def has(self, name: str) -> bool:
        return self.reader.get_field(name) is not None

    def _field(self, name: str):
        field = self.reader.get_field(name)
        if field is None:
            raise ModelFormatError(f"{self.fname}: metadata key {name} is missing{self.note}")
        return field

    def scalar(self, name: str, kinds: tuple[GGUFValueType, ...]) -> int | float | str:
        field = self._field(name)
        if not field.types or field.types[0] not in kinds:
            found = field.types[0].name if field.types else "nothing"
            want = " or ".join(k.name for k in kinds)
            raise ModelFormatError(f"{self.fname}: metadata key {name} should be {want}, found {found}")
        if field.types[0] == GGUFValueType.STRING:
            try:
                return str(bytes(field.parts[field.data[0]]), encoding="utf-8")
            except UnicodeDecodeError as exc:
                raise ModelFormatError(f"{self.fname}: metadata key {name} is not valid UTF-8 ({exc})") from None
        return field.parts[field.data[0]][0].item()

    def u32(self, name: str) -> int:
        """An integer of any integer type (third parties record sizes as u32, i32, u64 ...)."""
        return int(self.scalar(name, _INT_TYPES))

    def f32(self, name: str) -> float:
        return float(self.scalar(name, (GGUFValueType.FLOAT32, GGUFValueType.FLOAT64)))

    def string(self, name: str) -> str:
        return str(self.scalar(name, (GGUFValueType.STRING,)))

    def boolean(self, name: str) -> bool:
        return bool(self.scalar(name, (GGUFValueType.BOOL,)))

    def strings(self, name: str) -> list[str]:
        """A string array (a tokenizer's token list, its merges)."""
        field = self._field(name)
        if field.types[:2] != [GGUFValueType.ARRAY, GGUFValueType.STRING]:
            found = " of ".join(t.name for t in field.types) if field.types else "nothing"
            raise ModelFormatError(f"{self.fname}: metadata key {name} should be a string array, found {found}")
        try:
            return [str(bytes(field.parts[i]), encoding="utf-8") for i in field.data]
        except UnicodeDecodeError as exc:
            raise ModelFormatError(f"{self.fname}: metadata key {name} holds a string that is not valid UTF-8 "
                                   f"({exc})") from None

    def array(self, name: str, unsigned_max_unmapped: bool = False) -> np.ndarray:
        """An integer array, of any integer element type, as int64 (parts concatenated: fast even for
        a 129k-entry token map). unsigned_max_unmapped: an unsigned type's largest value reads as -1
        (how a u32 token map marks an unmapped id)."""
        field = self._field(name)
        if not field.types or field.types[0] != GGUFValueType.ARRAY:
            found = field.types[0].name if field.types else "nothing"
            raise ModelFormatError(f"{self.fname}: metadata key {name} should be an integer array, found {found}")
        if len(field.types) != 2 or field.types[1] not in _INT_TYPES:
            found = " of ".join(t.name for t in field.types)
            raise ModelFormatError(f"{self.fname}: metadata key {name} should be an integer array, found {found}")
        parts = [field.parts[i] for i in field.data]
        if not parts:
            return np.zeros(0, dtype=np.int64)
        values = np.concatenate([np.asarray(p).reshape(-1) for p in parts])
        unmapped = None
        if unsigned_max_unmapped and values.dtype.kind == "u":
            unmapped = values == np.iinfo(values.dtype).max
            values = np.where(unmapped, 0, values)
        if values.dtype == np.uint64 and values.size and values.max() > np.iinfo(np.int64).max:
            raise ModelFormatError(f"{self.fname}: metadata key {name} holds values past int64")
        out = values.astype(np.int64)
        if unmapped is not None:
            out[unmapped] = -1
        return out
