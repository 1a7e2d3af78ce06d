"""The module accelerate prepares for DPO, SimPO, ORPO and KTO (preference.py is the method; it imports this, and
torch, only when the loss module is built)."""

from __future__ import annotations

import torch

from . import preference_loss as plosses
from .lm_loss import CausalLMLoss
from .preference import needs_reference
from .preference_logps import sequence_logps
from .reference_model import ReferenceModel


class PreferenceLoss(ReferenceModel, CausalLMLoss):
    """Reference pass + policy pass + preference loss, in one forward. Returns (loss summed over units, metric sums)."""

    def __init__(self, causal_lm, config, chunked: bool = True):
        super().__init__(causal_lm, chunked=chunked)
        self.method = config.method
        self.beta = config.beta
        # a config holds its own method's keys alone (DPO's label_smoothing is no key of KTO): another method's are
        # None here, and only that method's branch of forward reads them
        for key in ("loss_type", "label_smoothing", "simpo_gamma", "desirable_weight", "undesirable_weight"):
            setattr(self, key, getattr(config, key, None))
        self.uses_reference = needs_reference(config)
        self.init_reference(causal_lm, self.uses_reference)

    def reference_logps(self, input_ids, labels, attention_mask) -> torch.Tensor:
        with self._reference_model() as model:
            return sequence_logps(self, model, input_ids, labels, attention_mask, self.chunked)[0].detach()

    def forward(self, input_ids, labels, attention_mask=None, reference_only: bool = False, **extra):
        if reference_only:  # precompute_ref_log_probs, through the prepared module: one log-prob per row
            return self.reference_logps(input_ids, labels, attention_mask)
        if self.method == "kto":
            return self._kto(input_ids, labels, attention_mask, **extra)
        return self._pairs(input_ids, labels, attention_mask, **extra)

    def _pairs(self, input_ids, labels, attention_mask, ref_chosen_logps=None, ref_rejected_logps=None):
        n = input_ids.size(0) // 2
        reference = None
        if self.uses_reference:
            if ref_chosen_logps is None:  # before the policy pass: its activations are not alive yet
                reference = self.reference_logps(input_ids, labels, attention_mask)
            else:
                reference = torch.cat([ref_chosen_logps, ref_rejected_logps]).to(input_ids.device)
        logps, counts = sequence_logps(self, self.causal_lm, input_ids, labels, attention_mask, self.chunked)
        chosen, rejected = logps[:n], logps[n:]
        chosen_count, rejected_count = counts[:n].to(logps.dtype), counts[n:].to(logps.dtype)
        if self.method == "orpo" or self.loss_type == "simpo":
            chosen, rejected = chosen / chosen_count.clamp(min=1), rejected / rejected_count.clamp(min=1)
            if self.method == "orpo":
                losses, chosen_rewards, rejected_rewards, _ = plosses.orpo_losses(self.beta, chosen, rejected)
            else:
                losses, chosen_rewards, rejected_rewards = plosses.simpo_losses(
                    self.beta, self.simpo_gamma, self.label_smoothing, chosen, rejected)
        else:
            losses, chosen_rewards, rejected_rewards = plosses.dpo_losses(
                self.loss_type, self.beta, self.label_smoothing, chosen, rejected, reference[:n].to(chosen.dtype),
                reference[n:].to(chosen.dtype), chosen_count, rejected_count)
        return losses.sum(), plosses.pair_metric_sums(chosen_rewards, rejected_rewards, chosen, rejected)

    def _kto(self, input_ids, labels, attention_mask, desirable, kl_rows, ref_logps=None):
        n = desirable.numel()
        kl_count = int(kl_rows)
        mask = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
        if ref_logps is None:
            reference = self.reference_logps(input_ids, labels, mask)
            ref_logps, ref_kl = reference[:n], reference[n:]
        else:
            ref_logps = ref_logps.to(input_ids.device)
            ref_kl = self.reference_logps(input_ids[n:], labels[n:], mask[n:]) if kl_count else None
        kl = torch.zeros((), device=input_ids.device)
        if kl_count:
            with torch.no_grad():
                kl_logps = sequence_logps(self, self.causal_lm, input_ids[n:], labels[n:], mask[n:], self.chunked)[0]
            kl = plosses.kto_kl(kl_logps, ref_kl)
        logps = sequence_logps(self, self.causal_lm, input_ids[:n], labels[:n], mask[:n], self.chunked)[0]
        desirable = desirable.to(logps.device).bool()
        losses, rewards = plosses.kto_losses(self.beta, self.desirable_weight, self.undesirable_weight, logps,
                                             ref_logps.to(logps.dtype), desirable, kl)
        return losses.sum(), plosses.kto_metric_sums(rewards, logps, desirable, kl)
