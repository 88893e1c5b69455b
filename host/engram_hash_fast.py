"""The engram n-gram hash (the engram sublayer's first step) on the host, compiled: row ids for the GPU stages.

Same math, same interface and same errors as host.engram_hash (the oracle, vectorised NumPy), in a
`numba.njit` loop that is fast enough for long prefills (docs/performance.md P6: >= 20 M token-layers/s on a
64k-token prefill). For position p and shift s = 0..max_ngram-1 the look-back token is the
compressed id at p - s; once p - s < 0 or a looked-back id is -1 (unmapped or masked) that shift and
every farther one take `pad_id`. Per engram layer: rolling = t0 * m0, then for each s >= 1:
rolling ^= t_s * m_s and, per head j, row = (rolling mod prime[s-1][j]) + offset[s-1][j], with the
non-negative (floor) modulo.

Shapes and dtypes: token ids int [T] (any integer dtype), token_mask bool [T], the result int64
[T, n_engram_layers, cols] with cols = (max_ngram - 1) * heads in [shift - 1][head] order; the
sequence's compressed-id history int64 [max_seq].

Oracle: host.engram_hash.hash_positions / EngramHasher; the results must be equal, element for
element (tests/test_engram_stages.py).

The modulo is the hot spot (cols of them per token and layer). A 64-bit integer division has a
throughput of several nanoseconds, and it blocks vectorisation; `floor_mod` instead takes the
quotient from a float64 reciprocal, corrects it with a second, exact step, and needs no branches,
so the compiler vectorises the loop over heads.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from flashv41.host.config import EngramConfig
from flashv41.host.engram_hash import DEAD, compress_tokens
from flashv41.host.engram_tables import MAX_PRIME
from flashv41.host.errors import CapacityError, UnsupportedError
from flashv41.host.tokens import Tokens


@njit(inline="always", cache=True)
def floor_mod(a, p, inv_p):
    """a mod p in [0, p) for int64 a and 2 <= p < 2^51, with inv_p = float64(1 / p).

    Step 1: q = trunc(a * inv_p) is within |a| * 3 * 2^-53 / p + 1 of a / p, so r = a - q * p
    (int64 arithmetic wraps, but the true value is small) has |r| < 3 * 2^10 + p < 2^52.
    Step 2: the same with r, whose float64 value is exact: r / p is now small enough that the
    quotient's rounding can only move it across an integer when r / p is that integer, so
    r - q * p lands in [-p, p]; one conditional add and one conditional subtract (as masks, no
    branches) bring it to [0, p).
    """
    q = np.int64(np.float64(a) * inv_p)
    r = a - q * p
    q = np.int64(np.float64(r) * inv_p)
    r -= q * p
    r += p & (r >> 63)
    r -= p & ~((r - p) >> 63)
    return r


@njit(cache=True, nogil=True)
def _hash_into(history, start, count, max_ngram, pad_id, multipliers, primes, inv_primes, offsets, out):
    """The hash of positions start..start+count-1 into out int64 [count, layers, cols].

    history int64 [>= start + count]; multipliers int64 [layers, max_ngram]; primes, offsets int64
    and inv_primes float64 [layers, max_ngram - 1, heads].
    """
    n_layers = multipliers.shape[0]
    heads = primes.shape[2]
    rolling = np.empty(n_layers, np.int64)
    for i in range(count):
        pos = start + i
        blocked = False
        for s in range(max_ngram):
            source = history[max(pos - s, 0)]
            blocked = blocked or pos < s or source == DEAD
            token = pad_id if blocked else source
            for layer in range(n_layers):
                product = token * multipliers[layer, s]
                if s == 0:
                    rolling[layer] = product
                else:
                    r = rolling[layer] ^ product
                    rolling[layer] = r
                    row = out[i, layer, (s - 1) * heads:s * heads]
                    prime = primes[layer, s - 1]
                    inv = inv_primes[layer, s - 1]
                    offset = offsets[layer, s - 1]
                    for j in range(heads):
                        row[j] = floor_mod(r, prime[j], inv[j]) + offset[j]


def _checked_tables(engram: EngramConfig) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(multipliers, primes, 1 / primes, offsets) as the compiled loop takes them."""
    primes = np.ascontiguousarray(engram.primes, dtype=np.int64)
    if primes.size and (primes.min() < 2 or primes.max() >= MAX_PRIME):
        raise UnsupportedError(f"engram primes must lie in [2, 2^51) for the fast hash, found "
                               f"{int(primes.min())}..{int(primes.max())}")
    return (np.ascontiguousarray(engram.multipliers, dtype=np.int64), primes,
            1.0 / primes.astype(np.float64), np.ascontiguousarray(engram.offsets, dtype=np.int64))


def hash_positions(engram: EngramConfig, history: np.ndarray, start: int, count: int) -> np.ndarray:
    """Row ids int64 [count, n_engram_layers, cols] of positions start..start+count-1, given the
    compressed ids of every position up to start+count-1 in `history` (as the oracle's function)."""
    multipliers, primes, inv_primes, offsets = _checked_tables(engram)
    out = np.empty((count, multipliers.shape[0], engram.cols), np.int64)
    _hash_into(history, start, count, engram.max_ngram, engram.pad_id, multipliers, primes, inv_primes,
               offsets, out)
    return out


class FastEngramHasher:
    """The hash of one sequence, compiled: its compressed-id cache int64 [max_seq] and the tables.

    Interface and errors as host.engram_hash.EngramHasher: InputError for bad ids or masks,
    CapacityError for positions past max_seq; the cache is written only once the input is valid.
    """

    def __init__(self, engram: EngramConfig, max_seq: int):
        self.engram = engram
        self.max_seq = max_seq
        self.history = np.full(max_seq, DEAD, dtype=np.int64)
        self._multipliers, self._primes, self._inv_primes, self._offsets = _checked_tables(engram)

    def reset(self) -> None:
        self.history.fill(DEAD)

    def rewind(self, position: int) -> None:
        """Forget the positions from `position` on, as a sequence that never reached them holds them
        (a truncated sequence's: flashv41.sequence_state)."""
        self.history[position:] = DEAD

    def hash(self, token_ids: np.ndarray | Tokens, start_pos: int, token_mask: np.ndarray | None = None) -> np.ndarray:
        """Row ids int64 [T, n_engram_layers, cols] for `token_ids` placed at start_pos.. (checked
        here unless they are `Tokens`, as the engine passes them)."""
        compressed = compress_tokens(self.engram, token_ids, token_mask)
        count = compressed.shape[0]
        end = start_pos + count
        if start_pos < 0 or end > self.max_seq:
            raise CapacityError(f"engram hash: positions {start_pos}..{end - 1} exceed max_seq {self.max_seq}")
        self.history[start_pos:end] = compressed
        out = np.empty((count, self._multipliers.shape[0], self.engram.cols), np.int64)
        _hash_into(self.history, start_pos, count, self.engram.max_ngram, self.engram.pad_id,
                   self._multipliers, self._primes, self._inv_primes, self._offsets, out)
        return out
