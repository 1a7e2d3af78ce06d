"""praisonai-accel report OUTPUT_DIR: what a run did (finished, running or interrupted), and a fresh loss plot."""

from __future__ import annotations

import logging
from pathlib import Path

import typer

from ..run_dir.lock import LOCK_NAME
from ._common import fail

log = logging.getLogger("praisonai_accel")

# what a run writes in its output_dir from its start (the lock, taken before anything else) to its end, and the
# results `eval` keeps there
RUN_FILES = (LOCK_NAME, "progress.json", "metrics.jsonl", "train_summary.json", "logs", "eval")


def report_command(output_dir: Path = typer.Argument(..., help="a training output_dir")) -> None:
    """A table of the run and output_dir/loss.png, read from its files alone."""
    from ..evaluate.results import eval_rows
    from ..run_dir.report import read_run, write_loss_plot

    if not output_dir.is_dir():
        fail(f"{output_dir}: no such directory")
    if not any((output_dir / name).exists() for name in RUN_FILES) and not any(output_dir.glob("checkpoint-*")):
        fail(f"{output_dir}: holds no training run (no progress.json, metrics.jsonl, checkpoint-N or eval results); "
             "name a run's output_dir")
    run = read_run(output_dir, method_rows)
    rows = run.rows() + eval_rows(output_dir)  # the latest `praisonai-accel eval` of this run, if any
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        typer.echo(f"{name:<{width}}  {value}")
    plot = write_loss_plot(output_dir)
    typer.echo(f"{'plot':<{width}}  {plot if plot else 'no training steps logged yet'}")


def method_rows(progress: dict, records: list[dict]) -> list[tuple[str, str]]:
    """The rows the run's training method adds (progress.json names it); none when it cannot be found here."""
    from ..methods.registry import method_class

    if not progress.get("method"):
        return []  # a run from before progress.json named its method
    try:
        method = method_class(progress["method"], progress.get("config_dir"))
    except ValueError as exc:
        log.warning("warning: %s; the report shows no rows of the method", exc)
        return []
    return method.report_rows(records)
