"""A sequence in a file: `Sequence.save(path)` writes it, `Engine.load_sequence(path)` reads it back.

The file is a NumPy .npz archive (a zip of .npy arrays, each with its CRC-32), written to a
temporary name beside the target and renamed over it once complete, so a file is whole or absent.
Its arrays:
- "header": UTF-8 JSON: `format` ("flashv41-sequence"), `version` (FORMAT_VERSION), `model` (the
  model's content hash, `model_hash`) and its file name (for messages), `position` P (the positions
  the state holds: a loading engine needs max_seq >= P), the saving engine's `max_seq` and
  `max_tokens` (for the record), the geometry the arrays follow (layers with their compress ratio
  and kv-source role, window, head_dim, index_head_dim), and `digest`: the SHA-256 of every other
  array's name, dtype, shape and bytes;
- "tokens" int64 [P], "mask" bool [P], "calls" int64 [calls, 3] (start, count, masked): the
  history (flashv41.sequence_state.History), from which the hash history is recomputed;
- the used part of the device state (sequence_state.download): "rings" bf16 [L, W, D], and for
  each kv source i "layer{i}.kv_state" and ".score_state" fp32 [r, D], ".compressed" bf16
  [P // r, D], ".index_keys" bf16 [P // r, ID].

Nothing in the state depends on max_seq but the caches' length (RoPE tables and rows are indexed by
position), so a file loads into any engine on the same model whose max_seq holds its P positions.

Reading checks everything on the host before the engine allocates anything (`read_sequence`); a
file that is not such an archive, is cut short or altered (a zip CRC, the digest, an array of the
wrong shape or dtype, ids outside the vocabulary, calls that do not tile 0..P-1), another format
version or another model's is a SequenceFileError, a P past max_seq a CapacityError.

The model hash (`model_hash`) is the SHA-256 of the GGUF metadata as stored (every key and value of
every shard), every tensor's name, type and shape, and the first and last SAMPLE_BYTES of every
tensor's bytes: cheap (a few pages a tensor, whatever the model's size), it tells apart files that
differ in configuration, layout, types or drawn weights, but not two files whose weights differ
only away from their tensors' two ends. A file saved on one copy of a model loads on any
byte-identical copy, wherever it lies; a re-split or re-converted copy is another model to it.
"""

from __future__ import annotations

import hashlib
import json
import os
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from flashv41.host.engram_hash import compress_tokens
from flashv41.host.errors import CapacityError, SequenceFileError
from flashv41.host.model import Model
from flashv41.host.tokens import Tokens
from flashv41.sequence_state import History, download, expected_shapes, upload

if TYPE_CHECKING:
    from flashv41.engine import Engine, Sequence

FORMAT = "flashv41-sequence"
FORMAT_VERSION = 1
SAMPLE_BYTES = 4096


def model_hash(model: Model) -> str:
    """The model's content hash (hex SHA-256; the module docstring says what it covers)."""
    h = hashlib.sha256()
    for reader in model.weights.readers:
        for name, field in reader.fields.items():
            h.update(name.encode())
            for part in field.parts:
                h.update(np.ascontiguousarray(part).tobytes())
    for t in sorted(model.weights, key=lambda t: t.name):
        h.update(f"{t.name}|{getattr(t.ggml_type, 'name', t.ggml_type)}|{t.shape}|{t.nbytes}".encode())
        flat = np.ascontiguousarray(t.data).reshape(-1).view(np.uint8)
        h.update(flat[:SAMPLE_BYTES].tobytes())
        h.update(flat[-SAMPLE_BYTES:].tobytes())
    return h.hexdigest()


def _digest(arrays: dict[str, np.ndarray]) -> str:
    h = hashlib.sha256()
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        h.update(f"{name}|{a.dtype.str}|{a.shape}".encode())
        h.update(a.reshape(-1).view(np.uint8).data)  # the same bytes as a.tobytes(), without copying them
    return h.hexdigest()


def _geometry(engine: Engine) -> dict[str, Any]:
    cfg = engine.cfg
    return {"layers": [[role.ratio, bool(role.kv_source)] for role in cfg.roles], "window": cfg.window,
            "head_dim": cfg.head_dim, "index_head_dim": cfg.index_head_dim}


def write_sequence(seq: Sequence, path: str | os.PathLike[str]) -> None:
    """`seq`'s state into `path` (whole or not at all: written beside it, then renamed)."""
    engine, position = seq.engine, seq.position
    arrays = download(seq.state, position)
    arrays.update(tokens=seq.history.ids[:position].copy(), mask=seq.history.mask[:position].copy(),
                  calls=seq.history.calls_array())
    header = {"format": FORMAT, "version": FORMAT_VERSION, "model": engine.model_hash(),
              "model_file": Path(engine.model.path).name, "position": position, "max_seq": engine.max_seq,
              "max_tokens": engine.max_tokens, **_geometry(engine), "digest": _digest(arrays)}
    target = Path(path)
    temp = target.with_name(f".{target.name}.{os.getpid()}.partial")
    try:
        with open(temp, "wb") as f:
            members = {"header": np.frombuffer(json.dumps(header).encode(), np.uint8), **arrays}
            # numpy's stubs type the keywords as allow_pickle's bool
            np.savez(f, **members)  # type: ignore[arg-type]
        os.replace(temp, target)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise


@dataclass
class SavedSequence:
    """A file's contents, every array checked against the engine that reads it."""

    position: int
    arrays: dict[str, np.ndarray]  # the device state's used part (sequence_state.download's names)
    history: History

    def into(self, seq: Sequence) -> None:
        """Into a new, empty sequence of the checking engine: its device state, history and hash
        history, and a checkpoint at its position (so a truncate back to here is a copy)."""
        stream = seq.engine.attention.stream
        upload(seq.state, self.arrays, stream)
        seq.history = self.history
        engram = seq.engine.cfg.engram
        if seq.hasher is not None and engram is not None:
            ids, mask = self.history.ids[:self.position], self.history.mask[:self.position]
            seq.hasher.history[:self.position] = compress_tokens(engram, Tokens(ids, mask))
        seq.checkpoints.take(seq.state, self.position, stream)


def read_sequence(engine: Engine, path: str | os.PathLike[str]) -> SavedSequence:
    """The checked contents of a saved sequence for `engine`, or the error naming what is wrong."""
    where = str(path)
    try:
        npz = np.load(path, allow_pickle=False)
        if not isinstance(npz, np.lib.npyio.NpzFile):
            raise SequenceFileError(f"{where}: not a flashv41 sequence file (a bare .npy array)")
        with npz:
            names = set(npz.files)
            if "header" not in names:
                raise SequenceFileError(f"{where}: not a flashv41 sequence file (no header)")
            header = _header(npz["header"], where)
            _check_header(engine, header, where)
            arrays = {name: npz[name] for name in names - {"header"}}
    except FileNotFoundError:
        raise SequenceFileError(f"{where}: no such file") from None
    except (zipfile.BadZipFile, EOFError, ValueError, OSError, KeyError) as e:
        raise SequenceFileError(f"{where}: not a flashv41 sequence file, or damaged ({e})") from None
    if _digest(arrays) != header["digest"]:
        raise SequenceFileError(f"{where}: damaged: its arrays do not match the digest its header records")
    return _checked(engine, header, arrays, where)


def _header(raw: np.ndarray, where: str) -> dict[str, Any]:
    try:
        header = json.loads(raw.astype(np.uint8).tobytes().decode())
    except (UnicodeDecodeError, ValueError):
        raise SequenceFileError(f"{where}: not a flashv41 sequence file (its header is not JSON)") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise SequenceFileError(f"{where}: not a flashv41 sequence file (format {header.get('format')!r})"
                                if isinstance(header, dict) else f"{where}: not a flashv41 sequence file")
    return header


def _check_header(engine: Engine, header: dict[str, Any], where: str) -> None:
    """Version, model and size, in that order: each refusal says the first that does not fit."""
    version = header.get("version")
    if version != FORMAT_VERSION:
        raise SequenceFileError(f"{where}: format version {version!r}; this flashv41 reads version {FORMAT_VERSION}")
    model = engine.model_hash()
    if header.get("model") != model:
        raise SequenceFileError(f"{where}: saved from another model ({header.get('model_file')!r}, content hash "
                                f"{str(header.get('model'))[:16]}...); this engine's model "
                                f"{Path(engine.model.path).name!r} hashes to {model[:16]}...")
    position = header.get("position")
    if not isinstance(position, int) or isinstance(position, bool) or position < 0:
        raise SequenceFileError(f"{where}: damaged: its header's position is {position!r}")
    if position > engine.max_seq:
        raise CapacityError(f"{where}: the saved sequence holds {position} positions, past this engine's max_seq "
                            f"{engine.max_seq} (saved from an engine of max_seq {header.get('max_seq')})")
    if any(header.get(k) != v for k, v in _geometry(engine).items()) or not isinstance(header.get("digest"), str):
        raise SequenceFileError(f"{where}: damaged: its header's sizes do not fit the model it names")


def _checked(engine: Engine, header: dict[str, Any], arrays: dict[str, np.ndarray], where: str) -> SavedSequence:
    """The arrays against the engine's geometry at the header's position, the history's values."""
    p = header["position"]
    want = expected_shapes(engine.cfg, p)
    want.update(tokens=((p,), np.dtype(np.int64)), mask=((p,), np.dtype(bool)))
    calls = arrays.get("calls")
    if calls is None or calls.dtype != np.int64 or calls.ndim != 2 or calls.shape[1] != 3:
        raise SequenceFileError(f"{where}: damaged: no calls int64 [n, 3]")
    want["calls"] = (calls.shape, np.dtype(np.int64))
    if set(arrays) != set(want):
        raise SequenceFileError(f"{where}: damaged: arrays {sorted(set(arrays) ^ set(want))} missing or unexpected")
    for name, (shape, dtype) in want.items():
        if arrays[name].shape != shape or arrays[name].dtype != dtype:
            raise SequenceFileError(f"{where}: damaged: {name} is {arrays[name].dtype} {arrays[name].shape}, "
                                    f"expected {dtype} {shape}")
    ids = arrays["tokens"]
    if ids.size and (ids.min() < 0 or ids.max() >= engine.cfg.vocab_size):
        raise SequenceFileError(f"{where}: damaged: token ids outside the vocabulary [0, {engine.cfg.vocab_size})")
    ends = np.cumsum(calls[:, 1]) if calls.size else np.zeros(0, np.int64)
    if (calls.size and ((calls[:, 1] < 1).any() or (calls[:, 0] != ends - calls[:, 1]).any()
                        or not np.isin(calls[:, 2], (0, 1)).all())) or (ends[-1] if ends.size else 0) != p:
        raise SequenceFileError(f"{where}: damaged: its calls do not tile positions 0..{p - 1}")
    state = {name: arrays[name] for name in want if name not in ("tokens", "mask", "calls")}
    return SavedSequence(p, state, History.from_arrays(engine.max_seq, ids, arrays["mask"], calls))

