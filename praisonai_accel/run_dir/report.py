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

from ..atomic import atomic_path
from . import checkpoints as ckpt_dir
from .metrics import headline_names, read_metrics

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
    adapter: str | None  # the final model's directory, adapter or whole model
    headline: dict[str, tuple[float, float]] = field(default_factory=dict)  # the method's metrics: first, last
    full_model: bool = False  # a full fine-tune: the final directory holds a model, not an adapter
    method_rows: list[tuple[str, str]] = field(default_factory=list)  # the method's (TrainingMethod.report_rows)
    task_scores: dict[str, tuple[float, float]] = field(default_factory=dict)  # eval_tasks' scores: first, last

    def rows(self) -> list[tuple[str, str]]:
        def number(value, fmt=".4f"):
            return "n/a" if value is None else format(value, fmt)

        planned = f" of {self.steps_planned}" if self.steps_planned else ""
        headline = [(f"{name} (first -> last)", f"{number(first)} -> {number(last)}")
                    for name, (first, last) in self.headline.items()]
        return [
            ("status", self.status),
            ("steps", f"{self.steps_done}{planned}"),
            ("loss (first -> last)", f"{number(self.first_loss)} -> {number(self.last_loss)}"),
            *headline,
            *self.method_rows,
            ("best training loss", number(self.best_loss)),
            ("best eval loss", number(self.best_eval_loss)),
            *((f"{name} (first -> last)", f"{number(first)} -> {number(last)}")
              for name, (first, last) in self.task_scores.items()),
            ("tokens/s (median)", number(self.tokens_per_second, ",.0f")),
            ("training time", "n/a" if self.elapsed_seconds is None else f"{self.elapsed_seconds:.1f} s"),
            ("checkpoints", ", ".join(self.checkpoints) or "none"),
            ("model" if self.full_model else "adapter", self.adapter or "not saved yet"),
        ]


def read_run(output_dir: Path, method_rows=None) -> RunReport:
    """`method_rows(progress, records)`: the rows the run's training method adds (the report command asks the
    method registry, a room above this one)."""
    output_dir = Path(output_dir)
    records = read_metrics(output_dir / "metrics.jsonl")
    steps = [r for r in records if "loss" in r]
    evals = [r["eval_loss"] for r in records if "eval_loss" in r]
    progress = _read_json(output_dir / "progress.json")
    summary = _read_json(output_dir / "train_summary.json")
    speeds = sorted(r["tokens_per_second"] for r in steps if r.get("tokens_per_second"))
    done = steps[-1]["step"] if steps else 0
    checkpoints = [p.name for p in ckpt_dir.complete_checkpoints(output_dir)]
    final = summary.get("final_model_dir") or progress.get("final_model_dir")
    final_dir = Path(final) if final and Path(final).is_dir() else None
    return RunReport(
        status=_status(output_dir, progress, summary, checkpoints, bool(steps)),
        steps_done=summary.get("global_step", max(done, progress.get("global_step") or 0)),
        steps_planned=summary.get("total_steps") or progress.get("total_steps"),
        first_loss=steps[0]["loss"] if steps else None,
        last_loss=steps[-1]["loss"] if steps else None,
        best_loss=min((r["loss"] for r in steps), default=None),
        best_eval_loss=min(evals, default=None),
        tokens_per_second=speeds[len(speeds) // 2] if speeds else None,
        elapsed_seconds=_training_seconds(steps) if steps else None,
        checkpoints=checkpoints,
        adapter=str(final_dir) if final_dir else None,
        headline=_headline(steps, progress),
        full_model=final_dir is not None and not (final_dir / "adapter_config.json").is_file(),
        method_rows=method_rows(progress, records) if method_rows else [],
        task_scores=_task_scores(records, summary.get("eval_tasks") or ()),
    )


def _status(output_dir: Path, progress: dict, summary: dict, checkpoints: list[str], trained: bool) -> str:
    """How the run ended, as its progress.json says (the training loop writes it on every way out), or that it is
    still running: its run.lock is held."""
    state = progress.get("status")
    if summary or state == "finished":
        return "finished, but a push or an Ollama create failed (exit code 4)" if progress.get("exit_code") == 4 \
            else "finished"
    resume = (f"re-run the same command to resume from {checkpoints[-1]}" if checkpoints
              else "no checkpoint: a re-run starts from step 0")
    if state == "running" and _lock_held(output_dir):
        return "running"
    if state in ("interrupted", "preempted"):
        how = f" by {progress['signal']}" if progress.get("signal") else ""
        return f"{state}{how} at step {progress.get('global_step', 0)}; {resume}"
    if state == "failed":
        return f"failed (exit code {progress.get('exit_code')}); {resume}"
    if state == "running":
        written = output_dir / ("metrics.jsonl" if (output_dir / "metrics.jsonl").exists() else "progress.json")
        recent = time.time() - os.path.getmtime(written) < 600
        return ("running (or stopped in the last 10 minutes)" if recent and not (output_dir / "run.lock").exists()
                else f"interrupted without saying how (killed?); {resume}")
    if trained or progress:
        return f"interrupted; {resume}"
    return "not started"


def _lock_held(output_dir: Path) -> bool:
    """Whether a live run holds output_dir/run.lock (flock: the kernel drops it however the run ended)."""
    try:
        import fcntl

        fd = os.open(output_dir / "run.lock", os.O_RDONLY)
    except (ImportError, OSError):
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    except OSError:
        return True
    finally:
        os.close(fd)


def _training_seconds(steps: list[dict]) -> float:
    """Time spent training: each logged window's mean step time x its steps, so the hours between an interrupt and
    its resume are not counted."""
    total, previous = 0.0, 0
    for record in steps:
        if record["step"] <= previous:  # a resumed attempt re-logged a step: metrics.jsonl was trimmed, not here
            previous = 0
        total += record.get("step_seconds", 0) * (record["step"] - previous)
        previous = record["step"]
    return total


def headline_of(steps: list[dict], progress: dict) -> list[str]:
    """The method's headline metrics (progress.json names the patterns); runs from before it: reward, if logged."""
    patterns = progress.get("headline_metrics")
    if patterns is None:
        patterns = ["reward"]
    keys = {k for r in steps for k in r}
    return headline_names(patterns, keys)


def _headline(steps: list[dict], progress: dict) -> dict[str, tuple[float, float]]:
    out = {}
    for name in headline_of(steps, progress):
        values = [r[name] for r in steps if r.get(name) is not None]
        if values:
            out[name] = (values[0], values[-1])
    return out


def _task_scores(records: list[dict], tasks) -> dict[str, tuple[float, float]]:
    """eval_<task>/<metric> of eval_tasks, first and last evaluation."""
    prefixes = tuple(f"eval_{task}/" for task in tasks)
    out: dict[str, list[float]] = {}
    for record in records:
        for name, value in record.items():
            if prefixes and name.startswith(prefixes) and isinstance(value, (int, float)):
                out.setdefault(name, []).append(value)
    return {name: (values[0], values[-1]) for name, values in out.items()}


def _read_json(path: Path) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}


def write_loss_plot(output_dir: Path) -> Path | None:
    """output_dir/loss.png: training and eval loss and the learning rate against step, and beside it one panel for each
    of the method's headline metrics. None without matplotlib or data."""
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
    headline = headline_of(steps, _read_json(output_dir / "progress.json"))
    figure = Figure(figsize=(8 + 4 * len(headline), 4.5), dpi=100)
    FigureCanvasAgg(figure)
    loss_axis = figure.add_subplot(1, 1 + len(headline), 1)
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
    for index, name in enumerate(headline, start=2):  # one panel per headline metric, eval points where logged
        axis = figure.add_subplot(1, 1 + len(headline), index)
        logged = [r for r in steps if r.get(name) is not None]
        axis.plot([r["step"] for r in logged], [r[name] for r in logged], label=f"train {name}", color="tab:green")
        evaluated = [r for r in records if r.get(f"eval_{name}") is not None]
        if evaluated:
            axis.plot([r["step"] for r in evaluated], [r[f"eval_{name}"] for r in evaluated], "o-",
                      label=f"eval {name}", color="tab:orange")
        axis.set_xlabel("step")
        axis.set_title(name)
        axis.legend(loc="best")
    figure.tight_layout()
    target = output_dir / PLOT_NAME
    with atomic_path(target, suffix=".png") as tmp:
        figure.savefig(tmp)
    return target
