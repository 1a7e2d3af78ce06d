"""Training methods: each owns its config keys, rows, their encoding and collation, and its loss (base.py says how);
registry.py finds one by name."""

from __future__ import annotations

from .base import TrainingMethod
from .registry import method_class, register_method
from .sft import SFT

__all__ = ["SFT", "TrainingMethod", "method_class", "method_for", "register_method"]


def method_for(config) -> TrainingMethod:
    """The run's training method (`method:` in config.yaml), set up with its config."""
    return type(config).training_method(config)
