"""Training methods: each owns its rows, their encoding and collation, and its loss (base.py says how)."""

from __future__ import annotations

from .base import TrainingMethod
from .sft import SFT

METHODS: dict[str, type[TrainingMethod]] = {SFT.name: SFT}


def method_for(config) -> TrainingMethod:
    return METHODS[getattr(config, "method", "sft")](config)
