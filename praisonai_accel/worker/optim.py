"""The optimizer (decay on matrices only) and the learning-rate schedule over the run's optimizer steps."""

from __future__ import annotations

import math

from ..config import ConfigError, TrainConfig


def plan_steps(config: TrainConfig, batches_per_epoch: int, steps_per_batch: int = 1) -> tuple[int, int]:
    """(optimizer steps per epoch, total optimizer steps); `steps_per_batch`: steps each group of micro-batches is
    trained for (GRPO's num_iterations)."""
    per_epoch = max(1, math.ceil(batches_per_epoch / config.gradient_accumulation_steps)) * steps_per_batch
    total = config.max_steps if config.max_steps > 0 else per_epoch * config.num_train_epochs
    return per_epoch, total


def warmup_steps(config: TrainConfig, total_steps: int) -> int:
    return config.warmup_steps or math.ceil(config.warmup_ratio * total_steps)


def build_optimizer(config: TrainConfig, model):
    import torch

    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if param.requires_grad:
            (no_decay if param.ndim < 2 or "norm" in name.lower() else decay).append(param)
    groups = [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    betas, eps, lr = (config.adam_beta1, config.adam_beta2), config.adam_epsilon, config.learning_rate
    if config.optim == "sgd":
        return torch.optim.SGD(groups, lr=lr)
    if config.optim in ("adamw_8bit", "paged_adamw_8bit"):
        try:
            import bitsandbytes as bnb
        except Exception as exc:
            raise ConfigError(f"optim: {config.optim} needs bitsandbytes ({type(exc).__name__}); "
                              "pip install 'praisonai-accel[qlora]', or use optim: adamw_torch") from None
        cls = bnb.optim.PagedAdamW8bit if config.optim.startswith("paged") else bnb.optim.AdamW8bit
        return cls(groups, lr=lr, betas=betas, eps=eps)
    fused = config.optim == "adamw_torch_fused" and torch.cuda.is_available()
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, **({"fused": True} if fused else {}))


def build_scheduler(config: TrainConfig, optimizer, total_steps: int):
    """Not prepared by accelerate: a prepared scheduler steps once per process per optimizer step. It goes into
    checkpoints as JSON (checkpoint.save_scheduler), never registered with accelerate, which would pickle it."""
    from transformers import get_scheduler

    return get_scheduler(config.lr_scheduler_type, optimizer, num_warmup_steps=warmup_steps(config, total_steps),
                         num_training_steps=total_steps)
