"""The engine: every stage created once, sequences with their own device state, and the scheduler
that runs a chunk of tokens through the layer stack.

    import flashv41
    model = flashv41.load_model("model.gguf")
    engine = flashv41.Engine(model, max_seq=4096, max_tokens=256)
    seq = engine.new_sequence()
    h = seq.prefill(token_ids)      # final highway [T, hc, dim] float32 (NumPy)
    h = seq.decode(token_id)        # [1, hc, dim]
    h = engine.decode_batch([seq, other], [tok, tok2])  # one step of several sequences [B, hc, dim]
    branch = seq.fork()             # a copy of the state that goes its own way
    seq.truncate(n)                 # as if only the first n tokens had been run
    seq.save("seq.npz"); again = engine.load_sequence("seq.npz")
    logits = seq.logits()           # the head's fp32 logits [vocab] of the last position processed
    seq.release()                   # frees its device state; the engine stays usable
    engine.close()

    engine = flashv41.Engine(model, ffn=fn)  # the caller's FFN (MoE) between the layers (flashv41.ffn)

A call reads as code, in the V4.1 order (SPEC 2), from `Sequence.decode` / `prefill` to every
launch: `Engine._forward` runs `_upload` (the host part: the checked token ids uploaded once, the
engram hash of the same ids, each engram layer's rows; then mask, first mix and positions), then
`_device` (the embedding, the first engram layer's rows and projection, then `_layer` for each
layer: engram gate -> attention mixes with hc_pre + attn_norm -> attention -> hc_post -> the FFN
sublayer with its own mixes, whose `pre` is the next layer's pre-mix: a zero output, or with an FFN
callback (flashv41.ffn) its input normed into x, the callback, and its hc_post; after the last
layer the head's input into the sequence's buffer, where the model has a head), then `_download`
(the highway's rows). `Sequence.logits` runs the head's product on what the last call left there.
Each stage call on the way is `run(step, self.stage.method, ...)`: `run` makes it, watched or not
(flashv41.plan.Run). What one hyper-connection call hands the next is a value (stages.hyper.Mixes:
a mixes call returns the one its post reads); which posts form the next mixes' product was decided
once by the hyper stage (HyperStage.plan).

What a call decides the same way every time is built once, at construction, into `Engine.plan`
(flashv41.plan: per layer its engram, its hyper values, its profile names). A one-token step's
device part is replayed from a CUDA graph of the sequence (flashv41.graphs), one graph per
`graph_key`: what the step decides on the host. Profiling and captures watch the calls
(`StageTimer`, `LayerCapture`, and any observers in `Engine.observers`); a watched call, like a
prefill chunk, launches eagerly. `decode_batch` runs the same code for one token of each of B
sequences (`Call.batched`: its attention is AttentionStage.forward_batch, which reads each
sequence's state through address tables and decides on the device what depends on a sequence's
position); its device part is replayed from one CUDA graph per batch size (and mask or none),
whichever sequences, wherever they stand.

A sequence's state moves as a whole (flashv41.sequence_state says what it holds and how a rewind
gets it back; flashv41.sequence_file how it is kept in a file): `fork` copies its used part on the
device, `truncate` restores a checkpoint and runs again the calls that brought the kept tokens,
`save` / `load_sequence` write and read it with a header naming the model.

The engine's workspaces are shared by its sequences, so calls on one engine must not run
concurrently (one Python thread drives an engine). A prompt longer than `max_tokens` is prefilled
in chunks of `max_tokens`.
"""

from __future__ import annotations

import os
import warnings
import weakref
from collections import defaultdict
from collections.abc import Callable
from collections.abc import Sequence as Sequence_
from typing import Any

import numpy as np

from flashv41.ffn import FfnCallback, FfnStream, callback_name, is_capturable, stream_handle
from flashv41.graphs import GraphRunner, graphs_available
from flashv41.host.errors import (
    CallbackError,
    CapacityError,
    InputError,
    SequenceStateError,
    UnsupportedError,
    plural,
)
from flashv41.host.model import Model
from flashv41.host.tokens import Tokens
from flashv41.memory import (
    DEFAULT_MAX_SEQ,
    DEFAULT_MAX_TOKENS,
    TABLE_RESIDENCIES,
    device_free_bytes,
    estimate_memory,
    sequence_state_bytes,
)
from flashv41.plan import (
    ATTN,
    DIRECT,
    ENGRAM,
    FFN,
    Call,
    EngramPlan,
    LayerCapture,
    LayerPlan,
    Plan,
    Run,
    StageTimer,
    Step,
    StepObserver,
    Watched,
)
from flashv41.sequence import Sequence, one_token_mask

ProgressFn = Callable[[str], None]

# the profile's rows (flashv41.plan.Step) of the calls outside the layers and of the engram's
EMBEDDING = Step("embedding")  # the ids' upload (host part) and the embedding (device part)
HASH = Step("engram hash (host)")
DOWNLOAD = Step("highway download")
HEAD_INPUT = Step("head input (hc_pre + output_norm)")
ENGRAM_NAME = "engram rows, projection, gate"


class Engine:
    """DeepSeek-V4.1 engram + attention layers on the GPU (or the CUDA simulator) for one model.

    max_seq: positions a sequence may hold (sizes the per-sequence caches and RoPE tables); by
    default 4096, or the model's context length where that is shorter.
    max_tokens: tokens per forward call (sizes the workspaces; longer prompts are chunked).
    table_residency: "device" (engram tables uploaded once), "pinned" (copied once into page-locked
    host memory that the row kernel reads over the host link: no table bytes on the device) or
    "host" (rows read from the memory-mapped file per call and uploaded).
    profile: synchronise around every step and add its wall time to `stage_seconds` under the
    step's name (flashv41.plan.StageTimer; slower; for timing tables; steps then run eagerly).
    graphs: replay one-token steps as CUDA graphs (flashv41.graphs), per sequence and per step
    kind (`graph_key`); ignored on the simulator and with "host" tables, whose rows are uploaded
    data rather than ids. Results are the same either way.
    progress: called with a line of text at each step of the (possibly long) set-up.
    ffn: the FFN sublayer's callback, `ffn(layer, x, out, stream)` (flashv41.ffn says what it gets
    and what it may do inside a captured step); None: a zero FFN output. It needs the model's
    ffn_norm tensors.
    """

    def __init__(self, model: Model, max_seq: int | None = None, max_tokens: int = DEFAULT_MAX_TOKENS,
                 table_residency: str = "device", profile: bool = False, progress: ProgressFn | None = None,
                 graphs: bool = True, ffn: FfnCallback | None = None):
        cfg = model.config
        if max_seq is None:
            max_seq = min(DEFAULT_MAX_SEQ, cfg.context_length)
        for name, value in (("max_seq", max_seq), ("max_tokens", max_tokens)):
            if not isinstance(value, (int, np.integer)) or isinstance(value, (bool, np.bool_)):
                raise InputError(f"{name} must be an integer, got {type(value).__name__} {value!r}")
            if value < 1:
                raise InputError(f"{name} must be at least 1, got {value}")
        if max_seq > cfg.context_length:
            raise CapacityError(f"max_seq {max_seq} exceeds the model's context length {cfg.context_length}")
        if table_residency not in TABLE_RESIDENCIES:
            raise InputError(f"table_residency must be one of {', '.join(TABLE_RESIDENCIES)}, "
                             f"got {table_residency!r}")
        if ffn is not None and not callable(ffn):
            raise InputError(f"ffn must be a callable ffn(layer, x, out, stream) or None, got {type(ffn).__name__}")
        if ffn is not None and not cfg.ffn_norm:
            raise UnsupportedError(f"{model.path.name}: an FFN callback's input is normed with each layer's "
                                   f"ffn_norm, and the file has none (a file written without its FFN tensors)")
        # importing flashv41.stages chooses the backend, before numba.cuda is first imported
        from flashv41.stages.backend import select_backend

        select_backend()
        from numba import cuda

        from flashv41.host.engram_hash_fast import FastEngramHasher
        from flashv41.stages.attention import AttentionStage
        from flashv41.stages.engram import EngramStage
        from flashv41.stages.head import HeadStage
        from flashv41.stages.hyper import HyperStage

        self._cuda = cuda
        self._hasher_cls = FastEngramHasher
        self.model = model
        self.cfg = cfg
        self.max_seq = max_seq
        self.max_tokens = max_tokens
        self.table_residency = table_residency
        say = progress or (lambda _msg: None)
        say("uploading hyper-connection weights and the embedding")
        self.hyper = HyperStage(model, max_tokens)
        say("uploading attention weights")
        self.attention = AttentionStage(model, max_tokens, max_seq)
        self.engram: EngramStage | None = None
        if cfg.engram is not None:
            say(f"uploading engram weights (tables: {table_residency})")
            self.engram = EngramStage(model, max_tokens, table_residency)
        self.head: HeadStage | None = None
        if cfg.head:
            say("uploading the head (output_norm, output)")
            self.head = HeadStage(model, max_tokens)
        self.ffn = ffn
        hc, dim = cfg.hc, cfg.dim
        self.h = cuda.device_array((max_tokens, hc, dim), np.float32)  # [T, hc, C] the highway
        self.x = cuda.device_array((max_tokens, dim), np.uint16)  # [T, C] bf16 sublayer input
        self.a = cuda.device_array((max_tokens, dim), np.uint16)  # [T, C] bf16 attention output
        self.mask = cuda.device_array(max_tokens, np.uint8)  # [T] engram token mask
        # [T, C] bf16: the FFN callback's output; the head's input of a decode_batch step (a sequence's
        # own call writes the sequence's buffer)
        self.ffn_out = cuda.device_array((max_tokens, dim), np.uint16) if ffn is not None else None
        self.head_x = cuda.device_array((max_tokens, dim), np.uint16) if self.head is not None else None
        self.profile = profile
        self.stage_seconds: defaultdict[str, float] = defaultdict(float)
        self._timer = StageTimer(cuda.synchronize, self.stage_seconds)
        # more observers of every call's steps (a benchmark's events); a watched one-token step
        # launches eagerly, as a profiled one does
        self.observers: list[StepObserver] = []
        self.plan = self._build_plan()
        self._ratios = sorted({role.ratio for role in cfg.roles if role.ratio > 0})
        self.graphs = graphs and graphs_available() and table_residency != "host"
        if self.graphs and ffn is not None and not is_capturable(ffn):
            self.graphs = False
            warnings.warn(f"flashv41.Engine: the FFN callback {callback_name(ffn)} is not marked capturable "
                          "(flashv41.capturable), so this engine's decode steps launch eagerly, without CUDA "
                          "graphs", stacklevel=2)
        self._runner = GraphRunner() if self.graphs else None
        self._batch_graphs: dict[tuple[int, bool], Any] = {}  # decode_batch graphs by (B, masked)
        self._batch_keys_seen: set[tuple[int, bool]] = set()
        self._sequences: weakref.WeakSet[Sequence] = weakref.WeakSet()
        self._model_hash: str | None = None
        self.closed = False
        say("engine ready")

    def sequence_bytes(self, position: int | None = None) -> int:
        """One sequence's state (window rings, kv sources' caches and compressor state, and the
        engram hash cache, on the host: a few bytes a position), as the memory estimate counts it.
        By default at max_seq: the device memory one more sequence takes (its checkpoint aside:
        `checkpoint_bytes`). At a position: the used part that a fork copies and a save writes."""
        estimate = estimate_memory(self.cfg, self.model.weights, self.max_seq, self.max_tokens, self.table_residency)
        if position is None:
            return estimate.state_bytes_per_sequence
        if not 0 <= position <= self.max_seq:
            raise InputError(f"position {position} is outside 0..max_seq ({self.max_seq})")
        return sequence_state_bytes(self.cfg, position)

    def checkpoint_bytes(self) -> int:
        """The device memory of one truncate checkpoint (flashv41.sequence_state): every layer's
        window ring and the compressor's partial groups. A sequence holds one by default."""
        return estimate_memory(self.cfg, self.model.weights, self.max_seq, self.max_tokens,
                               self.table_residency).checkpoint_bytes

    def max_batch(self) -> int:
        """How many more sequences fit in the device memory free now (the driver's figure, after
        the queued work and numba's deferred frees), each `sequence_bytes()` and one checkpoint."""
        self._check_open()
        return device_free_bytes() // (self.sequence_bytes() + self.checkpoint_bytes())

    def new_sequence(self, checkpoints: int = 1) -> Sequence:
        """A new, empty sequence with its own device state. checkpoints: how many truncate
        checkpoints it keeps (`Sequence.truncate`; 0 makes every truncate run from position 0)."""
        self._check_open()
        if not isinstance(checkpoints, (int, np.integer)) or isinstance(checkpoints, (bool, np.bool_)) \
                or checkpoints < 0:
            raise InputError(f"checkpoints must be an integer of at least 0, got {checkpoints!r}")
        seq = Sequence(self, int(checkpoints))
        self._sequences.add(seq)
        return seq

    def load_sequence(self, path: str | os.PathLike[str], checkpoints: int = 1) -> Sequence:
        """A new sequence with the state `Sequence.save` wrote to `path`, going on bit for bit as the
        saved one would. Read and checked whole before anything is allocated (flashv41.sequence_file:
        SequenceFileError, or CapacityError for a sequence longer than max_seq)."""
        self._check_open()
        from flashv41.sequence_file import read_sequence

        saved = read_sequence(self, path)
        seq = self.new_sequence(checkpoints)
        try:
            saved.into(seq)
        except BaseException:
            seq.release()
            raise
        return seq

    def model_hash(self) -> str:
        """The content hash of the engine's model that a saved sequence names (computed once;
        flashv41.sequence_file.model_hash says what it covers)."""
        if self._model_hash is None:
            from flashv41.sequence_file import model_hash

            self._model_hash = model_hash(self.model)
        return self._model_hash

    def close(self) -> None:
        """Release every sequence and free the engine's device memory (idempotent)."""
        if self.closed:
            return
        for seq in list(self._sequences):
            seq.release()
        for graph in self._batch_graphs.values():
            graph.close()
        self._batch_graphs = {}
        self.hyper.free()
        self.attention.free()
        if self.engram is not None:
            self.engram.free()
        if self.head is not None:
            self.head.free()
        self.h = self.x = self.a = self.mask = self.ffn_out = self.head_x = None
        self.plan = Plan.empty()
        self.closed = True

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _check_open(self) -> None:
        if self.closed:
            raise SequenceStateError("this engine was closed")

    def _build_plan(self) -> Plan:
        """What every call decides the same way, once: each engram layer's column of the hash and
        the engram layer after it, the hyper stage's values for each layer (HyperStage.plan: which
        buffers, which post forms which product) and the names the profile gives each call."""
        cfg = self.cfg
        engram_layers = [role.layer for role in cfg.roles if role.engram]
        engram: dict[int, EngramPlan] = {}
        after = None
        for i in reversed(engram_layers):  # each names the next, so the last is built first
            assert cfg.engram is not None
            after = engram[i] = EngramPlan(i, cfg.engram.hash_index(i), Step(ENGRAM_NAME, i), after)
        layers = []
        hook = self.ffn is not None
        for role, hc in zip(cfg.roles, self.hyper.plan(engram_layers, zero_ffn=not hook), strict=True):
            i = role.layer
            ffn_mixes = "hc mixes + hc_post + next mixes' product" if hc.ffn_in_one else "hc mixes"
            layers.append(LayerPlan(
                i, engram.get(i), hc,
                attn_mixes=Step("hc mixes + hc_pre + attn_norm", i),
                attention=Step(f"attention ({role.block_type})", i),
                attn_post=Step(post_name(hc.attn_then is not None), i),
                ffn_mixes=Step("hc mixes + hc_pre + ffn_norm" if hook else ffn_mixes, i),
                ffn_post=Step(post_name(hc.ffn_then is not None), i),
                ffn=Step(FFN_CALLBACK, i) if hook else None))
        stages = tuple(s for s in (self.hyper, self.engram, self.attention, self.head) if s is not None)
        return Plan(tuple(layers), tuple(engram[i] for i in engram_layers), stages, self.h)

    def _run(self, call: Call, capture: bool) -> Run:
        """Who watches this call's stage calls (the profile's timer, then `observers`, and the
        captures at the layers' edges): DIRECT, the calls as written, when nobody does."""
        observers = ((self._timer,) if self.profile else ()) + tuple(self.observers)
        if not observers and not capture:
            return DIRECT
        return Watched(call, observers, LayerCapture(self.h) if capture else None)

    def _forward(self, seq: Sequence, tokens: Tokens, capture: bool, rows: int) -> np.ndarray:
        """One chunk of T <= max_tokens tokens at the sequence's position; returns h [rows, hc, C],
        its last `rows` tokens' final highway (none: the call still ends when the device does)."""
        t = tokens.ids.size
        call = Call(tokens=t, start=seq.position, ids=tokens, mask=None if tokens.mask is None else self.mask,
                    hasher=seq.hasher, state=seq.state, shared=self.attention.new_shared(),
                    captures=[{} for _ in self.cfg.roles] if capture else None, head_x=seq.head_x)
        run = self._run(call, capture)
        self._upload(call, run)
        # an observer needs the calls one by one, which a graph replay does not give it
        if t == 1 and self.graphs and not run.observed:
            self._replay(seq, call)
        else:
            self._device(call, run)
            if call.captures is not None:
                seq.captures = call.captures
        seq.history.record(tokens)
        seq.head_rows = t
        return self._download(call, run, rows)

    def _upload(self, call: Call, run: Run) -> None:
        """The host part of a call: what its device part reads that changes from call to call. The
        checked token ids, uploaded once (the embedding reads them there); the engram hash of the
        same ids on the host; each engram layer's row ids (or a host table's rows) into its
        workspace; then the plain copies of `_copy_inputs`."""
        t = call.tokens
        run(EMBEDDING, self.hyper.upload_ids, call.ids.ids, t)
        if self.engram is not None:
            call.hashes = hashes = run(HASH, call.hasher.hash, call.ids, call.start)
            for e in self.plan.engram:
                run(e.step, self.engram.upload_rows, e.layer, hashes[:, e.column], t)
        self._copy_inputs(call)

    def _device(self, call: Call, run: Run) -> None:
        """The device part of a call, launches only (what a CUDA graph records): the embedding of
        the uploaded ids into every copy of the highway, the first engram layer's rows and
        projection, then every layer."""
        t = call.tokens
        run(EMBEDDING, self.hyper.embed_uploaded, self.h, t)
        if self.plan.engram:
            first = self.plan.engram[0]
            assert self.engram is not None
            run(first.step, self.engram.prepare, first.layer, t)
        for lp in self.plan.layers:
            self._layer(lp, call, run)
        if self.head is not None:  # the last layer's FFN pre collapses the copies (V4.1's head has no mixes)
            run(HEAD_INPUT, self.head.input, self.h, self.plan.layers[-1].hyper.ffn.pre, call.head_x, t)

    def _layer(self, lp: LayerPlan, call: Call, run: Run) -> None:
        """Layer lp.layer on the highway h [T, hc, C], in the V4.1 order: the engram gate (engram
        layers), the attention sublayer (its mixes, with hc_pre + attn_norm into x; the attention
        into a; hc_post), the FFN sublayer (its mixes, whose pre is the next layer's pre_in; a zero
        output, or the callback's on x = ffn_norm(hc_pre(h, the attention's pre)); hc_post). A mixes
        call returns the Mixes its post reads; `then` is the next mixes', whose product that post
        forms (stages.hyper)."""
        i, t, h, x, a = lp.layer, call.tokens, self.h, self.x, self.a
        hyper, hc = self.hyper, lp.hyper
        run.layer_begins(lp)
        if lp.engram is not None:
            assert self.engram is not None
            run(lp.engram.step, self.engram.finish, i, h, t, call.mask, call.capture(i))
            upcoming = lp.engram.next
            if upcoming is not None:  # the next engram layer's rows and projection, now its workspaces are free
                run(upcoming.step, self.engram.prepare, upcoming.layer, t)
            run.sublayer_ends(lp, ENGRAM)
        attn = run(lp.attn_mixes, hyper.mixes_norm, h, hc.attn, hc.pre_in, x, t)
        if call.batched:
            run(lp.attention, self.attention.forward_batch, i, x, a, call.state, call.shared, call.start, t)
        else:
            run(lp.attention, self.attention.forward, i, x, a, call.state, call.shared, call.start, t,
                call.capture(i))
        run(lp.attn_post, hyper.post_mix, h, a, attn, t, hc.attn_then)
        run.sublayer_ends(lp, ATTN)
        if hc.ffn_in_one:  # its mixes, its post and the next mixes' product in one launch
            run(lp.ffn_mixes, hyper.mixes_post, h, hc.ffn, t, hc.ffn_then)
        elif lp.ffn is None:
            ffn = run(lp.ffn_mixes, hyper.mixes, h, hc.ffn, t)
            run(lp.ffn_post, hyper.post_mix, h, None, ffn, t, hc.ffn_then)
        else:  # the caller's FFN, on x collapsed by this layer's attention pre
            ffn = run(lp.ffn_mixes, hyper.mixes_norm, h, hc.ffn, attn.pre, x, t)
            run(lp.ffn, self._ffn_call, i, x, self.ffn_out, t)
            run(lp.ffn_post, hyper.post_mix, h, self.ffn_out, ffn, t, hc.ffn_then)
        run.sublayer_ends(lp, FFN)

    def _ffn_call(self, layer: int, x: Any, out: Any, n_tokens: int) -> None:
        """The FFN callback on x[:T] into out[:T], with the stream the stages launch on now (a
        graph's builder while one is recorded); what it raises, as a CallbackError naming it."""
        stream = self.hyper.stream
        try:
            self.ffn(layer, x[:n_tokens], out[:n_tokens], FfnStream(stream, stream_handle(stream)))  # type: ignore[misc]
        except Exception as exc:
            raise CallbackError(f"the FFN callback {callback_name(self.ffn)} raised {type(exc).__name__} at layer "
                                f"{layer} ({plural(n_tokens, 'token')}): {exc}") from exc

    def _download(self, call: Call, run: Run, rows: int) -> np.ndarray:
        """The call's last `rows` rows of the highway, h [rows, hc, C] float32, on the host. With
        none it waits for the device all the same: the next call's uploads reuse pinned host
        buffers that this call's copies may still read."""
        t = call.tokens
        if rows == 0:
            run(DOWNLOAD, self._cuda.synchronize)
            return np.empty((0, *self.h.shape[1:]), np.float32)
        return run(DOWNLOAD, self.h[t - rows:t].copy_to_host)

    def decode_batch(self, seqs: Sequence_[Sequence], token_ids: Any, token_masks: Any = None) -> np.ndarray:
        """One step of B sequences of this engine, one token each (B <= max_tokens), each at its own
        position with its own state; returns h [B, hc, dim], row b sequence b's (what
        `seqs[b].decode(token_ids[b])` returns). token_masks: None, or B bools / Nones (False: the
        token takes no part in any n-gram, as decode's token_mask). Everything is checked before
        anything runs (a bad token, a full, released or failed sequence, one given twice or from
        another engine: an error naming the sequence's index, the others untouched).

        Every stage is one launch for the B sequences: the products read each weight once, the
        per-sequence stages (window, compressor, indexer, sparse attention) read each sequence's own
        state through address tables. The step replays a CUDA graph per batch size (captured the
        second time a size comes up, as a sequence's are), whatever the sequences and positions.
        Results are those of decoding each sequence alone wherever the kernels are the same for B
        tokens as for one (the products' stream kernel and the sparse attention's split path, B
        <= 8). For B = 9 to 64 the products run on the narrow tensor-core kernel, whose sums do not
        depend on the batch: each sequence's result is then within the oracle's bounds of its
        result alone and bit for bit the same in any batch of more than eight. With profile=True
        the step is walked stage by stage into `stage_seconds` instead of replayed."""
        self._check_open()
        seqs = list(seqs)
        tokens = self._check_batch(seqs, token_ids, token_masks)
        b = len(seqs)
        call = Call(tokens=b, start=[seq.position for seq in seqs], ids=tokens,
                    mask=None if tokens.mask is None else self.mask,
                    hasher=BatchHasher([seq.hasher for seq in seqs]), state=[seq.state for seq in seqs],
                    shared=[self.attention.new_shared() for _ in seqs], batched=True, head_x=self.head_x)
        run = self._run(call, False)  # profile: the calls one by one, timed (no graph)
        try:
            self._upload(call, run)
            if self.graphs and not run.observed:
                self._replay_batch(call)
            else:
                self._device(call, run)
            out = self._download(call, run, call.tokens)
            if self.head_x is not None:  # each sequence's row of the head's input, into its own buffer
                for b, seq in enumerate(seqs):
                    seq.head_x[:1].copy_to_device(self.head_x[b:b + 1])
        except BaseException:
            for seq in seqs:  # validated input failed on the way: every state may be partly written
                seq.failed = True
            raise
        for b, seq in enumerate(seqs):
            seq.history.record(tokens.part(b, b + 1))
            seq.head_rows = 1
        return out

    def _check_batch(self, seqs: list[Sequence], token_ids: Any, token_masks: Any) -> Tokens:
        """decode_batch's tokens (ids int64 [B], mask bool [B] or None), each checked once by its
        sequence, or the error naming the first bad sequence."""
        if not 1 <= len(seqs) <= self.max_tokens:
            raise InputError(f"decode_batch takes 1 to max_tokens ({self.max_tokens}) sequences, got {len(seqs)}")
        ids = np.asarray(token_ids)
        if ids.shape != (len(seqs),) or not np.issubdtype(ids.dtype, np.integer):
            raise InputError(f"decode_batch: token_ids must be {len(seqs)} integers, one a sequence, got "
                             f"{ids.dtype} {ids.shape}")
        masks = [None] * len(seqs) if token_masks is None else list(token_masks)
        if len(masks) != len(seqs):
            raise InputError(f"decode_batch: {len(masks)} token masks for {len(seqs)} sequences")
        seen: set[int] = set()
        checked = []
        for i, (seq, m) in enumerate(zip(seqs, masks, strict=True)):
            if not isinstance(seq, Sequence) or seq.engine is not self:
                raise InputError(f"decode_batch: sequence {i} is not a sequence of this engine")
            if id(seq) in seen:
                raise InputError(f"decode_batch: sequence {i} appears twice (one token a sequence a step)")
            seen.add(id(seq))
            one = one_token_mask(m, f"decode_batch: token mask {i}")
            try:
                checked.append(seq._validate(ids[i:i + 1], one))
            except (InputError, CapacityError, SequenceStateError) as e:
                raise type(e)(f"decode_batch: sequence {i}: {e}") from e
        mask = None if all(m is None for m in masks) else np.array([True if m is None else bool(m) for m in masks])
        return Tokens(np.concatenate([c.ids for c in checked]), mask)

    def _copy_inputs(self, call: Call) -> None:
        """The rest of what the device part reads that changes from call to call (mask, first mix,
        positions, a batch's address tables): plain copies, not stages of the profile's table."""
        t = call.tokens
        if call.ids.mask is not None:
            self.mask[:t].copy_to_device(call.ids.mask.astype(np.uint8))
        self.hyper.upload_first_mix(t)
        self.attention.upload_positions(call.start, t)
        if call.batched:
            self.attention.upload_rows(call.state)

    def graph_key(self, start: int, masked: bool) -> tuple:
        """What a one-token step at `start` decides on the host, for every compressor ratio r of
        the model: whether the token completes a group, and whether any group is complete yet
        (whether there is anything to score); and whether a mask is applied. Steps with one key
        launch the same kernels with the same arguments, so they share a graph."""
        return (masked, *((start % r == r - 1, start + 1 < r) for r in self._ratios))

    def _replay(self, seq: Sequence, call: Call) -> None:
        """The device part of a one-token step as a CUDA graph: the sequence's graph for this
        step's key."""
        assert isinstance(call.start, int)  # a single sequence's call
        self._replay_graph(seq.graphs, seq.graph_keys_seen, self.graph_key(call.start, call.mask is not None), call)

    def _replay_batch(self, call: Call) -> None:
        """The device part of a decode_batch step as a CUDA graph, one per (B, masked): it reads
        the positions and the sequences' address tables from the device, so it serves any batch
        of B."""
        self._replay_graph(self._batch_graphs, self._batch_keys_seen, (call.tokens, call.mask is not None), call)

    def _replay_graph(self, graphs: dict, seen: set, key: tuple, call: Call) -> None:
        """Launch graphs[key] of the call's device part, captured the second time the key comes up
        (the first runs eagerly, which also compiles every kernel the capture will record)."""
        graph = graphs.get(key)
        if graph is None and key not in seen:
            seen.add(key)
            self._device(call, DIRECT)
            return
        assert self._runner is not None
        if graph is None:
            graph = self._runner.capture_stages(list(self.plan.stages), lambda: self._device(call, DIRECT))
            graphs[key] = graph
        self._cuda.synchronize()  # eager work queued on other streams comes first
        self._runner.launch(graph)


FFN_CALLBACK = "ffn (callback)"  # the step name of an FFN callback's call


def post_name(with_product: bool) -> str:
    """The step name of an hc_post: the profile shows where it also forms the next mixes' product."""
    return "hc_post + next mixes' product" if with_product else "hc_post"


class BatchHasher:
    """The engram hash of a decode_batch step: each sequence's own hasher on its token, at its
    position, stacked ([B, n_engram_layers, cols], as one hasher's hash of B tokens)."""

    def __init__(self, hashers: list[Any]):
        self.hashers = hashers

    def hash(self, tokens: Tokens, starts: list[int]) -> np.ndarray:
        return np.concatenate([h.hash(tokens.part(b, b + 1), starts[b]) for b, h in enumerate(self.hashers)])
