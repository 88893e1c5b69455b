"""flashv41: DeepSeek-V4.1-Flash engram and attention layers on the GPU, from GGUF files.

Public API: `load_model`, `builtin_model` (the built-in tiny model's path), `Model`, `Engine` /
`Sequence`, the FFN callback's helpers (`host_ffn`, `capturable`, `FfnStream`: flashv41.ffn),
`HostMoE` (the model's MoE on the host), `sample` and `generate`, `Text` (the file's tokenizer),
`ModelConfig`, `LayerRole`, `EngramConfig`, `MoEConfig` and the errors.

The names are imported when first used (`flashv41.Engine`, `from flashv41 import Engine`), not
when the package is: the command line imports `flashv41.cli`, and so this package, before it
knows what it will run, and `flashv41 --help` must not wait for NumPy, gguf-py or Numba.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# each public name and the module that defines it
_HOMES = {
    "CallbackError": "flashv41.host.errors",
    "FfnStream": "flashv41.ffn",
    "HostMoE": "flashv41.host.moe",
    "MoEConfig": "flashv41.host.config",
    "capturable": "flashv41.ffn",
    "generate": "flashv41.sampling",
    "host_ffn": "flashv41.ffn",
    "sample": "flashv41.sampling",
    "Engine": "flashv41.engine",
    "Sequence": "flashv41.engine",
    "EngramConfig": "flashv41.host.config",
    "LayerRole": "flashv41.host.config",
    "ModelConfig": "flashv41.host.config",
    "CapacityError": "flashv41.host.errors",
    "FlashError": "flashv41.host.errors",
    "InputError": "flashv41.host.errors",
    "ModelFormatError": "flashv41.host.errors",
    "SequenceFileError": "flashv41.host.errors",
    "SequenceStateError": "flashv41.host.errors",
    "Text": "flashv41.text",
    "UnsupportedError": "flashv41.host.errors",
    "Model": "flashv41.host.model",
    "load_model": "flashv41.model",
    "builtin_model": "flashv41.runner",
}

__all__ = [
    "CallbackError",
    "CapacityError",
    "Engine",
    "EngramConfig",
    "FfnStream",
    "FlashError",
    "HostMoE",
    "InputError",
    "LayerRole",
    "MoEConfig",
    "Model",
    "ModelConfig",
    "ModelFormatError",
    "Sequence",
    "SequenceFileError",
    "SequenceStateError",
    "Text",
    "UnsupportedError",
    "builtin_model",
    "capturable",
    "generate",
    "host_ffn",
    "load_model",
    "sample",
]
assert sorted(_HOMES) == __all__

if TYPE_CHECKING:
    from flashv41.engine import Engine, Sequence
    from flashv41.ffn import FfnStream, capturable, host_ffn
    from flashv41.host.config import EngramConfig, LayerRole, ModelConfig, MoEConfig
    from flashv41.host.errors import (
        CallbackError,
        CapacityError,
        FlashError,
        InputError,
        ModelFormatError,
        SequenceFileError,
        SequenceStateError,
        UnsupportedError,
    )
    from flashv41.host.model import Model
    from flashv41.host.moe import HostMoE
    from flashv41.model import load_model
    from flashv41.runner import builtin_model
    from flashv41.sampling import generate, sample
    from flashv41.text import Text


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'flashv41' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # the next look-up is a plain one
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOMES})
