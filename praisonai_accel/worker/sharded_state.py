"""FSDP2 checkpoints: each rank's shard of the trainable weights and of the optimizer state, as safetensors.

Nothing is gathered to save or to resume, and nothing is pickled: weights and optimizer tensors are safetensors,
the optimizer's hyperparameters JSON, the RNG state what accelerate writes for every checkpoint. A sharded
checkpoint resumes with the number of processes that saved it.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..config import ConfigError

OPTIMIZER_GROUPS_FILE = "optimizer_groups.json"  # the optimizer's hyperparameters


def _local(tensor):
    """This rank's shard of an FSDP2 DTensor; a plain tensor as it is."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _shard_files(directory: Path, rank: int) -> tuple[Path, Path]:
    return Path(directory) / f"model_shard_{rank}.safetensors", Path(directory) / f"optimizer_shard_{rank}.safetensors"


def reshard(model) -> None:
    """Put every FSDP2 unit back in its sharded state. Units that keep their parameters gathered after a forward
    (the root and the head, by Accelerate's choice) stay gathered after a no-grad forward such as evaluation, and then
    name their full tensors, not the shards the optimizer steps."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def save_sharded_state(accelerator, model, optimizer, directory: Path) -> None:
    """Under FSDP2: each rank writes its own shard of the trainable weights and of the optimizer state as safetensors
    (nothing is gathered, nothing is pickled), its RNG state as accelerate does, and rank 0 the optimizer's
    hyperparameters as JSON. Resuming needs the same number of processes."""
    import torch
    from accelerate.checkpointing import save_accelerator_state
    from safetensors.torch import save_file

    rank = accelerator.process_index
    model_file, optimizer_file = _shard_files(directory, rank)
    reshard(model)
    names = {param: name for name, param in model.named_parameters()}
    save_file({name: _local(p.detach()).contiguous().cpu() for name, p in model.named_parameters() if p.requires_grad},
              str(model_file))
    tensors, groups = {}, []
    for group in optimizer.param_groups:
        groups.append({**{k: v for k, v in group.items() if k != "params" and _json_scalar(v)},
                       "params": [names[p] for p in group["params"]]})
        for param in group["params"]:
            for key, value in optimizer.state.get(param, {}).items():
                if torch.is_tensor(value):
                    tensors[f"{names[param]}/{key}"] = _local(value).detach().contiguous().cpu()
    save_file(tensors, str(optimizer_file))
    if accelerator.is_main_process:
        (Path(directory) / OPTIMIZER_GROUPS_FILE).write_text(json.dumps(groups))
    save_accelerator_state(str(directory), [], [], [], [], rank, 0, scaler=accelerator.scaler)


def _json_scalar(value) -> bool:
    return isinstance(value, (int, float, bool, str, type(None))) or (
        isinstance(value, (list, tuple)) and all(isinstance(v, (int, float)) for v in value))


def load_sharded_state(accelerator, model, optimizer, directory: Path) -> None:
    """The inverse of save_sharded_state, into this rank's shards."""
    import torch
    from accelerate.checkpointing import load_accelerator_state
    from safetensors.torch import load_file

    rank = accelerator.process_index
    model_file, optimizer_file = _shard_files(directory, rank)
    reshard(model)
    if not model_file.is_file() or not optimizer_file.is_file():
        raise ConfigError(f"resume_from_checkpoint: {directory} has no shard for rank {rank}; a sharded (FSDP) checkpoint "
                          "resumes only with the number of processes that saved it")
    params = dict(model.named_parameters())
    weights = load_file(str(model_file))
    missing = {name for name, p in params.items() if p.requires_grad} - set(weights)
    if missing or not set(weights) <= set(params):
        raise ConfigError(f"resume_from_checkpoint: {directory} does not match this model ({len(missing)} trainable "
                          "weights missing)")
    with torch.no_grad():
        for name, tensor in weights.items():
            local = _local(params[name])
            if local.shape != tensor.shape:
                raise ConfigError(f"resume_from_checkpoint: {directory}: {name} has shape {tuple(tensor.shape)}, this "
                                  f"rank's shard {tuple(local.shape)}; resume with the number of processes that saved it")
            local.copy_(tensor)
    saved = load_file(str(optimizer_file))
    groups = json.loads((Path(directory) / OPTIMIZER_GROUPS_FILE).read_text())
    for group, saved_group in zip(optimizer.param_groups, groups):
        group.update({k: tuple(v) if isinstance(v, list) else v for k, v in saved_group.items() if k != "params"})
    for name, param in params.items():
        entries = {key.split("/", 1)[1]: tensor for key, tensor in saved.items() if key.split("/", 1)[0] == name}
        if entries:
            optimizer.state[param] = {key: _like(param, tensor) for key, tensor in entries.items()}
    load_accelerator_state(str(directory), [], [], [], [], rank, scaler=accelerator.scaler)


def _like(param, tensor):
    """An optimizer-state tensor placed as its parameter is: a DTensor shard where the parameter is one."""
    tensor = tensor.to(_local(param).device)
    if hasattr(param, "to_local") and tensor.dim() > 0 and tensor.shape == param.to_local().shape:
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(tensor, param.device_mesh, param.placements, run_check=False, shape=param.shape,
                                  stride=param.stride())
    return tensor


def parameter_bytes(model) -> int:
    """Bytes of parameters this rank holds (its shards under FSDP2)."""
    return sum(_local(p).numel() * _local(p).element_size() for p in model.parameters())
