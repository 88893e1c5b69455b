"""Rebuilding the engram hash tables of a file that lacks them, from its tokenizer and its table sizes.

Files converted before 2026-09-11 carry only the engram geometry (layer ids, heads, head width,
n-gram size, under `deepseek4.engram.*`). The V4.1 reference (`engram.py`) never stores the rest: it
derives it at start-up, and so can we, the same way.

- token map (`build_compressed_token_map`): every token id in order; its text is the tokenizer's
  decoding of that one id (the byte-level decoder: token characters back to bytes, UTF-8 with
  replacement characters); a text holding U+FFFD (a partial UTF-8 byte token) is keyed by the raw
  token string, any other by its normal form (NORMALISATION, below), or by the text itself where the
  normal form is empty. Each new key takes the next compressed id, 0, 1, 2 ...; the compressed
  vocabulary is the number of keys.
- pad id: the compressed id of the raw pad id the official config names (`engram_pad_id` 2).
- primes (`find_next_prime`, host.engram_tables.engram_primes): the consecutive primes above
  `engram_vocab_size - 1`, [layer][n-gram][head] in order. That size is not in these files, but each
  layer's table holds exactly the sum of its primes (`engram_num_embeddings`), so the first layer's
  table size finds the run of primes, which fixes them all; every other layer's size is checked.
- offsets: running sums of each layer's primes (host.engram_tables.engram_offsets).
- multipliers (`compute_hash_multipliers`, host.engram_tables.engram_multipliers): per layer, from
  NumPy's PCG64 seeded with 10007 * layer id, bounded by the compressed vocabulary size.

NORMALISATION is the reference's `tokenizers` normaliser sequence, written here with the standard
library: NFKC, NFD, strip accents (drop every General_Category Mark character), lowercase one
character at a time (no final-sigma rule), runs of space / tab / CR / LF to one space, a text that
is then a single space kept as one, then strip Unicode White_Space from both ends. Python's Unicode
database may be newer than the one the `tokenizers` library was built with: characters added or
changed since may normalise differently (Python 3.11's Unicode 14 against tokenizers 0.23: 442 code
points of 1.1M, none below U+07FD, all in later scripts and new letters; tests/test_engram_rebuild.py
holds every code point below U+07FD and a set of hard cases to the library). For V4.1-Flash's own
tables the rebuilt vocabulary must also count the official 99,092 keys, as the reference asserts.

Oracle: the reference's own derivation run with `tokenizers` (tests/test_engram_rebuild.py), and
the tables of a file that stores them.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass

import numpy as np
from gguf import GGUFReader, TokenType

from flashv41.host import gguf_layout as L
from flashv41.host.engram_tables import engram_multipliers, engram_offsets, engram_primes, is_prime
from flashv41.host.errors import ModelFormatError, UnsupportedError
from flashv41.host.vocab import Vocab, byte_tokens, read_vocab

# the official config.json (deepseek-ai/DeepSeek-V4.1-Flash, inference/): the raw token id whose
# compressed id pads blocked n-gram slots (engram_pad_id), V4.1-Flash's table sizes
# (engram_num_embeddings), and the compressed vocabulary those tables were trained with
V41_ENGRAM_PAD_ID = 2
V41_NUM_EMBEDDINGS = (384_006_168, 384_016_682)
V41_COMPRESSED_VOCAB = 99_092

# a private-use character, as in the reference: a text that is one space keeps it through the strip
_SENTINEL = "\ue000"
_SPACE_RUN = re.compile(r"[ \t\r\n]+")
# Unicode's White_Space property (what Rust's char::is_whitespace tests, so the library's Strip);
# str.strip() would also take U+001C..U+001F, which are not White_Space
_WHITE_SPACE = ("\t\n\x0b\x0c\r \x85\xa0\u1680" + "".join(chr(c) for c in range(0x2000, 0x200B))
                + "\u2028\u2029\u202f\u205f\u3000")
_MARKS = ("Mn", "Mc", "Me")
_CHAR_BYTES = {c: b for b, c in enumerate(byte_tokens())}


@dataclass(frozen=True)
class RebuiltTables:
    """The engram tables a file lacks, as the reference derives them.

    token_map: int64 [tokens], raw id -> compressed id (-1 for the llama.cpp converter's UNUSED fillers);
    compressed_vocab: keys in the map; pad_id: compressed; multipliers: int64 [layers, max_ngram];
    primes, offsets: int64 [layers, max_ngram - 1, heads].
    """

    token_map: np.ndarray
    compressed_vocab: int
    pad_id: int
    multipliers: np.ndarray
    primes: np.ndarray
    offsets: np.ndarray


def normalise(text: str) -> str:
    """A token text's normal form, as the reference's normaliser sequence gives it (module docstring)."""
    text = unicodedata.normalize("NFD", unicodedata.normalize("NFKC", text))
    text = "".join(c for c in text if unicodedata.category(c) not in _MARKS)
    # per character: the library lowercases each character alone, so a final capital sigma is "σ"
    text = "".join(c.lower() for c in text)
    text = _SPACE_RUN.sub(" ", text)
    if text == " ":
        text = _SENTINEL
    return text.strip(_WHITE_SPACE).replace(_SENTINEL, " ")


def token_text(token: str) -> str:
    """What the byte-level decoder makes of one token string: its characters mapped back to bytes
    (a token with any character outside the 256 byte characters, such as an added marker, stands
    for its own UTF-8 bytes), decoded as UTF-8 with U+FFFD for bytes that are no whole character."""
    try:
        raw = bytes(_CHAR_BYTES[c] for c in token)
    except KeyError:
        raw = token.encode("utf-8")
    return raw.decode("utf-8", errors="replace")


def compressed_token_map(vocab: Vocab, skip_normalisation: bool = False) -> tuple[np.ndarray, int]:
    """int64 [tokens] raw id -> compressed id, and the number of compressed ids (module docstring).
    UNUSED tokens (llama.cpp's "[PAD...]" fillers for ids the tokenizer lacks, which the reference's
    lookup has no entry for) map to -1. skip_normalisation keys every text as it is (for the tests'
    check that the normalisation matters)."""
    keys: dict[str, int] = {}
    out = np.full(len(vocab.tokens), -1, dtype=np.int64)
    for i, token in enumerate(vocab.tokens):
        if vocab.token_types[i] == TokenType.UNUSED:
            continue
        text = token_text(token)
        if "\ufffd" in text:
            key = token
        else:
            key = (text if skip_normalisation else normalise(text)) or text
        out[i] = keys.setdefault(key, len(keys))
    return out, len(keys)


def primes_from_rows(table_rows: tuple[int, ...], max_ngram: int, heads: int, fname: str) -> np.ndarray:
    """int64 [layers, max_ngram - 1, heads]: the prime construction whose per-layer sums are the tables'
    row counts. The first table's rows are the sum of `cols` consecutive primes; sums of such runs grow
    with their start, so at most one run fits, and it lies around rows / cols. ModelFormatError where
    none fits or a later table's rows are not its layer's sum."""
    cols = (max_ngram - 1) * heads
    rows0 = int(table_rows[0])
    mean = rows0 // cols
    below: list[int] = []
    n = mean
    while len(below) < cols and n >= 2:
        if is_prime(n):
            below.append(n)
        n -= 1
    above: list[int] = []
    n = mean + 1
    while len(above) < cols:
        if is_prime(n):
            above.append(n)
        n += 1
    run = below[::-1] + above
    starts = [i for i in range(len(run) - cols + 1) if sum(run[i:i + cols]) == rows0]
    if not starts:
        raise ModelFormatError(
            f"{fname}: the first engram table has {rows0} rows, which is no sum of {cols} consecutive primes "
            f"((max_ngram_size - 1) x heads): its hash primes cannot be rebuilt from the table size")
    primes = engram_primes(len(table_rows), max_ngram, heads, run[starts[0]])
    for i, rows in enumerate(table_rows):
        if int(primes[i].sum()) != int(rows):
            raise ModelFormatError(
                f"{fname}: engram table {i} has {int(rows)} rows, but the primes rebuilt from the first table's "
                f"size give it {int(primes[i].sum())}: the tables do not follow the reference's prime construction")
    return primes


def rebuild_tables(vocab: Vocab, layer_ids: tuple[int, ...], max_ngram: int, heads: int,
                   table_rows: tuple[int, ...], fname: str) -> RebuiltTables:
    """The token map, pad id, primes, offsets and multipliers of a file that stores only the engram
    geometry, from its tokenizer and its tables' row counts, as the reference derives them.
    ModelFormatError where the tables or the tokenizer do not allow it (table sizes that are no prime
    construction's, a pad id past the tokens or unmapped); UnsupportedError for V4.1-Flash's own
    tables with a tokenizer that does not compress to the official size (the rebuild would differ)."""
    token_map, compressed = compressed_token_map(vocab)
    if tuple(int(r) for r in table_rows) == V41_NUM_EMBEDDINGS and compressed != V41_COMPRESSED_VOCAB:
        raise UnsupportedError(
            f"{fname}: the engram tables are V4.1-Flash's, trained with a tokenizer of {V41_COMPRESSED_VOCAB} "
            f"normalised keys, but the file's tokenizer gives {compressed}: the hash cannot be rebuilt "
            "faithfully from it")
    if not 0 <= V41_ENGRAM_PAD_ID < token_map.size or token_map[V41_ENGRAM_PAD_ID] < 0:
        raise ModelFormatError(
            f"{fname}: the engram pad token (raw id {V41_ENGRAM_PAD_ID}, the official engram_pad_id) is "
            f"{'past the tokenizer' if V41_ENGRAM_PAD_ID >= token_map.size else 'an UNUSED token'}, so it has "
            "no compressed id")
    primes = primes_from_rows(table_rows, max_ngram, heads, fname)
    return RebuiltTables(
        token_map=token_map,
        compressed_vocab=compressed,
        pad_id=int(token_map[V41_ENGRAM_PAD_ID]),
        multipliers=engram_multipliers(layer_ids, max_ngram, compressed),
        primes=primes,
        offsets=engram_offsets(primes),
    )


def rebuild_for_old_keys(reader: GGUFReader, fname: str, layer_ids: tuple[int, ...], max_ngram: int, heads: int,
                         table_rows: tuple[int, ...]) -> RebuiltTables:
    """rebuild_tables for a file with the old `deepseek4.engram.*` keys, from the tokenizer its metadata
    carries; an error reading that tokenizer (none, not a byte-level BPE, damaged) says what it was for."""
    try:
        vocab = read_vocab(reader, fname)
    except (UnsupportedError, ModelFormatError) as e:
        raise type(e)(
            f"{e}; it is needed to rebuild the engram tables of a file with the old {L.OLD_ENGRAM_PREFIX}* keys "
            f"(or add the {L.key('engram.*')} keys with {L.OLD_ENGRAM_REPAIR}, the vcruz305 recipe)") from None
    return rebuild_tables(vocab, layer_ids, max_ngram, heads, table_rows, fname)
