"""A sequence on an engine: its position and tokens, its device state, and what a server does with
it (fork, truncate, save; `Engine.load_sequence` reads a saved one back).

    seq = engine.new_sequence()
    h = seq.prefill(token_ids)      # final highway [T, hc, dim] float32 (NumPy)
    h = seq.decode(token_id)        # [1, hc, dim]
    logits = seq.logits()           # the head's fp32 logits [vocab] of the last position processed
    branch = seq.fork()             # a copy of the state that goes its own way
    seq.truncate(n)                 # as if only the first n tokens had been run
    seq.save("seq.npz")             # engine.load_sequence("seq.npz") reads it back
    seq.release()

A call runs on the engine (`Engine._forward`: the steps of docs/architecture.md); the sequence
checks its tokens once, cuts a long prompt into chunks of max_tokens, and keeps what the call left
behind: its state on the device, its history (flashv41.sequence_state), the head's input.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import numpy as np

from flashv41.host.errors import CapacityError, InputError, SequenceStateError, UnsupportedError, plural
from flashv41.host.tokens import Tokens, check_output, check_tokens, one_token
from flashv41.sequence_state import Checkpoints, History, copy_used, oracle_form, rewind_to

if TYPE_CHECKING:
    from flashv41.engine import Engine


def one_token_mask(mask: Any, what: str) -> np.ndarray | None:
    """A one-token step's mask (decode's, each of decode_batch's) as prefill takes it: None, or
    bool [1]; anything but one bool or None is an InputError naming `what`."""
    if mask is None:
        return None
    if not isinstance(mask, (bool, np.bool_)):
        raise InputError(f"{what} is one bool or None, got {type(mask).__name__}")
    return np.array([bool(mask)])


class Sequence:
    """One sequence on an engine: its tokens and calls (`history`), its hash history, its device
    state and its truncate checkpoints (flashv41.sequence_state)."""

    def __init__(self, engine: Engine, checkpoints: int = 1):
        self.engine = engine
        self.history = History(engine.max_seq)
        self.captures: list[dict] = []
        self.state = engine.attention.new_state()
        self.checkpoints = Checkpoints(self.state, checkpoints)
        engram = engine.cfg.engram
        self.hasher = engine._hasher_cls(engram, engine.max_seq) if engram is not None else None
        self.graphs: dict[tuple, Any] = {}  # decode graphs by Engine.graph_key
        self.graph_keys_seen: set[tuple] = set()
        self.failed = False  # a call failed after its input was accepted (see prefill)
        self.released = False
        # [max_tokens, C] bf16: the head's input of the last call's positions, its first head_rows rows
        self.head_x: Any = (engine._cuda.device_array((engine.max_tokens, engine.cfg.dim), np.uint16)
                            if engine.head is not None else None)
        self.head_rows = 0

    @property
    def max_seq(self) -> int:
        return self.engine.max_seq

    @property
    def position(self) -> int:
        """The tokens run so far (the next token's position)."""
        return self.history.position

    @property
    def tokens(self) -> np.ndarray:
        """The token ids run so far, int64 [position] (a read-only copy)."""
        out = self.history.ids[:self.position].copy()
        out.flags.writeable = False
        return out

    def _check_usable(self) -> None:
        """The error that refuses any call on a released or failed sequence, or a closed engine."""
        if self.released:
            raise SequenceStateError("this sequence was released")
        if self.failed:
            raise SequenceStateError("this sequence failed in the middle of a call, so its state may be partly "
                                     "written: release it and start a new one")
        self.engine._check_open()

    def _validate(self, token_ids: Any, token_mask: Any) -> Tokens:
        """The tokens, checked once (host.tokens.check_tokens) for everything after, or the error
        that refuses the call: a bad id or mask, too many positions, a released or failed sequence."""
        self._check_usable()
        tokens = check_tokens(token_ids, token_mask, self.engine.cfg.vocab_size)
        n = tokens.ids.size
        if self.position + n > self.max_seq:
            raise CapacityError(f"{plural(n, 'token')} at position {self.position} "
                                f"{'exceeds' if n == 1 else 'exceed'} max_seq {self.max_seq} "
                                f"({plural(self.max_seq - self.position, 'position')} left)")
        return tokens

    def prefill(self, token_ids: Any, token_mask: Any = None, capture: bool = False,
                output: str = "all") -> np.ndarray:
        """Run tokens from the current position (chunks of max_tokens); returns h [T, hc, dim] float32.

        token_mask: bool [T], False = the token takes no part in any n-gram and gets no engram
        contribution. capture: keep every layer's intermediates of the (last) chunk in `captures`.
        output: "all" (every token's final highway) or "last" (the last token's, [1, hc, dim]: a long
        prompt's T x hc x dim floats, 80 KiB a token at flash sizes, stay on the device;
        `logits()` reads the last position there either way).
        """
        check_output(output)
        tokens = self._validate(token_ids, token_mask)
        step = self.engine.max_tokens
        size = tokens.ids.size
        try:
            out = [self._chunk(tokens.part(s, s + step), capture,
                               min(step, size - s) if output == "all" else int(s + step >= size))
                   for s in range(0, size, step)]
        except BaseException:
            self.failed = True  # validated input failed on the way: the state may be partly written
            raise
        return np.concatenate(out) if len(out) > 1 else out[0]

    def _chunk(self, tokens: Tokens, capture: bool, rows: int) -> np.ndarray:
        """One call of at most max_tokens checked tokens, returning its last `rows` tokens' highway;
        a call of several first leaves a checkpoint of the state it is about to overwrite (what
        `truncate` comes back to)."""
        if tokens.ids.size > 1:
            self.checkpoints.take(self.state, self.position, self.engine.attention.stream)
        return self.engine._forward(self, tokens, capture, rows)

    def decode(self, token_id: int, token_mask: bool | None = None, capture: bool = False) -> np.ndarray:
        """One token at the current position; returns h [1, hc, dim]."""
        return self.prefill(one_token(token_id), one_token_mask(token_mask, "decode's token_mask"),
                            capture)

    def fork(self) -> Sequence:
        """A new sequence of this engine with a copy of this one's state; the two then go their own
        ways. Cost: a new sequence, one device copy of the used state (`engine.sequence_bytes(
        position)`), one of its rings and partial groups into the fork's checkpoint (none of this
        one's is kept: a truncate below the fork point runs from 0), the history on the host."""
        self._check_usable()
        new = self.engine.new_sequence(len(self.checkpoints))
        stream = self.engine.attention.stream
        try:
            copy_used(self.state, new.state, self.position, stream)
            new.history = self.history.copy()
            if self.hasher is not None and new.hasher is not None:
                new.hasher.history[:] = self.hasher.history
            new.checkpoints.take(new.state, new.position, stream)
            if self.head_x is not None and self.head_rows:  # the last call's head input: the fork's logits
                new.head_x[:self.head_rows].copy_to_device(self.head_x[:self.head_rows], stream=stream)
                new.head_rows = self.head_rows
        except BaseException:
            new.release()
            raise
        return new

    def truncate(self, n: int) -> None:
        """Keep the first n tokens: afterwards the sequence is, in every later output and array of
        its state, bit for bit the one that ran only those in the calls that first brought them
        (the one n cuts ending at n). The newest checkpoint at or before n (taken before each call
        of several tokens; none: the empty state) is copied back, and the tokens from it to n run
        again in their calls (flashv41.sequence_state, which states the cost). n past the position
        is an InputError that changes nothing; an error while the tokens run leaves it failed."""
        self._check_usable()
        if not isinstance(n, (int, np.integer)) or isinstance(n, (bool, np.bool_)):
            raise InputError(f"truncate takes a token count, an integer, got {type(n).__name__} {n!r}")
        if not 0 <= n <= self.position:
            raise InputError(f"cannot truncate to {n} tokens: the sequence holds {plural(self.position, 'token')} "
                             f"(0..{self.position})")
        n = int(n)
        position = self.position
        if n == position:
            return
        checkpoint = self.checkpoints.newest(n)
        start = 0 if checkpoint is None else checkpoint.position or 0
        chunks = self.history.replay(start, n, self.engine.max_tokens)
        self.head_rows = 0  # the logits are those of the last call the rewind runs again, if any
        try:
            rewind_to(self.state, checkpoint, position, self.hasher, self.engine.attention.stream)
            self.history.rewind(start)
            self.checkpoints.drop_after(n)
            for chunk in chunks:
                self._chunk(chunk, False, 0)
        except BaseException:
            self.failed = True
            raise

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the state to `path` (flashv41.sequence_file: a header naming the model by its content
        hash, the sizes and the format version, then the used part of the state and the token
        history); `Engine.load_sequence` reads it back. The file appears whole or not at all."""
        self._check_usable()
        from flashv41.sequence_file import write_sequence

        write_sequence(self, path)

    def logits(self, all_positions: bool = False) -> np.ndarray:
        """The head's float32 logits [vocab] of the last position this sequence processed; with
        all_positions, [T, vocab] of every position of its last call (of a prefill longer than
        max_tokens: its last chunk's). On the device as the reference's head computes them: the
        copies collapsed by the last layer's pre-mix, output_norm, the output product in fp32
        (stages.head; host.oracle.head is its oracle)."""
        if self.released:
            raise SequenceStateError("this sequence was released")
        self.engine._check_open()
        if self.failed:
            raise SequenceStateError("this sequence failed in the middle of a call: its logits would be of a "
                                     "half-written state")
        head = self.engine.head
        if head is None:
            raise UnsupportedError(f"{self.engine.model.path.name}: the file has no head (output_norm, output), "
                                   "so there are no logits")
        if self.head_rows == 0:
            raise SequenceStateError("no logits yet: they are those of the sequence's last call, and it has made "
                                     "none since it was created, loaded, or truncated to where a call began "
                                     "(prefill or decode first)")
        first = 0 if all_positions else self.head_rows - 1
        out = head.logits(self.head_x[first:self.head_rows], self.head_rows - first)
        return out if all_positions else out[0]

    def attention_state(self) -> list[dict[str, np.ndarray]]:
        """Every layer's attention state copied to the host, in the oracle's form (bf16 values as
        float32): window_ring, and for kv sources kv_state, score_state, compressed, index_keys.
        `host.oracle.OracleSequence.load_attention_state` takes it (for layer-by-layer checks)."""
        if self.released:
            raise SequenceStateError("this sequence was released")
        return oracle_form(self.state)

    def release(self) -> None:
        """Free this sequence's device state (idempotent); the engine stays usable."""
        if self.released:
            return
        for graph in self.graphs.values():
            graph.close()
        self.graphs = {}
        self.state.free()
        self.checkpoints.free()
        self.hasher = None
        self.head_x = None
        self.released = True
