"""flashv41: DeepSeek-V4.1-Flash engram and attention layers on the GPU, from GGUF files.

Public API: `load_model`, `builtin_model` (the built-in tiny model's path), `Model`, `Engine` /
`Sequence`, `ModelConfig`, `LayerRole`, `EngramConfig` and the errors.
"""

from flashv41.engine import Engine, Sequence
from flashv41.host.config import EngramConfig, LayerRole, ModelConfig
from flashv41.host.errors import (
    CapacityError,
    FlashError,
    InputError,
    ModelFormatError,
    SequenceStateError,
    UnsupportedError,
)
from flashv41.host.model import Model
from flashv41.model import load_model
from flashv41.runner import builtin_model

__all__ = [
    "CapacityError",
    "Engine",
    "EngramConfig",
    "FlashError",
    "InputError",
    "LayerRole",
    "Model",
    "ModelConfig",
    "ModelFormatError",
    "Sequence",
    "SequenceStateError",
    "UnsupportedError",
    "builtin_model",
    "load_model",
]
__version__ = "0.1.0"
