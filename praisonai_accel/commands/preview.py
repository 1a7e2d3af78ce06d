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
    from ..preview import dataset_rows, histogram, marked_text

    cfg = load_config(config)
    check_local_inputs(cfg)
    tokenizer, data, stats, cached, _evaluation = tokenized_or_fail(cfg)
    colour = sys.stdout.isatty()
    console = Console(highlight=False, soft_wrap=True) if colour else None
    show = console.print if colour else typer.echo
    legend = "trained tokens in green" if colour else "trained tokens between [[ and ]]"
    for index in range(min(examples, len(data))):
        row = data[index]
        trained = int((row["labels"] != IGNORE_INDEX).sum())
        show(f"--- example {index + 1} of {len(data)}: {len(row['input_ids'])} tokens, {trained} trained ({legend})")
        show(marked_text(tokenizer, row["input_ids"], row["labels"], colour))
    for row in dataset_rows(data, stats):
        typer.echo(f"=== {row['name']}")
        typer.echo(f"examples {row['examples']} of {row['rows']} | tokens {row['tokens']:,} | trained fraction "
                   f"{row['trained_fraction']:.1%} | truncated by max_seq_length {row['truncated']} "
                   f"(response cut {row['response_cut']}) | dropped {row['dropped']}"
                   + (f" | invalid skipped {row['invalid']}" if row["invalid"] else ""))
        typer.echo(f"masking: {row['masking']}")
        typer.echo(f"lengths (max_seq_length {cfg.max_seq_length}):")
        for line in histogram(row["lengths"], cfg.max_seq_length):
            typer.echo(f"  {line}")
    for warning in stats.warnings():
        typer.echo(f"warning: {warning}", err=True)
    typer.echo(f"({'from the cache' if cached else 'tokenized and cached'}; training reads the same cache)")
