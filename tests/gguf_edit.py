"""Rewriting a GGUF file with changes, through gguf-py (GGUFReader -> GGUFWriter), to build the
broken and foreign files the loader must refuse: tensors dropped or replaced (new shape or type),
metadata keys removed, added or changed, another architecture."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.gguf_reader import ReaderField

ARCH_KEY = "general.architecture"
ALIGNMENT_KEY = "general.alignment"
# the keys GGUFReader reports for the file header itself; GGUFWriter writes those on its own
HEADER_KEYS = ("GGUF.version", "GGUF.tensor_count", "GGUF.kv_count")


def field_value(field: ReaderField) -> tuple[Any, GGUFValueType, GGUFValueType | None]:
    """(value, type, array element type) of one metadata field, as GGUFWriter.add_key_value takes them."""
    vtype = field.types[0]
    if vtype == GGUFValueType.ARRAY:
        return field.contents(), vtype, field.types[-1]
    return field.contents(), vtype, None


def rewrite_gguf(
    src: Path,
    dst: Path,
    *,
    drop_tensors: Iterable[str] = (),
    replace_tensors: Mapping[str, tuple[np.ndarray, GGMLQuantizationType]] | None = None,
    drop_keys: Iterable[str] = (),
    set_keys: Mapping[str, tuple[Any, GGUFValueType, GGUFValueType | None]] | None = None,
    arch: str | None = None,
) -> Path:
    """Copy `src` to `dst` with changes.

    replace_tensors: name -> (stored data, ggml type); data as GGUFReader gives it (typed for F32 /
    F16, uint8 [rows, row bytes] otherwise), so a new shape or type is a new array.
    set_keys: key -> (value, type, array element type or None), added or replacing the old value.
    arch: a different general.architecture; drop_keys may name general.architecture to drop it.
    """
    reader = GGUFReader(src)
    drop_tensors, drop_keys = set(drop_tensors), set(drop_keys)
    replace_tensors, set_keys = dict(replace_tensors or {}), dict(set_keys or {})
    for name in drop_tensors | set(replace_tensors):
        assert any(t.name == name for t in reader.tensors), f"{src.name} has no tensor {name}"
    old_arch = reader.get_field(ARCH_KEY)
    assert old_arch is not None
    writer = GGUFWriter(dst, arch if arch is not None else old_arch.contents())
    if ARCH_KEY in drop_keys:
        writer.kv_data[0].pop(ARCH_KEY)
    for field in reader.fields.values():
        skipped = field.name in HEADER_KEYS or field.name == ARCH_KEY
        if skipped or field.name in drop_keys or field.name in set_keys:
            continue
        value, vtype, sub_type = field_value(field)
        if field.name == ALIGNMENT_KEY:  # (the writer must lay the data out by it, as the reader will read it)
            writer.add_custom_alignment(int(value))
            continue
        writer.add_key_value(field.name, value, vtype, sub_type=sub_type)
    for name, (value, vtype, sub_type) in set_keys.items():
        writer.add_key_value(name, value, vtype, sub_type=sub_type)
    for t in reader.tensors:
        if t.name in drop_tensors:
            continue
        data, qtype = replace_tensors.get(t.name, (np.asarray(t.data), t.tensor_type))
        typed = qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16)
        writer.add_tensor(t.name, np.ascontiguousarray(data), raw_dtype=None if typed else qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def expect_load_error(path: Path, error: type[Exception], *fragments: str) -> None:
    """load_model(path) raises `error` with every fragment in its message."""
    import flashv41

    with pytest.raises(error) as caught:
        flashv41.load_model(path)
    message = str(caught.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
