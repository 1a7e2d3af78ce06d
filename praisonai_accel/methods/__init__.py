"""Training methods: each owns its rows, their encoding and collation, and its loss (base.py says how)."""

from __future__ import annotations

from .base import TrainingMethod
from .sft import SFT


def method_for(config) -> TrainingMethod:
    """The run's training method (`method:` in config.yaml)."""
    name = getattr(config, "method", "sft")
    if name == "sft":
        return SFT(config)
    if name == "grpo":
        from .grpo import GRPO

        return GRPO(config)
    if name == "reward":  # method: reward (methods/reward.py)
        from .reward import RewardMethod

        return RewardMethod(config)
    from .preference import PreferenceMethod  # dpo, orpo, kto

    return PreferenceMethod(config)
