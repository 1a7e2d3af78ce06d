"""praisonai-accel chat / generate: try a trained model before publishing it."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import List, Optional

import typer

from ..errors import first_line
from ..logs import show_progress_lines
from ._common import fail


def _load(path: Path, trust_remote_code: bool, image_paths: Optional[List[Path]], command: str):
    """(model, tokenizer or processor, images): every --image read and the model checked to take images before it
    loads, each failure in one line."""
    from ..data.vision_processor import is_vision_config
    from ..models.inference import (ModelDirError, is_processor, load_for_inference, model_config_of, read_image,
                                    resolve_model_dir, reward_model_refusal)

    show_progress_lines()
    try:
        images = [read_image(p) for p in image_paths or []]
    except ValueError as exc:
        fail(f"--image {first_line(exc)}")
    try:
        model_dir = resolve_model_dir(path)
        refusal = reward_model_refusal(model_dir, command)
        if refusal:
            fail(refusal)
        if images:
            config = model_config_of(model_dir, trust_remote_code)
            if not is_vision_config(config):
                fail(f"--image: {model_dir} holds a text-only model ({config.model_type}); images need a "
                     "vision-language model")
        model, tokenizer = load_for_inference(path, trust_remote_code=trust_remote_code)
    except (ModelDirError, OSError, ValueError) as exc:
        fail(first_line(exc))
    if images and not is_processor(tokenizer):
        fail(f"--image: {path} was saved without its processor (no preprocessor_config.json here or in its base "
             "model), so images cannot reach it")
    return model, tokenizer, images


_IMAGE_HELP = "an image file for the first message (a vision-language model); repeat for several"


def chat_command(
    path: Path = typer.Argument(..., help="adapter directory, merged model, or training output_dir"),
    system: Optional[str] = typer.Option(None, "--system", help="system prompt"),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", min=1),
    temperature: float = typer.Option(0.0, "--temperature", min=0.0, help="0 = greedy"),
    trust_remote_code: bool = typer.Option(False, "--trust-remote-code", help="run the model's own code (as trained with trust_remote_code: true)"),
    image: Optional[List[Path]] = typer.Option(None, "--image", help=_IMAGE_HELP),
) -> None:
    """Chat with the model on stdin (one message per line; empty line or EOF ends). On a terminal, Ctrl-C during a
    reply drops that message and its reply, and at the prompt ends the chat."""
    from ..models import inference

    model, tokenizer, images = _load(path, trust_remote_code, image, "chat")
    messages = [{"role": "system", "content": system}] if system else []
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            typer.echo("you> ", nl=False)
        try:
            line = sys.stdin.readline()
        except KeyboardInterrupt:
            if not interactive:
                raise
            line = ""
        if not line or not line.strip() or line.strip() in ("exit", "quit"):
            if interactive and not line.endswith("\n"):  # Ctrl-D or Ctrl-C: the shell's prompt on a line of its own
                typer.echo("")
            break
        messages.append({"role": "user", "content": line.strip()})
        try:
            reply = inference.generate(model, tokenizer, messages, max_new_tokens, temperature, images=images)
        except KeyboardInterrupt:
            if not interactive:
                raise
            messages.pop()  # as if never sent: the next message follows the last full exchange
            typer.echo("\n(stopped; that message is dropped)")
            continue
        messages.append({"role": "assistant", "content": reply})
        typer.echo(f"model> {reply}" if interactive else reply)


def generate_command(
    path: Path = typer.Argument(..., help="adapter directory, merged model, training output_dir, or a .gguf file"),
    prompt: List[str] = typer.Option(..., "--prompt", "-p", help="a prompt; repeat for several"),
    system: Optional[str] = typer.Option(None, "--system", help="system prompt"),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", min=1),
    temperature: float = typer.Option(0.0, "--temperature", min=0.0, help="0 = greedy"),
    trust_remote_code: bool = typer.Option(False, "--trust-remote-code", help="run the model's own code (as trained with trust_remote_code: true)"),
    image: Optional[List[Path]] = typer.Option(
        None, "--image", help="an image file each prompt is about (a vision-language model); repeat for several"),
) -> None:
    """Answer each --prompt once, one reply per line. A .gguf file is run by llama.cpp, in a child process."""
    conversations = [([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
                     for text in prompt]
    if path.suffix.lower() == ".gguf":
        replies = _generate_from_gguf(path, conversations, max_new_tokens, temperature, image)
    else:
        from ..models.inference import generate

        model, tokenizer, images = _load(path, trust_remote_code, image, "generate")
        replies = [generate(model, tokenizer, messages, max_new_tokens, temperature, images=images)
                   for messages in conversations]
    for reply in replies:
        typer.echo(reply.replace("\n", " "))


def _generate_from_gguf(path: Path, conversations: list[list[dict]], max_new_tokens: int, temperature: float,
                        image) -> list[str]:
    from ..publish.gguf_engine import generate as generate_from_gguf
    from ..publish.gguf_llamacpp import GGUFError, check_engine

    if image:
        fail(f"--image: {path} is a GGUF file, which our GGUF path keeps text-only; use the safetensors model")
    if not path.is_file():
        fail(f"{path}: no such GGUF file")
    try:
        check_engine()
        return generate_from_gguf(path, conversations, max_new_tokens, temperature)
    except GGUFError as exc:
        fail(str(exc))
