"""Building the engram hash tables the way the V4.1 reference builds them (`engram.py`).

- primes: per layer, per n-gram size, per head, the next prime above `engram_vocab_size - 1` that
  no earlier (layer, n-gram, head) has taken, so every bucket range is distinct;
- offsets: per layer, the running sums of that layer's primes in [n-gram][head] order, from 0;
- multipliers: per layer, `max_ngram` odd int64 values from NumPy's PCG64 seeded with
  10007 * layer_id, bounded so that id * multiplier never overflows int64;
- a stub token map in the spirit of the reference tests' stub tokenizer: raw ids 2k and 2k+1
  collapse onto compressed id k (optionally leaving the last ids unmapped, -1).
"""

from __future__ import annotations

import numpy as np

# the largest table prime the compiled hash takes (host.engram_hash_fast's floor_mod is exact for
# divisors below it; real tables have primes < 2^32)
MAX_PRIME = 1 << 51


def is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin for n < 3.3e24 (far beyond any bucket size)."""
    if n < 2:
        return False
    small = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41)
    for p in small:
        if n % p == 0:
            return n == p
    d, s = n - 1, 0
    while d % 2 == 0:
        d //= 2
        s += 1
    for a in small:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def engram_primes(n_layers: int, max_ngram: int, n_heads: int, engram_vocab_size: int) -> np.ndarray:
    """int64 [n_layers, max_ngram - 1, n_heads]: consecutive unused primes above vocab - 1."""
    taken: set[int] = set()
    out = np.zeros((n_layers, max_ngram - 1, n_heads), dtype=np.int64)
    for layer in range(n_layers):
        for ngram in range(max_ngram - 1):
            current = engram_vocab_size - 1
            for head in range(n_heads):
                current += 1
                while not is_prime(current) or current in taken:
                    current += 1
                taken.add(current)
                out[layer, ngram, head] = current
    return out


def engram_offsets(primes: np.ndarray) -> np.ndarray:
    """Running sums of each layer's primes, flattened [n-gram][head], starting at 0."""
    flat = primes.reshape(primes.shape[0], int(np.prod(primes.shape[1:])))
    starts = np.concatenate([np.zeros((flat.shape[0], 1), np.int64), np.cumsum(flat, axis=1)[:, :-1]], axis=1)
    return starts.reshape(primes.shape)


def engram_multipliers(layer_ids: tuple[int, ...], max_ngram: int, compressed_vocab: int) -> np.ndarray:
    """int64 [layers, max_ngram] odd multipliers, from a generator seeded per layer id."""
    bound = max(1, (np.iinfo(np.int64).max // compressed_vocab) // 2)
    rows = []
    for layer_id in layer_ids:
        draw = np.random.default_rng(10007 * layer_id).integers(0, bound, size=(max_ngram,), dtype=np.int64)
        rows.append(draw * 2 + 1)
    return np.stack(rows) if rows else np.zeros((0, max_ngram), np.int64)


def stub_token_map(vocab: int, unmapped_tail: int = 0) -> tuple[np.ndarray, int]:
    """Raw id t -> t // 2, the last `unmapped_tail` ids -> -1. Returns (map, compressed vocab size)."""
    token_map = np.arange(vocab, dtype=np.int64) // 2
    if unmapped_tail:
        token_map[vocab - unmapped_tail:] = -1
    compressed = int(token_map.max()) + 1
    return token_map, compressed
