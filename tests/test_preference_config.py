"""The preference keys of config.yaml: TRL's defaults, and a key that the chosen method does not read refused in
one line."""

from __future__ import annotations

import pytest

from praisonai_accel.config import ConfigError, parse_config

BASE = {"model_name": "m", "dataset": "d.jsonl"}


def _default(config_class, name):
    return config_class.__dataclass_fields__[name].default


def test_defaults_are_trls():
    from trl import DPOConfig, KTOConfig
    from trl.experimental.cpo import CPOConfig

    config = parse_config({**BASE, "method": "dpo"})
    assert config.beta == _default(DPOConfig, "beta") == 0.1
    assert config.label_smoothing == _default(DPOConfig, "label_smoothing")
    assert config.precompute_ref_log_probs == _default(DPOConfig, "precompute_ref_log_probs")
    assert config.loss_type == "sigmoid"
    assert config.simpo_gamma == _default(CPOConfig, "simpo_gamma")
    kto = parse_config({**BASE, "method": "kto"})  # each method has its own keys: KTO's weights are KTO's alone
    assert kto.desirable_weight == _default(KTOConfig, "desirable_weight")
    assert kto.undesirable_weight == _default(KTOConfig, "undesirable_weight")
    assert not hasattr(config, "desirable_weight")
    assert parse_config(BASE).method == "sft"


@pytest.mark.parametrize("extra", [
    {"method": "dpo", "loss_type": "ipo", "beta": 0.5},
    {"method": "dpo", "loss_type": "robust", "label_smoothing": 0.1},
    {"method": "dpo", "loss_type": "simpo", "simpo_gamma": 1.0, "label_smoothing": 0.1},
    {"method": "dpo", "precompute_ref_log_probs": True, "max_prompt_length": 256},
    {"method": "orpo", "beta": 0.2, "max_prompt_length": 128},
    {"method": "kto", "desirable_weight": 1.3, "undesirable_weight": 0.8, "precompute_ref_log_probs": True},
])
def test_keys_of_the_chosen_method_are_accepted(extra):
    config = parse_config({**BASE, **extra})
    for key, value in extra.items():
        assert getattr(config, key) == value


@pytest.mark.parametrize("extra,message", [
    ({"beta": 0.2}, "beta: belongs to method dpo / orpo / kto / grpo, not to method: sft; remove it or set method: dpo"),
    ({"method": "orpo", "loss_type": "ipo"}, "loss_type: belongs to method dpo / grpo, not to method: orpo"),
    ({"method": "dpo", "desirable_weight": 2}, "desirable_weight: belongs to method kto, not to method: dpo"),
    ({"method": "orpo", "precompute_ref_log_probs": True},
     "precompute_ref_log_probs: belongs to method dpo / kto, not to method: orpo"),
    ({"method": "dpo", "simpo_gamma": 1}, "simpo_gamma: only loss_type simpo reads it, not loss_type: sigmoid"),
    ({"method": "dpo", "label_smoothing": 0.1}, "label_smoothing: only loss_type robust or simpo reads it"),
    ({"method": "dpo", "loss_type": "simpo", "precompute_ref_log_probs": True},
     "precompute_ref_log_probs: loss_type simpo is reference-free"),
    ({"method": "dpo", "max_prompt_length": 4096}, "max_prompt_length: 4096 leaves no room for the completion within "
                                                     "max_seq_length 2048"),
    ({"method": "dpo", "loss_type": "kto_pair"}, "loss_type: expected one of"),
    ({"method": "ppo"}, "method: expected one of"),
    ({"method": "kto", "packing": True}, "packing: method kto trains whole pairs (or examples) side by side"),
    ({"method": "kto", "metric_for_best_model": "eval_rewards/accuracies"},
     "metric_for_best_model: 'eval_rewards/accuracies' is not a metric method: kto logs; use one of eval_loss, "
     "eval_rewards/chosen"),
    ({"metric_for_best_model": "rewards/margins"}, "is not a metric method: sft logs; use one of eval_loss"),
])
def test_a_key_of_another_method_is_refused_in_one_line(extra, message):
    with pytest.raises(ConfigError) as error:
        parse_config({**BASE, **extra})
    text = str(error.value)
    assert message in text and "\n" not in text


def test_a_dumped_config_reads_back():
    for extra in ({}, {"method": "kto", "desirable_weight": 2.0}, {"method": "dpo", "max_seq_length": 256}):
        config = parse_config({**BASE, **extra})
        assert parse_config(config.model_dump()).fingerprint() == config.fingerprint()


def test_default_prompt_limit_fits_a_short_max_seq_length():
    from praisonai_accel.methods.method_keys import prompt_limit

    assert prompt_limit(parse_config({**BASE, "method": "dpo", "max_seq_length": 256})) == 128
    assert prompt_limit(parse_config({**BASE, "method": "dpo"})) == 512


def test_metric_for_best_model_may_name_an_eval_metric_of_the_method():
    from types import SimpleNamespace

    from praisonai_accel.worker.evaluation import record_evaluation

    for name in ("eval_rewards/accuracies", "rewards/accuracies"):
        config = parse_config({**BASE, "method": "dpo", "metric_for_best_model": name, "greater_is_better": True,
                               "early_stopping_patience": 2, "val_split_ratio": 0.1})
        state = SimpleNamespace(best_metric=None, best_checkpoint=None, evals_without_improvement=0, global_step=1)
        evaluations = [(0.69, {"rewards/accuracies": 0.5}), (0.70, {"rewards/accuracies": 0.75}),
                       (0.60, {"rewards/accuracies": 0.6}), (0.50, {"rewards/accuracies": 0.7})]
        stops = []
        for step, evaluation in enumerate(evaluations, 1):
            state.global_step = step
            stops.append(record_evaluation(config, state, evaluation, saves_now=True))
        # the best is the highest accuracy (step 2), not the lowest loss (step 4); two evaluations without a
        # better accuracy stop the run
        assert (state.best_metric, state.best_checkpoint, stops) == (0.75, "checkpoint-2", [False, False, False, True])
    assert parse_config({**BASE, "metric_for_best_model": "loss"}).metric_for_best_model == "loss"
