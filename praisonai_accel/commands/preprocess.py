"""praisonai-accel preprocess CONFIG: tokenize and cache, exactly as training will, with no GPU and no launch."""

from __future__ import annotations

from pathlib import Path

import typer

from ..config import load_config
from ..launcher.prelaunch import check_local_inputs
from ._common import tokenized_or_fail


def preprocess_command(config: Path = typer.Argument(..., help="config.yaml")) -> None:
    """Tokenize the datasets into output_dir's cache (run it once before a multi-node job)."""
    from ..data import cache_dir

    cfg = load_config(config)
    check_local_inputs(cfg)
    _tokenizer, data, stats, cached, evaluation = tokenized_or_fail(cfg)
    for d in stats.datasets:
        typer.echo(f"{d.line()}; {d.tokens:,} tokens, {d.target_tokens / max(d.tokens, 1):.1%} trained")
    for warning in stats.warnings():
        typer.echo(f"warning: {warning}", err=True)
    if evaluation is not None:
        typer.echo(f"eval: {len(evaluation)} examples")
    typer.echo(f"{'already cached' if cached else 'cached'} in {cache_dir(cfg)}")
