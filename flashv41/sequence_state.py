"""A sequence's state as a server moves it: the record of its calls, copies of its device state,
and the checkpoints that let it rewind (`Sequence.fork`, `truncate`, `save`, `Engine.load_sequence`).

What one sequence holds (SPEC 2; stages.attention.AttentionState, host.engram_hash_fast), with
L layers, W window, D head_dim, ID index_head_dim, r a kv source's compress ratio:
- per layer, the window ring bf16 [W, D], slot = position % W. A call of T tokens overwrites
  min(T, W) slots: rows a sequence rewound into that call's past needs again;
- per kv source, the compressor's partial group, kv and gate score fp32 [r, D] (slot = position %
  r), rewritten by every call; and two append-only caches, compressed rows bf16 [max_seq // r, D]
  and index keys bf16 [max_seq // r, ID]. Row j is written once, by the call whose tokens complete
  group j (position j * r + r - 1); rows past the P // r groups of a sequence at position P are zero;
- the engram hasher's history int64 [max_seq]: the compressed id of every position so far (-1 for
  a masked or unmapped token), -1 past the position;
- on the host, `History`: the token ids, their mask, and the calls (start, count, masked) that
  brought them.
The shared runtime, the selection and the candidate mask belong to a call, not to a sequence: the
stage's workspaces, rebuilt by every call from the caches above.

The used part at position P is every ring and partial group and the caches' first P // r rows:
what `copy_used` copies (a fork), `download` reads (a save) and `upload` writes (a load); the rest
of a state is zero in any sequence, a fresh one included, so the copy is the whole state.

Rewinding. Before every call of more than one token from a position c > 0 (a prefill chunk, a
draft's verify), the sequence copies its rings and partial groups into a `Checkpoint` (device to
device, L x W x D bf16 and the partial groups: 5.2 MB at V4.1-Flash's 40 layers). To get back to
n, `rewind_to` restores the newest checkpoint at or before n (none: the empty sequence, c = 0)
and zeroes the cache rows of the groups completed since c and the hash history since c: the state
is then, array for array, the state at c. `History.replay` gives the chunks that bring c..n-1
again: the calls that first brought them, the one that n cuts ending at n, which the sequence runs
as it ran them. So the sequence is the one that made those calls, bit for bit, on any device.
Cost: the restore (one checkpoint copy and a few rows of zeros) plus a forward of n - c tokens in
those chunks: nothing for n = c (a draft rejected whole), one call of the accepted tokens for a
verify call cut short, one decode step a token decoded one at a time since c, the whole history
where no checkpoint lies at or before n (a sequence keeps the newest `Checkpoints` it was given, one
by default; a fork or a load has one at its starting point). One exception to bit for bit: a token
decoded in a decode_batch of more than 8 sequences (narrow tensor-core products) runs again alone,
within the products' bound of its batched result.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from flashv41.host.config import ModelConfig
from flashv41.host.tokens import Tokens

if TYPE_CHECKING:  # imported where used: flashv41.engine imports this module before it picks the backend
    from flashv41.stages.attention import AttentionState
    from flashv41.stages.device import DeviceArray


@dataclass(frozen=True)
class CallRecord:
    """One forward call of a sequence: its first position, its token count, and whether it applied
    a token mask (a masked call takes its own launch path, so a replay applies one too)."""

    start: int
    count: int
    masked: bool


class History:
    """A sequence's tokens on the host: ids int64 [max_seq] and mask bool [max_seq] (False: the
    token takes no part in any n-gram), valid below the position, and every call that wrote them."""

    def __init__(self, max_seq: int):
        self.ids = np.zeros(max_seq, np.int64)
        self.mask = np.ones(max_seq, bool)
        self.calls: list[CallRecord] = []

    @property
    def position(self) -> int:
        last = self.calls[-1] if self.calls else None
        return 0 if last is None else last.start + last.count

    def record(self, tokens: Tokens) -> None:
        """A call's checked tokens, placed at the position."""
        start, n = self.position, tokens.ids.size
        self.ids[start:start + n] = tokens.ids
        self.mask[start:start + n] = True if tokens.mask is None else tokens.mask
        self.calls.append(CallRecord(start, n, tokens.mask is not None))

    def replay(self, start: int, end: int, max_tokens: int) -> list[Tokens]:
        """The chunks that bring positions start..end-1 again: the calls recorded from `start` (a
        call's first position) on, the one that `end` cuts ending at end, each split to max_tokens
        (only a call recorded by an engine of larger max_tokens, then loaded, needs the split)."""
        chunks = []
        for call in self.calls:
            if call.start < start or call.start >= end:
                continue
            stop = min(call.start + call.count, end)
            for s in range(call.start, stop, max_tokens):
                e = min(s + max_tokens, stop)
                chunks.append(Tokens(self.ids[s:e].copy(), self.mask[s:e].copy() if call.masked else None))
        return chunks

    def rewind(self, start: int) -> None:
        """Forget the calls from `start` (a call's first position, or 0) on."""
        self.calls = [c for c in self.calls if c.start < start]
        assert self.position == start, f"position {start} is no call's start"
        self.ids[start:] = 0
        self.mask[start:] = True

    def copy(self) -> History:
        out = History(self.ids.size)
        out.ids[:] = self.ids
        out.mask[:] = self.mask
        out.calls = list(self.calls)
        return out

    def calls_array(self) -> np.ndarray:
        """int64 [calls, 3]: (start, count, masked) a call, as a file keeps them."""
        return np.array([(c.start, c.count, int(c.masked)) for c in self.calls], np.int64).reshape(-1, 3)

    @classmethod
    def from_arrays(cls, max_seq: int, ids: np.ndarray, mask: np.ndarray, calls: np.ndarray) -> History:
        """A history from a file's arrays (checked by the reader: calls tile 0..len(ids)-1)."""
        out = cls(max_seq)
        out.ids[:ids.size] = ids
        out.mask[:mask.size] = mask
        out.calls = [CallRecord(int(s), int(n), bool(m)) for s, n, m in calls]
        return out


def _copy(dst: DeviceArray, src: DeviceArray, stream) -> None:
    """dst = src, device to device on `stream` (same shape, both contiguous; nothing for no rows)."""
    if src.size:
        dst.copy_to_device(src, stream=stream)


def kv_sources(state: AttentionState) -> list[int]:
    """The layers of a state that hold a compressor and caches."""
    return [i for i, layer in enumerate(state.layers) if layer.source is not None]


class Checkpoint:
    """A sequence's rings and partial groups at `position` (the start of a call), on the device:
    rings bf16 [L, W, D], and each kv source's kv and score fp32 [r, D]. None: empty."""

    def __init__(self, state: AttentionState):
        from numba import cuda

        first = state.layers[0].ring
        self.rings = cuda.device_array((len(state.layers), *first.shape), first.dtype)  # bf16 [L, W, D]
        # each layer's ring in it, sliced once: numba builds a new device array object for every slice
        self.ring_views = [self.rings[i] for i in range(len(state.layers))]
        self.partial: dict[int, tuple[DeviceArray, DeviceArray]] = {}  # layer -> kv, score fp32 [r, D]
        for i in kv_sources(state):
            src = state.layers[i].source
            assert src is not None
            self.partial[i] = (cuda.device_array_like(src.kv_state), cuda.device_array_like(src.score_state))
        self.position: int | None = None

    def take(self, state: AttentionState, position: int, stream) -> None:
        for view, layer in zip(self.ring_views, state.layers, strict=True):
            _copy(view, layer.ring, stream)
        for i, (kv, score) in self.partial.items():
            src = state.layers[i].source
            assert src is not None
            _copy(kv, src.kv_state, stream)
            _copy(score, src.score_state, stream)
        self.position = position

    def restore(self, state: AttentionState, stream) -> None:
        """Rings and partial groups back as they were at `position` (the caches: `clear_groups`)."""
        for view, layer in zip(self.ring_views, state.layers, strict=True):
            _copy(layer.ring, view, stream)
        for i, (kv, score) in self.partial.items():
            src = state.layers[i].source
            assert src is not None
            _copy(src.kv_state, kv, stream)
            _copy(src.score_state, score, stream)

    def nbytes(self) -> int:
        return int(self.rings.nbytes) + sum(int(kv.nbytes + score.nbytes) for kv, score in self.partial.values())


class Checkpoints:
    """A sequence's checkpoint slots (allocated once, with the sequence): `take` fills an empty slot
    or the oldest one; `newest(n)` is the one to rewind to n from."""

    def __init__(self, state: AttentionState, count: int):
        self.slots = [Checkpoint(state) for _ in range(count)]

    def __len__(self) -> int:
        return len(self.slots)

    def take(self, state: AttentionState, position: int, stream) -> None:
        """A checkpoint at `position` (none at 0, whose state is the empty one, nor where one is)."""
        if not self.slots or position == 0 or any(s.position == position for s in self.slots):
            return
        slot = min(self.slots, key=lambda s: -1 if s.position is None else s.position)
        slot.take(state, position, stream)

    def newest(self, n: int) -> Checkpoint | None:
        """The checkpoint of the largest position at or before n, if any."""
        held = [s for s in self.slots if s.position is not None and s.position <= n]
        return max(held, key=lambda s: s.position or 0, default=None)

    def drop_after(self, n: int) -> None:
        """Forget the checkpoints past n (a rewound sequence's future)."""
        for s in self.slots:
            if s.position is not None and s.position > n:
                s.position = None

    def nbytes(self) -> int:
        return sum(s.nbytes() for s in self.slots)

    def free(self) -> None:
        self.slots = []


def clear_groups(state: AttentionState, start: int, end: int, stream) -> None:
    """Zero the cache rows of the groups completed at positions start..end-1 (rows start // r to
    end // r of each kv source's caches), as they are in a sequence that never got past start."""
    from flashv41.stages.device import fill

    for i in kv_sources(state):
        src = state.layers[i].source
        assert src is not None
        ratio = src.kv_state.shape[0]
        g0, g1 = start // ratio, end // ratio
        if g1 > g0:
            fill(src.compressed[g0:g1], 0, stream)
            fill(src.index_keys[g0:g1], 0, stream)


def rewind_to(state: AttentionState, checkpoint: Checkpoint | None, position: int, hasher: Any, stream) -> int:
    """The state of a sequence at `position` back to what it was at the checkpoint's position (0,
    the empty state, for none): rings and partial groups restored, the cache rows and the hasher's
    history (host.engram_hash_fast.FastEngramHasher, or None) since then cleared. Returns that
    position."""
    from flashv41.stages.device import fill

    if checkpoint is None:
        start = 0
        for layer in state.layers:
            fill(layer.ring, 0, stream)
            if layer.source is not None:  # the partial group as KvSourceState.reset leaves it
                fill(layer.source.kv_state, 0, stream)
                fill(layer.source.score_state, -np.inf, stream)
    else:
        start = checkpoint.position or 0
        checkpoint.restore(state, stream)
    clear_groups(state, start, position, stream)
    if hasher is not None:
        hasher.rewind(start)
    return start


def copy_used(src: AttentionState, dst: AttentionState, position: int, stream) -> None:
    """dst's device state = src's at `position` (dst empty): every ring and partial group, and the
    caches' rows of the groups completed so far."""
    for a, b in zip(src.layers, dst.layers, strict=True):
        _copy(b.ring, a.ring, stream)
        if a.source is not None:
            assert b.source is not None
            groups = position // a.source.kv_state.shape[0]
            _copy(b.source.kv_state, a.source.kv_state, stream)
            _copy(b.source.score_state, a.source.score_state, stream)
            _copy(b.source.compressed[:groups], a.source.compressed[:groups], stream)
            _copy(b.source.index_keys[:groups], a.source.index_keys[:groups], stream)


# the arrays of one kv source a file keeps, by name: (attribute, used rows only)
SOURCE_ARRAYS = (("kv_state", False), ("score_state", False), ("compressed", True), ("index_keys", True))


def download(state: AttentionState, position: int) -> dict[str, np.ndarray]:
    """The used part of a state on the host, by name: "rings" bf16 [L, W, D], and for each kv source
    i "layer{i}.kv_state", ".score_state" fp32 [r, D], ".compressed" bf16 [P // r, D], ".index_keys"
    bf16 [P // r, ID]."""
    from numba import cuda

    cuda.synchronize()
    out = {"rings": np.stack([layer.ring.copy_to_host() for layer in state.layers])}
    for i in kv_sources(state):
        src = state.layers[i].source
        assert src is not None
        groups = position // src.kv_state.shape[0]
        for name, used in SOURCE_ARRAYS:
            a = getattr(src, name)
            out[f"layer{i}.{name}"] = (a[:groups] if used else a).copy_to_host()
    return out


def oracle_form(state: AttentionState) -> list[dict[str, np.ndarray]]:
    """Every layer's state on the host as the oracle holds it (bf16 values as float32):
    window_ring, and for kv sources kv_state, score_state, compressed, index_keys."""
    from flashv41.host.numerics import from_bits

    out = []
    for layer in state.layers:
        entry = {"window_ring": from_bits(layer.ring.copy_to_host())}
        if layer.source is not None:
            src = layer.source
            entry.update(kv_state=src.kv_state.copy_to_host(), score_state=src.score_state.copy_to_host(),
                         compressed=from_bits(src.compressed.copy_to_host()),
                         index_keys=from_bits(src.index_keys.copy_to_host()))
        out.append(entry)
    return out


def expected_shapes(cfg: ModelConfig, position: int) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """The (shape, dtype) of every array `download` gives for a model's state at `position` (as
    stages.attention.AttentionState and stages.kv_sources.KvSourceState allocate them)."""
    bf16, f32 = np.dtype(np.uint16), np.dtype(np.float32)
    out: dict[str, tuple[tuple[int, ...], np.dtype]] = {"rings": ((cfg.n_layers, cfg.window, cfg.head_dim), bf16)}
    for role in cfg.roles:
        if role.kv_source:
            r, groups = role.ratio, position // role.ratio
            out.update({f"layer{role.layer}.kv_state": ((r, cfg.head_dim), f32),
                        f"layer{role.layer}.score_state": ((r, cfg.head_dim), f32),
                        f"layer{role.layer}.compressed": ((groups, cfg.head_dim), bf16),
                        f"layer{role.layer}.index_keys": ((groups, cfg.index_head_dim), bf16)})
    return out


def upload(state: AttentionState, arrays: dict[str, np.ndarray], stream) -> None:
    """`download`'s arrays into an empty state (of the same geometry, checked by the caller)."""
    for i, layer in enumerate(state.layers):
        layer.ring.copy_to_device(np.ascontiguousarray(arrays["rings"][i]), stream=stream)
    for i in kv_sources(state):
        src = state.layers[i].source
        assert src is not None
        for name, _ in SOURCE_ARRAYS:
            host = np.ascontiguousarray(arrays[f"layer{i}.{name}"])
            if host.size:
                getattr(src, name)[:host.shape[0]].copy_to_device(host, stream=stream)
