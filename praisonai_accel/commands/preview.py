"""praisonai-accel preview CONFIG: what training will see, trained tokens marked, per-dataset statistics."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from ..config import load_config
from ..launcher.prelaunch import check_local_inputs
from ._common import tokenized_or_fail


def preview_command(
    config: Path = typer.Argument(..., help="config.yaml"),
    examples: int = typer.Option(3, "-n", "--examples", min=0, help="examples to show"),
) -> None:
    """Tokenize exactly as training will (same cache) and show examples with the trained tokens highlighted."""
    from rich.console import Console

    from ..data import IGNORE_INDEX
    from ._preview import dataset_rows, example_parts, histogram, image_marks, marked_text

    cfg = load_config(config)
    check_local_inputs(cfg)
    tokenizer, data, stats, cached, _evaluation = tokenized_or_fail(cfg)
    colour = sys.stdout.isatty()
    console = Console(highlight=False, soft_wrap=True) if colour else None
    show = console.print if colour else typer.echo
    legend = "trained tokens in green" if colour else "trained tokens between [[ and ]]"

    def show_parts(parts, marks=()) -> None:
        for title, ids, labels in parts:
            if title:  # a preference example: its prompt, then each completion after it; a logged rollout
                show(f"- {title} ({len(ids)} tokens):")
            show(marked_text(tokenizer, ids, labels, colour, () if title else marks))

    for index in range(min(examples, len(data))):
        parts = example_parts(cfg, data[index])
        tokens = sum(len(ids) for _, ids, _ in parts)
        trained = sum(label != IGNORE_INDEX for _, _, labels in parts for label in labels)
        show(f"--- example {index + 1} of {len(data)}: {tokens} tokens, {trained} trained ({legend})")
        show_parts(parts, image_marks(tokenizer, data[index]))
    logged = type(cfg).training_method.logged_parts(cfg, examples)
    if logged:
        show(f"--- the run's last {len(logged)} logged rollout(s), as sampled ({legend})")
    for parts in logged:
        show_parts(parts)
    for row in dataset_rows(data, stats):
        typer.echo(f"=== {row['name']}")
        typer.echo(f"examples {row['examples']} of {row['rows']} | tokens {row['tokens']:,} | trained fraction "
                   f"{row['trained_fraction']:.1%} | truncated by max_seq_length {row['truncated']} "
                   f"(response cut {row['response_cut']}) | dropped {row['dropped']}"
                   + (f" | invalid skipped {row['invalid']}" if row["invalid"] else ""))
        typer.echo(f"masking: {row['masking']}")
        longest = max([cfg.max_seq_length, *row["lengths"]])  # a preference pair is two sequences
        pairs = ", a pair counts both" if longest > cfg.max_seq_length else ""
        typer.echo(f"lengths (max_seq_length {cfg.max_seq_length}{pairs}):")
        for line in histogram(row["lengths"], longest):
            typer.echo(f"  {line}")
    for warning in stats.warnings():
        typer.echo(f"warning: {warning}", err=True)
    typer.echo(f"({'from the cache' if cached else 'tokenized and cached'}; training reads the same cache)")
