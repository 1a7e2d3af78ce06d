"""Resuming a run: where it resumes from (decided once, on the main process, before the model loads), the state a
fresh run starts from, and a checkpoint loaded into the prepared model, optimizer, scheduler and training method."""

from __future__ import annotations

import logging
from pathlib import Path

from ..checks import resume_rule
from ..config import ConfigError
from . import checkpoint as ckpt
from . import outputs
from .checkpoint_manifest import decided_on_main_process, set_aside_skipped

log = logging.getLogger("praisonai_accel")


def find_resume_point(accelerator, config) -> tuple[Path | None, int, str | None]:
    """(the checkpoint to resume from or None, the micro-batches each rank skips in its epoch, a warning when the
    process layout changed since it); interrupted saves are cleaned up first."""
    resume_from, resume_skip, warning = decided_on_main_process(
        accelerator, lambda: resume_rule(config, accelerator.num_processes))
    if accelerator.is_main_process:
        set_aside_skipped()
        outputs.clean_up_interrupted_saves(config, resuming=resume_from is not None)
    accelerator.wait_for_everyone()
    return resume_from, resume_skip, warning


def fresh_state(config, data_parallel: int, model_commit: str | None) -> ckpt.CheckpointState:
    return ckpt.CheckpointState(
        global_step=0, epoch=0, batches_in_epoch=0, samples_in_epoch=0, samples_seen=0,
        world_size=data_parallel, per_device_train_batch_size=config.per_device_train_batch_size,
        gradient_accumulation_steps=config.gradient_accumulation_steps,
        run_fingerprint=config.run_fingerprint(), config_fingerprint=config.fingerprint(),
        run_identity=config.run_identity(), model_commit=model_commit,
    )


def load_checkpoint(recipe, path: Path) -> tuple[ckpt.CheckpointState, Path | None]:
    """Load `path` into the recipe's prepared model, optimizer, scheduler and method. Returns (the run's state, the
    checkpoint whose RNG state the first epoch re-applies once its iterator has started, or None)."""
    accelerator, config = recipe.accelerator, recipe.config
    saved = ckpt.CheckpointState.read(path)
    if saved.model_commit and recipe.model_commit and saved.model_commit != recipe.model_commit:
        raise ConfigError(f"revision: {config.model_name} now resolves to commit {recipe.model_commit}, but "
                          f"{path.name} was trained on {saved.model_commit}; set revision: {saved.model_commit} to resume")
    if not ckpt.rng_file_exists(path, accelerator.process_index):
        log.warning("%s has no RNG state for rank %d (it was saved by %d process(es)); that rank starts from its seed",
                    path, accelerator.process_index, saved.world_size)
    if recipe._resume_warning:
        log.warning(recipe._resume_warning)
    ckpt.load_state(accelerator, path, recipe.model, recipe.optimizer, recipe.scheduler)
    recipe.method.load_state(path, accelerator, saved.global_step)
    accelerator.project_configuration.iteration = len(ckpt.complete_checkpoints(recipe.output_dir))
    state = saved
    state.batches_in_epoch = recipe.resume_skip
    state.world_size = recipe.data_parallel
    state.per_device_train_batch_size = config.per_device_train_batch_size
    state.gradient_accumulation_steps = config.gradient_accumulation_steps
    state.config_fingerprint = config.fingerprint()
    state.run_fingerprint, state.run_identity = config.run_fingerprint(), config.run_identity()
    state.model_commit = recipe.model_commit
    # mid-way through a group trained for several steps, the uninterrupted run drew its iterator before it too
    rng_to_reapply = path if recipe.resume_skip or saved.global_step % recipe.method.steps_per_batch else None
    log.info("resumed from %s at step %d (epoch %d, %d batch(es) in)", path, saved.global_step, saved.epoch,
             recipe.resume_skip)
    return state, rng_to_reapply
