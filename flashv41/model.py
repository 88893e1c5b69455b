"""Opening a model file: `load_model`, the public entry point to a GGUF."""

from __future__ import annotations

import os
from pathlib import Path

from flashv41.host.gguf_model import read_model
from flashv41.host.model import Model


def load_model(path: str | os.PathLike[str]) -> Model:
    """Open a DeepSeek-V4.1 GGUF (llama.cpp or mxxm-t layout) and validate it: one file, or any shard of a
    split set (llama.cpp gguf-split, `NAME-00001-of-00003.gguf` ...), whose other shards are found
    beside it by name.

    Raises `ModelFormatError` / `UnsupportedError` (both `FlashError`) naming the key or tensor
    at fault. Tensor data is memory-mapped, not read.
    """
    config, weights = read_model(path)
    return Model(Path(path), config, weights)
