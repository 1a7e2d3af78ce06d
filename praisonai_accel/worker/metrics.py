"""Rank 0's view of the run: metrics.jsonl, experiment trackers, and the console (a progress bar on a terminal)."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..distributed import TTY_ENV

log = logging.getLogger("praisonai_accel")
_NOT_SHOWN = ("step", "time", "tokens", "positions", "targets", "examples", "model_flops")
TRACKED = ("loss", "eval_loss", "learning_rate", "grad_norm", "tokens_per_second", "step_seconds", "padding_fraction",
           "model_tflops_per_second")


def read_metrics(path: Path) -> list[dict]:
    """metrics.jsonl, skipping a last line cut short by a kill."""
    records = []
    if Path(path).exists():
        for line in Path(path).read_text().splitlines():
            try:
                records.append(json.loads(line))
            except ValueError:
                continue
    return records


@dataclass
class StepResult:
    loss_sum: float  # summed token losses
    targets: int  # tokens the loss was computed on
    tokens: int  # real input tokens
    positions: int  # tokens processed, padding included
    grad_norm: float | None
    stop: bool  # some rank received SIGTERM
    examples: int = 0  # training examples (several to a packed row)
    flops: float = 0.0  # model FLOPs (flops.py), all ranks
    units: int | None = None  # what the loss is a mean over (methods/base.py); target tokens when None
    metric_sums: dict | None = None  # the method's metrics, summed over units


class Window:
    """Steps since the last log line, summed over ranks."""

    def __init__(self, reduce_metrics=None):
        # a training method's metrics, as it logs them from their sums (methods/base.py)
        self.reduce_metrics = reduce_metrics or (lambda sums, units: {k: v / max(units, 1) for k, v in sums.items()})
        self.steps = self.targets = self.tokens = self.positions = self.examples = self.units = 0
        self.loss_sum = self.flops = 0.0
        self.metric_sums: dict[str, float] = {}
        self.started = time.perf_counter()

    def add(self, step: StepResult) -> None:
        self.steps += 1
        self.loss_sum += step.loss_sum
        self.targets += step.targets
        self.tokens += step.tokens
        self.positions += step.positions
        self.examples += step.examples
        self.flops += step.flops
        self.units += step.targets if step.units is None else step.units
        for name, value in (step.metric_sums or {}).items():
            self.metric_sums[name] = self.metric_sums.get(name, 0.0) + value

    def record(self, state, learning_rate: float, grad_norm: float | None, batches_per_epoch: int) -> dict:
        elapsed = time.perf_counter() - self.started
        return {
            "step": state.global_step,
            "epoch": round(state.epoch + state.batches_in_epoch / max(batches_per_epoch, 1), 4),
            "loss": self.loss_sum / max(self.units, 1),
            **(self.reduce_metrics(self.metric_sums, self.units) if self.metric_sums else {}),
            "learning_rate": learning_rate,
            "grad_norm": grad_norm,
            "tokens_per_second": self.tokens / elapsed if elapsed > 0 else None,
            "model_tflops_per_second": self.flops / elapsed / 1e12 if elapsed > 0 and self.flops else None,
            "step_seconds": elapsed / max(self.steps, 1),
            "padding_fraction": 1 - self.tokens / max(self.positions, 1),
            "tokens": self.tokens,
            "positions": self.positions,
            "targets": self.targets,
            "examples": self.examples,
            "model_flops": self.flops,
            "time": time.time(),
        }


class MetricsLogger:
    """Does nothing on ranks other than 0, so callers need no `if is_main_process`.

    Every record goes to metrics.jsonl and to the experiment trackers (`tracker_log`, Accelerate's
    accelerator.log). On a terminal the console shows a progress bar with loss, tokens/s and ETA;
    piped, it gets one plain line per logging step.
    """

    def __init__(self, path: Path, total_steps: int, enabled: bool, start_step: int = 0, append: bool = False,
                 tracker_log: Callable[[dict, int], None] | None = None):
        self.path = Path(path)
        self.total_steps = total_steps
        self.enabled = enabled
        self.start_step = start_step
        self.append = append
        self.tracker_log = tracker_log
        self._file = None
        self._progress = None
        self._task = None

    def __enter__(self) -> "MetricsLogger":
        if not self.enabled:
            return self
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a" if self.append else "w")
        if sys.stderr.isatty() or os.environ.get(TTY_ENV) == "1":
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._progress = Progress(
                TextColumn("[bold]training"), BarColumn(), MofNCompleteColumn(), TextColumn("eta"),
                TimeRemainingColumn(), TextColumn("{task.fields[status]}"), console=Console(stderr=True, force_terminal=True),
                transient=False,
            )
            self._progress.start()
            self._task = self._progress.add_task("train", total=self.total_steps, completed=self.start_step, status="")
        return self

    def log(self, record: dict) -> None:
        """A training step record; also moves the progress bar."""
        if self.enabled and self._progress is not None:
            speed = record.get("tokens_per_second")
            status = f"loss {record['loss']:.4f}" + (f"  {speed:,.0f} tok/s" if speed else "")
            self._progress.update(self._task, completed=record["step"], status=status)
        self._write(record, show=self._progress is None)

    def log_event(self, record: dict) -> None:
        """An eval result or a checkpoint."""
        self._write(record, show=True)

    def _write(self, record: dict, show: bool) -> None:
        if not self.enabled:
            return
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self.tracker_log is not None:
            values = {k: v for k, v in record.items() if (k in TRACKED or "/" in k) and v is not None}  # + a method's own
            if values:
                self.tracker_log(values, record["step"])
        if show:
            line = f"step {record['step']}/{self.total_steps} " + " ".join(
                f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                for k, v in record.items() if k not in _NOT_SHOWN and v is not None
            )
            (self._progress.console.print if self._progress is not None else log.info)(line)

    def __exit__(self, *exc) -> None:
        if self._progress is not None:
            self._progress.stop()
        if self._file is not None:
            self._file.close()
