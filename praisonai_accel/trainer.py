"""The training loop, top to bottom: set up, prepare with Accelerate, step, log, save.

Accelerate owns DDP wrapping, mixed precision, device placement and rank-0 gating. The loop
owns gradient accumulation (with `no_sync`) because the loss is normalised by the number of
target tokens in the whole optimizer step, over every micro-batch and every rank: only then do
2 processes x batch B give the same update as 1 process x batch 2B.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import shutil
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from .config import TrainConfig
from .data import IGNORE_INDEX, PadCollator, ensure_chat_template, load_or_build
from .distributed import DistEnv, resolve_mixed_precision
from .metrics import MetricsLogger
from .model import choose_backend, load_model_and_tokenizer, trainable_parameter_count

log = logging.getLogger("praisonai_accel")


@dataclass
class TrainState:
    """Where the run is; saved in every checkpoint."""

    global_step: int = 0
    epoch: int = 0
    batches_in_epoch: int = 0  # micro-batches this rank has consumed in the current epoch
    samples_seen: int = 0  # over all ranks
    history: list = field(default_factory=list)


def _quiet_libraries(is_main: bool) -> None:
    import datasets
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    if not is_main:
        datasets.disable_progress_bars()
    logging.basicConfig(level=logging.INFO if is_main else logging.WARNING, format="%(message)s")
    log.setLevel(logging.INFO if is_main else logging.WARNING)


def build_accelerator(config: TrainConfig, env: DistEnv, use_cuda: bool):
    import torch
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, DistributedDataParallelKwargs, ProjectConfiguration

    precision = resolve_mixed_precision(
        config.mixed_precision, use_cuda, use_cuda and torch.cuda.is_bf16_supported()
    )
    find_unused = config.ddp_find_unused_parameters
    if find_unused is None:
        find_unused = env.is_distributed
    return Accelerator(
        mixed_precision=precision,
        cpu=not use_cuda,
        gradient_accumulation_steps=1,  # accumulation is done by the loop, see module docstring
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=config.seed),
        kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=find_unused)],
        project_config=ProjectConfiguration(project_dir=config.output_dir, automatic_checkpoint_naming=False),
    )


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
            from .config import ConfigError

            raise ConfigError(f"optim: {config.optim} needs bitsandbytes ({type(exc).__name__}); use optim: adamw_torch") from None
        cls = bnb.optim.PagedAdamW8bit if config.optim.startswith("paged") else bnb.optim.AdamW8bit
        return cls(groups, lr=lr, betas=betas, eps=eps)
    fused = config.optim == "adamw_torch_fused" and torch.cuda.is_available()
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, **({"fused": True} if fused else {}))


def plan_steps(config: TrainConfig, batches_per_epoch: int) -> tuple[int, int]:
    """(optimizer steps per epoch, total optimizer steps)."""
    per_epoch = max(1, math.ceil(batches_per_epoch / config.gradient_accumulation_steps))
    total = config.max_steps if config.max_steps > 0 else per_epoch * config.num_train_epochs
    return per_epoch, total


def warmup_steps(config: TrainConfig, total_steps: int) -> int:
    return config.warmup_steps or math.ceil(config.warmup_ratio * total_steps)


def token_loss_sum(logits, labels):
    """Summed next-token cross-entropy over target tokens (labels != -100)."""
    import torch.nn.functional as F

    shifted_logits = logits[:, :-1, :].float()
    shifted_labels = labels[:, 1:]
    return F.cross_entropy(
        shifted_logits.reshape(-1, shifted_logits.size(-1)),
        shifted_labels.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )


def count_target_tokens(batch) -> int:
    return int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())


def micro_batch_groups(batches: Iterator, size: int) -> Iterator[list]:
    group = []
    for batch in batches:
        group.append(batch)
        if len(group) == size:
            yield group
            group = []
    if group:
        yield group


def parameter_digest(model) -> str:
    """Hash of this rank's trainable weights: equal on every rank iff DDP kept them in sync."""
    digest = hashlib.sha256()
    for name, param in sorted(model.named_parameters(), key=lambda item: item[0]):
        if param.requires_grad:
            digest.update(name.encode())
            digest.update(param.detach().float().cpu().numpy().tobytes())
    return digest.hexdigest()


def save_final_model(accelerator, model, tokenizer, target: Path) -> None:
    """Rank 0 writes the adapter (or full model) and tokenizer; the directory appears complete or not at all."""
    state_dict = accelerator.get_state_dict(model)  # collective under FSDP/DeepSpeed, so every rank calls it
    if accelerator.is_main_process:
        target = Path(target)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        accelerator.unwrap_model(model).save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        old = target.with_name(f".{target.name}.old-{os.getpid()}")
        if target.exists():
            os.replace(target, old)
        os.replace(tmp, target)
        shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()


def train(config: TrainConfig) -> dict:
    import torch

    env = DistEnv.from_environ()
    use_cuda = torch.cuda.is_available()
    backend = choose_backend(config, env, use_cuda)  # imports unsloth, if at all, before transformers

    from accelerate.utils import gather_object, set_seed
    from torch.utils.data import DataLoader
    from transformers import get_scheduler

    accelerator = build_accelerator(config, env, use_cuda)
    _quiet_libraries(accelerator.is_main_process)
    set_seed(config.seed)
    log.info("backend: %s%s | processes: %d | device: %s | mixed precision: %s", backend.name,
             f" ({backend.reason})" if backend.reason else "", accelerator.num_processes, accelerator.device,
             accelerator.mixed_precision)

    bf16_ok = use_cuda and torch.cuda.is_bf16_supported()
    model, tokenizer = load_model_and_tokenizer(config, env, backend, use_cuda, bf16_ok)
    ensure_chat_template(tokenizer, config.chat_template)
    trainable, total = trainable_parameter_count(model)
    log.info("model: %s | trainable parameters: %s of %s (%.2f%%)", config.model_name, f"{trainable:,}",
             f"{total:,}", 100 * trainable / max(total, 1))

    started = time.perf_counter()
    with accelerator.local_main_process_first():
        dataset, from_cache = load_or_build(config.dataset, tokenizer, config, config.output_path() / ".cache" / "preprocessed")
    log.info("data: %d examples (%s in %.2fs)", len(dataset), "cached" if from_cache else "tokenized",
             time.perf_counter() - started)
    dataset = dataset.select_columns(["input_ids", "labels"])

    loader = DataLoader(
        dataset,
        batch_size=config.per_device_train_batch_size,
        shuffle=True,
        collate_fn=PadCollator(tokenizer.pad_token_id),
        generator=torch.Generator().manual_seed(config.seed),
    )
    optimizer = build_optimizer(config, model)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    steps_per_epoch, total_steps = plan_steps(config, len(loader))
    # Not prepared: a prepared scheduler steps once per process per optimizer step.
    scheduler = get_scheduler(config.lr_scheduler_type, optimizer,
                              num_warmup_steps=warmup_steps(config, total_steps), num_training_steps=total_steps)
    accelerator.register_for_checkpointing(scheduler)
    epochs = math.ceil(total_steps / steps_per_epoch)
    world, accum = accelerator.num_processes, config.gradient_accumulation_steps
    log.info("steps: %d (%d per epoch, %d epoch(s)) | effective batch: %d x %d x %d = %d", total_steps, steps_per_epoch,
             epochs, config.per_device_train_batch_size, accum, world, config.per_device_train_batch_size * accum * world)

    state = TrainState()
    metrics = MetricsLogger(config.output_path() / "metrics.jsonl", total_steps, enabled=accelerator.is_main_process)
    model.train()
    window_loss, window_targets, window_tokens, window_start = 0.0, 0, 0, time.perf_counter()
    with metrics:
        for epoch in range(state.epoch, epochs):
            state.epoch = epoch
            loader.set_epoch(epoch)
            for group in micro_batch_groups(iter(loader), accum):
                local = torch.tensor([sum(count_target_tokens(b) for b in group)], device=accelerator.device)
                step_targets = int(accelerator.reduce(local, reduction="sum").item())
                scale = world / max(step_targets, 1)  # DDP averages over ranks; micro-batch gradients add up
                loss_sum = torch.zeros((), device=accelerator.device)
                tokens = 0
                for index, batch in enumerate(group):
                    last = index == len(group) - 1
                    with accelerator.no_sync(model) if not last else nullcontext():
                        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
                        summed = token_loss_sum(logits, batch["labels"])
                        accelerator.backward(summed * scale)
                    loss_sum += summed.detach()
                    tokens += int(batch["attention_mask"].sum())
                grad_norm = None
                if config.max_grad_norm > 0:
                    grad_norm = accelerator.clip_grad_norm_(model.parameters(), config.max_grad_norm)
                optimizer.step()
                if not accelerator.optimizer_step_was_skipped:
                    scheduler.step()
                optimizer.zero_grad(set_to_none=True)

                totals = accelerator.reduce(torch.tensor([float(loss_sum), float(tokens)], device=accelerator.device), "sum")
                state.global_step += 1
                state.batches_in_epoch += len(group)
                state.samples_seen += sum(len(b["input_ids"]) for b in group) * world
                window_loss += float(totals[0])
                window_targets += step_targets
                window_tokens += int(totals[1])
                if state.global_step % config.logging_steps == 0 or state.global_step == total_steps:
                    elapsed = time.perf_counter() - window_start
                    record = {
                        "step": state.global_step,
                        "epoch": round(epoch + state.batches_in_epoch / max(len(loader), 1), 4),
                        "loss": window_loss / max(window_targets, 1),
                        "learning_rate": scheduler.get_last_lr()[0],
                        "grad_norm": float(grad_norm) if grad_norm is not None else None,
                        "tokens_per_second": window_tokens / elapsed if elapsed > 0 else None,
                    }
                    metrics.log(record)
                    state.history.append(record)
                    window_loss, window_targets, window_tokens, window_start = 0.0, 0, 0, time.perf_counter()
                if state.global_step >= total_steps:
                    break
            state.batches_in_epoch = 0
            if state.global_step >= total_steps:
                break

    final_dir = config.final_model_path()
    save_final_model(accelerator, model, tokenizer, final_dir)
    digests = gather_object([parameter_digest(accelerator.unwrap_model(model))])
    summary = {
        "global_step": state.global_step,
        "num_processes": world,
        "final_model_dir": str(final_dir),
        "final_loss": state.history[-1]["loss"] if state.history else None,
        "first_loss": state.history[0]["loss"] if state.history else None,
        "rank_weight_digests": digests,
        "weights_in_sync": len(set(digests)) == 1,
        "backend": backend.name,
        "train_seconds": time.perf_counter() - started,
    }
    if accelerator.is_main_process:
        metrics.write_summary(config.output_path() / "train_summary.json", summary)
        log.info("saved %s to %s", "adapter" if config.uses_lora else "model", final_dir)
        if not summary["weights_in_sync"]:
            log.warning("ranks finished with different weights: %s", digests)
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return summary
