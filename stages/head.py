"""The head on the device: the logits of the positions a call processed.

Shapes: T tokens, hc copies, C dim, V vocab. Two parts, as the engine runs them:

- `input` (in every call, after the last layer): x [T, C] bf16 = output_norm(bf16(sum_c pre[c] h[c])),
  h the final highway [T, hc, C] fp32 and pre [T, hc] the last layer's FFN mixes' pre (V4.1's
  head has no mixes of its own). stages.hyper's pre_norm_kernel, one block of PRE_NORM_THREADS per
  token: the collapse and norm the sublayers' inputs get (the same device function).
- `logits` (when asked): y [T, V] fp32 = x @ output^T, stages.linear's products with an fp32
  output (stream for a decode step's row), up to HEAD_ROWS rows at a time into the stage's
  workspace, then copied to the host.

Oracle: host.oracle.head (head_input, head_logits), the same arguments.
"""

from __future__ import annotations

import numpy as np
from numba import cuda

from flashv41.host import gguf_layout as L
from flashv41.host.errors import UnsupportedError
from flashv41.stages.hyper import PRE_NORM_THREADS, pre_norm_kernel
from flashv41.stages.linear import DeviceWeight, linear

HEAD_ROWS = 64  # logits rows one product computes (the workspace's): all_positions walks T in such runs


class HeadStage:
    """output_norm and output on the device, and the logits workspace fp32 [min(max_tokens,
    HEAD_ROWS), V]. The head's input buffer belongs to the caller (a sequence keeps its last
    call's)."""

    def __init__(self, model, max_tokens: int, stream=0):
        cfg = model.config
        if not cfg.head:
            raise UnsupportedError(f"{model.path.name}: the file has no head (output_norm, output)")
        self.cfg = cfg
        self.stream = stream
        self.norm = cuda.to_device(model.tensor(None, L.OUTPUT_NORM).dequantize(), stream=stream)  # [C] fp32
        self.output = DeviceWeight.from_ref(model.tensor(None, L.OUTPUT), stream)  # [V, C]
        self.rows = min(max_tokens, HEAD_ROWS)
        self.workspace = cuda.device_array((self.rows, cfg.vocab_size), np.float32)  # [rows, V]

    @property
    def device_bytes(self) -> int:
        return int(self.output.nbytes + self.norm.nbytes + self.workspace.nbytes)

    def input(self, h, pre, x, n_tokens: int) -> None:
        """x[:T] = output_norm(hc_pre(h, pre)), bf16 bits [T, C] (x: the caller's buffer)."""
        cfg = self.cfg
        per_thread = -(-cfg.dim // PRE_NORM_THREADS)
        pre_norm_kernel(cfg.hc, per_thread)[n_tokens, PRE_NORM_THREADS, self.stream](
            h, pre, self.norm, x, cfg.dim, np.float32(cfg.norm_eps))

    def logits(self, x, n_tokens: int) -> np.ndarray:
        """x[:T] @ output^T: float32 [T, V] on the host, HEAD_ROWS rows a product."""
        out = np.empty((n_tokens, self.cfg.vocab_size), np.float32)
        for r0 in range(0, n_tokens, self.rows):
            n = min(self.rows, n_tokens - r0)
            linear(x[r0:r0 + n], self.output, self.workspace, n, stream=self.stream)
            out[r0:r0 + n] = self.workspace[:n].copy_to_host()  # (the default stream: after the product)
        return out

    def free(self) -> None:
        self.norm = self.workspace = None
        self.output = None  # type: ignore[assignment]
