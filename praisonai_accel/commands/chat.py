"""praisonai-accel chat / generate: try a trained model before publishing it."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import List, Optional

import typer

from ..errors import first_line
from ..logs import show_progress_lines
from ._common import fail


def _load(path: Path, trust_remote_code: bool):
    from ..inference import ModelDirError, load_for_inference

    show_progress_lines()
    try:
        return load_for_inference(path, trust_remote_code=trust_remote_code)
    except (ModelDirError, OSError, ValueError) as exc:
        fail(first_line(exc))


def chat_command(
    path: Path = typer.Argument(..., help="adapter directory, merged model, or training output_dir"),
    system: Optional[str] = typer.Option(None, "--system", help="system prompt"),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", min=1),
    temperature: float = typer.Option(0.0, "--temperature", min=0.0, help="0 = greedy"),
    trust_remote_code: bool = typer.Option(False, "--trust-remote-code", help="run the model's own code (as trained with trust_remote_code: true)"),
) -> None:
    """Chat with the model on stdin (one message per line; empty line or EOF ends)."""
    from ..inference import generate

    model, tokenizer = _load(path, trust_remote_code)
    messages = [{"role": "system", "content": system}] if system else []
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            typer.echo("you> ", nl=False)
        line = sys.stdin.readline()
        if not line or not line.strip() or line.strip() in ("exit", "quit"):
            break
        messages.append({"role": "user", "content": line.strip()})
        reply = generate(model, tokenizer, messages, max_new_tokens, temperature)
        messages.append({"role": "assistant", "content": reply})
        typer.echo(f"model> {reply}" if interactive else reply)


def generate_command(
    path: Path = typer.Argument(..., help="adapter directory, merged model, or training output_dir"),
    prompt: List[str] = typer.Option(..., "--prompt", "-p", help="a prompt; repeat for several"),
    system: Optional[str] = typer.Option(None, "--system", help="system prompt"),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", min=1),
    temperature: float = typer.Option(0.0, "--temperature", min=0.0, help="0 = greedy"),
    trust_remote_code: bool = typer.Option(False, "--trust-remote-code", help="run the model's own code (as trained with trust_remote_code: true)"),
) -> None:
    """Answer each --prompt once, one reply per line."""
    from ..inference import generate

    model, tokenizer = _load(path, trust_remote_code)
    for text in prompt:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
        typer.echo(generate(model, tokenizer, messages, max_new_tokens, temperature).replace("\n", " "))
