"""Preference losses from per-sequence log-probs: DPO (sigmoid, ipo, hinge, robust), SimPO, ORPO and KTO.

Each function returns per-unit losses (a pair, or a KTO example) and the per-unit rewards that TRL logs, so the
caller can sum them: the recipe divides the sums by the units of the whole optimizer step, which makes the loss a mean
over pairs across micro-batches and ranks. The formulas are TRL's (DPOTrainer._compute_loss, CPOTrainer.cpo_loss
for SimPO, ORPOTrainer.odds_ratio_loss, KTOTrainer._compute_loss); tests/test_preference.py checks them against
TRL's own code to 1e-6.

Log-probs come in as sums over each completion's trained tokens with the token counts; the length-normalised forms
(IPO's scores, SimPO, ORPO) divide here.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

DPO_LOSS_TYPES = ("sigmoid", "ipo", "hinge", "robust")
REFERENCE_FREE = ("simpo",)
from .method_keys import KTO_METRICS, PAIR_METRICS  # noqa: F401  (the names, importable without torch)


def dpo_losses(loss_type: str, beta: float, label_smoothing: float, chosen: torch.Tensor, rejected: torch.Tensor,
               ref_chosen: torch.Tensor, ref_rejected: torch.Tensor, chosen_count: torch.Tensor,
               rejected_count: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair DPO loss and the rewards beta * (policy - reference) of chosen and rejected (summed log-probs)."""
    chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
    delta = chosen_ratio - rejected_ratio
    if loss_type == "sigmoid":
        losses = -F.logsigmoid(beta * delta)
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * delta)
    elif loss_type == "ipo":
        # TRL's IPO: the log-ratios averaged over each completion's tokens (confirmed with the IPO authors)
        ipo_delta = chosen_ratio / chosen_count.clamp(min=1) - rejected_ratio / rejected_count.clamp(min=1)
        losses = (ipo_delta - 1 / (2 * beta)) ** 2
    elif loss_type == "robust":
        clean = -(1 - label_smoothing) * F.logsigmoid(beta * delta)
        flipped = -label_smoothing * F.logsigmoid(-beta * delta)
        losses = (clean - flipped) / (1 - 2 * label_smoothing)
    else:
        raise ValueError(f"loss_type: unknown DPO loss '{loss_type}'")
    return losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach()


def simpo_losses(beta: float, gamma: float, label_smoothing: float, chosen_avg: torch.Tensor,
                 rejected_avg: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SimPO (reference-free; length-normalised log-probs, target margin gamma), as TRL's CPO with cpo_alpha 0."""
    logits = (chosen_avg - rejected_avg) - gamma / beta
    losses = (-F.logsigmoid(beta * logits) * (1 - label_smoothing)
              - F.logsigmoid(-beta * logits) * label_smoothing)
    return losses, beta * chosen_avg.detach(), beta * rejected_avg.detach()


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, stable on both sides of -ln 2."""
    return torch.where(x < -math.log(2), torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def orpo_losses(beta: float, chosen_avg: torch.Tensor, rejected_avg: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair ORPO loss: the chosen completion's NLL (mean over its tokens, the paper's L_SFT) minus beta times
    log sigmoid of the log odds ratio. Also returns the odds-ratio term alone, for comparison with TRL."""
    chosen_avg, rejected_avg = chosen_avg.float(), rejected_avg.float()
    log_odds = (chosen_avg - rejected_avg) - (log1mexp(chosen_avg) - log1mexp(rejected_avg))
    ratio_term = beta * F.logsigmoid(log_odds)
    losses = -chosen_avg - ratio_term
    return losses, beta * chosen_avg.detach(), beta * rejected_avg.detach(), ratio_term


def kto_losses(beta: float, desirable_weight: float, undesirable_weight: float, logps: torch.Tensor,
               ref_logps: torch.Tensor, desirable: torch.Tensor, kl: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-example KTO loss (weighted) and reward beta * (policy - reference). `kl` is the detached, clamped
    estimate from mismatched (prompt, completion) pairs (see `kto_kl`)."""
    ratio = logps - ref_logps
    chosen_losses = 1 - torch.sigmoid(beta * (ratio - kl))
    rejected_losses = 1 - torch.sigmoid(beta * (kl - ratio))
    losses = torch.where(desirable, desirable_weight * chosen_losses, undesirable_weight * rejected_losses)
    return losses, beta * ratio.detach()


def kto_kl(kl_logps: torch.Tensor, ref_kl_logps: torch.Tensor) -> torch.Tensor:
    """TRL's KL estimate: the mean policy-minus-reference log-ratio of the mismatched pairs, over every rank when
    training is distributed, clamped at 0 and never differentiated."""
    total = (kl_logps - ref_kl_logps).detach().float().sum()
    count = torch.tensor(float(kl_logps.numel()), device=total.device)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        both = torch.stack([total, count])
        torch.distributed.all_reduce(both)
        total, count = both[0], both[1]
    return (total / count.clamp(min=1)).clamp(min=0)


def pair_metric_sums(chosen_rewards, rejected_rewards, chosen_logps, rejected_logps) -> dict[str, torch.Tensor]:
    """TRL's logged pair metrics, as sums over pairs (the recipe divides by pairs)."""
    return {
        "rewards/chosen": chosen_rewards.sum(),
        "rewards/rejected": rejected_rewards.sum(),
        "rewards/margins": (chosen_rewards - rejected_rewards).sum(),
        "rewards/accuracies": (chosen_rewards > rejected_rewards).float().sum(),
        "logps/chosen": chosen_logps.detach().sum(),
        "logps/rejected": rejected_logps.detach().sum(),
    }


def kto_metric_sums(rewards, logps, desirable, kl) -> dict[str, torch.Tensor]:
    """KTO's metrics as sums, with the counts they are means over (see PreferenceMethod.reduce_metrics)."""
    d = desirable.float()
    logps = logps.detach()
    return {
        "rewards/chosen": (rewards * d).sum(), "rewards/rejected": (rewards * (1 - d)).sum(),
        "logps/chosen": (logps * d).sum(), "logps/rejected": (logps * (1 - d)).sum(),
        "count/desirable": d.sum(), "count/undesirable": (1 - d).sum(), "kl": kl * d.numel(),
    }
