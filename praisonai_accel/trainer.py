"""The training recipe, top to bottom: set up, (resume), step, evaluate, checkpoint, save.

Accelerate owns DDP wrapping, mixed precision, device placement, rank-0 gating and checkpoint
state. The loop owns gradient accumulation (with `no_sync`) because the loss is normalised by
the number of target tokens in the whole optimizer step, over every micro-batch and every rank:
only then do 2 processes x batch B give the same update as 1 process x batch 2B.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import math
import os
import shutil
import signal
import time
import warnings
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from . import checkpoint as ckpt
from .config import ConfigError, TrainConfig
from .data import IGNORE_INDEX, LengthGroupedSampler, PadCollator, ensure_chat_template, load_or_build
from .distributed import DistEnv, resolve_mixed_precision
from .hub import model_card
from .metrics import MetricsLogger, write_json_atomic
from .model import choose_backend, load_model_and_tokenizer, trainable_parameter_count

log = logging.getLogger("praisonai_accel")

# Test-only fault injection: rank 0 dies inside the save of this step, after the state is written
# but before the checkpoint is marked complete.
CRASH_IN_SAVE_ENV = "PRAISONAI_ACCEL_TEST_CRASH_IN_SAVE"


@dataclass
class StepResult:
    loss_sum: float  # summed token losses
    targets: int  # tokens the loss was computed on
    tokens: int  # real input tokens
    positions: int  # tokens processed, padding included
    grad_norm: float | None
    stop: bool  # some rank received SIGTERM


class Window:
    """Steps since the last log line, summed over ranks."""

    def __init__(self):
        self.steps = self.targets = self.tokens = self.positions = 0
        self.loss_sum = 0.0
        self.started = time.perf_counter()

    def add(self, step: StepResult) -> None:
        self.steps += 1
        self.loss_sum += step.loss_sum
        self.targets += step.targets
        self.tokens += step.tokens
        self.positions += step.positions

    def record(self, state, learning_rate: float, grad_norm: float | None, batches_per_epoch: int) -> dict:
        elapsed = time.perf_counter() - self.started
        return {
            "step": state.global_step,
            "epoch": round(state.epoch + state.batches_in_epoch / max(batches_per_epoch, 1), 4),
            "loss": self.loss_sum / max(self.targets, 1),
            "learning_rate": learning_rate,
            "grad_norm": grad_norm,
            "tokens_per_second": self.tokens / elapsed if elapsed > 0 else None,
            "step_seconds": elapsed / max(self.steps, 1),
            "padding_fraction": 1 - self.tokens / max(self.positions, 1),
            "tokens": self.tokens,
            "positions": self.positions,
            "time": time.time(),
        }


class Preempted(Exception):
    """SIGTERM arrived; a checkpoint was saved at `checkpoint`."""

    def __init__(self, checkpoint: Path):
        super().__init__(f"stopped by SIGTERM; checkpoint saved at {checkpoint}")
        self.checkpoint = checkpoint


# ---------------------------------------------------------------- small pure helpers

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
        shifted_logits.reshape(-1, shifted_logits.size(-1)), shifted_labels.reshape(-1),
        ignore_index=IGNORE_INDEX, reduction="sum",
    )


def count_target_tokens(batch) -> int:
    return int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())


def micro_batch_groups(batches: Iterator, size: int) -> Iterator[list]:
    while group := list(itertools.islice(batches, size)):
        yield group


def parameter_digest(model) -> str:
    """Hash of this rank's trainable weights: equal on every rank iff DDP kept them in sync."""
    digest = hashlib.sha256()
    for name, param in sorted(model.named_parameters(), key=lambda item: item[0]):
        if param.requires_grad:
            digest.update(name.encode())
            digest.update(param.detach().float().cpu().numpy().tobytes())
    return digest.hexdigest()


def improved(metric: float, best: float | None, greater_is_better: bool, threshold: float) -> bool:
    if best is None:
        return True
    return metric > best + threshold if greater_is_better else metric < best - threshold


def save_final_model(accelerator, model, tokenizer, target: Path, card: str | None = None) -> None:
    """Rank 0 writes the adapter (or full model), tokenizer and model card; the directory appears complete or not at all."""
    state_dict = accelerator.get_state_dict(model)  # collective under FSDP/DeepSpeed, so every rank calls it
    if accelerator.is_main_process:
        target = Path(target)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        accelerator.unwrap_model(model).save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if card is not None:
            (tmp / "README.md").write_text(card)
        old = target.with_name(f".{target.name}.old-{os.getpid()}")
        if target.exists():
            os.replace(target, old)
        os.replace(tmp, target)
        shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()


def _quiet_libraries(is_main: bool) -> None:
    import datasets
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    if not is_main:
        datasets.disable_progress_bars()
    logging.basicConfig(level=logging.INFO if is_main else logging.WARNING, format="%(message)s")
    log.setLevel(logging.INFO if is_main else logging.WARNING)
    logging.getLogger("accelerate").setLevel(logging.WARNING)  # per-file save/load chatter
    warnings.filterwarnings("ignore", category=FutureWarning, module="transformers")


def _peak_gpu_memory_mib() -> float | None:
    import torch

    return torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None


def _crash_hook():
    step = os.environ.get(CRASH_IN_SAVE_ENV)
    if not step:
        return None

    def hook(global_step: int) -> None:
        if global_step == int(step) and int(os.environ.get("RANK", 0)) == 0:
            os._exit(17)

    return hook


# ---------------------------------------------------------------- the recipe

class Recipe:
    def __init__(self, config: TrainConfig, publisher=None):
        self.config = config
        self.publisher = publisher  # rank 0's HubPublisher, or None
        self.env = DistEnv.from_environ()
        self.output_dir = config.output_path()
        self.stop_requested = False
        self._rng_to_reapply: Path | None = None  # set when resuming mid-epoch, see _epoch_batches

    # ------------------------------------------------------------ setup

    def setup(self) -> None:
        import torch
        from accelerate.utils import set_seed

        config = self.config
        use_cuda = torch.cuda.is_available()
        bf16 = use_cuda and torch.cuda.is_bf16_supported()
        self.backend = choose_backend(config, self.env, use_cuda)  # imports unsloth, if at all, before transformers
        self.accelerator = accelerator = self._build_accelerator(use_cuda, bf16)
        _quiet_libraries(accelerator.is_main_process)
        self.resume_from = self._find_resume_point()
        set_seed(config.seed)
        log.info("backend: %s%s | processes: %d | device: %s | mixed precision: %s", self.backend.name,
                 f" ({self.backend.reason})" if self.backend.reason else "", accelerator.num_processes,
                 accelerator.device, accelerator.mixed_precision)

        model, self.tokenizer = load_model_and_tokenizer(config, self.env, self.backend, use_cuda, bf16)
        ensure_chat_template(self.tokenizer, config.chat_template)
        trainable, total = trainable_parameter_count(model)
        log.info("model: %s | trainable parameters: %s of %s (%.2f%%)", config.model_name, f"{trainable:,}",
                 f"{total:,}", 100 * trainable / max(total, 1))

        train_data, lengths, self.eval_data = self._load_data()
        loader = self._train_loader(train_data, lengths)
        optimizer = self._build_optimizer(model)
        self.model, self.optimizer, self.loader = accelerator.prepare(model, optimizer, loader)
        self.steps_per_epoch, self.total_steps = plan_steps(config, len(self.loader))
        from transformers import get_scheduler

        # Not prepared: a prepared scheduler steps once per process per optimizer step.
        self.scheduler = get_scheduler(config.lr_scheduler_type, self.optimizer,
                                       num_warmup_steps=warmup_steps(config, self.total_steps),
                                       num_training_steps=self.total_steps)
        accelerator.register_for_checkpointing(self.scheduler)
        ckpt.install_trainable_only_hooks(accelerator)
        self.state = self._fresh_state()
        if self.resume_from is not None:
            self._load_checkpoint(self.resume_from)
        signal.signal(signal.SIGTERM, self._on_sigterm)
        world, accum, per_device = accelerator.num_processes, config.gradient_accumulation_steps, config.per_device_train_batch_size
        log.info("steps: %d (%d per epoch) | effective batch: %d x %d x %d = %d", self.total_steps, self.steps_per_epoch,
                 per_device, accum, world, per_device * accum * world)

    def _build_accelerator(self, use_cuda: bool, bf16: bool):
        from accelerate import Accelerator
        from accelerate.utils import DataLoaderConfiguration, DistributedDataParallelKwargs, ProjectConfiguration

        config = self.config
        precision = resolve_mixed_precision(config.mixed_precision, use_cuda, bf16)
        find_unused = config.ddp_find_unused_parameters
        if find_unused is None:
            find_unused = self.env.is_distributed
        return Accelerator(
            mixed_precision=precision,
            cpu=not use_cuda,
            gradient_accumulation_steps=1,  # accumulation is done by the loop, see module docstring
            dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=config.seed),
            kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=find_unused)],
            project_config=ProjectConfiguration(project_dir=config.output_dir, automatic_checkpoint_naming=False),
        )

    def _find_resume_point(self) -> Path | None:
        config = self.config
        resume = ckpt.checkpoint_to_resume(self.output_dir, config.resume_from_checkpoint, config.run_fingerprint(),
                                           config.overwrite_output_dir)
        if self.accelerator.is_main_process:
            if config.overwrite_output_dir and resume is None:
                ckpt.clear_checkpoints(self.output_dir)
            ckpt.remove_stale_temporaries(self.output_dir)
        self.accelerator.wait_for_everyone()
        return resume

    def _load_data(self):
        config, accelerator = self.config, self.accelerator
        cache = self.output_dir / ".cache" / "preprocessed"
        started = time.perf_counter()
        with accelerator.local_main_process_first():
            train, from_cache = load_or_build(config.dataset, self.tokenizer, config, cache)
            evaluation = load_or_build(config.eval_dataset, self.tokenizer, config, cache)[0] if config.eval_dataset else None
        self.preprocess = {"seconds": time.perf_counter() - started, "cached": from_cache}
        log.info("data: %d examples (%s in %.2fs)", len(train), "cached" if from_cache else "tokenized",
                 self.preprocess["seconds"])
        if config.val_split_ratio > 0:
            split = train.train_test_split(test_size=config.val_split_ratio, seed=config.seed)
            train, evaluation = split["train"], split["test"]
        if evaluation is not None:
            log.info("eval: %d examples", len(evaluation))
            evaluation = evaluation.select_columns(["input_ids", "labels"])
        return train.select_columns(["input_ids", "labels"]), train["length"], evaluation

    def _train_loader(self, dataset, lengths: list[int]):
        import torch
        from torch.utils.data import DataLoader

        config = self.config
        common = {"batch_size": config.per_device_train_batch_size, "collate_fn": PadCollator(self.tokenizer.pad_token_id)}
        if config.group_by_length:
            sampler = LengthGroupedSampler(lengths, config.group_by_length_window, config.seed)
            return DataLoader(dataset, sampler=sampler, **common)
        return DataLoader(dataset, shuffle=True, generator=torch.Generator().manual_seed(config.seed), **common)

    def _build_optimizer(self, model):
        import torch

        config = self.config
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
                raise ConfigError(f"optim: {config.optim} needs bitsandbytes ({type(exc).__name__}); use optim: adamw_torch") from None
            cls = bnb.optim.PagedAdamW8bit if config.optim.startswith("paged") else bnb.optim.AdamW8bit
            return cls(groups, lr=lr, betas=betas, eps=eps)
        fused = config.optim == "adamw_torch_fused" and torch.cuda.is_available()
        return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, **({"fused": True} if fused else {}))

    def _fresh_state(self) -> ckpt.CheckpointState:
        config = self.config
        return ckpt.CheckpointState(
            global_step=0, epoch=0, batches_in_epoch=0, samples_in_epoch=0, samples_seen=0,
            world_size=self.accelerator.num_processes, per_device_train_batch_size=config.per_device_train_batch_size,
            gradient_accumulation_steps=config.gradient_accumulation_steps,
            run_fingerprint=config.run_fingerprint(), config_fingerprint=config.fingerprint(),
        )

    def _load_checkpoint(self, path: Path) -> None:
        accelerator = self.accelerator
        saved = ckpt.CheckpointState.read(path)
        if not ckpt.rng_file_exists(path, accelerator.process_index):
            log.warning("%s has no RNG state for rank %d (it was saved by %d process(es)); that rank starts from its seed",
                        path, accelerator.process_index, saved.world_size)
        skip, warning = ckpt.resume_skip(saved, accelerator.num_processes, self.config.per_device_train_batch_size)
        if warning:
            log.warning(warning)
        accelerator.load_state(str(path), strict=False)  # hooks checked that every trainable weight is there
        accelerator.project_configuration.iteration = len(ckpt.complete_checkpoints(self.output_dir))
        self.state = saved
        self.state.batches_in_epoch = skip
        self.state.world_size = accelerator.num_processes
        self.state.per_device_train_batch_size = self.config.per_device_train_batch_size
        self.state.gradient_accumulation_steps = self.config.gradient_accumulation_steps
        self.state.config_fingerprint = self.config.fingerprint()
        self._rng_to_reapply = path if skip else None
        log.info("resumed from %s at step %d (epoch %d, %d batch(es) in)", path, saved.global_step, saved.epoch, skip)

    def _on_sigterm(self, _signum, _frame) -> None:
        self.stop_requested = True

    # ------------------------------------------------------------ the loop

    def _epoch_batches(self, epoch: int) -> Iterator:
        """This epoch's batches, resuming mid-epoch where the checkpoint left off."""
        self.loader.set_epoch(epoch)
        skip = self.state.batches_in_epoch
        loader = self.accelerator.skip_first_batches(self.loader, skip) if skip else self.loader
        batches = iter(loader)
        rng_checkpoint, self._rng_to_reapply = self._rng_to_reapply, None
        if rng_checkpoint is None:
            return batches
        # Starting the iterator draws from the RNG; the uninterrupted run drew at the epoch's start,
        # so re-apply the saved state now or dropout and friends diverge from it.
        try:
            first = next(batches)
        except StopIteration:
            return iter(())
        if ckpt.rng_file_exists(rng_checkpoint, self.accelerator.process_index):
            ckpt.load_rng_state(rng_checkpoint, self.accelerator.process_index)
        return itertools.chain([first], batches)

    def _optimizer_step(self, group: list) -> "StepResult":
        """Forward/backward every micro-batch, then one optimizer step; totals are over all ranks."""
        import torch

        accelerator, model = self.accelerator, self.model
        local = torch.tensor([sum(count_target_tokens(b) for b in group)], device=accelerator.device)
        step_targets = int(accelerator.reduce(local, reduction="sum").item())
        scale = accelerator.num_processes / max(step_targets, 1)  # DDP averages over ranks; micro-batch grads add up
        loss_sum = torch.zeros((), device=accelerator.device)
        tokens = positions = 0
        for index, batch in enumerate(group):
            last = index == len(group) - 1
            with nullcontext() if last else accelerator.no_sync(model):
                logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
                summed = token_loss_sum(logits, batch["labels"])
                accelerator.backward(summed * scale)
            loss_sum += summed.detach()
            tokens += int(batch["attention_mask"].sum())
            positions += batch["attention_mask"].numel()
        grad_norm = None
        if self.config.max_grad_norm > 0:
            grad_norm = float(accelerator.clip_grad_norm_(model.parameters(), self.config.max_grad_norm))
        self.optimizer.step()
        if not accelerator.optimizer_step_was_skipped:
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        # One collective for the loss, token counts and the stop decision, so every rank agrees.
        totals = accelerator.reduce(torch.tensor(
            [float(loss_sum), float(tokens), float(positions), float(self.stop_requested)], device=accelerator.device), "sum")
        return StepResult(loss_sum=float(totals[0]), targets=step_targets, tokens=int(totals[1]),
                          positions=int(totals[2]), grad_norm=grad_norm, stop=bool(totals[3] > 0))

    def evaluate(self) -> float:
        """Token-normalised loss over the whole eval set; each sample is seen by exactly one rank."""
        import torch

        accelerator = self.accelerator
        model = accelerator.unwrap_model(self.model)
        rank, world = accelerator.process_index, accelerator.num_processes
        shard = self.eval_data.select(range(rank, len(self.eval_data), world))
        collate = PadCollator(self.tokenizer.pad_token_id)
        batch_size = self.config.per_device_eval_batch_size or self.config.per_device_train_batch_size
        loss_sum = torch.zeros((), dtype=torch.float64, device=accelerator.device)
        targets = torch.zeros((), dtype=torch.float64, device=accelerator.device)
        model.eval()
        with torch.no_grad(), accelerator.autocast():
            for start in range(0, len(shard), batch_size):
                batch = collate([shard[i] for i in range(start, min(start + batch_size, len(shard)))])
                batch = {k: v.to(accelerator.device) for k, v in batch.items()}
                logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
                loss_sum += token_loss_sum(logits, batch["labels"]).double()
                targets += count_target_tokens(batch)
        model.train()
        totals = accelerator.reduce(torch.stack([loss_sum, targets]), "sum")
        return float(totals[0] / totals[1].clamp(min=1))

    def save_checkpoint(self) -> Path:
        config = self.config
        started = time.perf_counter()
        path = ckpt.save_checkpoint(self.accelerator, self.model, self.tokenizer, self.output_dir, self.state,
                                    config.uses_lora, fault_hook=_crash_hook())
        self.metrics.log_event({"step": self.state.global_step, "checkpoint": path.name,
                                "save_seconds": time.perf_counter() - started, "time": time.time()})
        if self.accelerator.is_main_process:
            deleted = ckpt.rotate(self.output_dir, config.save_total_limit, self.state.best_checkpoint)
            for old in deleted:
                log.info("deleted old checkpoint %s", old.name)
            if self.publisher is not None:
                self.publisher.on_checkpoint(path)
        self.accelerator.wait_for_everyone()
        log.info("saved checkpoint %s", path)
        return path

    def _after_eval(self, metric: float, end_of_epoch: bool) -> bool:
        """Track the best metric (and the checkpoint about to hold it); True when early stopping says stop.

        As in transformers: any improvement makes a new best, but only one beyond
        early_stopping_threshold resets the patience counter.
        """
        config, state = self.config, self.state
        previous_best = state.best_metric
        if improved(metric, previous_best, config.greater_is_better, 0.0):
            state.best_metric = metric
            if self._saves_at(state.global_step, end_of_epoch):
                state.best_checkpoint = f"checkpoint-{state.global_step}"
        if improved(metric, previous_best, config.greater_is_better, config.early_stopping_threshold):
            state.evals_without_improvement = 0
        else:
            state.evals_without_improvement += 1
        patience = config.early_stopping_patience
        return bool(patience and state.evals_without_improvement >= patience)

    def _saves_at(self, step: int, end_of_epoch: bool) -> bool:
        config = self.config
        if config.save_strategy == "steps":
            return step % config.save_steps == 0
        return config.save_strategy == "epoch" and end_of_epoch

    def _evals_at(self, step: int, end_of_epoch: bool) -> bool:
        config = self.config
        if config.eval_strategy == "steps":
            return step % config.eval_steps == 0
        return config.eval_strategy == "epoch" and end_of_epoch

    def train(self) -> dict:
        config, accelerator, state = self.config, self.accelerator, self.state
        world = accelerator.num_processes
        self._trim_metrics_after(state.global_step)
        metrics = self.metrics = MetricsLogger(self.output_dir / "metrics.jsonl", self.total_steps,
                                               enabled=accelerator.is_main_process, start_step=state.global_step, append=True)
        epochs = math.ceil(self.total_steps / self.steps_per_epoch)
        started = time.perf_counter()
        window = Window()
        stop_early = False
        self.model.train()
        with metrics:
            while state.global_step < self.total_steps and state.epoch < epochs and not stop_early:
                batches = self._epoch_batches(state.epoch)
                batches_per_epoch = len(self.loader)
                for group in micro_batch_groups(batches, config.gradient_accumulation_steps):
                    step = self._optimizer_step(group)
                    state.global_step += 1
                    state.batches_in_epoch += len(group)
                    consumed = sum(len(b["input_ids"]) for b in group) * world
                    state.samples_in_epoch += consumed
                    state.samples_seen += consumed
                    window.add(step)
                    end_of_epoch = state.batches_in_epoch >= batches_per_epoch
                    if end_of_epoch:
                        state.epoch, state.batches_in_epoch, state.samples_in_epoch = state.epoch + 1, 0, 0
                    last = state.global_step >= self.total_steps
                    if state.global_step % config.logging_steps == 0 or last:
                        record = window.record(state, self.scheduler.get_last_lr()[0], step.grad_norm, batches_per_epoch)
                        metrics.log(record)
                        state.first_loss = record["loss"] if state.first_loss is None else state.first_loss
                        state.last_loss = record["loss"]
                        window = Window()
                    if self.eval_data is not None and self._evals_at(state.global_step, end_of_epoch):
                        eval_loss = self.evaluate()
                        metrics.log_event({"step": state.global_step, "eval_loss": eval_loss})
                        stop_early = self._after_eval(eval_loss, end_of_epoch)
                    if step.stop:
                        raise Preempted(self.save_checkpoint())
                    if self._saves_at(state.global_step, end_of_epoch):
                        self.save_checkpoint()
                    if last or stop_early:
                        break
            if stop_early:
                log.info("early stopping at step %d: no improvement in %d evaluation(s)", state.global_step,
                         config.early_stopping_patience)
        return self._finish(started, stop_early)

    def _trim_metrics_after(self, step: int) -> None:
        """On resume, forget metric lines of steps that will be trained again."""
        path = self.output_dir / "metrics.jsonl"
        if not self.accelerator.is_main_process or not path.exists():
            return
        import json

        lines = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line).get("step", 0) <= step]
        path.write_text("".join(line + "\n" for line in lines))

    def _finish(self, started: float, stopped_early: bool) -> dict:
        from accelerate.utils import gather_object

        accelerator, config, state = self.accelerator, self.config, self.state
        if config.load_best_model_at_end and state.best_checkpoint:
            best = self.output_dir / state.best_checkpoint
            if ckpt.is_complete(best):
                accelerator.load_state(str(best), strict=False)
                log.info("loaded best checkpoint %s (%s %.4f)", best.name, config.metric_for_best_model, state.best_metric)
        final_dir = config.final_model_path()
        summary = {
            "global_step": state.global_step,
            "num_processes": accelerator.num_processes,
            "final_model_dir": str(final_dir),
            "first_loss": state.first_loss,
            "final_loss": state.last_loss,
            "best_metric": state.best_metric,
            "best_checkpoint": state.best_checkpoint,
            "stopped_early": stopped_early,
            "peak_gpu_memory_mib": _peak_gpu_memory_mib(),
            "preprocess_seconds": self.preprocess["seconds"],
            "preprocess_cached": self.preprocess["cached"],
        }
        save_final_model(accelerator, self.model, self.tokenizer, final_dir, model_card(config, summary))
        if self.publisher is not None:
            self.publisher.on_final(final_dir)
        digests = gather_object([parameter_digest(accelerator.unwrap_model(self.model))])
        summary.update({
            "rank_weight_digests": digests,
            "weights_in_sync": len(set(digests)) == 1,
            "backend": self.backend.name,
            "train_seconds": time.perf_counter() - started,
        })
        if accelerator.is_main_process:
            write_json_atomic(summary, self.output_dir / "train_summary.json")
            log.info("saved %s to %s", "adapter" if config.uses_lora else "model", final_dir)
            if not summary["weights_in_sync"]:
                log.warning("ranks finished with different weights: %s", digests)
        accelerator.wait_for_everyone()
        accelerator.end_training()
        return summary


def train(config: TrainConfig, publisher=None) -> dict:
    recipe = Recipe(config, publisher)
    recipe.setup()
    return recipe.train()
