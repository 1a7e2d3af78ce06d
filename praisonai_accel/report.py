"""What a run did, read from its output_dir alone: a table and output_dir/loss.png.

Works on a finished run, one in progress and an interrupted one: everything comes from
metrics.jsonl (written line by line), progress.json and the checkpoints on disk.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from .atomic import atomic_path
from .worker import checkpoint as ckpt
from .worker.metrics import read_metrics

log = logging.getLogger("praisonai_accel")
PLOT_NAME = "loss.png"


@dataclass
class RunReport:
    status: str
    steps_done: int
    steps_planned: int | None
    first_loss: float | None
    last_loss: float | None
    best_loss: float | None
    best_eval_loss: float | None
    tokens_per_second: float | None
    elapsed_seconds: float | None
    checkpoints: list[str]
    adapter: str | None
    method_rows: list[tuple[str, str]] = field(default_factory=list)  # the method's (TrainingMethod.report_rows)

    def rows(self) -> list[tuple[str, str]]:
        def number(value, fmt=".4f"):
            return "n/a" if value is None else format(value, fmt)

        planned = f" of {self.steps_planned}" if self.steps_planned else ""
        return [
            ("status", self.status),
            ("steps", f"{self.steps_done}{planned}"),
            *self.method_rows,
            ("loss (first -> last)", f"{number(self.first_loss)} -> {number(self.last_loss)}"),
            ("best training loss", number(self.best_loss)),
            ("best eval loss", number(self.best_eval_loss)),
            ("tokens/s (median)", number(self.tokens_per_second, ",.0f")),
            ("elapsed", "n/a" if self.elapsed_seconds is None else f"{self.elapsed_seconds:.1f} s"),
            ("checkpoints", ", ".join(self.checkpoints) or "none"),
            ("adapter", self.adapter or "not saved yet"),
        ]


def read_run(output_dir: Path) -> RunReport:
    output_dir = Path(output_dir)
    records = read_metrics(output_dir / "metrics.jsonl")
    steps = [r for r in records if "loss" in r]
    evals = [r["eval_loss"] for r in records if "eval_loss" in r]
    progress = _read_json(output_dir / "progress.json")
    summary = _read_json(output_dir / "train_summary.json")
    speeds = sorted(r["tokens_per_second"] for r in steps if r.get("tokens_per_second"))
    done = steps[-1]["step"] if steps else 0
    if summary:
        status = "finished"
    elif progress.get("status") == "running" and time.time() - os.path.getmtime(output_dir / "metrics.jsonl") < 600:
        status = "running (or stopped in the last 10 minutes)"
    elif steps or progress:
        status = "interrupted: re-run the same command to resume"
    else:
        status = "not started"
    final = summary.get("final_model_dir") or progress.get("final_model_dir")
    return RunReport(
        status=status,
        steps_done=summary.get("global_step", done),
        steps_planned=summary.get("total_steps") or progress.get("total_steps"),
        first_loss=steps[0]["loss"] if steps else None,
        last_loss=steps[-1]["loss"] if steps else None,
        best_loss=min((r["loss"] for r in steps), default=None),
        best_eval_loss=min(evals, default=None),
        tokens_per_second=speeds[len(speeds) // 2] if speeds else None,
        elapsed_seconds=(steps[-1]["time"] - steps[0]["time"] + steps[0].get("step_seconds", 0)) if steps else None,
        checkpoints=[p.name for p in ckpt.complete_checkpoints(output_dir)],
        adapter=final if final and Path(final).is_dir() else None,
        method_rows=_method_rows(progress, records),
    )


def _method_rows(progress: dict, records: list[dict]) -> list[tuple[str, str]]:
    """The rows the run's training method adds (progress.json names it); none when it cannot be found here."""
    from .methods.registry import method_class

    if not progress.get("method"):
        return []  # a run from before progress.json named its method
    try:
        method = method_class(progress["method"], progress.get("config_dir"))
    except ValueError as exc:
        log.warning("warning: %s; the report shows no rows of the method", exc)
        return []
    return method.report_rows(records)


def _read_json(path: Path) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}


def write_loss_plot(output_dir: Path) -> Path | None:
    """output_dir/loss.png: training and eval loss, and the learning rate, against step. None without matplotlib or data."""
    output_dir = Path(output_dir)
    records = read_metrics(output_dir / "metrics.jsonl")
    steps = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval_loss" in r]
    if not steps:
        return None
    try:  # the Figure API, not pyplot: no GUI backend, no global state, and a faster import
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        log.info("matplotlib is not installed; no loss plot (pip install matplotlib)")
        return None
    figure = Figure(figsize=(8, 4.5), dpi=100)
    FigureCanvasAgg(figure)
    loss_axis = figure.add_subplot()
    loss_axis.plot([r["step"] for r in steps], [r["loss"] for r in steps], label="train loss", color="tab:blue")
    if evals:
        loss_axis.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", label="eval loss", color="tab:orange")
    loss_axis.set_xlabel("step")
    loss_axis.set_ylabel("loss")
    lr_axis = loss_axis.twinx()
    lr_axis.plot([r["step"] for r in steps], [r.get("learning_rate") or 0 for r in steps], "--", color="tab:gray",
                 label="learning rate")
    lr_axis.set_ylabel("learning rate")
    lines = loss_axis.get_legend_handles_labels()[0] + lr_axis.get_legend_handles_labels()[0]
    loss_axis.legend(lines, [line.get_label() for line in lines], loc="upper right")
    loss_axis.set_title(output_dir.resolve().name)
    figure.tight_layout()
    target = output_dir / PLOT_NAME
    with atomic_path(target, suffix=".png") as tmp:
        figure.savefig(tmp)
    return target
