"""How much device memory an engine for a model will need: weights, per-sequence state, workspaces.

- weights: the stored bytes of every tensor the engine uses (the engine uploads them as stored,
  quantised); the engram tables count on the device, or on the host with
  `table_residency="pinned"` (page-locked host memory) or `"host"` (the file's pages);
- the head (output_norm, output) where the model has one, and each layer's ffn_norm (an FFN
  callback's input); the MoE tensors stay in the file (the caller's FFN, or flashv41.HostMoE on the
  host, reads them): counted apart, as host bytes;
- per-sequence state, for sequences of up to `max_seq` positions: each layer's window ring, each
  kv source's compressed cache, index-key cache and compressor partial-group state, the engram
  hash cache of compressed ids, and the head's input of the last call (bf16 [max_tokens, dim]);
- workspaces, per engine, for chunks of up to `max_tokens` tokens;
- what moves with a sequence: a fork copies and a save writes the used part of its state (every
  ring and partial group, the caches' rows of the groups completed so far, the hash history so
  far: `sequence_state_bytes` at its position), and a truncate checkpoint holds every ring and
  partial group (flashv41.sequence_state).

The workspace figure is a rough estimate from the largest buffers a forward pass needs, not the
engine's allocation: it is to be replaced by the engine's own allocation report once the engine
exists. Weights and state are exact: the tensors' stored sizes and the caches' shapes.
"""

from __future__ import annotations

from dataclasses import dataclass

from flashv41.host import gguf_layout as L
from flashv41.host.config import LayerRole, ModelConfig
from flashv41.host.errors import CapacityError, InputError
from flashv41.host.gguf_model import WeightStore

TABLE_RESIDENCIES = ("device", "pinned", "host")
# where each residency keeps the engram tables, in the words `info` and `run` print
TABLE_PLACES = {"device": "on the device", "pinned": "in pinned host memory", "host": "read from the file per call"}
# tokens per forward chunk where the caller does not say: the Engine's, `flashv41 run`'s and `info`'s
DEFAULT_MAX_TOKENS = 256
DEFAULT_MAX_SEQ = 4096  # an Engine's positions when not given (or the model's context, if shorter)
BF16_BYTES = 2
FP32_BYTES = 4
INT64_BYTES = 8


@dataclass(frozen=True)
class LayerMemory:
    """One layer's share. Bytes throughout."""

    layer: int
    block_type: str
    weight_bytes: int  # device: the layer's tensors as stored, engram table aside
    table_bytes: int  # the engram table, wherever it lives (0 without engram)
    table_on_device: bool
    state_bytes: int  # per sequence: window ring, plus a kv source's caches and compressor state

    @property
    def device_weight_bytes(self) -> int:
        return self.weight_bytes + (self.table_bytes if self.table_on_device else 0)


@dataclass(frozen=True)
class MemoryEstimate:
    """The estimate for one engine: per-layer rows, model-level parts and totals (bytes)."""

    max_seq: int
    max_tokens: int
    table_residency: str
    layers: tuple[LayerMemory, ...]
    embedding_bytes: int  # token_embd as stored
    hash_cache_bytes: int  # per sequence: int64 [max_seq] compressed ids (0 without engram)
    checkpoint_bytes: int  # one truncate checkpoint: every window ring and compressor partial group
    position_bytes: float  # what a position adds to a fork's copy or a save: cache rows, hash history
    workspaces: tuple[tuple[str, int], ...]  # (what, bytes), per engine; an estimate
    head_bytes: int = 0  # output_norm and output as stored (0 without a head)
    head_input_bytes: int = 0  # per sequence: the head's input of the last call, bf16 [max_tokens, dim]
    moe_host_bytes: int = 0  # the MoE tensors, which stay on the host (the file's pages)

    @property
    def weight_bytes(self) -> int:
        """Weights on the device (tables included only when they live there)."""
        return self.embedding_bytes + self.head_bytes + sum(layer.device_weight_bytes for layer in self.layers)

    @property
    def host_table_bytes(self) -> int:
        return sum(layer.table_bytes for layer in self.layers if not layer.table_on_device)

    @property
    def state_bytes_per_sequence(self) -> int:
        return self.hash_cache_bytes + self.head_input_bytes + sum(layer.state_bytes for layer in self.layers)

    @property
    def workspace_bytes(self) -> int:
        return sum(nbytes for _, nbytes in self.workspaces)

    def total_bytes(self, n_sequences: int = 1) -> int:
        """Device bytes for an engine holding `n_sequences` sequences at once."""
        return self.weight_bytes + n_sequences * self.state_bytes_per_sequence + self.workspace_bytes

    def table(self) -> str:
        """A readable multi-line table of the estimate."""
        lines = [
            f"device memory estimate (max_seq {self.max_seq}, max_tokens {self.max_tokens}, "
            f"engram tables {TABLE_PLACES[self.table_residency]})",
            f"  {'layer':>5}  {'block type':<28} {'weights':>10} {'engram table':>16} {'state/seq':>10}",
        ]
        for m in self.layers:
            table = "-"
            if m.table_bytes:
                table = format_bytes(m.table_bytes) + ("" if m.table_on_device else f" ({self.table_residency})")
            lines.append(f"  {m.layer:>5}  {m.block_type:<28} {format_bytes(m.weight_bytes):>10} {table:>16} "
                         f"{format_bytes(m.state_bytes):>10}")
        lines.append(f"  {'':>5}  {'token_embd':<28} {format_bytes(self.embedding_bytes):>10}")
        if self.hash_cache_bytes:
            lines.append(f"  {'':>5}  {'engram hash cache':<28} {'':>10} {'':>16} "
                         f"{format_bytes(self.hash_cache_bytes):>10}")
        if self.head_bytes:
            lines.append(f"  {'':>5}  {'head (output_norm, output)':<28} {format_bytes(self.head_bytes):>10} "
                         f"{'':>16} {format_bytes(self.head_input_bytes):>10}")
        lines.append("  workspaces (estimate, per engine):")
        for what, nbytes in self.workspaces:
            lines.append(f"    {what:<52} {format_bytes(nbytes):>10}")
        lines += [
            f"  weights on the device        {format_bytes(self.weight_bytes):>10}",
        ]
        if self.host_table_bytes:
            label = "engram tables, pinned host" if self.table_residency == "pinned" else "engram tables on the host"
            lines.append(f"  {label:<29}{format_bytes(self.host_table_bytes):>10}")
        if self.moe_host_bytes:
            lines.append(f"  {'MoE tensors (host, the file)':<29}{format_bytes(self.moe_host_bytes):>10}"
                         "  (the caller's FFN reads them, or HostMoE: not on the device)")
        per_gib = (1 << 30) // max(1, self.state_bytes_per_sequence)
        lines += [
            f"  state per sequence           {format_bytes(self.state_bytes_per_sequence):>10}"
            f"  ({per_gib} sequences per GiB left after the rest)",
            f"  fork / save move             {format_bytes(self.checkpoint_bytes):>10}  + {self.position_bytes:.0f} B "
            f"a position (the used state; {format_bytes(self.state_bytes_per_sequence)} at max_seq)",
            f"  truncate checkpoint          {format_bytes(self.checkpoint_bytes):>10}  per sequence (rings, partial "
            "groups)",
            f"  workspaces (estimate)        {format_bytes(self.workspace_bytes):>10}",
            f"  total, one sequence          {format_bytes(self.total_bytes(1)):>10}",
        ]
        return "\n".join(lines)


def format_bytes(n: int) -> str:
    """1536 -> '1.5 KiB' (binary units; bytes below 1 KiB as they are)."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _layer_state_bytes(config: ModelConfig, role: LayerRole, max_seq: int) -> int:
    window_ring = config.window * config.head_dim * BF16_BYTES
    if not role.kv_source:
        return window_ring
    groups = max_seq // role.ratio
    compressed = groups * config.head_dim * BF16_BYTES
    index_keys = groups * config.index_head_dim * BF16_BYTES
    # a ratio-r compressor keeps the kv and the gate score of an incomplete group, fp32
    partial_group = 2 * role.ratio * config.head_dim * FP32_BYTES
    return window_ring + compressed + index_keys + partial_group


def sequence_state_bytes(config: ModelConfig, positions: int) -> int:
    """The state of a sequence of `positions` positions (its used part at that position): every
    window ring and compressor partial group, the caches' rows of positions // ratio groups, and the
    engram hash history's int64 a position."""
    hashes = positions * INT64_BYTES if config.engram is not None else 0
    return hashes + sum(_layer_state_bytes(config, role, positions) for role in config.roles)


HEAD_ROWS = 64  # stages.head.HEAD_ROWS (the logits workspace's rows), without importing the stages


def _workspaces(config: ModelConfig, max_seq: int, max_tokens: int) -> tuple[tuple[str, int], ...]:
    t = max_tokens
    items = [
        (f"highway fp32 [{t}, {config.hc}, {config.dim}] x 2", 2 * t * config.hc * config.dim * FP32_BYTES),
        (f"q bf16 [{t}, {config.n_heads * config.head_dim}]",
         t * config.n_heads * config.head_dim * BF16_BYTES),
    ]
    from flashv41.stages.sparse_attention import SPLIT_BATCH_TOKENS, split_workspace_bytes

    entries = config.window + (config.index_topk if any(role.ratio > 0 for role in config.roles) else 0)
    items.append((f"sparse attention decode scratch fp32 ({entries} entries, {min(t, SPLIT_BATCH_TOKENS)} tokens)",
                  split_workspace_bytes(t, config.n_heads, config.head_dim, entries, SPLIT_BATCH_TOKENS)))
    if any(role.index_source for role in config.roles):
        groups = max(1, config.max_groups(max_seq))  # bf16, as stages.attention's score workspace
        items.append((f"index scores bf16 [{t}, {groups}]", t * groups * BF16_BYTES))
    e = config.engram
    if e is not None:
        items.append((f"engram rows bf16 [{t * e.cols}, {e.head_dim}]", t * e.cols * e.head_dim * BF16_BYTES))
        kv_width = config.dim * (config.hc + 1)
        items.append((f"engram kv bf16 [{t}, {kv_width}]", t * kv_width * BF16_BYTES))
    if config.head:
        rows = min(t, HEAD_ROWS)
        items.append((f"logits fp32 [{rows}, {config.vocab_size}]", rows * config.vocab_size * FP32_BYTES))
        items.append((f"head input of a batch step bf16 [{t}, {config.dim}]", t * config.dim * BF16_BYTES))
    return tuple(items)


def estimate_memory(config: ModelConfig, weights: WeightStore, max_seq: int, max_tokens: int,
                    table_residency: str = "device") -> MemoryEstimate:
    """The device memory an engine for `config` needs with sequences of up to `max_seq` positions
    and chunks of up to `max_tokens` tokens. Weight sizes are read from `weights` (as stored)."""
    if max_seq < 1 or max_tokens < 1:
        raise InputError(f"max_seq and max_tokens must be >= 1, got max_seq {max_seq}, "
                         f"max_tokens {max_tokens}")
    # the Engine's refusal, in its words: an estimate for an engine that cannot be built is no use
    if max_seq > config.context_length:
        raise CapacityError(f"max_seq {max_seq} exceeds the model's context length {config.context_length}")
    if table_residency not in TABLE_RESIDENCIES:
        raise InputError(f"table_residency must be one of {', '.join(TABLE_RESIDENCIES)}, "
                         f"got {table_residency!r}")
    layers = []
    for role in config.roles:
        specs = L.layer_tensor_specs(role.ratio, role.kv_source, role.index_source, role.engram)
        if config.ffn_norm:
            specs.append(L.FFN_NORM_TENSOR)
        weight_bytes = sum(weights.get(role.layer, spec.role).nbytes for spec in specs)
        table_bytes = weights.get(role.layer, L.ENGRAM_TABLE).nbytes if role.engram else 0
        layers.append(LayerMemory(
            layer=role.layer,
            block_type=role.block_type,
            weight_bytes=weight_bytes,
            table_bytes=table_bytes,
            table_on_device=table_residency == "device",
            state_bytes=_layer_state_bytes(config, role, max_seq),
        ))
    return MemoryEstimate(
        max_seq=max_seq,
        max_tokens=max_tokens,
        table_residency=table_residency,
        layers=tuple(layers),
        embedding_bytes=weights.get(None, L.TOKEN_EMBD).nbytes,
        hash_cache_bytes=max_seq * INT64_BYTES if config.engram is not None else 0,
        checkpoint_bytes=sequence_state_bytes(config, 0),
        position_bytes=(sequence_state_bytes(config, max_seq) - sequence_state_bytes(config, 0)) / max_seq,
        workspaces=_workspaces(config, max_seq, max_tokens),
        head_bytes=sum(weights.get(None, spec.role).nbytes for spec in L.HEAD_TENSORS) if config.head else 0,
        head_input_bytes=max_tokens * config.dim * BF16_BYTES if config.head else 0,
        moe_host_bytes=sum(weights.get(role.layer, spec.role).nbytes for role in config.roles
                           for spec in L.MOE_TENSORS) if config.moe is not None else 0,
    )


def flush_device_frees() -> None:
    """Wait for the queued work, then free what numba still holds back of the device arrays already
    dropped (it defers frees; the simulator has nothing to flush)."""
    from numba import cuda

    cuda.synchronize()
    pending = getattr(cuda.current_context(), "deallocations", None)
    if pending is not None:
        pending.clear()


def device_free_bytes() -> int:
    """The driver's free device memory now (a real GPU), after the queued work finished and numba's
    deferred frees were flushed: the figure leak checks and the benchmark's M1 row compare."""
    from numba import cuda

    flush_device_frees()
    return int(cuda.current_context().get_memory_info()[0])
