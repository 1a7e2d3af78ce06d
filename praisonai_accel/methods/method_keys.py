"""The config keys of the built-in training methods, each method's own pydantic model (TRL's names and defaults, a
description on every field). config.yaml is flat: the chosen method's model is composed into TrainConfig
(config_method.py), and a key another method declares is refused in one line. Importable without torch."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, Field, model_validator

LOSS_TYPES = {"dpo": ("sigmoid", "ipo", "hinge", "robust", "simpo"), "grpo": ("grpo", "dapo", "dr_grpo", "bnpo")}
# What each method logs beside its loss (TRL's names); evaluation logs them as eval_<name>. preference_loss uses these.
PAIR_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
                "logps/rejected")
KTO_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected", "kl")
# grpo: clip_ratio is TRL's clip_ratio/region_mean; methods/grpo_loss.py computes the clip ratios and kl
GRPO_METRICS = ("reward", "reward_std", "completions/mean_length", "clip_ratio", "clip_ratio/low_mean",
                "clip_ratio/high_mean", "kl", "tools/call_frequency", "tools/failure_frequency", "tools/mean_turns")
REWARD_METRICS = ("accuracy", "margin", "mean_reward", "rewards/chosen", "rewards/rejected")  # TRL's RewardTrainer


def written(config, key: str) -> bool:
    """A key counts as set when written with a value other than its default: a dumped and re-read config (every key
    at its default) is the same config."""
    return key in config.model_fields_set and getattr(config, key) != type(config).model_fields[key].default


class NoKeys(BaseModel):
    """A method that reads no keys of its own (SFT)."""


class _Unpacked(BaseModel):
    """Keys of a method that trains whole pairs or examples: packing is refused, prompts are cut first."""

    max_prompt_length: int = Field(default=512, gt=0, description=(
        "Prompts longer than this are cut from the left first, before the completion is cut (TRL's key). Default "
        "512, or half of a shorter max_seq_length."))

    @model_validator(mode="after")
    def _unpacked(self):
        if getattr(self, "packing", False):
            raise ValueError(f"packing: method {self.method} trains whole pairs (or examples) side by side, never "
                             "packed; remove packing")
        if written(self, "max_prompt_length") and self.max_prompt_length >= self.max_seq_length:
            raise ValueError(f"max_prompt_length: {self.max_prompt_length} leaves no room for the completion within "
                             f"max_seq_length {self.max_seq_length}; make it smaller")
        return self


class _Preference(_Unpacked):
    beta: float = Field(default=0.1, ge=0, description=(
        "Strength of the preference against the reference model (DPO, KTO) or of the odds-ratio term (ORPO); "
        "TRL's default 0.1."))

    @model_validator(mode="after")
    def _positive_beta(self):
        if self.beta <= 0:
            raise ValueError(f"beta: must be greater than 0 for method: {self.method}")
        return self


class _Reference(BaseModel):
    precompute_ref_log_probs: bool = Field(default=False, description=(
        "Compute the reference model's log-probs of the training set once, before the first step, instead of in "
        "every step (TRL's key)."))


class DPOKeys(_Reference, _Preference):
    loss_type: Literal["sigmoid", "ipo", "hinge", "robust", "simpo"] = Field(default="sigmoid", description=(
        "DPO's loss: sigmoid (DPO), ipo, hinge, robust, or simpo (SimPO: reference-free, length-normalised)."))
    label_smoothing: float = Field(default=0.0, ge=0.0, lt=0.5, description=(
        "The probability that a preference label is wrong (loss_type robust or simpo)."))
    simpo_gamma: float = Field(default=0.5, description="loss_type simpo: the target reward margin (TRL's CPO key).")

    @model_validator(mode="after")
    def _loss_type_keys(self):
        if written(self, "label_smoothing") and self.loss_type not in ("robust", "simpo"):
            raise ValueError(f"label_smoothing: only loss_type robust or simpo reads it, not loss_type: {self.loss_type}")
        if written(self, "simpo_gamma") and self.loss_type != "simpo":
            raise ValueError(f"simpo_gamma: only loss_type simpo reads it, not loss_type: {self.loss_type}")
        if written(self, "precompute_ref_log_probs") and self.loss_type == "simpo":
            raise ValueError("precompute_ref_log_probs: loss_type simpo is reference-free; there is nothing to precompute")
        return self


class ORPOKeys(_Preference):
    pass


class KTOKeys(_Reference, _Preference):
    desirable_weight: float = Field(default=1.0, gt=0, description="Weight of the desirable examples' loss (KTO).")
    undesirable_weight: float = Field(default=1.0, gt=0, description="Weight of the undesirable examples' loss (KTO).")


class RewardKeys(_Unpacked):
    center_rewards_coefficient: float | None = Field(default=None, ge=0, description=(
        "Adds this x (r_chosen + r_rejected)^2 to each pair's loss, so rewards centre on 0 (TRL's RewardTrainer key); "
        "default none."))
    prefix_sharing: bool = Field(default=True, description=(
        "Each pair's leading tokens (its prompt, at least) computed once for chosen and rejected, in one row with a "
        "4D mask, in batches where that costs less than padded rows; the same rewards. sdpa or eager attention, "
        "full-attention layers, no dropout; otherwise, or false, chosen and rejected are rows of their own, as in "
        "TRL."))


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


def split_entry(entry: str, where: str) -> tuple[str, str]:
    """("package.module", "name") of a tool or environment entry, "package.module:name"; ValueError (one line) for
    anything else."""
    module, colon, name = entry.strip().partition(":")
    if not colon or not module or not name.isidentifier() or not all(p.isidentifier() for p in module.split(".")):
        raise ValueError(f"{where}: {entry!r} is not \"package.module:name\"")
    return module, name


class GRPOKeys(_Unpacked):
    """GRPO (README "Reinforcement learning"): per_device_train_batch_size counts completions, as in TRL."""

    beta: float = Field(default=0.0, ge=0, description=(
        "The KL coefficient against the reference model; TRL's default 0.0 loads no reference."))
    loss_type: Literal["grpo", "dapo", "dr_grpo", "bnpo"] = Field(default="dapo", description=(
        "TRL's loss types, which differ in what the token losses are averaged over: grpo, dapo (TRL's default), "
        "dr_grpo, bnpo."))
    reward_funcs: list[str] | None = Field(default=None, description=(
        "The reward functions: \"package.module:function\" (looked for next to the config file first), or a "
        "built-in: exact_match, format."))
    reward_weights: list[float] | None = Field(default=None, description=(
        "One weight per reward function; default 1.0 each."))
    reward_format_pattern: str = Field(default=r"^<think>.*?</think>\s*<answer>.*?</answer>$", description=(
        "The regular expression the built-in format reward matches a completion against."))
    num_generations: int = Field(default=8, ge=2, description="Completions sampled per prompt: a group.")
    max_completion_length: int = Field(default=256, gt=0, description="Tokens a completion may have at most.")
    temperature: float = Field(default=1.0, gt=0, description="Sampling temperature of the rollouts.")
    top_p: float = Field(default=1.0, gt=0, le=1, description="Nucleus sampling of the rollouts.")
    epsilon: float = Field(default=0.2, ge=0, description="The clipping range's lower side.")
    epsilon_high: float | None = Field(default=None, ge=0, description=(
        "The clipping range's upper side (DAPO's clip-higher); default epsilon."))
    scale_rewards: Literal["group", "batch", "none"] = Field(default="group", description=(
        "What advantages are divided by: the reward std of the group, of the batch, or nothing."))
    num_iterations: int = Field(default=1, gt=0, description=(
        "Optimizer steps on each generated batch (TRL's mu); above 1 the ratio to the generating policy is clipped, "
        "and a checkpoint mid-way holds the batch (rollout_<rank>.safetensors)."))
    mask_truncated_completions: bool = Field(default=False, description=(
        "Completions cut at max_completion_length add nothing to the loss."))
    log_completions: bool = Field(default=True, description=(
        "Write a few prompts, completions and rewards to output_dir/logs/completions.jsonl (and the trackers)."))
    num_completions_to_print: int = Field(default=4, ge=0, description="How many, every logging_steps.")
    use_vllm: bool = Field(default=False, description=(
        "TRL's key; refused: rollouts are generated by the policy being trained, with a KV cache."))
    tools: list[str] | None = Field(default=None, description=(
        "Functions the model may call during a rollout: \"package.module:function\" (looked for next to the config "
        "file first), each with type hints and a Google-style docstring (its JSON schema for the chat template)."))
    environment_factory: str | dict[str, str] | None = Field(default=None, description=(
        "\"package.module:Class\": one environment per rollout, reset(**row) before it; its public methods are "
        "tools. A mapping name -> \"module:Class\" picks each row's by its `environment` column."))
    max_tool_calling_iterations: int | None = Field(default=None, ge=0, description=(
        "Tool-calling turns a rollout may take; default no limit (it ends at a turn without a tool call or at "
        "max_completion_length)."))
    tool_timeout: float = Field(default=30.0, gt=0, description=(
        "Seconds a tool call may take; past it the call is abandoned and the model reads an error."))
    max_tool_result_length: int = Field(default=4096, gt=0, description=(
        "Characters of a tool's result the model reads; the rest is cut, with a note saying so."))

    @model_validator(mode="before")
    @classmethod
    def _one_group_per_device(cls, data):
        """As TRL's 8 and 8: per_device_train_batch_size defaults to one group."""
        if isinstance(data, dict):
            group = data.get("num_generations", cls.model_fields["num_generations"].default)
            if isinstance(group, int) and not isinstance(group, bool):
                data = {"per_device_train_batch_size": group, **data}
        return data

    @model_validator(mode="after")
    def _check_grpo(self):
        if not self.reward_funcs:
            raise ValueError("reward_funcs: method grpo needs at least one reward function (\"package.module:function\", "
                             "or a built-in: exact_match, format)")
        for index, entry in enumerate(self.reward_funcs):
            parse_reward_entry(entry, index)
            if entry in self.reward_funcs[:index]:
                raise ValueError(f"reward_funcs[{index}]: {entry!r} is listed twice; list each reward function once "
                                 "(reward_weights weighs it)")
        for index, entry in enumerate(self.tools or []):
            split_entry(entry, f"tools[{index}]")
        factories = self.environment_factory
        for name, entry in (factories.items() if isinstance(factories, dict) else [(None, factories)]):
            if entry is not None:
                split_entry(entry, "environment_factory" + (f".{name}" if name else ""))
        if "format" in self.reward_funcs:
            try:
                re.compile(self.reward_format_pattern)
            except re.error as exc:
                raise ValueError(f"reward_format_pattern: {self.reward_format_pattern!r} is not a valid regular "
                                 f"expression: {exc}") from None
        elif written(self, "reward_format_pattern"):
            raise ValueError("reward_format_pattern: only the built-in format reward reads it; add format to "
                             "reward_funcs or remove it")
        if prompt_limit(self) + self.max_completion_length > self.max_seq_length:
            raise ValueError(f"max_completion_length: {self.max_completion_length} after a prompt of up to "
                             f"max_prompt_length {prompt_limit(self)} does not fit in max_seq_length "
                             f"{self.max_seq_length}; raise max_seq_length or lower one of them")
        if self.reward_weights is not None and len(self.reward_weights) != len(self.reward_funcs):
            raise ValueError(f"reward_weights: {len(self.reward_weights)} weight(s) for {len(self.reward_funcs)} "
                             "reward function(s); give one per function")
        if self.per_device_train_batch_size % self.num_generations:
            raise ValueError(f"per_device_train_batch_size: counts completions for method grpo, and "
                             f"{self.per_device_train_batch_size} does not hold whole groups of num_generations "
                             f"{self.num_generations}; use a multiple of {self.num_generations}")
        eval_batch = getattr(self, "per_device_eval_batch_size", None)
        if eval_batch is not None and eval_batch % self.num_generations:
            raise ValueError(f"per_device_eval_batch_size: counts completions for method grpo, and {eval_batch} does "
                             f"not hold whole groups of num_generations {self.num_generations}; use a multiple of "
                             f"{self.num_generations}")
        return self
