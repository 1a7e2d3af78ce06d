"""praisonai-accel publish ollama: create an Ollama model from a trained adapter or merged model."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from ..logs import show_progress_lines
from ._common import fail, one_line_errors

publish_app = typer.Typer(help="Publish a trained model.", no_args_is_help=True)


@publish_app.command("ollama")
@one_line_errors
def ollama_command(
    path: Path = typer.Argument(..., help="adapter directory, merged model, or training output_dir"),
    name: str = typer.Option(..., "--name", help="Ollama model name, name:tag"),
    from_: Optional[str] = typer.Option(None, "--from", help="an Ollama model to use as FROM instead of uploading the base model"),
    push: bool = typer.Option(False, "--push", help="also push it to the Ollama registry"),
    host: Optional[str] = typer.Option(None, "--host", help="Ollama server (default: $OLLAMA_HOST or localhost:11434)"),
    trust_remote_code: bool = typer.Option(False, "--trust-remote-code", help="run the model's own code (as trained with trust_remote_code: true)"),
) -> None:
    """Write a Modelfile next to the model and create it on the Ollama server."""
    from ..errors import first_line
    from ..models.inference import resolve_model_dir, reward_model_refusal
    from ..publish.ollama import OllamaRefused, publish

    show_progress_lines()
    try:
        model_dir = resolve_model_dir(path)
        refusal = reward_model_refusal(model_dir, "ollama")
        if refusal:
            raise OllamaRefused(refusal)
        modelfile = publish(model_dir, name, ollama_base=from_, push=push, host=host, trust_remote_code=trust_remote_code)
    except OllamaRefused as exc:
        fail(str(exc))
    except Exception as exc:  # connection refused, server errors, missing files: one line, never a traceback
        fail(f"ollama: {type(exc).__name__}: {first_line(exc, '')}".rstrip(": "))
    typer.echo(f"created Ollama model {name} (Modelfile: {modelfile})")
