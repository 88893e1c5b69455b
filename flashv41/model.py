"""A loaded model: its validated `ModelConfig` and a lazily reading `WeightStore`.

`host.gguf_model` is imported inside `load_model`, not at the top: host modules import
`flashv41.errors`, which runs this package's `__init__`, so a top-level import here would make
`import host.quants` (or `host.gguf_model`) as a program's first import a circular one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from flashv41.config import ModelConfig

if TYPE_CHECKING:
    from host.gguf_model import TensorRef, WeightStore


@dataclass
class Model:
    """What `load_model` returns: `config` (immutable) and `weights` (memory-mapped tensors)."""

    path: Path
    config: ModelConfig
    weights: WeightStore

    def tensor(self, layer: int | None, role: str) -> TensorRef:
        """The stored tensor `blk.{layer}.{role}.weight` (or `{role}.weight` for layer None)."""
        return self.weights.get(layer, role)

    def close(self) -> None:
        self.weights.close()


def load_model(path: str | os.PathLike[str]) -> Model:
    """Open a DeepSeek-V4.1 GGUF (llama.cpp layout) and validate it.

    Raises `ModelFormatError` / `UnsupportedError` (both `FlashError`) naming the key or tensor
    at fault. Tensor data is memory-mapped, not read.
    """
    from host.gguf_model import read_model

    config, weights = read_model(path)
    return Model(Path(path), config, weights)
