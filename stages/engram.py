"""The engram sublayer on the device: rows -> projection -> gate, in place on h.

Shapes: T tokens, L = cols row ids per token, E = a table row's width (head_dim), C = dim, hc copies.
- row ids int64 [T, L] of one layer, from the hash (host.engram_hash_fast, on the host);
- rows bf16 bits uint16 [T, L * E] (stages.engram_rows: the table on the device or on the host);
- kv = rows @ wkv^T bf16 bits uint16 [T, C * (hc + 1)]: hc keys then the value (stages.linear:
  the stream GEMV for up to 8 tokens, reading the wkv rows directly; tc or gemm for more);
- the gate (stages.engram_gate) adds g * value to h float32 [>= T, hc, C] in place and leaves
  g float32 [T, hc] in a workspace.

`EngramStage` uploads every engram layer's weights once (wkv as stored, qk = q_weight * k_weight
float32 [hc, C], the table or a reader of it) and allocates every workspace once, for up to
`max_tokens` tokens; `apply` allocates nothing on the device. A call is two parts: `upload_rows`
(the host's part: row ids, or rows of a host table, into the layer's device buffers) and `run`
(device work only, which a captured graph can replay); each layer has its own row workspace, so
every layer's upload can precede all the device work. `run` is `prepare` (rows and projection,
which read only the uploaded ids) then `finish` (the gate, on h): the engine issues a layer's
`prepare` early, and while a graph is captured it runs on a branch (stages.branches) beside the
layers before the engram layer, joined before its gate. The layers share the rows and kv
workspaces, so a layer's `prepare` must come after the previous engram layer's `finish`.

Oracle: host.oracle.engram.engram_layer (and engram_rows / engram_project / engram_gate per step).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import cuda

from flashv41.host import gguf_layout as L
from flashv41.host.errors import CapacityError, InputError, ModelFormatError, UnsupportedError
from flashv41.host.model import Model
from flashv41.host.numerics import F32, from_bits
from flashv41.stages.branches import Branch
from flashv41.stages.device import DeviceArray
from flashv41.stages.engram_gate import check_hc, engram_gate
from flashv41.stages.engram_rows import RESIDENCIES, RowWorkspace, TableRows, is_device_array
from flashv41.stages.linear import DeviceWeight, linear
from flashv41.stages.quants.table import DEVICE_TYPES
from flashv41.stages.trace import Traced

WKV, Q_WEIGHT, K_WEIGHT = "engram_wkv", "engram_q", "engram_k"


@dataclass
class EngramLayerWeights:
    """One engram layer on the device."""

    layer: int
    wkv: DeviceWeight  # stored [C * (hc + 1), L * E]
    qk: DeviceArray  # float32 [hc, C]
    table: TableRows  # [rows, E], on the device, in pinned host memory, or read from the file
    workspace: RowWorkspace  # this layer's uploaded row ids (device, pinned tables) or rows (host tables)


class EngramStage(Traced):
    """Every engram layer of a model, with workspaces for chunks of up to `max_tokens` tokens.

    table_residency: "device" (tables uploaded once), "pinned" (copied once into mapped page-locked
    host memory the row kernel reads) or "host" (rows read from the mapped file per call). stream:
    the CUDA stream every copy and kernel of the stage runs on. Its parts (Traced), in `prepare`:
    "engram rows" (the rows' dequantisation) and "engram wkv" (the projection).
    """

    def __init__(self, model: Model, max_tokens: int, table_residency: str = "device", stream=0):
        cfg = model.config
        e = cfg.engram
        if e is None:
            raise UnsupportedError(f"{model.path.name}: the model has no engram layers")
        if table_residency not in RESIDENCIES:
            raise InputError(f"table residency must be one of {', '.join(RESIDENCIES)}, got {table_residency!r}")
        if not isinstance(max_tokens, (int, np.integer)) or max_tokens < 1:
            raise InputError(f"max_tokens must be a positive integer, got {max_tokens!r}")
        check_hc(cfg.hc)
        self.max_tokens = int(max_tokens)
        self.table_residency = table_residency
        self.stream = stream
        self.capturing = False  # set while a graph is captured: prepare then runs on a branch
        self._branch = Branch()
        self.hc, self.dim, self.cols, self.head_dim = cfg.hc, cfg.dim, e.cols, e.head_dim
        self.eps = cfg.norm_eps
        self.layers: dict[int, EngramLayerWeights] = {}
        for layer in e.layer_ids:
            self.layers[layer] = self._upload_layer(model, layer)
        t, width = self.max_tokens, self.cols * self.head_dim
        self.rows = cuda.device_array((t, width), np.uint16)  # bf16 bits [T, L * E]
        self.kv = cuda.device_array((t, self.dim * (self.hc + 1)), np.uint16)  # bf16 bits [T, C * (hc + 1)]
        self.gates = cuda.device_array((t, self.hc), np.float32)  # [T, hc]
        self.all_tokens = cuda.to_device(np.ones(t, np.uint8), stream=stream)  # the mask when none is given

    def _upload_layer(self, model: Model, layer: int) -> EngramLayerWeights:
        wkv = model.tensor(layer, WKV)
        q = model.tensor(layer, Q_WEIGHT)
        k = model.tensor(layer, K_WEIGHT)
        table = model.tensor(layer, L.ENGRAM_TABLE)
        expected = {
            wkv.name: (self.dim * (self.hc + 1), self.cols * self.head_dim),
            q.name: (self.hc, self.dim),
            k.name: (self.hc, self.dim),
        }
        for ref in (wkv, q, k):
            if tuple(ref.shape) != expected[ref.name]:
                raise ModelFormatError(f"{ref.name}: shape {list(ref.shape)}, expected {list(expected[ref.name])}")
        if len(table.shape) != 2 or table.shape[1] != self.head_dim:
            raise ModelFormatError(f"{table.name}: shape {list(table.shape)}, expected [rows, {self.head_dim}]")
        if wkv.ggml_type not in DEVICE_TYPES:
            raise UnsupportedError(f"{wkv.name}: type {wkv.ggml_type.name} is not supported")
        qk = (q.dequantize() * k.dequantize()).astype(F32)
        rows = TableRows(table, self.table_residency, stream=self.stream)
        return EngramLayerWeights(
            layer=layer,
            wkv=DeviceWeight.from_ref(wkv, stream=self.stream),
            qk=cuda.to_device(qk, stream=self.stream),
            table=rows,
            workspace=RowWorkspace(self.max_tokens, self.cols, rows.row_bytes, self.table_residency),
        )

    @property
    def pinned_bytes(self) -> int:
        """Page-locked host memory held by pinned tables."""
        return sum(w.table.pinned_bytes for w in self.layers.values())

    @property
    def device_bytes(self) -> int:
        """Device memory held: weights, tables on the device, and workspaces."""
        arrays = [self.rows, self.kv, self.gates, self.all_tokens]
        for w in self.layers.values():
            arrays += [w.workspace.ids, w.workspace.raw]
        total = sum(int(a.nbytes) for a in arrays if a is not None)
        for w in self.layers.values():
            total += w.wkv.nbytes + int(w.qk.nbytes) + w.table.device_bytes
        return total

    def _weights(self, layer: int) -> EngramLayerWeights:
        if self.rows is None:
            raise InputError("engram stage: used after free()")
        if layer not in self.layers:
            known = ", ".join(str(i) for i in self.layers)
            raise InputError(f"layer {layer} has no engram sublayer (engram layers: {known})")
        return self.layers[layer]

    def _check_tokens(self, n_tokens: int) -> int:
        if not isinstance(n_tokens, (int, np.integer)) or n_tokens < 1:
            raise InputError(f"n_tokens must be a positive integer, got {n_tokens!r}")
        if n_tokens > self.max_tokens:
            raise CapacityError(f"engram stage: {n_tokens} tokens exceed max_tokens {self.max_tokens}")
        return int(n_tokens)

    def load_rows(self, layer: int, row_ids: np.ndarray, n_tokens: int) -> None:
        """rows[:T] = the bf16 table rows of row_ids int [T, L] (step 2): upload, then dequantise."""
        self.upload_rows(layer, row_ids, n_tokens)
        self.dequantize_rows(layer, n_tokens)

    def upload_rows(self, layer: int, row_ids: np.ndarray, n_tokens: int) -> None:
        """Validate row_ids int [T, L] and upload the ids (device tables) or the rows' bytes (host tables)."""
        w = self._weights(layer)
        w.table.upload(row_ids, self._check_tokens(n_tokens), w.workspace, self.stream)

    def dequantize_rows(self, layer: int, n_tokens: int, stream=None) -> None:
        """rows[:T] from what upload_rows put on the device (the device part of step 2); on the
        stage's stream unless one is given."""
        w = self._weights(layer)
        w.table.dequantize(self._check_tokens(n_tokens), w.workspace, self.rows,
                           self.stream if stream is None else stream)

    def project(self, layer: int, n_tokens: int, stream=None) -> None:
        """kv[:T] = rows[:T] @ wkv^T, bf16 (step 3); on the stage's stream unless one is given."""
        w = self._weights(layer)
        linear(self.rows, w.wkv, self.kv, self._check_tokens(n_tokens),
               stream=self.stream if stream is None else stream)

    def gate(self, layer: int, h_dev, n_tokens: int, token_mask_dev=None) -> None:
        """h[:T] += g * value in place, from kv[:T]; g into gates[:T] (step 4)."""
        w = self._weights(layer)
        t = self._check_tokens(n_tokens)
        mask = self._checked_mask(h_dev, t, token_mask_dev)
        engram_gate(h_dev, self.kv, w.qk, self.eps, mask, self.gates, t, self.stream)

    def apply(self, layer: int, h_dev, row_ids: np.ndarray, n_tokens: int, token_mask_dev=None,
              capture: dict | None = None) -> None:
        """The engram sublayer of `layer` on h_dev float32 [>= T, hc, C], in place.

        row_ids: int [T, L], this layer's ids from the hash. token_mask_dev: uint8 / bool device
        array [>= T], 0 = the token gets g = 0. capture: filled with engram_ids int64 [T, L],
        engram_rows [T, L * E] and engram_kv [T, C * (hc + 1)] (bf16 values as float32) and
        engram_gate float32 [T, hc], as host.oracle.engram.engram_layer's capture.
        """
        self._weights(layer)
        t = self._check_tokens(n_tokens)
        self._checked_mask(h_dev, t, token_mask_dev)  # refuse a bad h or mask before any work
        self.upload_rows(layer, row_ids, t)
        self.run(layer, h_dev, t, token_mask_dev, capture)
        if capture is not None:
            capture["engram_ids"] = np.asarray(row_ids, np.int64).copy()

    def run(self, layer: int, h_dev, n_tokens: int, token_mask_dev=None, capture: dict | None = None) -> None:
        """The device part of `apply` (rows, projection, gate) from the layer's uploaded rows."""
        self._checked_mask(h_dev, self._check_tokens(n_tokens), token_mask_dev)  # before any work
        self.prepare(layer, n_tokens)
        self.finish(layer, h_dev, n_tokens, token_mask_dev, capture)

    def prepare(self, layer: int, n_tokens: int) -> None:
        """Steps 2 and 3 of `layer` from its uploaded rows: rows[:T], then kv[:T]; while a graph
        is captured on the stage's branch, which `finish` joins."""
        t = self._check_tokens(n_tokens)
        self._weights(layer)  # an unknown layer fails before the branch is forked
        stream = self._branch.fork(self.stream, self.capturing)
        self.dequantize_rows(layer, t, stream)
        self._mark("engram rows")
        self.project(layer, t, stream)
        self._mark("engram wkv")

    def finish(self, layer: int, h_dev, n_tokens: int, token_mask_dev=None, capture: dict | None = None) -> None:
        """Step 4 of `layer` after its `prepare`: the gate, in place on h_dev."""
        t = self._check_tokens(n_tokens)
        self._checked_mask(h_dev, t, token_mask_dev)
        self._branch.join(self.stream)
        self.gate(layer, h_dev, t, token_mask_dev)
        if capture is not None:
            capture.update(engram_rows=from_bits(self._to_host(self.rows, t)),
                           engram_kv=from_bits(self._to_host(self.kv, t)),
                           engram_gate=self._to_host(self.gates, t))

    def _checked_mask(self, h_dev, n_tokens: int, token_mask_dev):
        """The mask the gate reads (all ones when none is given); InputError for a bad h or mask."""
        if not is_device_array(h_dev) or h_dev.dtype != np.float32 or h_dev.ndim != 3 \
                or h_dev.shape[0] < n_tokens or tuple(h_dev.shape[1:]) != (self.hc, self.dim):
            raise InputError(f"h must be a float32 device array [>= {n_tokens}, {self.hc}, {self.dim}], got "
                             f"{_describe(h_dev)}")
        if token_mask_dev is None:
            return self.all_tokens
        if not is_device_array(token_mask_dev) or token_mask_dev.dtype not in (np.uint8, np.bool_) \
                or token_mask_dev.ndim != 1 or token_mask_dev.shape[0] < n_tokens:
            raise InputError(f"token_mask_dev must be a uint8 or bool device array [>= {n_tokens}], got "
                             f"{_describe(token_mask_dev)}")
        return token_mask_dev

    def _to_host(self, dev, n_tokens: int) -> np.ndarray:
        out = dev[:n_tokens].copy_to_host(stream=self.stream)
        if self.stream:
            self.stream.synchronize()
        return out

    def free(self) -> None:
        """Release every device array (idempotent); the stage is unusable afterwards."""
        for w in self.layers.values():
            w.table.free()
        self.layers = {}
        self.rows = self.kv = self.gates = self.all_tokens = None


def _describe(a: object) -> str:
    kind = "device array" if is_device_array(a) else type(a).__name__
    return f"{kind} {getattr(a, 'dtype', '?')} {tuple(getattr(a, 'shape', ()))}"
