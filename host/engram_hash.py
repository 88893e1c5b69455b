"""The engram n-gram hash, integer-exact, vectorised NumPy: the oracle's hasher.

For position p and shift s = 0..max_ngram-1 the look-back token is the compressed id at p - s;
once p - s < 0 or a looked-back id is -1 (unmapped or masked), that shift and every farther one
take `pad_id` ("blocked" is cumulative). Per engram layer: rolling = t0 * m0, then for each
s >= 1: rolling ^= t_s * m_s and, per head j, row = rolling mod prime[s-1][j] + offset[s-1][j].

A sequence's compressed ids are kept in a cache of `max_seq` positions, so chunked prefill and
decode see the same look-back as one-shot prefill.
"""

from __future__ import annotations

import numpy as np

from flashv41.host.config import EngramConfig
from flashv41.host.errors import CapacityError
from flashv41.host.tokens import Tokens, check_tokens

DEAD = -1


def compress_tokens(engram: EngramConfig, token_ids: np.ndarray | Tokens,
                    token_mask: np.ndarray | None = None) -> np.ndarray:
    """Raw ids -> compressed ids (int64), -1 where unmapped or masked out. Ids as `check_tokens`
    returned them (`Tokens`, with their mask; the loader pads token_map to the vocabulary, so ids
    checked against it index the map) are taken as they are; anything else is checked first."""
    if isinstance(token_ids, Tokens):
        assert token_mask is None, "checked tokens carry their own mask"
        ids, mask = token_ids
    else:
        ids, mask = check_tokens(token_ids, token_mask, engram.token_map.shape[0], allow_empty=True)
    compressed = engram.token_map[ids]
    return compressed if mask is None else np.where(mask, compressed, DEAD)


def hash_positions(engram: EngramConfig, history: np.ndarray, start: int, count: int) -> np.ndarray:
    """Row ids int64 [count, n_engram_layers, cols] of positions start..start+count-1, given the
    compressed ids of every position up to start+count-1 in `history`."""
    positions = np.arange(start, start + count)
    blocked = np.zeros(count, dtype=bool)
    tokens = []
    for shift in range(engram.max_ngram):
        source = history[np.maximum(positions - shift, 0)]
        blocked |= (positions < shift) | (source == DEAD)
        tokens.append(np.where(blocked, engram.pad_id, source))
    t = np.stack(tokens, axis=-1)  # [T, max_ngram]
    products = t[:, None, :] * engram.multipliers[None, :, :]  # [T, layers, max_ngram]
    rolling = products[..., 0]
    columns = []
    for s in range(1, engram.max_ngram):
        rolling = rolling ^ products[..., s]
        columns.append(rolling[..., None] % engram.primes[None, :, s - 1, :] + engram.offsets[None, :, s - 1, :])
    return np.concatenate(columns, axis=-1)


class EngramHasher:
    """The hash of one sequence: its compressed-id cache and the positions filled so far."""

    def __init__(self, engram: EngramConfig, max_seq: int):
        self.engram = engram
        self.max_seq = max_seq
        self.history = np.full(max_seq, DEAD, dtype=np.int64)

    def reset(self) -> None:
        self.history.fill(DEAD)

    def rewind(self, position: int) -> None:
        """Forget the positions from `position` on, as a sequence that never reached them holds them
        (a truncated sequence's: flashv41.sequence_state)."""
        self.history[position:] = DEAD

    def hash(self, token_ids: np.ndarray | Tokens, start_pos: int, token_mask: np.ndarray | None = None) -> np.ndarray:
        """Row ids int64 [T, n_engram_layers, cols] for `token_ids` placed at start_pos.. (checked
        here unless they are `Tokens`); the cache is written only once the input has been validated."""
        compressed = compress_tokens(self.engram, token_ids, token_mask)
        end = start_pos + compressed.shape[0]
        if start_pos < 0 or end > self.max_seq:
            raise CapacityError(f"engram hash: positions {start_pos}..{end - 1} exceed max_seq {self.max_seq}")
        self.history[start_pos:end] = compressed
        return hash_positions(self.engram, self.history, start_pos, compressed.shape[0])
