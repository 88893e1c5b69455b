"""A loaded model: its validated `ModelConfig` and a lazily reading `WeightStore`.

`flashv41.load_model` builds one; the oracle and the GPU stages take one.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flashv41.host.config import ModelConfig
from flashv41.host.gguf_model import TensorRef, WeightStore


@dataclass
class Model:
    """What `load_model` returns: `config` (immutable) and `weights` (memory-mapped tensors); a
    context manager that closes the file maps on exit."""

    path: Path
    config: ModelConfig
    weights: WeightStore

    def tensor(self, layer: int | None, role: str) -> TensorRef:
        """The stored tensor `blk.{layer}.{role}.weight` (or `{role}.weight` for layer None)."""
        return self.weights.get(layer, role)

    def close(self) -> None:
        self.weights.close()

    def __enter__(self) -> Model:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
