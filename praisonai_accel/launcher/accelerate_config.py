"""The accelerate config file handed to `accelerate launch --config_file`.

Written with yaml.safe_dump so values such as 'no' stay strings (a bare `no` reads back as false).
"""

from __future__ import annotations

from pathlib import Path

import yaml

FSDP2_CONFIG = {
    "fsdp_version": 2,
    "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",  # the model's own _no_split_modules (decoder layers)
    "fsdp_reshard_after_forward": True,
    "fsdp_offload_params": False,
    "fsdp_cpu_ram_efficient_loading": True,  # rank 0 reads the weights; the others get its shards by broadcast
    "fsdp_state_dict_type": "SHARDED_STATE_DICT",  # checkpoints: each rank writes its shard (checkpoint.py)
    "fsdp_activation_checkpointing": False,
}


def build_accelerate_config(num_processes: int, mixed_precision: str = "no", gpu_ids: str = "all", *,
                            num_machines: int = 1, machine_rank: int = 0, main_process_ip: str | None = None,
                            main_process_port: int | None = None, rdzv_backend: str = "static",
                            fsdp: bool = False) -> dict:
    """One machine's launch config: one process per GPU under DDP (or FSDP2), or one plain process.

    `num_processes` counts every process on every machine, as accelerate's files do. On a machine
    without GPUs a MULTI_GPU config still gives real DDP over gloo, whereas `distributed_type:
    MULTI_CPU` / `--cpu` silently starts a single process.
    """
    distributed = "FSDP" if fsdp else ("MULTI_GPU" if num_processes > 1 else "NO")
    config = {
        "compute_environment": "LOCAL_MACHINE",
        "debug": False,
        "distributed_type": distributed,
        "downcast_bf16": "no",
        "enable_cpu_affinity": False,
        "gpu_ids": gpu_ids,
        "machine_rank": machine_rank,
        "main_training_function": "main",
        "mixed_precision": mixed_precision,
        "num_machines": num_machines,
        "num_processes": num_processes,
        "rdzv_backend": rdzv_backend,
        # static: torchrun's MASTER_ADDR/PORT; c10d: a rendezvous endpoint that assigns ranks
        "same_network": rdzv_backend == "static",
        "use_cpu": False,
    }
    if num_machines > 1:
        config["main_process_ip"] = main_process_ip
        config["main_process_port"] = main_process_port
    if fsdp:
        config["fsdp_config"] = dict(FSDP2_CONFIG)
    return config



def read_accelerate_config(path: Path) -> dict:
    data = yaml.safe_load(Path(path).read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not an accelerate config (expected a mapping)")
    return data


def total_processes(accelerate_config: dict) -> int:
    # In accelerate's files num_processes already counts every process on every machine.
    return int(accelerate_config.get("num_processes", 1))
