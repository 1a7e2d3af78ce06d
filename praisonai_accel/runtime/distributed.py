"""What this process knows about the run it belongs to, read from the torchrun environment.

Accelerate and torchrun both export LOCAL_RANK, RANK and WORLD_SIZE to every worker; nothing
here imports torch, so it is cheap to use before the heavy imports.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping

from ..config import MULTI_DEVICE_MAPS, ConfigError

UNSLOTH_DDP_FLAG = "UNSLOTH_USE_NEW_MODEL"
# transformers' ddp_backend: gloo lets several ranks share one GPU (NCCL refuses two ranks on one device)
DDP_BACKEND_ENV = "PRAISONAI_ACCEL_DDP_BACKEND"
DDP_BACKENDS = ("nccl", "gloo")


def device_map_rule(device_map, num_processes: int) -> None:
    """One model spread over several GPUs cannot also be replicated by DDP."""
    if num_processes > 1 and isinstance(device_map, str) and device_map in MULTI_DEVICE_MAPS:
        raise ConfigError(
            f"device_map: '{device_map}' spreads one model over several GPUs and cannot be used with "
            f"{num_processes} DDP processes; remove device_map to load the full model on each rank's GPU")


@dataclass(frozen=True)
class DistEnv:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> "DistEnv":
        environ = os.environ if environ is None else environ
        return cls(
            rank=int(environ.get("RANK", 0)),
            local_rank=int(environ.get("LOCAL_RANK", 0)),
            world_size=int(environ.get("WORLD_SIZE", 1)),
        )

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def attempt_id() -> str:
    """The same on every rank of one launch attempt, different on a restart or another run."""
    return "-".join(os.environ.get(k, "0") for k in ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT"))


def fsdp_requested(environ: Mapping[str, str] | None = None) -> bool:
    """accelerate launch with an FSDP config exports this to every worker."""
    environ = os.environ if environ is None else environ
    return environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"


def resolve_device_map(requested: Any, env: DistEnv, cuda_available: bool, sharded: bool = False,
                       device_count: int = 0) -> Any:
    """Where from_pretrained should put the weights of this rank's full copy of the model.

    Under DDP every rank holds the whole model on its own GPU; sharding it across GPUs with
    "auto" would make the ranks fight over the same devices. Under FSDP (`sharded`) nothing is placed:
    rank 0 reads the weights into host memory, the others build the model on the meta device, and
    FSDP moves each rank's shards to its GPU. With more ranks than GPUs (`device_count`, 0 when unknown) a rank's
    GPU is its local rank modulo the count, as accelerate places it.
    """
    if env.is_distributed and sharded:
        if requested not in (None, "cuda", "cpu"):
            raise ConfigError("device_map: under FSDP every rank holds a shard of the model; remove device_map")
        return None
    if env.is_distributed:
        device_map_rule(requested, env.world_size)
        if requested not in (None, "cuda", "cpu"):
            raise ConfigError("device_map: under DDP each rank loads the whole model on its own device; remove device_map")
        if requested == "cpu" or not cuda_available:
            return None
        return {"": env.local_rank % device_count if device_count else env.local_rank}
    if requested is not None:
        return requested
    return {"": 0} if cuda_available else None


def mark_unsloth_ddp(env: DistEnv, environ: dict | None = None) -> None:
    """Unsloth only builds a DDP-safe model when this is set before it is imported."""
    environ = os.environ if environ is None else environ
    if env.is_distributed:
        environ[UNSLOTH_DDP_FLAG] = "1"


def ddp_backend_kwargs(environ: Mapping[str, str] | None = None) -> dict:
    """init_process_group's backend, when PRAISONAI_ACCEL_DDP_BACKEND names one and there are several processes;
    accelerate's default otherwise (given a backend, accelerate treats even one process as distributed)."""
    environ = os.environ if environ is None else environ
    backend = environ.get(DDP_BACKEND_ENV, "").strip().lower()
    if not backend:
        return {}
    if backend not in DDP_BACKENDS:
        raise ConfigError(f"{DDP_BACKEND_ENV}={backend}: expected one of {', '.join(DDP_BACKENDS)}")
    return {"backend": backend} if DistEnv.from_environ(environ).is_distributed else {}


def gpu_has_bf16() -> bool:
    """Native bf16: compute capability 8.0 (Ampere) or newer. torch.cuda.is_bf16_supported() alone also counts
    emulation, which says yes on a T4 or V100 (7.x), where bf16 is slow or wrong."""
    import torch

    if not torch.cuda.is_available():
        return False
    major, _minor = torch.cuda.get_device_capability()
    return major >= 8 and torch.cuda.is_bf16_supported(including_emulation=False)


def resolve_mixed_precision(requested: str, use_cuda: bool, bf16_supported: bool) -> str:
    """"auto" means the fastest safe choice: bf16 where the GPU has it, fp16 on older GPUs, none on CPU."""
    if requested != "auto":
        return requested
    if not use_cuda:
        return "no"
    return "bf16" if bf16_supported else "fp16"
