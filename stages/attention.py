"""One V4.1 attention layer on the device, every layer kind, prefill in chunks from any position.

The per-layer orchestration of the attention stages, step for step as the oracle
(host.oracle.attention.attention_layer) runs them, for a chunk of T tokens at positions
start .. start+T-1 (C dim, H x D heads, Q q_lora, W window, K index_topk; bf16 = uint16 bits):

    qr = q_norm(x @ wq_a^T)                      [T, Q]       stages.linear, norm_rope_quant
    kv = act_quant(RoPE(kv_norm(x @ wkv^T)))     [T, D]       this chunk's window rows (wq_a and wkv
        in one launch, linear_pair, then q_norm and the kv chain in one, norm_rope_quant_pair)
    q = qr @ wq_b^T                              [T, H, D]  (RoPE'd where the attention reads it)
    kv sources: compressor -> latents of the completed groups -> index keys and compressed rows
        published into the sequence's caches                 stages.kv_sources
    index sources: queries from qr, scores against the last kv source's index keys, candidate
        blocks (candidate source) or their mask (later index sources), top-k -> the shared
        selection [T, K]                                      stages.indexer
    (in a captured graph the kv source's work runs on a branch beside the projections from the
    start, the indexer's on another beside wq_b, its scores after the kv branch: stages.branches)
    o = sparse attention with the sink over each query's entries: W window positions oldest first
        (ring slots before the chunk, chunk rows after), then the selection (ratio > 0 layers),
        made in the attention's kernels, which also rotate q as they load it and rotate the output
        back: o = RoPE^-1(attention(RoPE(q)))        [T, H, D]    stages.sparse_attention
    out = (o grouped @ wo_a^T) @ wo_b^T              [T, C]
    the ring takes the chunk's last min(T, W) rows (after the attention read it; a decode step's
        one row, whose slot holds position p - W, which no entry names, as the kv chain writes it)

Ratio > 0 layers rotate everything with the compressed (YaRN) table, ratio 0 with the plain one.

API (what the engine calls):
    stage = AttentionStage(model, max_tokens, max_seq)    # weights, RoPE tables, workspaces
    state = stage.new_state()                             # one sequence, every layer
    shared = stage.new_shared()                           # one forward call down the stack
    for layer in range(n_layers): stage.forward(layer, x, out, state, shared, start, T)

Decode (T = 1) allocates nothing on the device: every array is a workspace sized once for
max_tokens, or sequence state. It uploads one thing, the positions (int32 [T], once per forward
call: the layers share them; skipped when they did not change). Every kernel reads positions off
the device (window slots, ring slot, group ids, visible counts, score width, each query's entries),
selections are built on the device, and nothing comes back to the host. Host decisions depend
only on (start, T): how many groups a chunk completes, and whether a layer has any group to score.
While a graph is captured (`capturing`), the index-score and selection launches are sized for the
cache rather than the width (stages.indexer.index_scores and select take any width >= the real
one, and cap their grids at what fills the GPU, their blocks striding over, or slicing, the width
they read off the positions), so that a graph captured at one position serves every later one
with the same host decisions (flashv41.engine).

One forward call at a time per stage: the selection and candidate mask of a SharedRuntime are the
stage's workspaces."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
from numba import cuda

from flashv41.host import gguf_layout as L
from flashv41.host.config import LayerRole, ModelConfig
from flashv41.host.errors import CapacityError, InputError, ModelFormatError, SequenceStateError, plural
from flashv41.host.model import Model
from flashv41.host.numerics import from_bits, rope_tables
from flashv41.stages import indexer, kv_sources
from flashv41.stages.branches import Branch
from flashv41.stages.device import SIM, DeviceArray, check_array, fill, grid_1d, jit_kernel
from flashv41.stages.indexer import IndexerWeights
from flashv41.stages.kv_sources import KvSourceState, KvSourceWeights, KvSourceWorkspace
from flashv41.stages.linear import DeviceWeight, linear, linear_pair
from flashv41.stages.norm_rope_quant import Chain, norm_rope_quant_pair, rope
from flashv41.stages.row_tables import table_row
from flashv41.stages.sparse_attention import (
    SPLIT_BATCH_TOKENS,
    SparseWorkspace,
    sparse_attention,
    sparse_attention_tables,
)
from flashv41.stages.topk import SPLIT_ROWS, SelectWorkspace
from flashv41.stages.trace import Traced

COPY_THREADS = 64 if SIM else 256
ROLES = {**L.ATTENTION_ROLES, **L.OPTIONAL_ATTENTION_ROLES}  # blk.{i}.{role}.weight by weight name

# The stage's device workspaces (attribute names), sized once for max_tokens.
WORKSPACES = ("positions", "qa", "qr", "q", "kv_raw", "kv", "o", "oa", "selection", "score", "candidates", "iq", "hw",
              "source_ws", "select_ws", "sparse_ws", "batch_rows")
# A sequence's arrays that a batched step reads through address tables (stages.row_tables), per
# layer: its ring, and the compressor state and caches of the kv source the layer reads.
RING, KV_STATE, SCORE_STATE, COMPRESSED, INDEX_KEYS = range(5)
ROW_KINDS = 5
_SERIALS = itertools.count()


@jit_kernel()
def _ring_write_kernel(kv, ring, positions, n_tokens, width):
    """ring[positions[r] % W] = kv[r] for the chunk's last min(T, W) rows. kv bf16 [>= T, D], ring
    bf16 [W, D], positions int32 [T]."""
    i = cuda.grid(1)
    window = ring.shape[0]
    first = max(0, n_tokens - window)
    if i >= (n_tokens - first) * width:
        return
    r = first + i // width
    c = i % width
    ring[positions[r] % window, c] = kv[r, c]


@dataclass
class LayerWeights:
    """One layer's attention weights on the device ([out, in] matrices in their stored type)."""

    role: LayerRole
    sinks: DeviceArray  # fp32 [H]
    wq_a: DeviceWeight  # [Q, C]
    q_norm: DeviceArray  # fp32 [Q]
    wq_b: DeviceWeight  # [H * D, Q]
    wkv: DeviceWeight  # [D, C]
    kv_norm: DeviceArray  # fp32 [D]
    wo_a: DeviceWeight  # [O * o_lora, H * D / O]
    wo_b: DeviceWeight  # [C, O * o_lora]
    source: KvSourceWeights | None = None  # kv sources
    indexer: IndexerWeights | None = None  # index sources

    def matrices(self) -> list[DeviceWeight]:
        out = [self.wq_a, self.wq_b, self.wkv, self.wo_a, self.wo_b]
        if self.source is not None:
            out += [self.source.comp_kv, self.source.wk]
            if self.source.comp_gate is not None:
                out.append(self.source.comp_gate)
        if self.indexer is not None:
            out += [self.indexer.wq_b, self.indexer.proj]
        return out


@dataclass
class LayerState:
    """One sequence's device state of one layer."""

    ring: DeviceArray  # bf16 [W, D], slot = position % W
    source: KvSourceState | None = None  # kv sources: compressor state and the two caches


class AttentionState:
    """One sequence's attention state on the device, every layer (AttentionStage.new_state)."""

    def __init__(self, stage: AttentionStage):
        cfg = stage.cfg
        self.stage = stage
        self.layers: list[LayerState] = []
        for role in cfg.roles:
            source = None
            if role.kv_source:  # allocated empty (KvSourceState.reset)
                source = KvSourceState.allocate(role.ratio, cfg.head_dim, cfg.index_head_dim, stage.max_seq,
                                                stage.stream)
            ring = cuda.device_array((cfg.window, cfg.head_dim), np.uint16)
            fill(ring, 0, stage.stream)
            self.layers.append(LayerState(ring, source))
        self.address_rows = self._address_rows(stage)
        self.serial = next(_SERIALS)  # names the state in upload_rows' key (an id may be reused)
        self.freed = False

    def _address_rows(self, stage: AttentionStage) -> np.ndarray:
        """uint64 [layers, ROW_KINDS, 2]: the address-table rows (stages.row_tables) of what each
        layer's batched step reads of this sequence (zeros for what a layer has none of)."""
        rows = np.zeros((len(self.layers), ROW_KINDS, 2), np.uint64)
        for i, layer in enumerate(self.layers):
            rows[i, RING] = table_row(layer.ring)
            j = stage.cache_source[i]
            source = self.layers[j].source if j >= 0 else None
            if source is not None:
                for kind, a in ((COMPRESSED, source.compressed), (INDEX_KEYS, source.index_keys)):
                    rows[i, kind] = table_row(a)
                if j == i:
                    rows[i, KV_STATE] = table_row(source.kv_state)
                    rows[i, SCORE_STATE] = table_row(source.score_state)
        return rows

    def reset(self) -> None:
        """Back to an empty sequence (zero rings and caches, empty compressor groups), cleared on the
        device on the stage's stream."""
        if self.freed:
            raise SequenceStateError("this attention state was freed")
        stream = self.stage.stream
        for layer in self.layers:
            fill(layer.ring, 0, stream)
            if layer.source is not None:
                layer.source.reset(stream)

    def nbytes(self) -> int:
        arrays = []
        for layer in self.layers:
            arrays.append(layer.ring)
            if layer.source is not None:
                s = layer.source
                arrays += [s.kv_state, s.score_state, s.compressed, s.index_keys]
        return sum(int(a.nbytes) for a in arrays)

    def free(self) -> None:
        """Release the device memory (idempotent); the state is unusable afterwards."""
        self.layers = []
        self.freed = True


@dataclass
class SharedRuntime:
    """What source layers hand down the stack within one forward call (device references)."""

    compressed: DeviceArray | None = None  # the last kv source's compressed cache [G, D] bf16
    index_keys: DeviceArray | None = None  # its index-key cache [G, ID] bf16
    selection: DeviceArray | None = None  # [>=T, K] int32: the last index source's selection
    candidates: DeviceArray | None = None  # [>=T, NB] uint8: the candidate source's block mask
    candidate_width: int = 0  # the score width that mask was made for


class AttentionStage(Traced):
    """Every layer's attention weights, the RoPE tables and the workspaces, on one stream. Its
    parts (Traced): the products by their matrices, the norm chains, the compressor and publish,
    the indexer's queries, scores and selection, the sparse attention, the ring write."""

    def __init__(self, model: Model, max_tokens: int, max_seq: int, stream=0):
        cfg = model.config
        if max_tokens < 1 or max_seq < 1:
            raise InputError(f"max_tokens ({max_tokens}) and max_seq ({max_seq}) must be at least 1")
        if max_seq > cfg.context_length:
            raise CapacityError(f"max_seq {max_seq} exceeds the model's context length {cfg.context_length}")
        self.cfg: ModelConfig = cfg
        self.max_tokens = max_tokens
        self.max_seq = max_seq
        self.stream = stream  # every launch and copy goes here (a numba or cuda.core stream, a graph builder)
        self.capturing = False  # set while a graph is captured: grids are then sized for the caches
        # while capturing, a kv source's compressor and an index source's indexer run on branches
        self._kv_branch, self._index_branch = Branch(), Branch()
        self.eps = np.float32(cfg.norm_eps)
        self.scale = np.float32(cfg.head_dim ** -0.5)
        self.index_scale = np.float32(cfg.index_head_dim ** -0.5 * cfg.index_heads ** -0.5)
        self.layers = [self._load_layer(model, role) for role in cfg.roles]
        self.cache_source = self._cache_sources()
        tables = rope_tables(cfg, max_seq)
        self.tables = {False: tuple(cuda.to_device(a) for a in tables.plain),
                       True: tuple(cuda.to_device(a) for a in tables.compressed)}
        self._allocate_workspaces()
        self.freed = False

    def _cache_sources(self) -> list[int]:
        """For each layer, the kv-source layer whose caches it reads (the last one at or before it,
        as forward hands them down the stack), or -1."""
        out, last = [], -1
        for role in self.cfg.roles:
            if role.kv_source:
                last = role.layer
            out.append(last if role.ratio > 0 else -1)
        return out

    def _load_layer(self, model: Model, role: LayerRole) -> LayerWeights:
        cfg, i = self.cfg, role.layer

        def matrix(name: str, n: int, k: int) -> DeviceWeight:
            w = DeviceWeight.from_ref(model.tensor(i, ROLES[name]), self.stream)
            if (w.n, w.k) != (n, k):
                raise ModelFormatError(f"blk.{i}.{ROLES[name]}: shape [{w.n}, {w.k}], expected [{n}, {k}]")
            return w

        def vector(name: str, n: int) -> DeviceArray:
            v = np.ascontiguousarray(model.tensor(i, ROLES[name]).dequantize().reshape(-1), np.float32)
            if v.shape != (n,):
                raise ModelFormatError(f"blk.{i}.{ROLES[name]}: {v.size} values, expected {n}")
            return cuda.to_device(v)

        c, d, q = cfg.dim, cfg.head_dim, cfg.q_lora_rank
        w = LayerWeights(role, vector("sinks", cfg.n_heads), matrix("wq_a", q, c), vector("q_norm", q),
                         matrix("wq_b", cfg.n_heads * d, q), matrix("wkv", d, c), vector("kv_norm", d),
                         matrix("wo_a", cfg.o_groups * cfg.o_lora_rank, cfg.group_width),
                         matrix("wo_b", c, cfg.o_groups * cfg.o_lora_rank))
        if role.kv_source:
            w.source = KvSourceWeights(matrix("comp_kv", d, c),
                                       matrix("comp_gate", d, c) if role.ratio > 1 else None,
                                       vector("comp_norm", d), matrix("wk", cfg.index_head_dim, d),
                                       vector("k_norm", cfg.index_head_dim))
        if role.index_source:
            w.indexer = IndexerWeights(matrix("idx_wq_b", cfg.index_heads * cfg.index_head_dim, q),
                                       matrix("idx_proj", cfg.index_heads, c))
        return w

    def _allocate_workspaces(self) -> None:
        cfg, t = self.cfg, self.max_tokens

        def bf16(*shape: int) -> DeviceArray:
            return cuda.device_array((t, *shape), np.uint16)

        self.host_positions = np.zeros(t, np.int32)  # pageable: the driver stages it, so reuse is safe
        self.positions = cuda.device_array(t, np.int32)  # int32 [T]: start .. start+T-1
        self._positions_for: tuple | None = None  # (start, T), or ("batch", each sequence's position)
        self.qa = bf16(cfg.q_lora_rank)  # x @ wq_a^T
        self.qr = bf16(cfg.q_lora_rank)
        self.q = bf16(cfg.n_heads, cfg.head_dim)
        self.q_rows = self.q.reshape(t, cfg.n_heads * cfg.head_dim)
        self.kv_raw = bf16(cfg.head_dim)  # x @ wkv^T
        self.kv = bf16(cfg.head_dim)  # the chunk's window rows
        self.o = bf16(cfg.n_heads, cfg.head_dim)
        self.o_rows = self.o.reshape(t, cfg.n_heads * cfg.head_dim)
        self.oa = bf16(cfg.o_groups * cfg.o_lora_rank)
        ratios = [r.ratio for r in cfg.roles if r.ratio > 0]
        self.max_groups = cfg.max_groups(self.max_seq)
        self.selection = self.score = self.candidates = self.iq = self.hw = None
        self.select_ws: SelectWorkspace | None = None
        if ratios:
            self.selection = cuda.device_array((t, cfg.index_topk), np.int32)  # [T, K]
        if any(r.index_source for r in cfg.roles):
            blocks = -(-self.max_groups // cfg.candidate_block_size)
            self.iq = bf16(cfg.index_heads * cfg.index_head_dim)  # [T, IH * ID]
            self.hw = bf16(cfg.index_heads)  # [T, IH]
            self.score = bf16(max(1, self.max_groups))  # [T, G]
            self.candidates = cuda.device_array((t, max(1, blocks)), np.uint8)  # [T, NB]
            self.select_ws = SelectWorkspace.allocate(min(t, SPLIT_ROWS))  # the split select's (decode rows)
        # the sparse attention's split path: scratch for up to 64 tokens (a decode step, a batch, a prefill
        # chunk's sub-chunk) and the longest entry list
        self.sparse_ws = SparseWorkspace.allocate(t, cfg.n_heads, cfg.head_dim,
                                                  cfg.window + (cfg.index_topk if ratios else 0), SPLIT_BATCH_TOKENS)
        self.source_ws = None
        if any(r.kv_source for r in cfg.roles):
            self.source_ws = KvSourceWorkspace.allocate(t, cfg.head_dim, cfg.index_head_dim)
        # a batched step's address tables: row b = sequence b's AttentionState.address_rows
        self.batch_rows = cuda.device_array((t, len(cfg.roles), ROW_KINDS, 2), np.uint64)
        self.row_tables = [[self.batch_rows[:, i, kind] for kind in range(ROW_KINDS)] for i in range(len(cfg.roles))]
        self._rows_for: tuple | None = None  # the states whose rows batch_rows holds

    def new_state(self) -> AttentionState:
        self._check_live()
        return AttentionState(self)

    def new_shared(self) -> SharedRuntime:
        """For one forward call down the stack (allocates nothing)."""
        return SharedRuntime()

    def weight_bytes(self, layer: int) -> int:
        """Bytes of the layer's weight matrices (what a decode step streams, norms aside)."""
        return sum(w.nbytes for w in self.layers[layer].matrices())

    def workspace_bytes(self) -> int:
        arrays = [getattr(self, name) for name in WORKSPACES if name not in ("source_ws", "select_ws", "sparse_ws")]
        for ws in (self.source_ws, self.select_ws):
            if ws is not None:
                arrays += list(vars(ws).values())
        return sum(int(a.nbytes) for a in arrays if a is not None) + self.sparse_ws.nbytes

    def free(self) -> None:
        """Release weights, tables and workspaces (idempotent); numba frees what is unreferenced."""
        self.layers = []
        self.tables = {}
        for name in (*WORKSPACES, "q_rows", "o_rows"):
            setattr(self, name, None)
        self.row_tables = []
        self.freed = True

    def _check_live(self) -> None:
        if self.freed:
            raise SequenceStateError("this attention stage was freed")

    def _check_call(self, layer: int, x: DeviceArray, out: DeviceArray, state: AttentionState, start: int,
                    n_tokens: int, span: int = 0) -> None:
        """n_tokens rows taking `span` consecutive positions from `start` (n_tokens where 0)."""
        span = span or n_tokens
        self._check_live()
        if not 0 <= layer < self.cfg.n_layers:
            raise InputError(f"layer {layer} is outside 0..{self.cfg.n_layers - 1}")
        if n_tokens < 1:
            raise InputError(f"n_tokens must be at least 1, got {n_tokens}")
        if n_tokens > self.max_tokens:
            raise CapacityError(f"{n_tokens} tokens exceed max_tokens {self.max_tokens} of this stage")
        if start < 0:
            raise InputError(f"start must be >= 0, got {start}")
        if start + span > self.max_seq:
            raise CapacityError(f"{plural(span, 'token')} at position {start} go past max_seq {self.max_seq}")
        for a, what in ((x, "x"), (out, "out")):
            check_array(a, (np.uint16,), 2, f"attention {what}")
            if a.shape[0] < n_tokens or a.shape[1] != self.cfg.dim:
                raise InputError(f"attention {what}: expected [>= {n_tokens}, {self.cfg.dim}] bf16, got {a.shape}")
        if state.freed or state.stage is not self:
            raise SequenceStateError("the attention state was freed or belongs to another stage")

    def _check_shared(self, layer: int, role: LayerRole, shared: SharedRuntime, start: int, t: int) -> None:
        """What a layer needs from the source layers above it, checked before it changes any state."""
        if role.ratio == 0:
            return
        where = f"layer {layer} ({role.block_type})"
        if not role.kv_source and shared.compressed is None:
            raise InputError(f"{where} reads compressed rows, but no kv source ran before it in this forward call "
                             "(call the layers in order)")
        if not role.index_source and shared.selection is None:
            raise InputError(f"{where} attends the shared selection, but no index source ran before it in this "
                             "forward call (call the layers in order)")
        width = (start + t) // role.ratio
        if not role.index_source or width == 0:
            return
        rows = self.max_seq // role.ratio if role.kv_source else (
            0 if shared.index_keys is None else shared.index_keys.shape[0])
        if rows < width:
            raise InputError(f"{where} scores {width} groups, but the last kv source holds {rows} index-key rows")
        if role.uses_candidates and (shared.candidates is None or shared.candidate_width != width):
            found = "none" if shared.candidates is None else f"one of {shared.candidate_width} groups"
            raise InputError(f"{where} respects a candidate mask of {width} groups, but the candidate source "
                             f"published {found}")

    def upload_rows(self, states: list[AttentionState]) -> None:
        """The batch's address tables onto the device (forward_batch does it when the states
        changed; a captured forward_batch needs them there before it runs)."""
        key = tuple(st.serial for st in states)
        if self._rows_for != key:
            self.batch_rows[:len(states)].copy_to_device(np.stack([st.address_rows for st in states]),
                                                         stream=self.stream)
            self._rows_for = key

    def upload_positions(self, start: int | list[int], n_tokens: int) -> None:
        """The positions start .. start+T-1 onto the device, or for a batch (start a list) each
        sequence's position (forward does it when they changed; a captured forward needs them there
        before it runs)."""
        key = ("batch", *start) if isinstance(start, list) else (start, n_tokens)
        if self._positions_for != key:
            self.host_positions[:n_tokens] = start if isinstance(start, list) else np.arange(start, start + n_tokens)
            self.positions[:n_tokens].copy_to_device(self.host_positions[:n_tokens], stream=self.stream)
            self._positions_for = key

    def forward(self, layer: int, x: DeviceArray, out: DeviceArray, state: AttentionState, shared: SharedRuntime,
                start: int, n_tokens: int, capture: dict | None = None) -> None:
        """out[:T] = attention of layer `layer` over x[:T] (bf16 [>=T, C], the normed sublayer
        input) at positions start..start+T-1; updates the sequence's state and, on source layers,
        `shared`. capture: filled with the oracle's capture keys (host arrays, bf16 values as fp32);
        "q" and "attn_o", which the folded attention never writes, computed apart (_capture_attention)."""
        self._check_call(layer, x, out, state, start, n_tokens)
        cfg, s, t = self.cfg, self.stream, n_tokens
        w = self.layers[layer]
        role = w.role
        self._check_shared(layer, role, shared, start, t)
        st = state.layers[layer]
        self.upload_positions(start, t)
        pos = self.positions
        cos, sin = self.tables[role.ratio > 0]

        # a decode step's one window row goes to the ring with the kv chain; a longer chunk's rows
        # after the attention has read the older ones
        early_ring = t == 1
        # a kv source's compressor reads only x: its branch runs beside the projections
        if w.source is not None:
            self._kv_source(w, st, shared, x, start, t, cos, sin, capture, self._kv_branch.fork(s, self.capturing))
        self._project_in(w, x, pos, cos, sin, t, st.ring if early_ring else None)
        # an index source's queries read qr (and x): its indexer runs beside wq_b, its scores after
        # the kv branch has published this step's index keys
        if w.indexer is not None:
            self._index(w, shared, x, t, (start + t) // role.ratio, cos, sin, capture,
                        self._index_branch.fork(s, self.capturing))
        self._project_q(w, t)
        self._join_branches()
        # a ratio-0 layer has no compressed rows: any bf16 [*, D] array stands in (no entry names it)
        comp_rows, selection = self.kv, None
        if role.ratio > 0:
            comp_rows, selection = shared.compressed, shared.selection
            assert selection is not None
            if capture is not None:
                self._capture_selection(shared, t, capture)
        sparse_attention(self.q, st.ring, self.kv, comp_rows, pos, selection, w.sinks, self.scale, cos, sin, self.o, t,
                         stream=s, workspace=self.sparse_ws)
        self._mark("sparse_attention")
        if capture is not None:
            self._capture_attention(st.ring, comp_rows, selection, w.sinks, cos, sin, t, capture)
        self._project_out(w, out, t)
        if not early_ring:
            n_ring = min(t, cfg.window) * cfg.head_dim
            _ring_write_kernel[grid_1d(n_ring, COPY_THREADS), COPY_THREADS, s](self.kv, st.ring, pos, t, cfg.head_dim)
            self._mark("ring_write")
        if capture is not None:
            capture.update(attn_x=self._host(x, t), qr=self._host(self.qr, t), kv=self._host(self.kv, t),
                           attn_out=self._host(out, t))

    def _capture_attention(self, ring: DeviceArray, comp_rows: DeviceArray, selection: DeviceArray | None,
                           sinks: DeviceArray, cos: DeviceArray, sin: DeviceArray, t: int, capture: dict) -> None:
        """capture["q"] (the rotated queries) and ["attn_o"] (the output before its inverse RoPE),
        which the folded path never holds: computed apart, as the unfused sequence did, with the rope
        kernel on a copy of q and the attention without a table (a test and debug path)."""
        cfg, s, pos = self.cfg, self.stream, self.positions
        q = cuda.device_array_like(self.q)
        q.copy_to_device(self.q, stream=s)
        rope(q.reshape(q.shape[0], cfg.n_heads * cfg.head_dim), cos, sin, pos, False, t, cfg.n_heads, stream=s)
        o = cuda.device_array_like(self.o)
        sparse_attention(q, ring, self.kv, comp_rows, pos, selection, sinks, self.scale, None, None, o, t, stream=s,
                         workspace=self.sparse_ws)
        capture.update(q=self._host(q, t), attn_o=self._host(o, t))

    def _project_in(self, w: LayerWeights, x: DeviceArray, pos: DeviceArray, cos: DeviceArray, sin: DeviceArray,
                    t: int, ring: DeviceArray | None, ring_table: bool = False) -> None:
        """qr [T, Q] and the window rows kv [T, D] of x's T rows at positions pos; with a ring
        (bf16 [W, D], or an address table of each row's own: ring_table), each row also to its slot
        positions[r] % W there (a decode step's: no entry of this step names that slot)."""
        s, mark = self.stream, self._mark
        linear_pair(x, w.wq_a, self.qa, w.wkv, self.kv_raw, t, stream=s)  # one launch where it can
        mark("wq_a + wkv")
        norm_rope_quant_pair(Chain(self.qa, w.q_norm, self.eps, None, None, None, False, "none", out=self.qr),
                             Chain(self.kv_raw, w.kv_norm, self.eps, cos, sin, pos, False, "act", out=self.kv,
                                   ring=ring, ring_table=ring_table), t, stream=s)
        mark("q_norm + kv_norm_rope_quant")

    def _project_q(self, w: LayerWeights, t: int) -> None:
        """q [T, H, D] = qr @ wq_b^T (the attention's kernels rotate it as they read it)."""
        linear(self.qr, w.wq_b, self.q_rows, t, stream=self.stream)
        self._mark("wq_b")

    def _join_branches(self) -> None:
        """The stage's stream waits for the kv-source and indexer branches (stages.branches)."""
        self._kv_branch.join(self.stream)
        self._index_branch.join(self.stream)

    def _project_out(self, w: LayerWeights, out: DeviceArray, t: int) -> None:
        """out[:T] from the attention output o [T, H, D] (its inverse RoPE done): the grouped wo_a, wo_b."""
        cfg, s, mark = self.cfg, self.stream, self._mark
        linear(self.o_rows, w.wo_a, self.oa, t, group_rows=cfg.o_lora_rank, stream=s)
        mark("wo_a")
        linear(self.oa, w.wo_b, out, t, stream=s)
        mark("wo_b")

    def forward_batch(self, layer: int, x: DeviceArray, out: DeviceArray, states: list[AttentionState],
                      shareds: list[SharedRuntime], starts: list[int], n_tokens: int) -> None:
        """out[:B] = layer `layer`'s attention for B sequences, one token each (B = n_tokens): row b
        of x is sequence b's token at position starts[b], with its state states[b] and its forward
        call's shareds[b]. Every stage is one launch for the B rows: the products read each weight
        once, and the per-sequence stages (compressor, index scores, selection, sparse attention
        with its entry lists, ring write) read each row's own state and caches through the address
        tables (upload_rows), deciding on the device what depends on a row's position (whether it
        completes a compressor group, how many groups it sees), so nothing here depends on the
        positions but the index-score grid. Each row's result is what `forward` gives its token
        alone on the same kernel paths (the products' kernel follows B: the stream kernel for B <=
        8, as for one token; the sparse split path likewise)."""
        self._check_batch(layer, x, out, states, shareds, starts, n_tokens)
        cfg, s, t = self.cfg, self.stream, n_tokens
        w = self.layers[layer]
        role = w.role
        self.upload_positions(list(starts), t)
        self.upload_rows(states)
        pos = self.positions
        cos, sin = self.tables[role.ratio > 0]
        rows = self.row_tables[layer]
        if w.source is not None:  # branches as in forward
            self._kv_source_batch(layer, w, states, shareds, x, t, cos, sin, self._kv_branch.fork(s, self.capturing))
        self._project_in(w, x, pos, cos, sin, t, rows[RING], ring_table=True)
        if w.indexer is not None:
            self._index_batch(layer, w, shareds, x, starts, t, cos, sin, self._index_branch.fork(s, self.capturing))
        self._project_q(w, t)
        self._join_branches()
        selection = None
        if role.ratio > 0:
            assert self.selection is not None  # allocated for ratio > 0 layers
            selection = self.selection
        # a ratio-0 layer names no compressed row: its ring table stands in for the caches'
        comps = rows[COMPRESSED] if role.ratio > 0 else rows[RING]
        sparse_attention_tables(self.q, rows[RING], self.kv, comps, pos, selection, cfg.window, w.sinks, self.scale,
                                cos, sin, self.o, t, stream=s, workspace=self.sparse_ws)
        self._mark("sparse_attention")
        self._project_out(w, out, t)

    def _kv_source_batch(self, layer: int, w: LayerWeights, states: list[AttentionState],
                         shareds: list[SharedRuntime], x: DeviceArray, t: int, cos: DeviceArray, sin: DeviceArray,
                         s) -> None:
        """forward_batch's kv-source work on stream s, one launch a stage for the B rows; each
        sequence's `shared` is told which caches its later layers read, for their checks."""
        cfg, role, pos = self.cfg, w.role, self.positions
        rows = self.row_tables[layer]
        assert w.source is not None and self.source_ws is not None
        ws = self.source_ws
        kv_sources.compress_products(role, w.source, x, ws, t, s)
        self._mark("compress products")
        latents, group_pos = kv_sources.compress_groups_batch(cfg, role, w.source, rows[KV_STATE],
                                                              rows[SCORE_STATE], ws, pos, t, s)
        self._mark("compress")
        kv_sources.publish_batch(cfg, role, w.source, rows[INDEX_KEYS], rows[COMPRESSED], latents, group_pos, cos,
                                 sin, ws, pos, t, s, mark=self._mark)
        self._mark("publish")
        for state, shared in zip(states, shareds, strict=True):
            source = state.layers[layer].source
            assert source is not None
            shared.compressed, shared.index_keys = source.compressed, source.index_keys

    def _index_batch(self, layer: int, w: LayerWeights, shareds: list[SharedRuntime], x: DeviceArray,
                     starts: list[int], t: int, cos: DeviceArray, sin: DeviceArray, s) -> None:
        """forward_batch's indexer on stream s, one launch a stage for the B rows (the selection in
        the workspace's first B rows, for the layers after it); its scores wait for the kv branch."""
        cfg, role, pos = self.cfg, w.role, self.positions
        rows = self.row_tables[layer]
        assert w.indexer is not None and self.selection is not None and self.candidates is not None
        assert self.score is not None and self.iq is not None and self.hw is not None
        indexer.index_queries(w.indexer, x, self.qr, cos, sin, pos, self.iq, self.hw, t, stream=s, mark=self._mark)
        self._mark("index_queries")
        self._index_branch.wait_for(self._kv_branch)
        width = self.max_seq // role.ratio if self.capturing else max(start + 1 for start in starts) // role.ratio
        indexer.index_scores_tables(self.iq, self.hw, rows[INDEX_KEYS], self.index_scale, self.score, t, pos,
                                    role.ratio, width, cfg.index_head_dim, stream=s)
        self._mark("index_scores")
        indexer.select(cfg, role, self.score, pos, self.candidates, self.selection, t, stream=s, own_rows=True,
                       width=width, workspace=self.select_ws)
        self._mark("select")
        for shared, start in zip(shareds, starts, strict=True):
            shared.selection = self.selection
            if role.candidate_source:
                shared.candidates, shared.candidate_width = self.candidates, (start + 1) // role.ratio

    def _check_batch(self, layer: int, x: DeviceArray, out: DeviceArray, states: list[AttentionState],
                     shareds: list[SharedRuntime], starts: list[int], n_tokens: int) -> None:
        """forward_batch's arguments, every sequence's, checked before anything runs."""
        if not len(states) == len(shareds) == len(starts) == n_tokens:
            raise InputError(f"forward_batch: {n_tokens} tokens, {len(states)} states, {len(shareds)} shared runtimes "
                             f"and {len(starts)} positions must agree")
        if len({id(st) for st in states}) != len(states):
            raise InputError("forward_batch: a sequence appears twice in the batch (one token a sequence)")
        self._check_call(layer, x, out, states[0], 0, n_tokens, span=1)  # a position a row: B may pass max_seq
        role = self.layers[layer].role
        for b, (state, shared, start) in enumerate(zip(states, shareds, starts, strict=True)):
            if state.freed or state.stage is not self:
                raise SequenceStateError(f"batch sequence {b}: its attention state was freed or belongs to another "
                                         "stage")
            if not 0 <= start < self.max_seq:
                raise CapacityError(f"batch sequence {b}: position {start} is outside 0..{self.max_seq - 1}")
            self._check_shared(layer, role, shared, start, 1)

    def _kv_source(self, w: LayerWeights, st: LayerState, shared: SharedRuntime, x: DeviceArray, start: int,
                   t: int, cos: DeviceArray, sin: DeviceArray, capture: dict | None, s) -> None:
        """A kv source's compressor and publish on stream s (the kv branch): this step's compressed
        rows and index keys into the sequence's caches, which `shared` then names for the layers
        after it."""
        cfg, role, pos = self.cfg, w.role, self.positions
        assert w.source is not None and st.source is not None and self.source_ws is not None
        ws = self.source_ws
        kv_sources.compress_products(role, w.source, x, ws, t, s)
        self._mark("compress products")
        latents, groups = kv_sources.compress_groups(cfg, role, w.source, st.source, start, ws, pos, t, s)
        self._mark("compress")
        if capture is not None:  # before publish turns the latents into cache rows
            capture["latents"] = self._host(latents, groups.count)
            capture["groups"] = np.arange(groups.first, groups.first + groups.count, dtype=np.int64)
        kv_sources.publish(cfg, role, w.source, st.source, latents, groups, cos, sin, ws, pos, s, mark=self._mark)
        self._mark("publish")
        shared.compressed, shared.index_keys = st.source.compressed, st.source.index_keys

    def _index(self, w: LayerWeights, shared: SharedRuntime, x: DeviceArray, t: int, width: int,
               cos: DeviceArray, sin: DeviceArray, capture: dict | None, s) -> None:
        """The indexer of an index source on stream s (the index branch): publishes its selection
        (and, on the candidate source, the candidate mask) into `shared`. Its scores wait for the
        kv branch, whose index keys they read."""
        cfg, role, pos = self.cfg, w.role, self.positions
        assert w.indexer is not None and self.selection is not None and self.candidates is not None
        shared.selection = self.selection
        if width == 0:
            # no group is complete yet: nothing to score (the reference skips its indexer too)
            fill(self.selection[:t], -1, s)
            self._mark("select")
            return
        assert shared.index_keys is not None
        indexer.index_queries(w.indexer, x, self.qr, cos, sin, pos, self.iq, self.hw, t, stream=s, mark=self._mark)
        self._mark("index_queries")
        self._index_branch.wait_for(self._kv_branch)
        grid_width = shared.index_keys.shape[0] if self.capturing else width  # the graph serves later widths
        indexer.index_scores(self.iq, self.hw, shared.index_keys, self.index_scale, self.score, t, pos, role.ratio,
                             grid_width, stream=s)
        self._mark("index_scores")
        indexer.select(cfg, role, self.score, pos, self.candidates, self.selection, t, stream=s, width=grid_width,
                       workspace=self.select_ws)
        self._mark("select")
        if role.candidate_source:
            shared.candidates, shared.candidate_width = self.candidates, width
        if capture is not None:
            capture["index_score"] = from_bits(self._download(self.score, t)[:, :width])

    def _capture_selection(self, shared: SharedRuntime, t: int, capture: dict) -> None:
        """capture's selection and candidate mask of a ratio > 0 layer (and empty latents where
        the layer is no kv source)."""
        cfg = self.cfg
        capture.setdefault("latents", np.zeros((0, cfg.head_dim), np.float32))
        capture.setdefault("groups", np.zeros(0, np.int64))
        assert shared.selection is not None
        capture["selection"] = self._download(shared.selection, t).astype(np.int64)
        if shared.candidates is not None:
            blocks = self._download(shared.candidates, t).astype(bool)
            capture["candidates"] = np.repeat(blocks, cfg.candidate_block_size, axis=1)[:, :shared.candidate_width]

    def part_weights(self, layer: int) -> dict[str, list[DeviceWeight]]:
        """The weight matrices each traced part of the layer's step streams (parts without any
        stream none)."""
        w = self.layers[layer]
        parts: dict[str, list[DeviceWeight]] = {
            "wq_a + wkv": [w.wq_a, w.wkv], "wq_b": [w.wq_b], "wo_a": [w.wo_a], "wo_b": [w.wo_b]}
        if w.source is not None:
            parts["compress products"] = [w.source.comp_kv] + (
                [w.source.comp_gate] if w.source.comp_gate is not None else [])
            parts["wk"] = [w.source.wk]
        if w.indexer is not None:
            parts["index products"] = [w.indexer.wq_b, w.indexer.proj]
        return parts

    def _download(self, a: DeviceArray, rows: int) -> np.ndarray:
        """The first rows of a device array on the host (synchronises: captures only)."""
        cuda.synchronize()
        return a[:rows].copy_to_host()

    def _host(self, a: DeviceArray, rows: int) -> np.ndarray:
        """The first rows of a bf16 device array as fp32 values on the host."""
        return from_bits(self._download(a, rows))
