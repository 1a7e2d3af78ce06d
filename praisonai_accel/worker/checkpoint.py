"""Checkpoints on Accelerate state: atomic, rotated, and resumable exactly.

Layout of output_dir/checkpoint-<step>/:
    model.safetensors          trainable weights only (the adapter for LoRA), via accelerator.save_state
    optimizer.bin, random_states_<rank>.pkl (one per rank)
    scheduler.json             the LR scheduler's state (ints and floats), never a pickle
    adapter/                   a loadable PEFT adapter + tokenizer (LoRA runs)
    rollout_<rank>.safetensors GRPO mid-way through a generated batch's num_iterations steps (a method's state)
    praisonai_state.json       step, epoch, position in the epoch, samples seen, world size, batch, config hash
    MANIFEST.json              size and content hash of every file above (checkpoint_manifest), checked on resume
    COMPLETE                   written last; a checkpoint without it is ignored

Everything is written into checkpoint-<step>.tmp and renamed once complete, so a crash mid-save
leaves the previous checkpoint as the latest complete one.

A checkpoint is untrusted input (it may come from the Hub or another user): nothing in it is ever
unpickled. Every torch file is scanned for the globals its pickle would call before anything is
loaded, and Accelerate reads them with weights_only=True.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
from pathlib import Path

from ..config import ConfigError
from ..data.processor_files import save_processing
from ..run_dir import manifest
from ..run_dir.checkpoints import MARKER, SCHEDULER_FILE, CheckpointState, check_safe_to_load
from .sharded_state import load_sharded_state, reshard, save_sharded_state

log = logging.getLogger("praisonai_accel")


def save_scheduler(scheduler, directory: Path) -> None:
    (Path(directory) / SCHEDULER_FILE).write_text(json.dumps(scheduler.state_dict()))


def load_scheduler(scheduler, directory: Path) -> None:
    path = Path(directory) / SCHEDULER_FILE
    if not path.is_file():
        raise ConfigError(f"resume_from_checkpoint: {path} is missing (a checkpoint of an older version, whose "
                          "scheduler state is a pickle; it is never loaded)")
    try:
        scheduler.load_state_dict(json.loads(path.read_text()))
    except (ValueError, TypeError, KeyError) as exc:
        raise ConfigError(f"resume_from_checkpoint: {path} is not a scheduler state ({exc})") from None


def load_state(accelerator, checkpoint: Path, model, optimizer, scheduler) -> None:
    """accelerator.load_state (or this rank's shards under FSDP), only after every file was found safe; the scheduler
    from its JSON."""
    check_safe_to_load(checkpoint)
    if is_fsdp(accelerator):
        load_sharded_state(accelerator, model, optimizer, checkpoint)
    else:
        accelerator.load_state(str(checkpoint), strict=False)  # hooks checked that every trainable weight is there
    load_scheduler(scheduler, checkpoint)


def is_fsdp(accelerator) -> bool:
    return accelerator.distributed_type.name == "FSDP"


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


def trained_model_and_state(accelerator, model, trainable_only: bool = False):
    """The model being trained inside the prepared loss module, and its state dict: under FSDP gathered on rank 0
    (every rank must call this), and with trainable_only (LoRA) only the adapter is gathered, never the base model."""
    prefix = "causal_lm."
    if is_fsdp(accelerator):
        reshard(model)
    if trainable_only and is_fsdp(accelerator):
        state_dict = {}
        for name, param in model.named_parameters():  # the same order on every rank: one all-gather each
            if param.requires_grad:
                full = param.full_tensor() if hasattr(param, "full_tensor") else param
                if accelerator.is_main_process:
                    state_dict[name] = full.detach().cpu()
    else:
        state_dict = accelerator.get_state_dict(model)
    state_dict = {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)} if state_dict else state_dict
    return accelerator.unwrap_model(model).causal_lm, state_dict


def save_checkpoint(accelerator, model, optimizer, tokenizer, scheduler, output_dir: Path, state: CheckpointState,
                    uses_lora: bool, method_state=None) -> Path:
    """Every rank calls this; rank 0 finalises. Returns the complete checkpoint's path. `method_state(directory)`:
    called on every rank before the manifest is written (the training method's own state, methods/base.py)."""
    final = Path(output_dir) / f"checkpoint-{state.global_step}"
    tmp = final.with_name(final.name + ".tmp")
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    if is_fsdp(accelerator):
        save_sharded_state(accelerator, model, optimizer, tmp)
    else:
        accelerator.save_state(str(tmp))  # rank 0: weights and optimizer; each rank: its own RNG file
    if uses_lora:
        causal_lm, state_dict = trained_model_and_state(accelerator, model, trainable_only=True)
        if accelerator.is_main_process:
            causal_lm.save_pretrained(tmp / "adapter", state_dict=state_dict)
            save_processing(tokenizer, tmp / "adapter")  # a vision-language model's processor with it
    if method_state is not None:
        method_state(tmp)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        save_scheduler(scheduler, tmp)
        state.write(tmp)
        manifest.write_manifest(tmp, MARKER)
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

    # weights_only, as accelerate itself reads it; check_safe_to_load already scanned the file
    states = load(Path(checkpoint) / f"random_states_{process_index}.pkl")
    random.setstate(states["random_state"])
    np.random.set_state(states["numpy_random_seed"])
    torch.set_rng_state(states["torch_manual_seed"])
    if torch.cuda.is_available() and "torch_cuda_manual_seed" in states:
        torch.cuda.set_rng_state_all(states["torch_cuda_manual_seed"])


def rng_file_exists(checkpoint: Path, process_index: int) -> bool:
    return (Path(checkpoint) / f"random_states_{process_index}.pkl").is_file()
