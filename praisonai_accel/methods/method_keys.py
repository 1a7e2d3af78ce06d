"""Which config keys belong to which training method: a key set for another method is refused with one line."""

from __future__ import annotations

import re

GRPO_KEYS = {"reward_funcs", "reward_weights", "reward_format_pattern", "num_generations", "max_completion_length",
             "temperature", "top_p", "epsilon", "epsilon_high", "scale_rewards", "num_iterations",
             "mask_truncated_completions", "log_completions", "num_completions_to_print", "use_vllm"}
METHOD_KEYS = ("beta", "loss_type", "label_smoothing", "simpo_gamma", "max_prompt_length", "precompute_ref_log_probs",
               "desirable_weight", "undesirable_weight", "center_rewards_coefficient", *sorted(GRPO_KEYS))
LOSS_TYPES = {"dpo": ("sigmoid", "ipo", "hinge", "robust", "simpo"), "grpo": ("grpo", "dapo", "dr_grpo", "bnpo")}
KEYS_BY_METHOD = {
    "sft": set(),
    "dpo": {"beta", "loss_type", "label_smoothing", "simpo_gamma", "max_prompt_length", "precompute_ref_log_probs"},
    "orpo": {"beta", "max_prompt_length"},
    "kto": {"beta", "max_prompt_length", "precompute_ref_log_probs", "desirable_weight", "undesirable_weight"},
    "grpo": {"beta", "loss_type", "max_prompt_length"} | GRPO_KEYS,
    "reward": {"max_prompt_length", "center_rewards_coefficient"},  # methods/reward.py
}
# What each method logs beside its loss (TRL's names); evaluation logs them as eval_<name>. preference_loss uses these.
PAIR_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
                "logps/rejected")
KTO_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected", "kl")
# grpo: clip_ratio is TRL's clip_ratio/region_mean; methods/grpo_loss.py computes the clip ratios and kl
GRPO_METRICS = ("reward", "reward_std", "completions/mean_length", "clip_ratio", "clip_ratio/low_mean",
                "clip_ratio/high_mean", "kl")
REWARD_METRICS = ("accuracy", "margin", "mean_reward", "rewards/chosen", "rewards/rejected")  # methods/reward.py
METRICS_BY_METHOD = {"sft": (), "dpo": PAIR_METRICS, "orpo": PAIR_METRICS, "kto": KTO_METRICS, "grpo": GRPO_METRICS,
                     "reward": REWARD_METRICS}


def best_model_metric(config) -> str:
    """metric_for_best_model as evaluation logs it ("loss" and names without eval_ mean their eval_ form, as in
    transformers); ValueError (one line) for a metric the method never logs."""
    name = config.metric_for_best_model
    name = name if name.startswith("eval_") else f"eval_{name}"
    known = ("eval_loss",) + tuple(f"eval_{m}" for m in METRICS_BY_METHOD[config.method])
    # an eval_tasks score, eval_<task>/<metric>: its metric is checked before launch, once the task is built
    tasks = tuple(f"eval_{task}/" for task in getattr(config, "eval_tasks", None) or ())
    if name not in known and not (tasks and name.startswith(tasks)):
        raise ValueError(f"metric_for_best_model: {config.metric_for_best_model!r} is not a metric method: "
                         f"{config.method} logs; use one of {', '.join(known + tuple(t + '<metric>' for t in tasks))}")
    return name


def check_method_keys(config) -> None:
    """ValueError (one line) for a key written in the config that the chosen method (or DPO loss_type) does not read."""
    # A key counts as set when written with a value other than its default: a dumped and re-read config (every key
    # at its default) is the same config.
    fields = type(config).model_fields
    written = {k for k in config.model_fields_set if getattr(config, k) != fields[k].default}
    method = config.method
    for key in METHOD_KEYS:
        if key not in written:
            continue
        if key not in KEYS_BY_METHOD[method]:
            users = [m for m, keys in KEYS_BY_METHOD.items() if key in keys]
            raise ValueError(f"{key}: belongs to method {' / '.join(users)}, not to method: {method}; remove it or "
                             f"set method: {users[0]}")
        if key == "label_smoothing" and config.loss_type not in ("robust", "simpo"):
            raise ValueError(f"label_smoothing: only loss_type robust or simpo reads it, not loss_type: {config.loss_type}")
        if key == "simpo_gamma" and config.loss_type != "simpo":
            raise ValueError(f"simpo_gamma: only loss_type simpo reads it, not loss_type: {config.loss_type}")
        if key == "precompute_ref_log_probs" and config.loss_type == "simpo":
            raise ValueError("precompute_ref_log_probs: loss_type simpo is reference-free; there is nothing to precompute")
    if method in LOSS_TYPES and config.loss_type not in LOSS_TYPES[method]:
        raise ValueError(f"loss_type: {config.loss_type} is not a loss of method: {method}; use one of "
                         f"{', '.join(LOSS_TYPES[method])}")
    if method in ("dpo", "orpo", "kto") and config.beta <= 0:
        raise ValueError(f"beta: must be greater than 0 for method: {method}")
    if method == "grpo":
        _check_grpo(config)
    best_model_metric(config)
    if method != "sft" and config.packing:
        raise ValueError(f"packing: method {method} trains whole pairs (or examples) side by side, never packed; "
                         "remove packing")
    if method != "sft" and "max_prompt_length" in written and config.max_prompt_length >= config.max_seq_length:
        raise ValueError(f"max_prompt_length: {config.max_prompt_length} leaves no room for the completion within "
                         f"max_seq_length {config.max_seq_length}; make it smaller")


def prompt_limit(config) -> int:
    """max_prompt_length as encoding uses it: half of a max_seq_length that the default (512) would leave no room in."""
    if config.max_prompt_length < config.max_seq_length:
        return config.max_prompt_length
    return max(1, config.max_seq_length // 2)


BUILTIN_REWARDS = ("exact_match", "format")  # methods/rewards.py
REWARD_MODEL_PREFIX = "model:"  # reward_funcs: "model:PATH", a reward model trained with method: reward
_DOTTED = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")


def parse_reward_entry(entry: str, index: int) -> tuple[str | None, str]:
    """(module, function) of reward_funcs[index]: "package.module:function", or TRL's "package.module.function";
    (None, name) for a built-in; (REWARD_MODEL_PREFIX, path) for a reward model. ValueError (one line) for anything
    else."""
    entry = entry.strip()
    if entry in BUILTIN_REWARDS:
        return None, entry
    if entry.startswith(REWARD_MODEL_PREFIX):
        path = entry[len(REWARD_MODEL_PREFIX):].strip()
        if not path:
            raise ValueError(f"reward_funcs[{index}]: 'model:' names no reward model; write model:PATH")
        return REWARD_MODEL_PREFIX, path
    module, colon, function = entry.partition(":")
    if not colon:
        module, _, function = entry.rpartition(".")
    if not module or not _DOTTED.match(module) or not re.fullmatch(r"[A-Za-z_]\w*", function):
        raise ValueError(f"reward_funcs[{index}]: {entry!r} is neither a built-in ({', '.join(BUILTIN_REWARDS)}), "
                         "\"package.module:function\" nor a reward model \"model:PATH\"")
    return module, function


def _check_grpo(config) -> None:
    if not config.reward_funcs:
        raise ValueError("reward_funcs: method grpo needs at least one reward function (\"package.module:function\", "
                         "or a built-in: exact_match, format)")
    for index, entry in enumerate(config.reward_funcs):
        parse_reward_entry(entry, index)
        if entry in config.reward_funcs[:index]:
            raise ValueError(f"reward_funcs[{index}]: {entry!r} is listed twice; list each reward function once "
                             "(reward_weights weighs it)")
    fields = type(config).model_fields
    if "format" in config.reward_funcs:
        try:
            re.compile(config.reward_format_pattern)
        except re.error as exc:
            raise ValueError(f"reward_format_pattern: {config.reward_format_pattern!r} is not a valid regular "
                             f"expression: {exc}") from None
    elif config.reward_format_pattern != fields["reward_format_pattern"].default:
        raise ValueError("reward_format_pattern: only the built-in format reward reads it; add format to reward_funcs "
                         "or remove it")
    if prompt_limit(config) + config.max_completion_length > config.max_seq_length:
        raise ValueError(f"max_completion_length: {config.max_completion_length} after a prompt of up to "
                         f"max_prompt_length {prompt_limit(config)} does not fit in max_seq_length "
                         f"{config.max_seq_length}; raise max_seq_length or lower one of them")
    if config.reward_weights is not None and len(config.reward_weights) != len(config.reward_funcs):
        raise ValueError(f"reward_weights: {len(config.reward_weights)} weight(s) for {len(config.reward_funcs)} "
                         "reward function(s); give one per function")
    if config.per_device_train_batch_size % config.num_generations:
        raise ValueError(f"per_device_train_batch_size: counts completions for method grpo, and "
                         f"{config.per_device_train_batch_size} does not hold whole groups of num_generations "
                         f"{config.num_generations}; use a multiple of {config.num_generations}")
    eval_batch = getattr(config, "per_device_eval_batch_size", None)
    if eval_batch is not None and eval_batch % config.num_generations:
        raise ValueError(f"per_device_eval_batch_size: counts completions for method grpo, and {eval_batch} does not "
                         f"hold whole groups of num_generations {config.num_generations}; use a multiple of "
                         f"{config.num_generations}")
