"""config.yaml: the keys of the training method (`method:` and what each method reads), composed into TrainConfig.

methods/preference_keys.py says which method reads which key; a key written for another method is refused.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, model_validator


class MethodKeys(BaseModel):
    # training method (praisonai_accel/methods/): sft, or preference training; TRL's names and defaults
    method: Literal["sft", "dpo", "orpo", "kto"] = "sft"
    beta: float = Field(default=0.1, gt=0)  # dpo, orpo, kto
    loss_type: Literal["sigmoid", "ipo", "hinge", "robust", "simpo"] = "sigmoid"  # dpo (simpo: reference-free)
    label_smoothing: float = Field(default=0.0, ge=0.0, lt=0.5)  # dpo loss_type robust or simpo
    simpo_gamma: float = 0.5  # dpo loss_type simpo: the target reward margin
    max_prompt_length: int = Field(default=512, gt=0)  # dpo, orpo, kto: prompts cut from the left to this first
    precompute_ref_log_probs: bool = False  # dpo, kto: reference log-probs computed once, before the first step
    desirable_weight: float = Field(default=1.0, gt=0)  # kto
    undesirable_weight: float = Field(default=1.0, gt=0)  # kto

    @model_validator(mode="after")
    def _check_method_keys(self):
        from .methods.preference_keys import check_method_keys

        check_method_keys(self)
        return self

