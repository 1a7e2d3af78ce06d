"""A training method defined outside the package, as a user's would be (tests/test_method_registry.py trains it
through the CLI): SFT whose loss is multiplied by a key of its own, logging the loss before it, with its own preview
title and report row. Nothing else in the package knows of it."""

from __future__ import annotations

from pydantic import BaseModel, Field

from praisonai_accel.config import ConfigError
from praisonai_accel.methods import SFT


class ToyKeys(BaseModel):
    toy_loss_scale: float = Field(default=1.0, gt=0, description="What SFT's loss is multiplied by.")


class ToyMethod(SFT):
    name = "toy"
    keys = ToyKeys
    metrics = ("unscaled_loss",)
    headline_metrics = ("unscaled_loss",)
    metric_names = ("unscaled_loss",)
    supports_sequence_parallel = False

    @classmethod
    def check_config(cls, config) -> None:
        if config.toy_loss_scale > 100:
            raise ConfigError(f"toy_loss_scale: {config.toy_loss_scale} would blow the loss up; use at most 100")

    @classmethod
    def preview_parts(cls, row: dict):
        return [("toy example", list(row["input_ids"]), list(row["labels"]))]

    def forward(self, module, batch: dict):
        loss, metrics = super().forward(module, batch)
        return loss * self.config.toy_loss_scale, {**metrics, "unscaled_loss": loss.detach()}
