"""The reference model of the methods that need one (DPO / KTO, GRPO with beta > 0): for LoRA / QLoRA the policy
with its adapter disabled (peft's disable_adapter; no second copy), for full fine-tuning a frozen copy held as the
loss module's submodule `reference` (so FSDP2 wraps and shards its decoder layers exactly like the policy's)."""

from __future__ import annotations

import contextlib
import copy

import torch


def is_peft(model) -> bool:
    return hasattr(model, "disable_adapter") and hasattr(model, "peft_config")


class ReferenceModel:
    """Mixin for a CausalLMLoss (listed before it): `init_reference`, eval mode kept for the copy, and
    `_reference_model`."""

    def init_reference(self, causal_lm, needed: bool) -> None:
        if needed and not is_peft(causal_lm):
            # Full fine-tuning: the reference is the model as it starts, frozen; a submodule, so that FSDP2 wraps and
            # shards its decoder layers exactly like the policy's.
            self.reference = copy.deepcopy(causal_lm).requires_grad_(False).eval()
        else:
            self.reference = None

    def train(self, mode: bool = True):
        super().train(mode)
        if self.reference is not None:
            self.reference.eval()  # never dropout in the reference
        return self

    @contextlib.contextmanager
    def _reference_model(self):
        """The reference causal LM, in eval mode, without gradients."""
        if self.reference is not None:
            with torch.no_grad():
                yield self.reference
            return
        was_training = self.causal_lm.training
        self.causal_lm.eval()
        try:
            with torch.no_grad(), self.causal_lm.disable_adapter():
                yield self.causal_lm
        finally:
            self.causal_lm.train(was_training)
