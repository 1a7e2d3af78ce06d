"""Preference losses against TRL's own loss code, called on the same log-probs (DPOTrainer._compute_loss,
CPOTrainer.cpo_loss for SimPO, ORPOTrainer.odds_ratio_loss, KTOTrainer._compute_loss), to 1e-6."""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from praisonai_accel.methods import preference_loss as pl

B, T = 5, 9


class _Accelerator:
    device = torch.device("cpu")

    @staticmethod
    def gather_for_metrics(x):
        return x

    gather = gather_for_metrics


def _trainer_stub(**attrs):
    return SimpleNamespace(model=SimpleNamespace(training=True), accelerator=_Accelerator(), aux_loss_enabled=False,
                           _metrics=defaultdict(lambda: defaultdict(list)), _total_train_tokens=0, _tp_size=1, **attrs)


def _per_token(seed: int, rows: int):
    """Per-token log-probs (negative) and a completion mask with varied lengths and a prompt of 2 tokens."""
    g = torch.Generator().manual_seed(seed)
    logps = -torch.rand(rows, T - 1, generator=g, dtype=torch.float64) * 2
    lengths = torch.randint(1, T - 2, (rows,), generator=g)
    completion_mask = torch.zeros(rows, T, dtype=torch.long)
    for i, n in enumerate(lengths.tolist()):
        completion_mask[i, 2:2 + n] = 1
    return logps * completion_mask[:, 1:], completion_mask


def _outputs(log_probs):
    rows = log_probs.size(0)
    return SimpleNamespace(log_probs=log_probs, entropy=torch.zeros(rows, T - 1), mean_logits=torch.zeros(rows, T - 1),
                           is_top1=torch.zeros(rows, T - 1, dtype=torch.bool))


def _trl_dpo(loss_type, beta, label_smoothing, seed=0):
    from trl import DPOTrainer

    per_token, completion_mask = _per_token(seed, 2 * B)
    g = torch.Generator().manual_seed(seed + 1)
    ref = -torch.rand(2 * B, generator=g, dtype=torch.float64) * 6
    stub = _trainer_stub(ld_alpha=None, precompute_ref_logps=True, f_divergence_type="reverse_kl",
                         loss_types=[loss_type], loss_weights=[1.0], beta=beta, label_smoothing=label_smoothing,
                         use_weighting=False)
    inputs = {"input_ids": torch.ones(2 * B, T, dtype=torch.long), "attention_mask": torch.ones(2 * B, T, dtype=torch.long),
              "completion_mask": completion_mask, "ref_chosen_logps": ref[:B], "ref_rejected_logps": ref[B:]}
    loss = DPOTrainer._compute_loss(stub, lambda **kw: _outputs(per_token), inputs, False)
    metrics = {k: v[-1] for k, v in stub._metrics["train"].items()}
    counts = completion_mask.sum(1).double()
    return loss, metrics, per_token.sum(1), ref, counts


@pytest.mark.parametrize("loss_type,label_smoothing", [("sigmoid", 0.0), ("ipo", 0.0), ("hinge", 0.0), ("robust", 0.2)])
def test_dpo_losses_equal_trl(loss_type, label_smoothing):
    beta = 0.3
    expected, trl_metrics, logps, ref, counts = _trl_dpo(loss_type, beta, label_smoothing)
    losses, chosen_rewards, rejected_rewards = pl.dpo_losses(loss_type, beta, label_smoothing, logps[:B], logps[B:],
                                                             ref[:B], ref[B:], counts[:B], counts[B:])
    assert losses.shape == (B,)
    assert losses.mean().item() == pytest.approx(expected.item(), abs=1e-6)
    ours = {k: v.item() / B for k, v in pl.pair_metric_sums(chosen_rewards, rejected_rewards, logps[:B], logps[B:]).items()}
    for name in pl.PAIR_METRICS:
        assert ours[name] == pytest.approx(trl_metrics[name], abs=1e-6), name


def test_dpo_sigmoid_is_ln2_when_policy_is_reference():
    logps = -torch.rand(2 * B, dtype=torch.float64) * 5
    losses, *_ = pl.dpo_losses("sigmoid", 0.1, 0.0, logps[:B], logps[B:], logps[:B], logps[B:], None, None)
    assert torch.allclose(losses, torch.full((B,), torch.log(torch.tensor(2.0, dtype=torch.float64)).item(),
                                             dtype=torch.float64), atol=1e-12)


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_simpo_equals_trl_cpo_simpo(label_smoothing):
    from trl.experimental.cpo import CPOTrainer

    g = torch.Generator().manual_seed(3)
    chosen_avg, rejected_avg = -torch.rand(B, generator=g, dtype=torch.float64), -torch.rand(B, generator=g, dtype=torch.float64)
    stub = SimpleNamespace(alpha=0.0, loss_type="simpo", beta=2.0, simpo_gamma=0.8, label_smoothing=label_smoothing,
                           accelerator=_Accelerator())
    expected, exp_chosen, exp_rejected = CPOTrainer.cpo_loss(stub, chosen_avg, rejected_avg)
    losses, chosen_rewards, rejected_rewards = pl.simpo_losses(2.0, 0.8, label_smoothing, chosen_avg, rejected_avg)
    assert torch.allclose(losses, expected, atol=1e-6)
    assert torch.allclose(chosen_rewards, exp_chosen) and torch.allclose(rejected_rewards, exp_rejected)


def test_orpo_odds_ratio_equals_trl():
    from trl.experimental.orpo import ORPOTrainer

    g = torch.Generator().manual_seed(4)
    chosen_avg = -torch.rand(B, generator=g, dtype=torch.float64) * 3
    rejected_avg = -torch.rand(B, generator=g, dtype=torch.float64) * 3
    chosen_avg[0], rejected_avg[0] = -0.01, -0.9  # both sides of log1mexp's branch at -ln 2
    stub = SimpleNamespace(beta=0.25, accelerator=_Accelerator())
    trl_terms, trl_chosen, trl_rejected, *_ = ORPOTrainer.odds_ratio_loss(stub, chosen_avg, rejected_avg)
    losses, chosen_rewards, rejected_rewards, ratio_term = pl.orpo_losses(0.25, chosen_avg, rejected_avg)
    assert torch.allclose(ratio_term.double(), trl_terms.double(), atol=1e-6)
    # TRL's total is nll - mean(terms); our nll is the chosen completion's mean token NLL (the paper's L_SFT)
    assert losses.mean().item() == pytest.approx((-chosen_avg).mean().item() - trl_terms.mean().item(), abs=1e-6)
    assert torch.allclose(chosen_rewards.double(), trl_chosen.double()) and torch.allclose(rejected_rewards.double(), trl_rejected.double())


@pytest.mark.parametrize("weights", [(1.0, 1.0), (1.5, 0.7)])
def test_kto_equals_trl(weights):
    from trl import KTOTrainer

    n = 6
    per_token, completion_mask = _per_token(5, n)
    kl_per_token, kl_mask = _per_token(6, n)
    g = torch.Generator().manual_seed(7)
    ref, ref_kl = -torch.rand(n, generator=g, dtype=torch.float64) * 4, -torch.rand(n, generator=g, dtype=torch.float64) * 4
    labels = torch.tensor([True, False, True, True, False, False])
    input_ids, kl_input_ids = torch.ones(n, T, dtype=torch.long), torch.ones(n, T, dtype=torch.long)

    def model(input_ids, **kw):
        return _outputs(kl_per_token if input_ids is kl_input_ids else per_token)

    stub = _trainer_stub(calculate_KL=True, precompute_ref_logps=True, loss_type="kto", beta=0.2,
                         desirable_weight=weights[0], undesirable_weight=weights[1])
    stub._compute_kl_logps = lambda m, b: KTOTrainer._compute_kl_logps(stub, m, b)
    inputs = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "completion_mask": completion_mask,
              "KL_input_ids": kl_input_ids, "KL_attention_mask": torch.ones_like(input_ids), "KL_completion_mask": kl_mask,
              "label": labels, "ref_logps": ref, "ref_KL_logps": ref_kl}
    expected = KTOTrainer._compute_loss(stub, model, inputs, False)
    trl_metrics = {k: v[-1] for k, v in stub._metrics["train"].items()}

    kl = pl.kto_kl(kl_per_token.sum(1), ref_kl)
    assert kl.item() == pytest.approx(trl_metrics["kl"], abs=1e-6)
    losses, rewards = pl.kto_losses(0.2, weights[0], weights[1], per_token.sum(1), ref, labels, kl)
    assert losses.mean().item() == pytest.approx(expected.item(), abs=1e-6)

    from praisonai_accel.methods.preference import PreferenceMethod

    sums = {k: v.item() for k, v in pl.kto_metric_sums(rewards, per_token.sum(1), labels, kl).items()}
    ours = PreferenceMethod(SimpleNamespace(method="kto")).reduce_metrics(sums, n)
    for name in ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected", "kl"):
        assert ours[name] == pytest.approx(trl_metrics[name], abs=1e-6), name
