"""The tokenizer a GGUF file carries as `tokenizer.ggml.*` keys: reading them into a `Vocab`, and the
small byte-level BPE that synthetic models are written with.

Published V4.1 files carry DeepSeek-V3's tokenizer the way llama.cpp's converter writes a Hugging
Face byte-level BPE: `tokenizer.ggml.model` "gpt2", the token strings in GPT-2's byte-to-character
form (a space is "Ġ"), the merges as "LEFT RIGHT" strings in priority order, a type a token
(gguf.TokenType: NORMAL, CONTROL for the begin / end of sentence markers ...), the pre-tokenizer's
name (`tokenizer.ggml.pre`, "deepseek-v3") and the bos / eos ids. This module only reads and writes
those keys (NumPy and gguf-py); building a tokenizer from them is flashv41.text's job.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGUFReader, GGUFWriter, Keys, TokenType

from flashv41.host.errors import ModelFormatError, UnsupportedError
from flashv41.host.gguf_file import _Fields

BPE_MODEL = "gpt2"  # llama.cpp's name for a byte-level BPE, whatever model it came from
SYNTH_PRE = "deepseek-v3"  # the pre-tokenizer synthetic models name, as published V4.1 files do
BOS_TEXT = "<｜begin▁of▁sentence｜>"
EOS_TEXT = "<｜end▁of▁sentence｜>"
# the letters synthetic merges are built from, the commonest English ones first
SYNTH_LETTERS = "etaoinshrdlcumwfgypbvkjxqz"
NO_TOKENIZER = "the file has no tokenizer (tokenizer.ggml.*)"


@dataclass(frozen=True)
class Vocab:
    """A byte-level BPE as a GGUF file stores it.

    tokens: the token strings by id, in GPT-2's byte-to-character form; token_types: int32 [len(tokens)],
    gguf.TokenType values; merges: "LEFT RIGHT" strings, highest priority first; pre: the
    pre-tokenizer's name (tokenizer.ggml.pre); bos_id / eos_id: None where the file names none;
    add_bos: whether the model's input starts with bos (tokenizer.ggml.add_bos_token).
    """

    tokens: list[str]
    token_types: np.ndarray
    merges: list[str]
    pre: str
    bos_id: int | None
    eos_id: int | None
    add_bos: bool


def has_vocab(reader: GGUFReader) -> bool:
    """Whether a file carries a tokenizer (its tokenizer.ggml.model key)."""
    return reader.get_field(Keys.Tokenizer.MODEL) is not None


def read_vocab(reader: GGUFReader, fname: str) -> Vocab:
    """The tokenizer of one file's metadata (a split set's first shard). UnsupportedError for a file
    without one or with another kind than a byte-level BPE; ModelFormatError for keys that do not
    fit together (a missing list, types or merges that are not the token list's)."""
    fields = _Fields(reader, fname)
    if not has_vocab(reader):
        raise UnsupportedError(f"{fname}: {NO_TOKENIZER}")
    kind = fields.string(Keys.Tokenizer.MODEL)
    if kind != BPE_MODEL:
        raise UnsupportedError(f"{fname}: {Keys.Tokenizer.MODEL} is {kind!r}; flashv41 reads only byte-level BPE "
                               f"tokenizers ({BPE_MODEL!r})")
    if not fields.has(Keys.Tokenizer.PRE):
        raise ModelFormatError(f"{fname}: metadata key {Keys.Tokenizer.PRE} is missing: a byte-level BPE needs "
                               "its pre-tokenizer's name")
    tokens = fields.strings(Keys.Tokenizer.LIST)
    if fields.has(Keys.Tokenizer.TOKEN_TYPE):
        types = fields.array(Keys.Tokenizer.TOKEN_TYPE).astype(np.int32)
    else:
        types = np.full(len(tokens), TokenType.NORMAL, dtype=np.int32)
    if types.size != len(tokens):
        raise ModelFormatError(f"{fname}: {Keys.Tokenizer.TOKEN_TYPE} has {types.size} entries, "
                               f"{Keys.Tokenizer.LIST} {len(tokens)}")
    merges = fields.strings(Keys.Tokenizer.MERGES) if fields.has(Keys.Tokenizer.MERGES) else []
    for i, merge in enumerate(merges):
        if merge.find(" ", 1) < 0:
            raise ModelFormatError(f"{fname}: {Keys.Tokenizer.MERGES}[{i}] is {merge!r}, not two tokens "
                                   "with a space between")
    ids = []
    for key in (Keys.Tokenizer.BOS_ID, Keys.Tokenizer.EOS_ID):
        value = fields.u32(key) if fields.has(key) else None
        if value is not None and not 0 <= value < len(tokens):
            raise ModelFormatError(f"{fname}: {key} is {value}, past the {len(tokens)} tokens")
        ids.append(value)
    add_bos = fields.has(Keys.Tokenizer.ADD_BOS) and fields.boolean(Keys.Tokenizer.ADD_BOS)
    return Vocab(tokens, types, merges, fields.string(Keys.Tokenizer.PRE), ids[0], ids[1], add_bos)


def split_merge(merge: str) -> tuple[str, str]:
    """A stored merge's two tokens. The split is at the first space after the first character, as
    llama.cpp splits it (a byte-level token holds no space of its own, so only that one)."""
    at = merge.find(" ", 1)
    return merge[:at], merge[at + 1:]


def byte_tokens() -> list[str]:
    """The 256 one-byte tokens in GPT-2's byte-to-character form, in byte order: the printable
    Latin-1 bytes stand for themselves, the others for the characters from U+0100 on, in order."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    moved = [b for b in range(256) if b not in kept]
    chars = {b: chr(b) for b in kept} | {b: chr(256 + i) for i, b in enumerate(moved)}
    return [chars[b] for b in range(256)]


MIN_SYNTHETIC_VOCAB = 256 + 2  # a byte-level BPE's 256 byte tokens and the two markers


def synthetic_vocab(vocab_size: int) -> Vocab | None:
    """The byte-level BPE a synthetic model of `vocab_size` tokens carries, or None when it has
    fewer than 258 (a byte-level BPE needs all 256 bytes, and the two markers).

    ids 0-255 the byte tokens, then vocab_size - 258 merged tokens, then bos and eos (CONTROL). The
    merges grow words one letter at a time: level 1 is every SYNTH_LETTERS pair and every letter
    after a space ("Ġe"), level n appends each letter to each level n-1 token; they are taken in
    that order until the vocabulary is full. Plain text then encodes into merged tokens, which is
    all a synthetic model needs: its weights are random, so no token means anything.
    """
    if vocab_size < MIN_SYNTHETIC_VOCAB:
        return None
    bytes_ = byte_tokens()
    n_merges = vocab_size - 256 - 2
    merges: list[str] = []
    merged: list[str] = []
    level = [bytes_[ord(" ")], *SYNTH_LETTERS]
    while len(merges) < n_merges:
        start = len(merged)
        for left in level:
            for letter in SYNTH_LETTERS[: n_merges - len(merges)]:
                merges.append(f"{left} {letter}")
                merged.append(left + letter)
        level = merged[start:]
    tokens = [*bytes_, *merged, BOS_TEXT, EOS_TEXT]
    types = np.full(vocab_size, TokenType.NORMAL, dtype=np.int32)
    types[-2:] = TokenType.CONTROL
    return Vocab(tokens, types, merges, SYNTH_PRE, vocab_size - 2, vocab_size - 1, True)


def write_vocab(writer: GGUFWriter, vocab: Vocab) -> None:
    """Add a vocabulary's tokenizer.ggml.* keys to a file being written."""
    writer.add_tokenizer_model(BPE_MODEL)
    writer.add_tokenizer_pre(vocab.pre)
    writer.add_token_list(vocab.tokens)
    writer.add_token_types([int(t) for t in vocab.token_types])
    writer.add_token_merges(vocab.merges)
    if vocab.bos_id is not None:
        writer.add_bos_token_id(vocab.bos_id)
    if vocab.eos_id is not None:
        writer.add_eos_token_id(vocab.eos_id)
    writer.add_add_bos_token(vocab.add_bos)
