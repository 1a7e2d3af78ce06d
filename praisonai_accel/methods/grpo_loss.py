"""GRPO's math on tensors: the clipped policy loss of a micro-batch of completions (loss_type grpo, dapo, dr_grpo,
bnpo), the rewards' weighted total and the group-normalised advantages. Pure torch; nothing here knows the recipe.

The formulas are TRL 1.16's (GRPOTrainer._compute_loss, _generate_and_score_completions; importance sampling at
the token level, no vLLM correction, no entropy mask); tests/test_grpo_loss.py calls TRL's own code on the same
inputs. The recipe divides a step's summed loss by the units of all its micro-batches on all ranks, so each loss
type names its units such that that quotient is TRL's normalisation over the whole step:

| loss_type | loss_sum (of a micro-batch)                 | units                                   |
|-----------|---------------------------------------------|-----------------------------------------|
| dapo      | sum of token losses                         | completion tokens (TRL: num_items_in_batch over the generation batch and processes) |
| bnpo      | sum of token losses                         | completion tokens                       |
| grpo      | sum over completions of their token mean    | completions                             |
| dr_grpo   | sum of token losses                         | completions x max_completion_length     |

TRL averages grpo's, bnpo's and dr_grpo's per-micro-batch losses over accumulation and processes. For grpo and
dr_grpo that is the same as ours (every micro-batch holds the same number of completions); for bnpo ours is the
token mean of the whole step, TRL's the mean of each micro-batch's token mean: equal when the micro-batches hold
as many completion tokens each, and ours gives 2 ranks x B = 1 rank x 2B.
"""

from __future__ import annotations

import torch

from . import method_keys

LOSS_TYPES = method_keys.LOSS_TYPES["grpo"]  # one list: config checks it without torch
# Metric sums policy_loss returns that are means over completion tokens (divide by TOKENS), as TRL logs them:
# kl (only when beta > 0 in TRL; 0 here without a reference), clip_ratio (TRL's clip_ratio/region_mean).
TOKEN_MEANS = ("kl", "clip_ratio", "clip_ratio/low_mean", "clip_ratio/high_mean")
TOKENS = "completion_tokens"
POLICY_METRICS = (*TOKEN_MEANS, TOKENS)  # the sums policy_loss returns (a method's metric_names include them)
STD_EPSILON = 1e-4  # TRL's: advantages are divided by std + 1e-4


def policy_loss(logps: torch.Tensor, old_logps: torch.Tensor | None, ref_logps: torch.Tensor | None,
                advantages: torch.Tensor, mask: torch.Tensor, *, loss_type: str, beta: float, epsilon_low: float,
                epsilon_high: float | None, max_completion_length: int
                ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """(loss_sum, units, metric sums) of one micro-batch of B completions; loss_sum / units is TRL's loss on it.

    logps, old_logps, ref_logps: [B, T] log-probs of the completion tokens under the policy (with grad), the policy
    that generated them (None when num_iterations == 1: logps.detach(), a ratio of 1) and the reference (None when
    beta == 0). advantages: [B]. mask: [B, T], 1 on the completion tokens trained (0 after EOS, on padding, on a
    truncated completion that mask_truncated_completions drops). epsilon_high None means epsilon_low.

    Metric sums, all over the masked tokens (divide by sums[TOKENS], the completion tokens, for TRL's means;
    `token_means` does): "kl" (k3: exp(ref - logp) - (ref - logp) - 1; 0 without a reference),
    "clip_ratio/low_mean" (ratio < 1 - epsilon_low where the advantage < 0), "clip_ratio/high_mean" (ratio >
    1 + epsilon_high where the advantage > 0), "clip_ratio" (either: TRL's clip_ratio/region_mean)."""
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type: {loss_type!r} is not a GRPO loss; use one of {', '.join(LOSS_TYPES)}")
    epsilon_high = epsilon_low if epsilon_high is None else epsilon_high
    mask = mask.to(logps.dtype)
    adv = advantages.to(logps.dtype).unsqueeze(1)
    old = logps.detach() if old_logps is None else old_logps
    ratio = torch.exp(logps - old)
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    per_token = -torch.min(ratio * adv, clipped * adv)
    if beta != 0.0:
        if ref_logps is None:
            raise ValueError("policy_loss: beta > 0 needs the reference log-probs (ref_logps)")
    if ref_logps is not None:
        delta = ref_logps - logps
        kl = torch.exp(delta) - delta - 1
        if beta != 0.0:
            per_token = per_token + beta * kl
    else:
        kl = torch.zeros_like(logps)
    masked = per_token * mask
    tokens = mask.sum()
    if loss_type == "grpo":
        loss_sum = (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).sum()
    else:  # dapo, bnpo, dr_grpo: token losses summed; the units say what over
        loss_sum = masked.sum()
    units = loss_units(mask, loss_type, max_completion_length)
    with torch.no_grad():
        low = ((ratio < 1 - epsilon_low) & (adv < 0)).to(mask.dtype)
        high = ((ratio > 1 + epsilon_high) & (adv > 0)).to(mask.dtype)
        region = torch.maximum(low, high)
        metrics = {"kl": (kl.detach() * mask).sum(), "clip_ratio": (region * mask).sum(),
                   "clip_ratio/low_mean": (low * mask).sum(), "clip_ratio/high_mean": (high * mask).sum(),
                   TOKENS: tokens.detach()}
    return loss_sum, units.detach(), metrics


def loss_units(mask: torch.Tensor, loss_type: str, max_completion_length: int) -> torch.Tensor:
    """What a micro-batch's loss is a sum over, from its completion mask [B, T] alone (TrainingMethod.units, counted
    before the forward): completion tokens (dapo, bnpo), completions (grpo), completions x max_completion_length
    (dr_grpo). A 0-dim float tensor on the mask's device."""
    if loss_type == "grpo":
        return torch.tensor(float(mask.size(0)), device=mask.device)
    if loss_type == "dr_grpo":
        return torch.tensor(float(mask.size(0) * max_completion_length), device=mask.device)
    return mask.sum().float()


def token_means(sums: dict[str, float]) -> dict[str, float]:
    """TRL's logged means of policy_loss's metric sums (gathered over micro-batches and ranks): each over tokens."""
    tokens = max(float(sums.get(TOKENS, 0.0)), 1.0)
    return {name: float(sums[name]) / tokens for name in TOKEN_MEANS if name in sums}


def weighted_rewards(rewards_per_func: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """[N, F] rewards (NaN where a function returned None) -> [N] totals: nansum of weight x reward, as TRL; NaN for a
    completion no function scored (TRL leaves it out of the group's mean and std and gives it advantage 0)."""
    totals = (rewards_per_func * weights.to(rewards_per_func).unsqueeze(0)).nansum(dim=1)
    return totals.masked_fill(torch.isnan(rewards_per_func).all(dim=1), float("nan"))


def nanstd(values: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Standard deviation ignoring NaNs, with Bessel's correction; NaN for fewer than 2 values (TRL's nanstd)."""
    if dim is None:
        values, dim = values.reshape(-1), 0
    mean = torch.nanmean(values, dim=dim, keepdim=True)
    variance = torch.nanmean((values - mean) ** 2, dim=dim)
    count = (~torch.isnan(values)).sum(dim=dim)
    correction = torch.where(count > 1, count / (count - 1).clamp(min=1), torch.full_like(variance, float("nan")))
    return torch.sqrt(variance * correction)


def reward_moments(rewards: torch.Tensor) -> torch.Tensor:
    """[count, sum, sum of squares] of the non-NaN rewards (float64): summed over ranks, `std_from_moments` gives
    scale_rewards: batch's std of the whole generation batch without gathering the rewards."""
    valid = ~torch.isnan(rewards)
    r = rewards.double()[valid]
    return torch.stack([valid.sum().double(), r.sum(), (r * r).sum()])


def std_from_moments(moments: torch.Tensor) -> torch.Tensor:
    """The unbiased std of the values `reward_moments` summed; NaN for fewer than 2 (as nanstd)."""
    count, total, squares = moments.double().unbind()
    if count < 2:
        return total.new_tensor(float("nan"))
    return torch.sqrt(((squares - total * total / count) / (count - 1)).clamp(min=0.0))


def group_advantages(rewards: torch.Tensor, num_generations: int, scale_rewards: str, *,
                     batch_std: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages [N], std [N]) of the rewards [N] of N / num_generations whole groups, consecutive, as TRL's
    sum_then_normalize: reward minus its group's mean, divided by std + 1e-4 where std is the group's
    (scale_rewards group) or the batch's (batch: TRL's std over the whole generation batch of all processes, so pass
    `batch_std` from std_from_moments of the summed reward_moments when the batch spans ranks), not at all for none.
    NaN rewards (no function scored the completion) are left out of the means and stds and get advantage 0. std is
    what TRL logs frac_reward_zero_std from (the group's for group and none)."""
    if rewards.numel() % num_generations:
        raise ValueError(f"group_advantages: {rewards.numel()} rewards are not whole groups of {num_generations}")
    grouped = rewards.view(-1, num_generations)
    means = torch.nanmean(grouped, dim=1).repeat_interleave(num_generations)
    if scale_rewards in ("group", "none"):
        std = nanstd(grouped, dim=1).repeat_interleave(num_generations)
    elif scale_rewards == "batch":
        std = (nanstd(rewards) if batch_std is None else batch_std.to(rewards)).expand_as(rewards)
    else:
        raise ValueError(f"scale_rewards: {scale_rewards!r}; use group, batch or none")
    advantages = rewards - means
    if scale_rewards != "none":
        advantages = advantages / (std + STD_EPSILON)
    return torch.nan_to_num(advantages, nan=0.0), std


def reward_metric_sums(rewards_per_func: torch.Tensor, totals: torch.Tensor, std: torch.Tensor,
                       names: list[str]) -> dict[str, torch.Tensor]:
    """Sums over a rank's completions from which `reward_metrics` gives TRL's reward logs of the whole batch once
    they are summed over ranks: per function and for the weighted total, the count, sum and sum of squares of the
    non-NaN rewards; completions whose advantage std (group_advantages' std) is 0; completions."""
    sums: dict[str, torch.Tensor] = {}
    columns = [(f"rewards/{name}", rewards_per_func[:, i]) for i, name in enumerate(names)] + [("reward", totals)]
    for key, values in columns:
        count, total, squares = reward_moments(values).unbind()
        sums.update({f"{key}/count": count, f"{key}/sum": total, f"{key}/squares": squares})
    sums["reward/zero_std"] = torch.isclose(std, torch.zeros_like(std)).sum().double()
    sums["reward/completions"] = torch.tensor(float(totals.numel()), dtype=torch.float64)
    return sums


def reward_metrics(sums: dict[str, float], names: list[str]) -> dict[str, float]:
    """TRL's logged reward metrics from reward_metric_sums summed over ranks: rewards/<name>/mean and /std per
    function, reward and reward_std (the weighted total), frac_reward_zero_std. Means and stds leave out None
    (NaN) rewards; std is unbiased and NaN with fewer than 2 rewards, as TRL's nanstd."""
    logged: dict[str, float] = {}
    for key, mean_name, std_name in [(f"rewards/{n}", f"rewards/{n}/mean", f"rewards/{n}/std") for n in names] + [
            ("reward", "reward", "reward_std")]:
        moments = torch.tensor([sums[f"{key}/count"], sums[f"{key}/sum"], sums[f"{key}/squares"]], dtype=torch.float64)
        logged[mean_name] = float(moments[1] / moments[0]) if moments[0] > 0 else float("nan")
        logged[std_name] = float(std_from_moments(moments))
    logged["frac_reward_zero_std"] = float(sums["reward/zero_std"]) / max(float(sums["reward/completions"]), 1.0)
    return logged
