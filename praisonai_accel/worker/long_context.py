"""Long context in the worker: the sequence-parallel groups, the model's split attention and tiled MLP, the training
loader a group shares, and the data-parallel size the recipe counts samples by. The mechanics live in
sequence_parallel.py and tiled_mlp.py; the loss module that sums a slice's loss is the method's (methods/sft.py)."""

from __future__ import annotations

import logging

from ..config import TrainConfig
from .accelerator import track_loader

log = logging.getLogger("praisonai_accel")


def data_parallel_size(config: TrainConfig, num_processes: int) -> int:
    """Processes that read different rows: the ranks of a sequence-parallel group read the same ones."""
    return num_processes // config.sequence_parallel_size


def start_groups(config: TrainConfig):
    """This rank's SequenceParallel (its group, Layout at .layout), or None without sequence parallelism. Every rank
    calls it at the same point: creating the groups is a collective."""
    if config.sequence_parallel_size <= 1:
        return None
    from ..models.sequence_parallel import SequenceParallel

    sp, _layout = SequenceParallel.setup(config.sequence_parallel_size)
    return sp


def apply_to_model(config: TrainConfig, model, sp, pad_token_id: int | None) -> None:
    """The split attention and the tiled MLP, after the loss module is built (its head check runs whole rows) and
    before DDP/FSDP wrap it."""
    if sp is not None:
        sp.apply(model)
        sp.pad_token_id = pad_token_id or 0
        layout = sp.layout
        log.info("sequence parallel: %d ranks share every row (%d group(s)); this rank holds slice %d of %d",
                 sp.size, layout.dp_size, layout.sp_rank + 1, sp.size)
    if config.tiled_mlp:
        from ..models.tiled_mlp import apply_tiled_mlp

        count = apply_tiled_mlp(model, config.tiled_mlp_shards)
        log.info("tiled MLP: %d decoder MLP(s) over %s", count,
                 f"{config.tiled_mlp_shards} tiles" if config.tiled_mlp_shards else "tiles of about hidden_size tokens")


def prepare(accelerator, loss_module, optimizer, loader, sp):
    """accelerator.prepare; under sequence parallelism the loader is sharded by data-parallel rank, so the ranks of
    a group get the same rows."""
    if sp is None:
        return accelerator.prepare(loss_module, optimizer, loader)
    from ..models.sequence_parallel import prepare_loader

    module, optimizer = accelerator.prepare(loss_module, optimizer)
    prepared = prepare_loader(accelerator, loader, sp.layout)
    track_loader(accelerator, add=prepared)
    return module, optimizer, prepared
