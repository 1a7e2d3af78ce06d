"""Shared CLI plumbing: one-line errors and cheap checks that run before anything heavy."""

from __future__ import annotations

from pathlib import Path
from typing import NoReturn

import typer

LOCAL_SUFFIXES = (".json", ".jsonl", ".csv", ".parquet", ".txt")


def fail(message: str, code: int = 2) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def looks_local(name: str) -> bool:
    """A path the user meant to be on disk, as opposed to a Hub id such as org/model."""
    return name.startswith(("/", "./", "../", "~")) or name.lower().endswith(LOCAL_SUFFIXES)


def check_local_inputs(config) -> None:
    """Catch missing local model/data paths before any process is started."""
    if looks_local(config.model_name) and not Path(config.model_name).expanduser().exists():
        fail(f"model_name: no such directory '{config.model_name}'")
    for key in ("dataset", "eval_dataset"):
        for index, spec in enumerate(getattr(config, key) or []):
            if looks_local(spec.name) and not Path(spec.name).expanduser().exists():
                fail(f"{key}[{index}].name: no such file or directory '{spec.name}'")


def check_resume(config, num_processes: int) -> str:
    """Refuse a resume that the training module would refuse, before any process starts; describe the start."""
    from .. import checkpoint as ckpt
    from ..config import ConfigError

    try:
        start = ckpt.checkpoint_to_resume(config.output_path(), config.resume_from_checkpoint,
                                          config.run_fingerprint(), config.overwrite_output_dir)
        if start is None:
            return "fresh start"
        ckpt.resume_skip(ckpt.CheckpointState.read(start), num_processes, config.per_device_train_batch_size)
    except ConfigError as exc:
        fail(str(exc))
    return f"resume from {start}"


def load_config_or_fail(path: Path):
    from ..config import ConfigError, load_config

    try:
        return load_config(path)
    except ConfigError as exc:
        fail(str(exc))


def count_cuda_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def bf16_supported() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
