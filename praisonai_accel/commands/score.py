"""praisonai-accel score: the rewards a trained reward model (method: reward) gives prompt + completion pairs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import typer

from ..errors import first_line
from ._common import fail


def _read_pairs(path: Path) -> list[tuple]:
    """(prompt, completion) of each JSONL line: text, or lists of messages as in the training data."""
    pairs = []
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        fail(f"--file {path}: {first_line(exc)}")
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as exc:
            fail(f"--file {path}, line {number}: not JSON ({first_line(exc)})")
        if not isinstance(row, dict) or row.get("completion") in (None, "") or "prompt" not in row:
            fail(f"--file {path}, line {number}: needs 'prompt' and 'completion'")
        pairs.append((row["prompt"], row["completion"]))
    if not pairs:
        fail(f"--file {path}: no rows")
    return pairs


def score_command(
    path: Path = typer.Argument(..., help="the reward model: its final model directory, or the training output_dir"),
    prompt: Optional[List[str]] = typer.Option(None, "--prompt", "-p", help="a prompt; repeat, one per --completion"),
    completion: Optional[List[str]] = typer.Option(None, "--completion", "-c", help="the completion to score"),
    file: Optional[Path] = typer.Option(None, "--file", help="JSONL of prompt / completion rows (text or messages)"),
    raw: bool = typer.Option(False, "--raw", help="score text as it is, without the chat template (a model trained "
                                                   "on plain-text pairs)"),
    batch_size: int = typer.Option(8, "--batch-size", min=1),
) -> None:
    """Print the reward of each prompt + completion, one per line, in order. Text is put in the chat template as a
    user and an assistant message, as conversational training rows are, unless --raw."""
    from ..models.inference import ModelDirError, resolve_model_dir
    from ..methods.reward import reward_model_problem
    from ..methods.reward_scoring import load_scorer, score_texts

    prompt, completion = prompt or [], completion or []
    if file is not None:
        if prompt or completion:
            fail("score: give --file or --prompt / --completion, not both")
        pairs = _read_pairs(file)
    else:
        if not completion or len(prompt) != len(completion):
            fail(f"score: {len(prompt)} --prompt and {len(completion)} --completion; give one --prompt per "
                 "--completion (or --file)")
        pairs = list(zip(prompt, completion))
    try:
        model_dir = resolve_model_dir(path)
    except ModelDirError as exc:
        fail(str(exc))
    problem = reward_model_problem(model_dir)
    if problem:
        fail(problem)
    try:
        model, tokenizer = load_scorer(model_dir)
    except (OSError, ValueError) as exc:
        fail(f"{model_dir}: cannot load: {first_line(exc)}")
    for reward in score_texts(model, tokenizer, pairs, batch_size, chat=False if raw else None):
        typer.echo(f"{reward:.6f}")
