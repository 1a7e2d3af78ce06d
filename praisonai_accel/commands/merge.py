"""praisonai-accel merge: fold a LoRA adapter into its base model."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from ..errors import first_line
from ..logs import show_progress_lines
from ._common import fail


def merge_command(
    path: Path = typer.Argument(..., help="the adapter directory, or the training output_dir"),
    to: Optional[Path] = typer.Option(None, "--to", help="where to write the merged model (default: <adapter>-merged)"),
    force: bool = typer.Option(False, "--force", help="replace an existing target even if praisonai-accel did not write it"),
    trust_remote_code: bool = typer.Option(False, "--trust-remote-code", help="run the model's own code (as trained with trust_remote_code: true)"),
) -> None:
    """Merge the LoRA adapter into the base model; save safetensors + tokenizer."""
    from ..models.inference import ModelDirError, resolve_model_dir
    from ..publish.merge import merge_adapter

    show_progress_lines()
    try:
        adapter = resolve_model_dir(path)
        target = to or adapter.with_name(adapter.name + "-merged")
        merge_adapter(adapter, target, force=force, trust_remote_code=trust_remote_code)
    except (ModelDirError, OSError) as exc:
        fail(first_line(exc))
    typer.echo(f"merged {adapter} into {target}")
