"""Checkpoints on Accelerate state: atomic, rotated, and resumable exactly.

Layout of output_dir/checkpoint-<step>/:
    model.safetensors          trainable weights only (the adapter for LoRA), via accelerator.save_state
    optimizer.bin, scheduler.bin (custom_checkpoint_0.pkl), random_states_<rank>.pkl (one per rank)
    adapter/                   a loadable PEFT adapter + tokenizer (LoRA runs)
    praisonai_state.json       step, epoch, position in the epoch, samples seen, world size, batch, config hash
    COMPLETE                   written last; a checkpoint without it is ignored

Everything is written into checkpoint-<step>.tmp and renamed once complete, so a crash mid-save
leaves the previous checkpoint as the latest complete one.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from .config import ConfigError

log = logging.getLogger("praisonai_accel")

STATE_FILE = "praisonai_state.json"
MARKER = "COMPLETE"
_NAME = re.compile(r"^checkpoint-(\d+)$")


@dataclass
class CheckpointState:
    global_step: int
    epoch: int
    batches_in_epoch: int  # micro-batches each rank consumed in `epoch`
    samples_in_epoch: int  # over all ranks, so another world size can find the same place
    samples_seen: int
    world_size: int
    per_device_train_batch_size: int
    gradient_accumulation_steps: int
    run_fingerprint: str
    config_fingerprint: str
    first_loss: float | None = None  # first and latest logged training loss, for the summary and model card
    last_loss: float | None = None
    best_metric: float | None = None
    best_checkpoint: str | None = None
    evals_without_improvement: int = 0

    def write(self, directory: Path) -> None:
        (Path(directory) / STATE_FILE).write_text(json.dumps(asdict(self), indent=2))

    @classmethod
    def read(cls, directory: Path) -> "CheckpointState":
        return cls(**json.loads((Path(directory) / STATE_FILE).read_text()))


def step_of(path: Path) -> int:
    match = _NAME.match(Path(path).name)
    return int(match.group(1)) if match else -1


def is_complete(path: Path) -> bool:
    path = Path(path)
    return (path / MARKER).is_file() and (path / STATE_FILE).is_file()


def checkpoints(output_dir: Path) -> list[Path]:
    """Every checkpoint-<step> directory, complete or not, oldest first."""
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return []
    return sorted((p for p in output_dir.iterdir() if p.is_dir() and _NAME.match(p.name)), key=step_of)


def complete_checkpoints(output_dir: Path) -> list[Path]:
    return [p for p in checkpoints(output_dir) if is_complete(p)]


def latest_complete(output_dir: Path, warn: bool = True) -> Path | None:
    for path in reversed(checkpoints(output_dir)):
        if is_complete(path):
            return path
        if warn:
            log.warning("skipping incomplete checkpoint %s (no %s marker)", path, MARKER)
    return None


def checkpoint_to_resume(output_dir: Path, resume: bool | str, run_fingerprint: str, overwrite: bool) -> Path | None:
    """Which checkpoint this run starts from, or None for a fresh start; refuses to mix runs."""
    if isinstance(resume, str):
        path = Path(resume)
        if not path.is_dir():
            raise ConfigError(f"resume_from_checkpoint: no such checkpoint directory '{resume}'")
        if not is_complete(path):
            raise ConfigError(f"resume_from_checkpoint: '{resume}' is incomplete (no {MARKER} marker); it was interrupted while saving")
        return path
    existing = complete_checkpoints(output_dir)
    if overwrite or not existing:
        return None
    if resume is False:
        raise ConfigError(
            f"output_dir: {output_dir} already holds checkpoints ({existing[-1].name}); set resume_from_checkpoint: true "
            "to continue, or overwrite_output_dir: true to start over"
        )
    latest = latest_complete(output_dir)
    if CheckpointState.read(latest).run_fingerprint != run_fingerprint:
        raise ConfigError(
            f"output_dir: {output_dir} holds checkpoints of another run (model, data, LoRA or seed differ); "
            "use another output_dir, or overwrite_output_dir: true to start over"
        )
    return latest


def resume_skip(state: CheckpointState, world: int, per_device: int) -> tuple[int, str | None]:
    """Micro-batches each rank skips in the resumed epoch, and a warning if the layout changed.

    The sampler's order does not depend on the world size, so the same samples can be skipped
    as long as they fill whole global batches of the new layout; otherwise refuse.
    """
    if state.world_size == world and state.per_device_train_batch_size == per_device:
        return state.batches_in_epoch, None
    global_batch = world * per_device
    if state.samples_in_epoch % global_batch:
        raise ConfigError(
            f"resume_from_checkpoint: the checkpoint was taken after {state.samples_in_epoch} samples of epoch "
            f"{state.epoch} with {state.world_size} process(es) x batch {state.per_device_train_batch_size}; "
            f"{world} process(es) x batch {per_device} cannot continue at exactly that sample; resume with the original layout"
        )
    return state.samples_in_epoch // global_batch, (
        f"resuming with {world} process(es) x batch {per_device} (checkpoint: {state.world_size} x "
        f"{state.per_device_train_batch_size}); continuing at sample {state.samples_in_epoch} of epoch {state.epoch}"
    )


def clear_checkpoints(output_dir: Path) -> None:
    for path in checkpoints(output_dir) + list(Path(output_dir).glob("checkpoint-*.tmp")):
        shutil.rmtree(path, ignore_errors=True)


def remove_stale_temporaries(output_dir: Path) -> None:
    """Leftovers of a save that was killed half-way."""
    for path in Path(output_dir).glob("checkpoint-*.tmp"):
        log.warning("removing %s, left by a save that was interrupted", path)
        shutil.rmtree(path, ignore_errors=True)


def rotate(output_dir: Path, limit: int | None, keep: str | None) -> list[Path]:
    """Delete the oldest complete checkpoints beyond `limit`, never the newest nor the best one (so a limit of 1
    keeps two when the best is older than the newest, as transformers does); returns what was deleted."""
    if not limit:
        return []
    complete = complete_checkpoints(output_dir)
    protected = {p.name for p in complete[-1:]} | ({Path(keep).name} if keep else set())
    removable = [p for p in complete if p.name not in protected]
    excess = len(complete) - max(limit, len(protected))
    deleted = removable[: max(excess, 0)]
    for path in deleted:
        shutil.rmtree(path, ignore_errors=True)
    return deleted


def trainable_weight_names(model) -> set[str]:
    return {name for name, param in model.named_parameters() if param.requires_grad}


def install_trainable_only_hooks(accelerator) -> None:
    """Make save_state/load_state carry only trainable weights: without this they copy the frozen base model too."""

    def keep_trainable(models, weights, _output_dir):
        for index, model in enumerate(models[: len(weights)]):  # FSDP saves its own way and passes no weights
            names = trainable_weight_names(model)
            weights[index] = {k: v for k, v in weights[index].items() if k in names}

    def check_complete(models, input_dir):
        from safetensors import safe_open

        for index, model in enumerate(models):
            file = Path(input_dir) / ("model.safetensors" if index == 0 else f"model_{index}.safetensors")
            if not file.is_file():  # FSDP's sharded state, checked by FSDP itself
                continue
            with safe_open(str(file), framework="pt") as handle:
                missing = trainable_weight_names(model) - set(handle.keys())
            if missing:
                raise ConfigError(f"resume_from_checkpoint: {input_dir} does not match this model ({len(missing)} trainable weights missing)")

    accelerator.register_save_state_pre_hook(keep_trainable)
    accelerator.register_load_state_pre_hook(check_complete)


def trained_model_and_state(accelerator, model):
    """The model being trained inside the prepared loss module, and its full state dict (gathered under FSDP,
    so every rank must call this)."""
    prefix = "causal_lm."
    state_dict = accelerator.get_state_dict(model)
    state_dict = {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)} if state_dict else state_dict
    return accelerator.unwrap_model(model).causal_lm, state_dict


def save_checkpoint(accelerator, model, tokenizer, output_dir: Path, state: CheckpointState, uses_lora: bool,
                    fault_hook=None) -> Path:
    """Every rank calls this; rank 0 finalises. Returns the complete checkpoint's path."""
    final = Path(output_dir) / f"checkpoint-{state.global_step}"
    tmp = final.with_name(final.name + ".tmp")
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))  # rank 0: weights/optimizer/scheduler; each rank: its own RNG file
    if uses_lora:
        causal_lm, state_dict = trained_model_and_state(accelerator, model)
        if accelerator.is_main_process:
            causal_lm.save_pretrained(tmp / "adapter", state_dict=state_dict)
            tokenizer.save_pretrained(tmp / "adapter")
    accelerator.wait_for_everyone()
    if fault_hook is not None:
        fault_hook(state.global_step)
    if accelerator.is_main_process:
        state.write(tmp)
        (tmp / MARKER).write_text(str(state.global_step))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    accelerator.wait_for_everyone()
    return final


def load_rng_state(checkpoint: Path, process_index: int) -> None:
    """Re-apply this rank's RNG state, after the dataloader iterator has drawn its seed."""
    import numpy as np
    import torch
    from accelerate.utils import load

    states = load(Path(checkpoint) / f"random_states_{process_index}.pkl")  # read as accelerate itself reads it
    random.setstate(states["random_state"])
    np.random.set_state(states["numpy_random_seed"])
    torch.set_rng_state(states["torch_manual_seed"])
    if torch.cuda.is_available() and "torch_cuda_manual_seed" in states:
        torch.cuda.set_rng_state_all(states["torch_cuda_manual_seed"])


def rng_file_exists(checkpoint: Path, process_index: int) -> bool:
    return (Path(checkpoint) / f"random_states_{process_index}.pkl").is_file()
