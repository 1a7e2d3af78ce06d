"""GRPO's loss and advantages against TRL's own code on the same inputs: GRPOTrainer._compute_loss, called unbound on a
stub carrying the attributes it reads, with _get_per_token_logps_and_entropies returning our log-probs; the
advantages against the lines of _generate_and_score_completions that compute them (that method generates, so it
cannot be called without a model: the test repeats its eight lines verbatim, with TRL's own nanstd)."""

from __future__ import annotations

import itertools
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from praisonai_accel.methods import grpo_loss as gl

B, T, L = 6, 7, 9  # completions, padded completion length, max_completion_length


class _Accelerator:
    device = torch.device("cpu")
    num_processes = 1

    @staticmethod
    def gather(x):
        return x.reshape(-1) if x.dim() == 0 else x

    @staticmethod
    def reduce(x, reduction="sum"):
        return x


def _inputs(seed: int, rows: int = B, old: bool = False, ref: bool = False):
    """Log-probs [rows, T] (negative, float64), advantages, and a right-padded completion mask with an empty row, a
    one-token row and a full row among random lengths."""
    g = torch.Generator().manual_seed(seed)
    logps = -torch.rand(rows, T, generator=g, dtype=torch.float64) * 3
    lengths = torch.randint(0, T + 1, (rows,), generator=g)
    lengths[:3] = torch.tensor([0, 1, T])
    mask = (torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)).long()
    advantages = torch.randn(rows, generator=g, dtype=torch.float64)
    # Ratios far enough from 1 that both sides of the clip are hit
    old_logps = logps + torch.randn(rows, T, generator=g, dtype=torch.float64) * 0.4 if old else None
    ref_logps = logps + torch.randn(rows, T, generator=g, dtype=torch.float64) * 0.5 if ref else None
    return logps, old_logps, ref_logps, advantages, mask


def _trl_loss(logps, old_logps, ref_logps, advantages, mask, *, loss_type, beta, epsilon_low, epsilon_high):
    """TRL's GRPOTrainer._compute_loss on these log-probs (one process, no accumulation: the whole batch is one step
    and num_items_in_batch its completion tokens), its logged metrics, and the gradient wrt logps."""
    from trl import GRPOTrainer

    policy = logps.clone().requires_grad_(True)
    rows = policy.size(0)
    stub = SimpleNamespace(
        model=SimpleNamespace(training=True), accelerator=_Accelerator(), aux_loss_enabled=False,
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, importance_sampling_level="token", beta=beta,
        loss_type=loss_type, epsilon_low=epsilon_low, epsilon_high=epsilon_high, use_vllm=False,
        vllm_importance_sampling_correction=False, current_gradient_accumulation_steps=1, max_completion_length=L,
        _entropy_bonus_enabled=False, _metrics=defaultdict(lambda: defaultdict(list)),
        args=SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=1),
        _get_per_token_logps_and_entropies=lambda *a, **k: (policy, torch.zeros_like(policy), None))
    inputs = {"prompt_ids": torch.ones(rows, 2, dtype=torch.long), "prompt_mask": torch.ones(rows, 2, dtype=torch.long),
              "completion_ids": torch.ones(rows, T, dtype=torch.long), "completion_mask": mask,
              "advantages": advantages, "num_items_in_batch": mask.sum()}
    if old_logps is not None:
        inputs["old_per_token_logps"] = old_logps
    if ref_logps is not None:
        inputs["ref_per_token_logps"] = ref_logps
    loss = GRPOTrainer._compute_loss(stub, None, inputs)
    loss.backward()
    return loss.detach(), {k: v[-1] for k, v in stub._metrics["train"].items()}, policy.grad


def _ours(logps, old_logps, ref_logps, advantages, mask, **kw):
    policy = logps.clone().requires_grad_(True)
    loss_sum, units, sums = gl.policy_loss(policy, old_logps, ref_logps, advantages, mask, max_completion_length=L, **kw)
    loss = loss_sum / units
    loss.backward()
    return loss.detach(), sums, policy.grad


CASES = list(itertools.product(gl.LOSS_TYPES, (0.0, 0.04), (False, True), (None, 0.28)))


@pytest.mark.parametrize("loss_type,beta,multi_iteration,epsilon_high", CASES)
def test_policy_loss_equals_trl(loss_type, beta, multi_iteration, epsilon_high):
    """Every loss_type, with and without the KL term, num_iterations 1 (old = logps) and > 1 (old given), clip-higher
    set or not (TRL's epsilon_high defaults to epsilon): loss, gradient and logged means equal TRL's to 1e-6."""
    seed = CASES.index((loss_type, beta, multi_iteration, epsilon_high))
    args = _inputs(seed, old=multi_iteration, ref=beta > 0)
    kw = dict(loss_type=loss_type, beta=beta, epsilon_low=0.2)
    expected, trl_metrics, trl_grad = _trl_loss(*args, epsilon_high=0.2 if epsilon_high is None else epsilon_high, **kw)
    ours, sums, grad = _ours(*args, epsilon_high=epsilon_high, **kw)
    assert ours.item() == pytest.approx(expected.item(), abs=1e-6)
    torch.testing.assert_close(grad, trl_grad, atol=1e-6, rtol=0)
    means = gl.token_means({k: float(v) for k, v in sums.items()})
    assert means["clip_ratio"] == pytest.approx(trl_metrics["clip_ratio/region_mean"], abs=1e-6)
    assert means["clip_ratio/low_mean"] == pytest.approx(trl_metrics["clip_ratio/low_mean"], abs=1e-6)
    assert means["clip_ratio/high_mean"] == pytest.approx(trl_metrics["clip_ratio/high_mean"], abs=1e-6)
    if beta > 0:
        assert means["kl"] == pytest.approx(trl_metrics["kl"], abs=1e-6)
    if multi_iteration:  # the inputs are meant to clip: the metrics compared are not all zeros
        assert means["clip_ratio"] > 0


def test_kl_is_zero_at_step_zero():
    """Before the first update the policy is the reference: KL 0, and the loss is the plain advantage-weighted
    objective (ratio 1), whatever beta."""
    logps, _, _, advantages, mask = _inputs(3)
    for loss_type in gl.LOSS_TYPES:
        with_kl = gl.policy_loss(logps, None, logps.clone(), advantages, mask, loss_type=loss_type, beta=0.5,
                                 epsilon_low=0.2, epsilon_high=None, max_completion_length=L)
        without = gl.policy_loss(logps, None, None, advantages, mask, loss_type=loss_type, beta=0.0,
                                 epsilon_low=0.2, epsilon_high=None, max_completion_length=L)
        assert with_kl[2]["kl"].item() == 0.0
        assert with_kl[0].item() == pytest.approx(without[0].item(), abs=1e-12)
        assert with_kl[2]["clip_ratio"].item() == 0.0


def test_beta_without_reference_is_refused():
    logps, _, _, advantages, mask = _inputs(4)
    with pytest.raises(ValueError, match="ref_logps"):
        gl.policy_loss(logps, None, None, advantages, mask, loss_type="dapo", beta=0.1, epsilon_low=0.2,
                       epsilon_high=None, max_completion_length=L)


@pytest.mark.parametrize("loss_type", gl.LOSS_TYPES)
def test_micro_batches_and_ranks_sum_to_the_whole_batch(loss_type):
    """The recipe sums loss_sum and units over micro-batches and ranks and divides once. Split into 2 micro-batches
    on each of 2 simulated ranks (4 equal parts), that quotient is the loss of the one whole batch, for every
    loss_type: dapo because TRL's meaning is global (num_items_in_batch counts the tokens of the generation batch on
    every process); grpo and dr_grpo because TRL averages per-micro-batch means over accumulation and processes and
    every micro-batch holds the same number of completions; bnpo because we define it on the whole step's tokens
    (TRL's mean of micro-batch token means equals it only when the parts hold as many tokens: module docstring)."""
    rows = 8
    logps, old, ref, advantages, mask = _inputs(7, rows=rows, old=True, ref=True)
    kw = dict(loss_type=loss_type, beta=0.04, epsilon_low=0.2, epsilon_high=0.28, max_completion_length=L)
    whole_sum, whole_units, whole_metrics = gl.policy_loss(logps, old, ref, advantages, mask, **kw)
    parts = [slice(i, i + 2) for i in range(0, rows, 2)]  # rank 0: parts 0, 1; rank 1: parts 2, 3
    sums = [gl.policy_loss(logps[p], old[p], ref[p], advantages[p], mask[p], **kw) for p in parts]
    loss = sum(s[0] for s in sums) / sum(s[1] for s in sums)
    assert loss.item() == pytest.approx((whole_sum / whole_units).item(), abs=1e-9)
    for name in whole_metrics:
        assert sum(s[2][name] for s in sums).item() == pytest.approx(whole_metrics[name].item(), abs=1e-9)
    trl_whole, _, _ = _trl_loss(logps, old, ref, advantages, mask, loss_type=loss_type, beta=0.04, epsilon_low=0.2,
                                epsilon_high=0.28)
    assert loss.item() == pytest.approx(trl_whole.item(), abs=1e-6)


def _trl_advantages(rewards: torch.Tensor, num_generations: int, scale_rewards: str):
    """_generate_and_score_completions's advantage lines (sum_then_normalize), with TRL's nanstd."""
    from trl.trainer.utils import nanstd

    mean_grouped_rewards = torch.nanmean(rewards.view(-1, num_generations), dim=1)
    mean_grouped_rewards = mean_grouped_rewards.repeat_interleave(num_generations, dim=0)
    if scale_rewards in ["group", "none"]:
        std_rewards = nanstd(rewards.view(-1, num_generations), dim=1).repeat_interleave(num_generations, dim=0)
    else:
        std_rewards = nanstd(rewards).expand_as(rewards)
    advantages = rewards - mean_grouped_rewards
    if scale_rewards != "none":
        advantages = advantages / (std_rewards + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0), std_rewards


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
def test_group_advantages_equal_trl(scale_rewards):
    """Random rewards, a group of equal rewards (advantage 0, no NaN), and unscorable completions (NaN: left out of
    the mean and std, advantage 0)."""
    G = 4
    g = torch.Generator().manual_seed(11)
    rewards = torch.randn(5 * G, generator=g)
    rewards[G:2 * G] = 0.5  # one group all equal
    rewards[2 * G + 1] = float("nan")  # one unscorable completion
    rewards[3 * G:4 * G - 1] = float("nan")  # a group with a single scored completion: its std is NaN
    expected, expected_std = _trl_advantages(rewards, G, scale_rewards)
    advantages, std = gl.group_advantages(rewards, G, scale_rewards)
    assert not torch.isnan(advantages).any()
    torch.testing.assert_close(advantages, expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(std, expected_std, atol=1e-6, rtol=0, equal_nan=True)
    assert advantages[G:2 * G].abs().max().item() == 0.0
    assert advantages[2 * G + 1].item() == 0.0


def test_batch_std_across_ranks_from_moments():
    """scale_rewards batch spans the generation batch of every process: the moments summed over 2 simulated ranks
    give each rank the std of the whole batch, and its advantages equal the whole batch's."""
    G = 4
    rewards = torch.randn(4 * G, generator=torch.Generator().manual_seed(5))
    rewards[3] = float("nan")
    halves = rewards[:2 * G], rewards[2 * G:]
    batch_std = gl.std_from_moments(sum(gl.reward_moments(h) for h in halves))
    whole, _ = _trl_advantages(rewards, G, "batch")
    ranks = torch.cat([gl.group_advantages(h, G, "batch", batch_std=batch_std)[0] for h in halves])
    torch.testing.assert_close(ranks, whole, atol=1e-6, rtol=0)


def test_weighted_rewards_as_trl():
    """nansum of weight x reward over functions; a completion no function scored stays NaN (TRL's unscorable)."""
    per_func = torch.tensor([[1.0, float("nan")], [0.5, 2.0], [float("nan"), float("nan")]])
    totals = gl.weighted_rewards(per_func, torch.tensor([2.0, 0.5]))
    assert totals[:2].tolist() == [2.0, 2.0]
    assert torch.isnan(totals[2])


def test_reward_logs_summed_over_ranks_equal_trls_on_the_whole_batch():
    """rewards/<name>/mean and /std, reward, reward_std and frac_reward_zero_std as TRL logs them (nanmean and its
    nanstd over the gathered batch), from per-rank sums added over 2 simulated ranks."""
    from trl.trainer.utils import nanstd

    G, names = 2, ["exact_match", "rewards:brevity"]
    g = torch.Generator().manual_seed(2)
    per_func = torch.randn(8, 2, generator=g)
    per_func[0, 1] = per_func[5, 0] = float("nan")
    per_func[6] = float("nan")  # no function scored it
    per_func[2:4, 0], per_func[2:4, 1] = 1.0, 0.0  # a group with equal rewards: std 0
    weights = torch.tensor([1.0, 0.5])
    totals = gl.weighted_rewards(per_func, weights)
    _, std = gl.group_advantages(totals, G, "group")
    halves = [slice(0, 4), slice(4, 8)]
    parts = [gl.reward_metric_sums(per_func[h], totals[h], std[h], names) for h in halves]
    logged = gl.reward_metrics({k: float(parts[0][k] + parts[1][k]) for k in parts[0]}, names)
    expected = {"reward": torch.nanmean(totals).item(), "reward_std": nanstd(totals).item(),
                "frac_reward_zero_std": torch.isclose(std, torch.zeros_like(std)).float().mean().item()}
    for i, name in enumerate(names):
        expected[f"rewards/{name}/mean"] = torch.nanmean(per_func[:, i]).item()
        expected[f"rewards/{name}/std"] = nanstd(per_func[:, i]).item()
    assert logged.keys() == expected.keys()
    for key, value in expected.items():
        assert logged[key] == pytest.approx(value, abs=1e-6), key
    assert 0 < logged["frac_reward_zero_std"] < 1
