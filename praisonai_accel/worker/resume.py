"""Resuming a run: where it resumes from (decided once, on the main process, before the model loads), the state a
fresh run starts from, and a checkpoint loaded into the prepared model, optimizer, scheduler and training method."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from ..checks import resume_rule
from ..config import ConfigError
from . import checkpoint as ckpt
from ..run_dir import checkpoints as ckpt_dir
from . import outputs
from ..run_dir.manifest import decided_on_main_process, set_aside_skipped

log = logging.getLogger("praisonai_accel")


@dataclass(frozen=True)
class ResumePoint:
    path: Path | None  # the checkpoint to resume from; None: a fresh run
    skip: int = 0  # micro-batches each rank skips in the resumed epoch
    warning: str | None = None  # the process layout changed since the checkpoint


def find_resume_point(accelerator, config) -> ResumePoint:
    """Where the run resumes (decided on the main process); interrupted saves are cleaned up first."""
    resume_from, resume_skip, warning = decided_on_main_process(
        accelerator, lambda: resume_rule(config, accelerator.num_processes))
    if accelerator.is_main_process:
        set_aside_skipped()
        outputs.clean_up_interrupted_saves(config, resuming=resume_from is not None)
    accelerator.wait_for_everyone()
    return ResumePoint(resume_from, resume_skip, warning)


def fresh_state(config, data_parallel: int, model_commit: str | None) -> ckpt_dir.CheckpointState:
    return ckpt_dir.CheckpointState(
        global_step=0, epoch=0, batches_in_epoch=0, samples_in_epoch=0, samples_seen=0,
        world_size=data_parallel, per_device_train_batch_size=config.per_device_train_batch_size,
        gradient_accumulation_steps=config.gradient_accumulation_steps,
        run_fingerprint=config.run_fingerprint(), config_fingerprint=config.fingerprint(),
        run_identity=config.run_identity(), model_commit=model_commit,
    )


def load_checkpoint(point: ResumePoint, accelerator, config, prepared: tuple, method, fresh: ckpt_dir.CheckpointState
                    ) -> tuple[ckpt_dir.CheckpointState, Path | None]:
    """Load the checkpoint at `point` into the `prepared` (model, optimizer, scheduler) and the training method.
    `fresh`: the state this run would start from (its layout, fingerprints and model commit). Returns (the run's
    state, the checkpoint whose RNG state the first epoch re-applies once its iterator has started, or None)."""
    path, model_commit = point.path, fresh.model_commit
    saved = ckpt_dir.CheckpointState.read(path)
    if saved.model_commit and model_commit and saved.model_commit != model_commit:
        raise ConfigError(f"revision: {config.model_name} now resolves to commit {model_commit}, but "
                          f"{path.name} was trained on {saved.model_commit}; set revision: {saved.model_commit} to resume")
    if not ckpt.rng_file_exists(path, accelerator.process_index):
        log.warning("%s has no RNG state for rank %d (it was saved by %d process(es)); that rank starts from its seed",
                    path, accelerator.process_index, saved.world_size)
    if point.warning:
        log.warning(point.warning)
    ckpt.load_state(accelerator, path, *prepared)
    method.load_state(path, accelerator, saved.global_step)
    accelerator.project_configuration.iteration = len(ckpt_dir.complete_checkpoints(config.output_path()))
    state = saved
    state.batches_in_epoch = point.skip
    for key in ("world_size", "per_device_train_batch_size", "gradient_accumulation_steps", "config_fingerprint",
                "run_fingerprint", "run_identity", "model_commit"):
        setattr(state, key, getattr(fresh, key))  # this run's layout and identity from here on
    # mid-way through a group trained for several steps, the uninterrupted run drew its iterator before it too
    rng_to_reapply = path if point.skip or saved.global_step % method.steps_per_batch else None
    log.info("resumed from %s at step %d (epoch %d, %d batch(es) in)", path, saved.global_step, saved.epoch,
             point.skip)
    return state, rng_to_reapply
