"""config.yaml: the keys of the training method (`method:` and what each method reads), composed into TrainConfig.

methods/method_keys.py says which method reads which key; a key written for another method is refused.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, PrivateAttr, model_validator


class MethodKeys(BaseModel):
    # training method (praisonai_accel/methods/): sft, preference training, or online RL; TRL's names and defaults
    method: Literal["sft", "dpo", "orpo", "kto", "grpo"] = "sft"
    beta: float = Field(default=0.1, ge=0)  # dpo, orpo, kto (> 0); grpo: the KL coefficient (TRL's default 0.0)
    # dpo: sigmoid, ipo, hinge, robust, simpo (reference-free); grpo: grpo, dapo (TRL's default), dr_grpo, bnpo
    loss_type: Literal["sigmoid", "ipo", "hinge", "robust", "simpo", "grpo", "dapo", "dr_grpo", "bnpo"] = "sigmoid"
    label_smoothing: float = Field(default=0.0, ge=0.0, lt=0.5)  # dpo loss_type robust or simpo
    simpo_gamma: float = 0.5  # dpo loss_type simpo: the target reward margin
    max_prompt_length: int = Field(default=512, gt=0)  # dpo, orpo, kto, grpo: prompts cut from the left to this first
    precompute_ref_log_probs: bool = False  # dpo, kto: reference log-probs computed once, before the first step
    desirable_weight: float = Field(default=1.0, gt=0)  # kto
    undesirable_weight: float = Field(default=1.0, gt=0)  # kto
    # grpo (README "Reinforcement learning"): per_device_train_batch_size counts completions, as in TRL
    reward_funcs: list[str] | None = None  # "package.module:function", or a built-in: exact_match, format
    reward_weights: list[float] | None = None  # one per reward function; default 1.0 each
    reward_format_pattern: str = r"^<think>.*?</think>\s*<answer>.*?</answer>$"  # the built-in format reward's regex
    num_generations: int = Field(default=8, ge=2)  # completions per prompt: a group
    max_completion_length: int = Field(default=256, gt=0)
    temperature: float = Field(default=1.0, gt=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    epsilon: float = Field(default=0.2, ge=0)  # the clipping range's lower side
    epsilon_high: float | None = Field(default=None, ge=0)  # its upper side (DAPO's clip-higher); default epsilon
    scale_rewards: Literal["group", "batch", "none"] = "group"  # what advantages are divided by: the std of ...
    # optimizer steps on each generated batch (TRL's mu); > 1: the ratio to the generating policy's log-probs is
    # clipped, and a checkpoint mid-way holds the batch (rollout_<rank>.safetensors)
    num_iterations: int = Field(default=1, gt=0)
    mask_truncated_completions: bool = False  # completions cut at max_completion_length add nothing to the loss
    log_completions: bool = True  # a few prompts, completions and rewards in output_dir/logs/completions.jsonl
    num_completions_to_print: int = Field(default=4, ge=0)  # how many, every logging_steps
    use_vllm: bool = False  # rollouts by vLLM colocated on the GPU (the vllm extra), weights synced every step
    vllm_gpu_memory_utilization: float = Field(default=0.3, gt=0, lt=1)
    # The directory of the config file (config.load_config sets it): reward_funcs' modules are looked for there first
    _config_dir: str | None = PrivateAttr(default=None)

    @model_validator(mode="before")
    @classmethod
    def _method_defaults(cls, data):
        """TRL's GRPO defaults where they differ from DPO's for a key both read."""
        if isinstance(data, dict) and data.get("method") == "grpo":
            data = {"beta": 0.0, "loss_type": "dapo", **data}
            group = data.get("num_generations", cls.model_fields["num_generations"].default)
            if isinstance(group, int) and not isinstance(group, bool):  # one group per device, as TRL's 8 and 8
                data.setdefault("per_device_train_batch_size", group)
        return data

    @model_validator(mode="after")
    def _check_method_keys(self):
        from .methods.method_keys import check_method_keys

        check_method_keys(self)
        return self

