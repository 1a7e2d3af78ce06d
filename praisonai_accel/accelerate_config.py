"""The accelerate config file handed to `accelerate launch --config_file`.

Written with yaml.safe_dump so values such as 'no' stay strings (a bare `no` reads back as false).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import yaml


def build_accelerate_config(num_processes: int, mixed_precision: str = "no", gpu_ids: str = "all") -> dict:
    """Single-machine config: one process per GPU under DDP, or one plain process.

    On a machine without GPUs a MULTI_GPU config still gives real DDP over gloo, whereas
    `distributed_type: MULTI_CPU` / `--cpu` silently starts a single process.
    """
    return {
        "compute_environment": "LOCAL_MACHINE",
        "debug": False,
        "distributed_type": "MULTI_GPU" if num_processes > 1 else "NO",
        "downcast_bf16": "no",
        "enable_cpu_affinity": False,
        "gpu_ids": gpu_ids,
        "machine_rank": 0,
        "main_training_function": "main",
        "mixed_precision": mixed_precision,
        "num_machines": 1,
        "num_processes": num_processes,
        "rdzv_backend": "static",
        "same_network": True,
        "use_cpu": False,
    }


def write_yaml_atomic(data: dict, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w") as handle:
        yaml.safe_dump(data, handle, sort_keys=True)
    os.replace(tmp, path)
    return path


def read_accelerate_config(path: Path) -> dict:
    data = yaml.safe_load(Path(path).read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not an accelerate config (expected a mapping)")
    return data


def total_processes(accelerate_config: dict) -> int:
    # In accelerate's files num_processes already counts every process on every machine.
    return int(accelerate_config.get("num_processes", 1))
