"""The training recipe, top to bottom: setup, train, save, cleanup.

Accelerate owns DDP/FSDP wrapping, mixed precision, device placement, rank-0 gating, trackers and checkpoint
state. The recipe owns the loop: gradient accumulation (step.py: the loss is normalised over every micro-batch and
rank of an optimizer step), evaluation scheduling, checkpoints, resume and what the run leaves behind. What is
trained — rows, batches, the loss — belongs to the training method (methods/), which the recipe knows only through
its interface.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Iterator

from ..checks import Situation, check_run
from ..config import ConfigError, TrainConfig
from ..data.vision_processor import model_inputs
from ..runtime.distributed import DistEnv, fsdp_requested, gpu_has_bf16
from ..runtime.handoff import VERBOSE_ENV
from ..logs import quiet_libraries
from ..methods import method_for
from ..models.host_embedding import ddp_ignore_host_tensors
from ..models.loading import (
    choose_backend, context_warning, load_model_and_tokenizer, parameters_without_gradient, resolve_commit,
    trainable_parameter_count, uses_reentrant_checkpointing,
)
from ..evaluate.results import latest_eval
from ..publish.hub import model_card
from . import checkpoint as ckpt
from ..run_dir import checkpoints as ckpt_dir
from . import outputs, resume
from .accelerator import build_accelerator, check_shared_output_dir, quiet_stdout, run_context, start_trackers, track_loader
from .evaluation import evaluate, evals_at, record_evaluation, saves_at
from .failures import DiskFull, is_disk_full
from .flops import flop_counts
from .inputs import load_training_data, packing_for, shares_cache, train_loader
from .long_context import apply_to_model, data_parallel_size, prepare, start_groups
from .metrics import MetricsLogger, Window
from .optim import build_optimizer, build_scheduler, plan_steps
from .preflight import run_preflight
from .sharded_state import parameter_bytes, reshard
from .step import micro_batch_groups, optimizer_step, repeated_groups
from .stop import StopSignals
from .task_eval import TaskEvaluation, task_summary
from .watchdog import Watchdog

log = logging.getLogger("praisonai_accel")


class Recipe:
    def __init__(self, config: TrainConfig, publisher=None):
        self.config = config
        self.publisher = publisher  # rank 0's HubPublisher, or None
        self.env = DistEnv.from_environ()
        self.output_dir = config.output_path()
        self.verbose = os.environ.get(VERBOSE_ENV) == "1"
        self.method = method_for(config)
        self.headline = tuple(self.method.headline_metrics)  # what the console, report and loss.png show beside loss
        self.stop = StopSignals()  # a stop signal arrived: checkpoint and stop at the next micro-batch
        # set up by setup()
        self.accelerator = None
        self.backend = None  # model.Backend: transformers or unsloth
        self.inputs = None  # data/vision_processor.ModelInputs: whether the model takes images
        self.reentrant = self.packing = False  # reentrant gradient checkpointing (unsloth's, or asked for)
        self.sp = None  # sequence_parallel.SequenceParallel when sequence_parallel_size > 1
        self.data_parallel = 1  # processes reading different rows (a sequence-parallel group reads the same)
        self.resume_point = resume.ResumePoint(None)
        self.model_commit: str | None = None
        self.tokenizer = self.collate = self.eval_data = None
        self.task_eval: TaskEvaluation | None = None  # eval_tasks
        self.preprocess: dict = {}  # how long preprocessing took, and whether it came from the cache
        self.model = None  # the method's loss module, prepared (DDP / FSDP2)
        self.optimizer = self.scheduler = self.loader = self.flop_counts = None
        self.parameter_bytes = 0  # this rank's share: 1/N of each layer under FSDP
        self.steps_per_epoch = self.total_steps = 0
        self.state: ckpt_dir.CheckpointState | None = None
        self.metrics: MetricsLogger | None = None
        self._rng_to_reapply: Path | None = None  # set when resuming mid-epoch, see _epoch_batches

    # ------------------------------------------------------------ setup

    def setup(self) -> None:
        import torch
        from accelerate.utils import set_seed

        config = self.config
        use_cuda = torch.cuda.is_available()
        bf16 = gpu_has_bf16()  # the model's dtype, LoRA's, autocast's and unsloth's all follow from this one answer
        self.inputs = model_inputs(config)  # what the model takes besides text, decided once for the whole run
        self.backend = choose_backend(config, self.env, use_cuda, self.inputs)  # unsloth, if at all, before transformers
        self.reentrant = uses_reentrant_checkpointing(config, self.backend)
        self.packing = packing_for(config, self.backend, warn=self.env.is_main)
        self.accelerator = accelerator = build_accelerator(config, self.env.is_distributed, self.reentrant, use_cuda, bf16)
        quiet_libraries(self.verbose)
        check_run(Situation(config, accelerator.num_processes, "worker", reentrant=self.reentrant,
                            distributed_type=accelerator.distributed_type.name))  # torchrun checked nothing before
        self.data_parallel = data_parallel_size(config, accelerator.num_processes)
        if config.trust_remote_code and not config.revision and accelerator.is_main_process:  # once, not once per rank
            log.warning("warning: trust_remote_code: true without revision: every rank, node and restart runs whatever "
                        "code is on the model's main branch when it loads; pin it with revision: <commit>")
        run_preflight(accelerator, config, local_processes=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
                      fsdp=fsdp_requested())
        cache_shared = True
        if accelerator.num_processes > 1:
            check_shared_output_dir(accelerator, self.output_dir)
            cache_shared = shares_cache(accelerator, config)
        self.resume_point = resume.find_resume_point(accelerator, config)
        set_seed(config.seed)
        log.info("backend: %s%s | processes: %d (%s) | device: %s | mixed precision: %s", self.backend.name,
                 f" ({self.backend.reason})" if self.backend.reason else "", accelerator.num_processes,
                 accelerator.distributed_type.name, accelerator.device, accelerator.mixed_precision)

        self.model_commit = resolve_commit(config)
        pinned = config.model_copy(update={"revision": self.model_commit}) if self.model_commit else config
        model, self.tokenizer = load_model_and_tokenizer(pinned, self.env, self.backend, use_cuda, bf16, self.inputs)
        trainable, total = trainable_parameter_count(model)
        log.info("model: %s | trainable parameters: %s of %s (%.2f%%)", config.model_name, f"{trainable:,}",
                 f"{total:,}", 100 * trainable / max(total, 1))
        check_run(Situation(config, accelerator.num_processes, "loaded", model_config=model.config, inputs=self.inputs))
        self.sp = start_groups(config)

        train_data, self.eval_data, self.preprocess = load_training_data(accelerator, config, self.tokenizer, cache_shared,
                                                                         self.method.data(self.tokenizer))
        lengths = getattr(train_data, "example_lengths", None)
        if accelerator.is_main_process and (warning := context_warning(config.max_seq_length, model.config, lengths)):
            log.warning(warning)
        self.collate = self.method.collator(self.tokenizer.pad_token_id)
        self.task_eval = TaskEvaluation.build(config, self.tokenizer, self._eval_batch_size(), fsdp_requested(),
                                              self.preprocess.get("formats"), self.inputs.vision)
        loader_batch = self.method.loader_batch_size(config.per_device_train_batch_size)
        loader = train_loader(config, train_data, self.collate, self.packing, loader_batch)
        self.method.set_up(run_context(accelerator, self.tokenizer, config))
        loss_module = self.method.loss_module(model, accelerator=accelerator, tokenizer=self.tokenizer, use_cuda=use_cuda)
        self.flop_counts = flop_counts(model)
        if self.reentrant and accelerator.num_processes > 1:
            self._check_every_trainable_parameter_learns(loss_module, train_data)
        apply_to_model(config, model, self.sp, self.tokenizer.pad_token_id)
        optimizer = build_optimizer(config, loss_module)
        ddp_ignore_host_tensors(loss_module)  # offload_embedding's table: on the CPU, the same on every rank
        self.model, self.optimizer, self.loader = prepare(accelerator, loss_module, optimizer, loader, self.sp)
        prepared = self.method.before_training(accelerator, self.model, train_data, self.collate, self.output_dir)
        if prepared is not train_data:  # the method attached what it computed once (reference log-probs)
            track_loader(accelerator, remove=self.loader)  # one loader, as in a run without it: checkpoints agree
            self.loader = accelerator.prepare(train_loader(config, prepared, self.collate, self.packing, loader_batch))
        self.parameter_bytes = parameter_bytes(self.model)
        self.steps_per_epoch, self.total_steps = plan_steps(config, len(self.loader), self.method.steps_per_batch)
        self.scheduler = build_scheduler(config, self.optimizer, self.total_steps)
        ckpt.install_trainable_only_hooks(accelerator)
        self.state = resume.fresh_state(config, self.data_parallel, self.model_commit)
        if self.resume_point.path is not None:
            prepared = (self.model, self.optimizer, self.scheduler)
            self.state, self._rng_to_reapply = resume.load_checkpoint(self.resume_point, accelerator, config, prepared,
                                                                      self.method, self.state)
        self.stop.install()
        start_trackers(accelerator, config, self.verbose)
        world, accum, per_device = self.data_parallel, config.gradient_accumulation_steps, config.per_device_train_batch_size
        log.info("steps: %d (%d per epoch) | effective batch: %d x %d x %d = %d%s", self.total_steps, self.steps_per_epoch,
                 per_device, accum, world, per_device * accum * world, " rows" if self.packing else "")

    def _check_every_trainable_parameter_learns(self, loss_module, dataset) -> None:
        """Reentrant checkpointing under DDP runs without unused-parameter detection, which is only right when every
        trainable parameter gets a gradient from a batch: checked on one example before DDP wraps the model."""
        batch = self.collate([dataset[0]])
        batch = {k: v.to(self.accelerator.device) if hasattr(v, "to") else v for k, v in batch.items()}
        missing = parameters_without_gradient(loss_module, batch, self.method.forward)
        if missing:
            raise ConfigError(
                f"reentrant gradient checkpointing (unsloth's, or use_gradient_checkpointing: reentrant) under DDP needs "
                f"every trainable parameter to get a gradient, and {len(missing)} get none ({', '.join(missing[:3])}"
                f"{', ...' if len(missing) > 3 else ''}); use use_gradient_checkpointing: true (non-reentrant, "
                "transformers) or leave those modules out of lora_target_modules")

    # ------------------------------------------------------------ train

    def train(self) -> dict:
        config, accelerator, state = self.config, self.accelerator, self.state
        world = self.data_parallel
        if accelerator.is_main_process:
            outputs.trim_metrics_after(self.output_dir, state.global_step)
        tracker_log = (lambda values, step: accelerator.log(values, step=step)) if config.trackers else None
        metrics = self.metrics = MetricsLogger(self.output_dir / "metrics.jsonl", self.total_steps,
                                               enabled=accelerator.is_main_process, start_step=state.global_step,
                                               append=True, tracker_log=tracker_log, headline=self.headline,
                                               scores=tuple(f"eval_{task}/" for task in config.eval_tasks or ()))
        self._write_progress("running")
        epochs = math.ceil(self.total_steps / self.steps_per_epoch)
        started = time.perf_counter()
        window = Window(self.method.reduce_metrics)
        stop_early = False
        self.model.train()
        log_path = self.output_dir / "logs" / f"rank-{accelerator.process_index}.log"
        with metrics, Watchdog(config.hang_timeout, accelerator.process_index, log_path) as watchdog:
            while state.global_step < self.total_steps and state.epoch < epochs and not stop_early:
                batches = self._epoch_batches(state.epoch)
                batches_per_epoch = len(self.loader)
                repeats = self.method.steps_per_batch
                for group in repeated_groups(micro_batch_groups(batches, config.gradient_accumulation_steps), repeats,
                                             state.global_step % repeats):
                    group = self.method.rollout(accelerator, self.model, group, state.global_step, self.total_steps,
                                                state.epoch + state.batches_in_epoch / max(batches_per_epoch, 1))
                    step = optimizer_step(accelerator, self.model, self.optimizer, self.scheduler, self.method, group,
                                          config.max_grad_norm, self.flop_counts, self._stop_agreed, self.stop.requested,
                                          self.sp)
                    watchdog.progress()
                    if step is None:  # SIGTERM between micro-batches: the step was abandoned, save where the last ended
                        self._preempted()
                    state.global_step += 1
                    whole = state.global_step % repeats == 0  # the group's last step: it is consumed
                    state.batches_in_epoch += len(group) if whole else 0
                    consumed = sum(self.method.examples_in(b) for b in group) * world if whole else 0
                    state.samples_in_epoch += consumed
                    state.samples_seen += consumed
                    window.add(step)
                    metrics.advance(state.global_step)
                    end_of_epoch = state.batches_in_epoch >= batches_per_epoch
                    if end_of_epoch:
                        state.epoch, state.batches_in_epoch, state.samples_in_epoch = state.epoch + 1, 0, 0
                    last = state.global_step >= self.total_steps
                    if state.global_step % config.logging_steps == 0 or last:
                        record = window.record(state, self.scheduler.get_last_lr()[0], batches_per_epoch)
                        metrics.log(record)
                        state.first_loss = record["loss"] if state.first_loss is None else state.first_loss
                        state.last_loss = record["loss"]
                        window = Window(self.method.reduce_metrics)
                    if evals_at(self.config, state.global_step, end_of_epoch):
                        stop_early = self._evaluate_and_record(end_of_epoch)
                        watchdog.progress()
                    if step.stop and not last:  # on the last step: finish, the final save is the checkpoint
                        self._preempted()
                    if saves_at(self.config, state.global_step, end_of_epoch):
                        self.save_checkpoint()
                        watchdog.progress()
                    if last or stop_early:
                        break
            if self.task_eval is not None and not evals_at(self.config, state.global_step, state.batches_in_epoch == 0):
                self.metrics.log_event({"step": state.global_step, **self._task_scores()})  # the end's scores
            if stop_early:
                log.info("early stopping at step %d: no improvement in %d evaluation(s)", state.global_step,
                         config.early_stopping_patience)
        return self._finish(started, stop_early)

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

    def _stop_agreed(self) -> bool:
        """Whether any rank has been asked to stop: every rank must leave the step at the same micro-batch."""
        import torch

        flag = torch.tensor([float(self.stop.requested)], device=self.accelerator.device)
        return bool(self.accelerator.reduce(flag, "sum")[0] > 0)

    def _evaluate_and_record(self, end_of_epoch: bool) -> bool:
        """Evaluate, log it, track the best metric; True when early stopping says stop."""
        config, state = self.config, self.state
        eval_loss, eval_metrics = self.evaluate() if self.eval_data is not None else (None, {})
        scores = self._task_scores()
        self.metrics.log_event({"step": state.global_step, **({"eval_loss": eval_loss} if eval_loss is not None else {}),
                                **{f"eval_{name}": value for name, value in eval_metrics.items()}, **scores})
        eval_metrics.update({name[len("eval_"):]: value for name, value in scores.items()})
        return record_evaluation(config, state, (eval_loss, eval_metrics),
                                 saves_at(self.config, state.global_step, end_of_epoch))

    def _task_scores(self) -> dict[str, float]:
        scores = self.task_eval.score(self.accelerator, self.model) if self.task_eval is not None else {}
        return {f"eval_{name}": value for name, value in scores.items()}

    def _eval_batch_size(self) -> int:
        batch_size = self.config.per_device_eval_batch_size or self.config.per_device_train_batch_size
        return max(1, self.method.loader_batch_size(batch_size))

    def evaluate(self) -> tuple[float, dict[str, float]]:
        result = evaluate(self.accelerator, self.model, self.method, self.eval_data, self.collate,
                          self._eval_batch_size(), self.sp)
        reshard(self.model)  # FSDP2: what stayed gathered after the no-grad forwards goes back to shards
        return result

    # ------------------------------------------------------------ save

    def save_checkpoint(self) -> Path:
        config = self.config
        started = time.perf_counter()
        try:
            path = ckpt.save_checkpoint(self.accelerator, self.model, self.optimizer, self.tokenizer, self.scheduler,
                                        self.output_dir, self.state, config.uses_lora,
                                        lambda tmp: self.method.save_state(tmp, self.accelerator, self.state.global_step))
        except Exception as exc:
            if not is_disk_full(exc):
                raise
            tmp = self.output_dir / f"checkpoint-{self.state.global_step}.tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            latest = ckpt_dir.latest_complete(self.output_dir, warn=False)
            raise DiskFull(f"no space left on device while saving checkpoint-{self.state.global_step}; the latest "
                           f"complete checkpoint is {latest.name if latest else 'none'}; free space in "
                           f"{self.output_dir} and re-run the same command to resume") from None
        self.metrics.log_event({"step": self.state.global_step, "checkpoint": path.name,
                                "save_seconds": time.perf_counter() - started, "time": time.time()})
        if self.accelerator.is_main_process:
            deleted = ckpt_dir.rotate(self.output_dir, config.save_total_limit, self.state.best_checkpoint)
            for old in deleted:
                log.info("deleted old checkpoint %s", old.name)
            if self.publisher is not None:
                self.publisher.on_checkpoint(path)
        self.accelerator.wait_for_everyone()
        log.info("saved checkpoint %s", path)
        return path

    def _preempted(self) -> None:
        """Every rank agreed to stop after the last finished step: its checkpoint, whatever save_strategy says."""
        stopped = self.stop.stopped(self.save_checkpoint())
        self._write_progress(stopped.status, signal=self.stop.name)
        raise stopped

    def _write_progress(self, status: str, **ended) -> None:
        if self.accelerator.is_main_process:
            outputs.write_progress(self.output_dir, status, self.state.global_step, self.total_steps,
                                   self.accelerator.num_processes, self.config.final_model_path(),
                                   self.config.method, self.config._config_dir, headline=self.headline,
                                   config_file=self.config._config_file,
                                   run=(self.state.run_fingerprint, self.state.run_identity),
                                   data_formats=self.preprocess.get("formats") or None, **ended)

    def _finish(self, started: float, stopped_early: bool) -> dict:
        from accelerate.utils import gather_object

        accelerator, config, state = self.accelerator, self.config, self.state
        if config.load_best_model_at_end and state.best_checkpoint:
            best = self.output_dir / state.best_checkpoint
            if ckpt_dir.is_complete(best):
                ckpt.load_state(accelerator, best, self.model, self.optimizer, self.scheduler)
                log.info("loaded best checkpoint %s (%s %.4f)", best.name, config.metric_for_best_model, state.best_metric)
        final_dir = config.final_model_path()
        summary = {
            "global_step": state.global_step,
            "total_steps": self.total_steps,
            "num_processes": accelerator.num_processes,
            "final_model_dir": str(final_dir),
            "first_loss": state.first_loss, "final_loss": state.last_loss,
            "best_metric": state.best_metric, "best_checkpoint": state.best_checkpoint,
            "stopped_early": stopped_early,
            "peak_gpu_memory_mib": outputs.peak_gpu_memory_mib(),
            "preprocess_seconds": self.preprocess["seconds"],
            "preprocess_cached": self.preprocess["cached"], "data_formats": self.preprocess.get("formats") or None,
            "revision": config.revision, "model_commit": self.model_commit,
            **task_summary(config, self.metrics),
        }
        outputs.save_final_model(accelerator, self.model, self.tokenizer, config, model_card(config, summary, self.inputs, latest_eval(self.output_dir)))
        if self.publisher is not None:
            self.publisher.on_final(final_dir)
        digests = gather_object([outputs.parameter_digest(accelerator.unwrap_model(self.model))])
        summary.update({
            "distributed_type": accelerator.distributed_type.name,
            "parameter_bytes_per_rank": gather_object([self.parameter_bytes]),
            "flop_counts": self.flop_counts.as_dict(),
            "rank_weight_digests": digests,
            "peak_gpu_memory_mib_per_rank": gather_object([outputs.peak_gpu_memory_mib()]),
            "weights_in_sync": len(set(digests)) == 1,
            "backend": self.backend.name,
            "train_seconds": time.perf_counter() - started,
        })
        if accelerator.is_main_process:
            outputs.write_summary(summary, self.output_dir, config.plot_loss)
            self._write_progress("finished", exit_code=0)
            for line in outputs.end_summary(summary, self.metrics, config.uses_lora, self.resume_point.path):
                log.info(line)
            if not summary["weights_in_sync"]:
                log.warning("ranks finished with different weights: %s", digests)
        accelerator.wait_for_everyone()
        self.cleanup()
        return summary

    # ------------------------------------------------------------ cleanup

    def cleanup(self) -> None:
        with quiet_stdout(self.verbose):
            self.accelerator.end_training()
        trackio = sys.modules.get("trackio")
        if trackio is not None:  # its exit hook would finish the finished run again, and say so on the console
            trackio.context_vars.current_run.set(None)


def train(config: TrainConfig, publisher=None) -> dict:
    recipe = Recipe(config, publisher)
    recipe.setup()
    return recipe.train()
