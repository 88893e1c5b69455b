"""The engine: every stage created once, sequences with their own device state, and the scheduler
that runs a chunk of tokens through the layer stack.

    import flashv41
    model = flashv41.load_model("model.gguf")
    engine = flashv41.Engine(model, max_seq=4096, max_tokens=256)
    seq = engine.new_sequence()
    h = seq.prefill(token_ids)      # final highway [T, hc, dim] float32 (NumPy)
    h = seq.decode(token_id)        # [1, hc, dim]
    h = engine.decode_batch([seq, other], [tok, tok2])  # one step of several sequences [B, hc, dim]
    seq.release()                   # frees its device state; the engine stays usable
    engine.close()

Per layer, in the V4.1 order: engram (hash once per call for all engram layers -> rows ->
projection -> gate) -> attention mixes with hc_pre + attn_norm -> attention -> hc_post -> the FFN
sublayer as a zero output with its own mixes, whose `pre` is the next layer's pre-mix. Each hc_post
also forms the next mixes' product where it can (HyperStage.fuses; not before an engram layer).

The steps of a call are built once, at construction, into `Engine.plan` (flashv41.plan): which
stage, which method, which buffers. A call walks it: the host part (token ids, the engram hash,
each engram layer's rows onto the device; then mask, first mix and positions, `_copy_inputs`), the
device part (launches only) and the highway's download. A one-token step's device part is
replayed from a CUDA graph of the sequence (flashv41.graphs), one graph per `graph_key`: what the
step decides on the host. Profiling and captures watch the walk as observers (`StageTimer`,
`LayerCapture`, and any in `Engine.observers`); a watched call, like a prefill chunk, launches
eagerly. `decode_batch` walks a second plan, `batch_plan`, built the same way but for one token
of each of B sequences (its attention step is AttentionStage.forward_batch, which reads each
sequence's state through address tables and decides on the device what depends on a sequence's
position); its device part is replayed from one CUDA graph per batch size (and mask or none),
whichever sequences, wherever they stand.

The engine's workspaces are shared by its sequences, so calls on one engine must not run
concurrently (one Python thread drives an engine). A prompt longer than `max_tokens` is prefilled
in chunks of `max_tokens`.
"""

from __future__ import annotations

import itertools
import weakref
from collections import defaultdict
from collections.abc import Callable
from collections.abc import Sequence as Sequence_
from typing import Any

import numpy as np

from flashv41.graphs import GraphRunner, graphs_available
from flashv41.host.errors import CapacityError, InputError, SequenceStateError, plural
from flashv41.host.model import Model
from flashv41.host.tokens import check_tokens, one_token
from flashv41.memory import DEFAULT_MAX_SEQ, DEFAULT_MAX_TOKENS, TABLE_RESIDENCIES, device_free_bytes, estimate_memory
from flashv41.plan import (
    HASHER,
    IDS,
    MASK,
    SHARED,
    START,
    STATE,
    TOKEN_MASK,
    TOKENS,
    Call,
    Captured,
    Head,
    LayerCapture,
    LayerPlan,
    Plan,
    Rows,
    StageTimer,
    Step,
    StepObserver,
    walk,
)

ProgressFn = Callable[[str], None]


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
    """

    def __init__(self, model: Model, max_seq: int | None = None, max_tokens: int = DEFAULT_MAX_TOKENS,
                 table_residency: str = "device", profile: bool = False, progress: ProgressFn | None = None,
                 graphs: bool = True):
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
        # importing flashv41.stages chooses the backend, before numba.cuda is first imported
        from flashv41.stages.backend import select_backend

        select_backend()
        from numba import cuda

        from flashv41.host.engram_hash_fast import FastEngramHasher
        from flashv41.stages.attention import AttentionStage
        from flashv41.stages.engram import EngramStage
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
        hc, dim = cfg.hc, cfg.dim
        self.h = cuda.device_array((max_tokens, hc, dim), np.float32)  # [T, hc, C] the highway
        self.x = cuda.device_array((max_tokens, dim), np.uint16)  # [T, C] bf16 sublayer input
        self.a = cuda.device_array((max_tokens, dim), np.uint16)  # [T, C] bf16 attention output
        self.pre = [cuda.device_array((max_tokens, hc), np.float32) for _ in range(3)]  # [T, hc] mixes
        self.mask = cuda.device_array(max_tokens, np.uint8)  # [T] engram token mask
        self._one_hot = np.zeros((max_tokens, hc), np.float32)
        self._one_hot[:, 0] = 1
        self.profile = profile
        self.stage_seconds: defaultdict[str, float] = defaultdict(float)
        self._timer = StageTimer(cuda.synchronize, self.stage_seconds)
        # more observers of every call's steps (a benchmark's events); a watched one-token step
        # launches eagerly, as a profiled one does
        self.observers: list[StepObserver] = []
        self.plan = self._build_plan()
        self.batch_plan = self._build_plan(batched=True)
        self._ratios = sorted({role.ratio for role in cfg.roles if role.ratio > 0})
        self.graphs = graphs and graphs_available() and table_residency != "host"
        self._runner = GraphRunner() if self.graphs else None
        self._batch_graphs: dict[tuple[int, bool], Any] = {}  # decode_batch graphs by (B, masked)
        self._batch_keys_seen: set[tuple[int, bool]] = set()
        self._sequences: weakref.WeakSet[Sequence] = weakref.WeakSet()
        self.closed = False
        say("engine ready")

    def sequence_bytes(self) -> int:
        """The device memory one more sequence takes: its window rings, kv sources' caches and
        compressor state at this engine's max_seq, as the memory estimate counts them (with its
        engram hash cache, which lives on the host: a few bytes a position to spare)."""
        return estimate_memory(self.cfg, self.model.weights, self.max_seq, self.max_tokens,
                               self.table_residency).state_bytes_per_sequence

    def max_batch(self) -> int:
        """How many more sequences fit in the device memory free now (the driver's figure, after
        the queued work and numba's deferred frees), `sequence_bytes()` each."""
        self._check_open()
        return device_free_bytes() // self.sequence_bytes()

    def new_sequence(self) -> Sequence:
        """A new, empty sequence with its own device state."""
        self._check_open()
        seq = Sequence(self)
        self._sequences.add(seq)
        return seq

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
        self.h = self.x = self.a = self.mask = None
        self.pre = []
        self.plan = self.batch_plan = Plan.empty()
        self.closed = True

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _check_open(self) -> None:
        if self.closed:
            raise SequenceStateError("this engine was closed")

    def _build_plan(self, batched: bool = False) -> Plan:
        """Every step of a call, once, in the V4.1 order: the host part (token ids, the engram hash,
        each engram layer's rows), the embedding, each layer's engram -> mixes with hc_pre + attn_norm
        -> attention -> hc_post -> the FFN sublayer as a zero output, and the highway's download.
        An hc_post forms the next mixes' product where HyperStage.fuses allows it and no engram runs
        between them; those mixes then skip their own product launch (after_post). An FFN sublayer
        between two such posts is one launch (mixes_post: its mixes, post and the next product).
        batched: the plan of `decode_batch`, one token of each of B sequences (the call's start,
        state and shared runtime are then lists, its hasher a BatchHasher); only the attention
        step differs (AttentionStage.forward_batch)."""
        cfg, hyper, attention, engram = self.cfg, self.hyper, self.attention, self.engram
        h, x, a = self.h, self.x, self.a
        upload = [Step("embedding", None, hyper, "upload_ids", (IDS, TOKENS))]
        if cfg.engram is not None:
            upload.append(Step("engram hash (host)", None, HASHER, "hash", (IDS, START, TOKEN_MASK), result="hashes"))
        # the attention sublayer reads the mix the previous layer's FFN mixes wrote (layer 0: the
        # uploaded one-hot), so two buffers alternate; its own mixes' `pre` goes to the third
        pre_mix, pre_next, unused = self.pre
        # which mixes' product the post before them forms (HyperStage.fuses): not the first layer's
        # attention mixes (after the embedding), nor an engram layer's (the engram runs between)
        roles = cfg.roles
        attn_after_post = [n > 0 and not role.engram and hyper.fuses(role.layer, "attn")
                           for n, role in enumerate(roles)]
        # each engram layer's rows and projection (EngramStage.prepare) run as early as its shared
        # workspaces allow: the first after the embedding, each later one after the previous
        # engram layer's gate; a captured graph runs them beside the layers in between
        engram_name = "engram rows, projection, gate"
        engram_layers = [role.layer for role in roles if role.engram]
        prepare = {i: (Step(engram_name, i, engram, "prepare", (i, TOKENS)),) for i in engram_layers}
        next_prepare = {i: prepare[j] for i, j in itertools.pairwise(engram_layers)}
        layers = []
        for n, role in enumerate(roles):
            i = role.layer
            rows: Rows | None = None
            engram_steps: tuple[Step, ...] = ()
            if role.engram:
                assert engram is not None and cfg.engram is not None
                rows = Rows(cfg.engram.hash_index(i))
                upload.append(Step(engram_name, i, engram, "upload_rows", (i, rows, TOKENS)))
                engram_steps = (Step(engram_name, i, engram, "finish", (i, h, TOKENS, MASK, Captured(i))),
                                *next_prepare.get(i, ()))
            ffn_after_post = hyper.fuses(i, "ffn")
            then_attn = (roles[n + 1].layer, "attn") if n + 1 < len(roles) and attn_after_post[n + 1] else None
            attn = (Step("hc mixes + hc_pre + attn_norm", i, hyper, "mixes_norm",
                         (i, h, pre_mix, unused, x, TOKENS, attn_after_post[n])),
                    Step(f"attention ({role.block_type})", i, attention, "forward_batch",
                         (i, x, a, STATE, SHARED, START, TOKENS)) if batched else
                    Step(f"attention ({role.block_type})", i, attention, "forward",
                         (i, x, a, STATE, SHARED, START, TOKENS, Captured(i))),
                    Step(post_name(ffn_after_post), i, hyper, "post_mix",
                         (h, a, TOKENS, (i, "ffn") if ffn_after_post else None)))
            if ffn_after_post and then_attn is not None:
                ffn: tuple[Step, ...] = (Step("hc mixes + hc_post + next mixes' product", i, hyper, "mixes_post",
                                              (i, h, pre_next, TOKENS, then_attn)),)
            else:
                ffn = (Step("hc mixes", i, hyper, "mixes", (i, "ffn", h, pre_next, TOKENS, ffn_after_post)),
                       Step(post_name(then_attn is not None), i, hyper, "post_mix", (h, None, TOKENS, then_attn)))
            layers.append(LayerPlan(i, pre_mix, rows, engram_steps, attn, ffn))
            pre_mix, pre_next = pre_next, pre_mix
        head = (Step("embedding", None, hyper, "embed_uploaded", (h, TOKENS)),
                *(prepare[engram_layers[0]] if engram_layers else ()))
        download = (Step("highway download", None, Head(h), "copy_to_host", result="output"),)
        return Plan(tuple(upload), head, tuple(layers), download, h)

    def _observers(self, capture: bool) -> tuple[StepObserver, ...]:
        """Who watches this call's steps; nobody on the plain path. The capture comes first, so its
        host copies fall outside the timer's window; `observers` come last."""
        watching: list[StepObserver] = []
        if capture:
            watching.append(LayerCapture(self.plan))
        if self.profile:
            watching.append(self._timer)
        return (*watching, *self.observers)

    def _forward(self, seq: Sequence, ids: np.ndarray, mask: np.ndarray | None, capture: bool) -> np.ndarray:
        """One chunk of T <= max_tokens tokens at the sequence's position; returns h [T, hc, C]."""
        t = ids.size
        call = Call(tokens=t, start=seq.position, ids=ids, token_mask=mask, mask=None if mask is None else self.mask,
                    hasher=seq.hasher, state=seq.state, shared=self.attention.new_shared(),
                    captures=[{} for _ in self.cfg.roles] if capture else None)
        observers = self._observers(capture)
        walk(self.plan.upload, call, observers)
        self._copy_inputs(call)
        # an observer needs the steps one by one, which a graph replay does not give it
        if t == 1 and self.graphs and not observers:
            self._replay(seq, call)
        else:
            walk(self.plan.device, call, observers)
            if call.captures is not None:
                seq.captures = call.captures
        seq.position += t
        walk(self.plan.download, call, observers)
        assert call.output is not None
        return call.output

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
        ids, mask = self._check_batch(seqs, token_ids, token_masks)
        b = len(seqs)
        starts = [seq.position for seq in seqs]
        call = Call(tokens=b, start=starts, ids=ids, token_mask=mask, mask=None if mask is None else self.mask,
                    hasher=BatchHasher([seq.hasher for seq in seqs]), state=[seq.state for seq in seqs],
                    shared=[self.attention.new_shared() for _ in seqs])
        observers = self._observers(False)  # profile: the steps one by one, timed (no graph)
        try:
            walk(self.batch_plan.upload, call, observers)
            self._copy_inputs(call)
            if self.graphs and not observers:
                self._replay_batch(call)
            else:
                walk(self.batch_plan.device, call, observers)
            walk(self.batch_plan.download, call, observers)
        except BaseException:
            for seq in seqs:  # validated input failed on the way: every state may be partly written
                seq.failed = True
            raise
        for seq in seqs:
            seq.position += 1
        assert call.output is not None
        return call.output

    def _check_batch(self, seqs: list[Sequence], token_ids: Any,
                     token_masks: Any) -> tuple[np.ndarray, np.ndarray | None]:
        """decode_batch's (ids int64 [B], mask bool [B] or None), or the error naming the first bad
        sequence."""
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
        for i, (seq, m) in enumerate(zip(seqs, masks, strict=True)):
            if not isinstance(seq, Sequence) or seq.engine is not self:
                raise InputError(f"decode_batch: sequence {i} is not a sequence of this engine")
            if id(seq) in seen:
                raise InputError(f"decode_batch: sequence {i} appears twice (one token a sequence a step)")
            seen.add(id(seq))
            one = one_token_mask(m, f"decode_batch: token mask {i}")
            try:
                seq._validate(ids[i:i + 1], one)
            except (InputError, CapacityError, SequenceStateError) as e:
                raise type(e)(f"decode_batch: sequence {i}: {e}") from e
        mask = None if all(m is None for m in masks) else np.array([True if m is None else bool(m) for m in masks])
        return ids.astype(np.int64), mask

    def _copy_inputs(self, call: Call) -> None:
        """The rest of what the device part reads that changes from call to call (mask, first mix,
        positions): plain copies, not stages of the profile's table."""
        t = call.tokens
        if call.token_mask is not None:
            self.mask[:t].copy_to_device(call.token_mask.astype(np.uint8))
        self.pre[0][:t].copy_to_device(self._one_hot[:t])
        self.attention.upload_positions(call.start, t)
        if isinstance(call.state, list):
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
        self._replay_graph(self.plan, seq.graphs, seq.graph_keys_seen,
                           self.graph_key(call.start, call.mask is not None), call)

    def _replay_batch(self, call: Call) -> None:
        """The device part of a decode_batch step as a CUDA graph, one per (B, masked): it reads
        the positions and the sequences' address tables from the device, so it serves any batch
        of B."""
        self._replay_graph(self.batch_plan, self._batch_graphs, self._batch_keys_seen,
                           (call.tokens, call.mask is not None), call)

    def _replay_graph(self, plan: Plan, graphs: dict, seen: set, key: tuple, call: Call) -> None:
        """Launch graphs[key] of the plan's device part, captured the second time the key comes up
        (the first runs eagerly, which also compiles every kernel the capture will record)."""
        graph = graphs.get(key)
        if graph is None and key not in seen:
            seen.add(key)
            walk(plan.device, call)
            return
        assert self._runner is not None
        if graph is None:
            graph = self._runner.capture_stages(plan.device_stages(), lambda: walk(plan.device, call))
            graphs[key] = graph
        self._cuda.synchronize()  # eager work queued on other streams comes first
        self._runner.launch(graph)


def post_name(with_product: bool) -> str:
    """The step name of an hc_post: the profile shows where it also forms the next mixes' product."""
    return "hc_post + next mixes' product" if with_product else "hc_post"


def one_token_mask(mask: Any, what: str) -> np.ndarray | None:
    """A one-token step's mask (decode's, each of decode_batch's) as prefill takes it: None, or
    bool [1]; anything but one bool or None is an InputError naming `what`."""
    if mask is None:
        return None
    if not isinstance(mask, (bool, np.bool_)):
        raise InputError(f"{what} is one bool or None, got {type(mask).__name__}")
    return np.array([bool(mask)])


class BatchHasher:
    """The engram hash of a decode_batch step: each sequence's own hasher on its token, at its
    position, stacked ([B, n_engram_layers, cols], as one hasher's hash of B tokens)."""

    def __init__(self, hashers: list[Any]):
        self.hashers = hashers

    def hash(self, token_ids: np.ndarray, starts: list[int], token_mask: np.ndarray | None) -> np.ndarray:
        return np.concatenate([h.hash(token_ids[b:b + 1], starts[b],
                                      None if token_mask is None else token_mask[b:b + 1])
                               for b, h in enumerate(self.hashers)])


class Sequence:
    """One sequence on an engine: its position, its hash history and its device state."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.position = 0
        self.captures: list[dict] = []
        self.state = engine.attention.new_state()
        engram = engine.cfg.engram
        self.hasher = engine._hasher_cls(engram, engine.max_seq) if engram is not None else None
        self.graphs: dict[tuple, Any] = {}  # decode graphs by Engine.graph_key
        self.graph_keys_seen: set[tuple] = set()
        self.failed = False  # a call failed after its input was accepted (see prefill)
        self.released = False

    @property
    def max_seq(self) -> int:
        return self.engine.max_seq

    def _validate(self, token_ids: Any, token_mask: Any) -> tuple[np.ndarray, np.ndarray | None]:
        if self.released:
            raise SequenceStateError("this sequence was released")
        if self.failed:
            raise SequenceStateError("this sequence failed in the middle of a call, so its state may be partly "
                                     "written: release it and start a new one")
        self.engine._check_open()
        ids, mask = check_tokens(token_ids, token_mask, self.engine.cfg.vocab_size)
        if self.position + ids.size > self.max_seq:
            raise CapacityError(f"{plural(ids.size, 'token')} at position {self.position} "
                                f"{'exceeds' if ids.size == 1 else 'exceed'} max_seq "
                                f"{self.max_seq} "
                                f"({plural(self.max_seq - self.position, 'position')} left)")
        return ids, mask

    def prefill(self, token_ids: Any, token_mask: Any = None, capture: bool = False) -> np.ndarray:
        """Run tokens from the current position (chunks of max_tokens); returns h [T, hc, dim] float32.

        token_mask: bool [T], False = the token takes no part in any n-gram and gets no engram
        contribution. capture: keep every layer's intermediates of the (last) chunk in `captures`.
        """
        ids, mask = self._validate(token_ids, token_mask)
        step = self.engine.max_tokens
        out = []
        try:
            for s in range(0, ids.size, step):
                part_mask = None if mask is None else mask[s:s + step]
                out.append(self.engine._forward(self, ids[s:s + step], part_mask, capture))
        except BaseException:
            self.failed = True  # validated input failed on the way: the state may be partly written
            raise
        return np.concatenate(out) if len(out) > 1 else out[0]

    def decode(self, token_id: int, token_mask: bool | None = None, capture: bool = False) -> np.ndarray:
        """One token at the current position; returns h [1, hc, dim]."""
        return self.prefill(one_token(token_id), one_token_mask(token_mask, "decode's token_mask"),
                            capture)

    def attention_state(self) -> list[dict[str, np.ndarray]]:
        """Every layer's attention state copied to the host, in the oracle's form (bf16 values as
        float32): window_ring, and for kv sources kv_state, score_state, compressed, index_keys.
        `host.oracle.OracleSequence.load_attention_state` takes it (for layer-by-layer checks)."""
        if self.released:
            raise SequenceStateError("this sequence was released")
        from flashv41.host.numerics import from_bits

        out = []
        for layer in self.state.layers:
            entry = {"window_ring": from_bits(layer.ring.copy_to_host())}
            if layer.source is not None:
                src = layer.source
                entry.update(kv_state=src.kv_state.copy_to_host(), score_state=src.score_state.copy_to_host(),
                             compressed=from_bits(src.compressed.copy_to_host()),
                             index_keys=from_bits(src.index_keys.copy_to_host()))
            out.append(entry)
        return out

    def release(self) -> None:
        """Free this sequence's device state (idempotent); the engine stays usable."""
        if self.released:
            return
        for graph in self.graphs.values():
            graph.close()
        self.graphs = {}
        self.state.free()
        self.hasher = None
        self.released = True
