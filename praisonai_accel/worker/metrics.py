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

from ..runtime.handoff import TTY_ENV
from ..logs import end_status_line, start_status_line
from ..run_dir.metrics import headline_names

log = logging.getLogger("praisonai_accel")
TRACKED = ("loss", "eval_loss", "learning_rate", "grad_norm", "tokens_per_second", "step_seconds", "padding_fraction",
           "model_tflops_per_second")


def short_name(name: str) -> str:
    """rewards/accuracies -> accuracies, rewards/correct/mean -> correct, completions/mean_length -> mean_length."""
    return name.removeprefix("rewards/").removeprefix("completions/").removesuffix("/mean")


def _number(value) -> str:
    if not isinstance(value, float):
        return str(value)
    return f"{value:.4g}" if abs(value) < 1000 else f"{value:,.0f}"


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
        self.loss_sum = self.flops = self.grad_norm_sum = 0.0
        self.grad_norms = 0  # steps that reported a norm
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
        if step.grad_norm is not None:
            self.grad_norm_sum += step.grad_norm
            self.grad_norms += 1
        for name, value in (step.metric_sums or {}).items():
            self.metric_sums[name] = self.metric_sums.get(name, 0.0) + value

    def record(self, state, learning_rate: float, batches_per_epoch: int) -> dict:
        """Loss, the method's metrics and grad_norm are means over the window's steps, like each other."""
        elapsed = time.perf_counter() - self.started
        return {
            "step": state.global_step,
            "epoch": round(state.epoch + state.batches_in_epoch / max(batches_per_epoch, 1), 4),
            "loss": self.loss_sum / max(self.units, 1),
            **(self.reduce_metrics(self.metric_sums, self.units) if self.metric_sums else {}),
            "learning_rate": learning_rate,
            "grad_norm": self.grad_norm_sum / self.grad_norms if self.grad_norms else None,
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
    accelerator.log). The console gets short lines: loss, the method's headline metrics (`headline`, patterns),
    grad_norm, learning rate and tokens/s. On a terminal a progress bar redraws in place below them and moves
    every optimizer step (`advance`); piped, there is one plain line per logging step.
    """

    def __init__(self, path: Path, total_steps: int, enabled: bool, start_step: int = 0, append: bool = False,
                 tracker_log: Callable[[dict, int], None] | None = None, headline=(), scores=()):
        self.path = Path(path)
        self.total_steps = total_steps
        self.enabled = enabled
        self.start_step = start_step
        self.append = append
        self.tracker_log = tracker_log
        self.headline = tuple(headline)
        self.scores = tuple(scores)  # the prefixes of eval_tasks' scores (eval_<task>/), shown with each evaluation
        self.first: dict | None = None  # this attempt's first and last training records, and its last evaluation
        self.last: dict | None = None
        self.last_eval: dict | None = None
        self._file = None
        self._bar = None
        self._status = ""
        self._step = start_step
        self._started = time.perf_counter()

    def __enter__(self) -> "MetricsLogger":
        if not self.enabled:
            return self
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a" if self.append else "w")
        if sys.stderr.isatty() or os.environ.get(TTY_ENV) == "1":
            self._bar = start_status_line(sys.stderr)
            self._draw()
        return self

    def advance(self, step: int) -> None:
        """An optimizer step finished: the bar moves, whether or not the step logs."""
        self._step = step
        if self.enabled and self._bar is not None:
            self._draw()

    def _draw(self) -> None:
        done, total = self._step, max(self.total_steps, 1)
        counter = f" {done}/{self.total_steps}"
        rate = (done - self.start_step) / max(time.perf_counter() - self._started, 1e-9)
        eta = f" eta {_duration((total - done) / rate)}" if done > self.start_step and rate > 0 else ""
        tail = counter + eta + (f" | {self._status}" if self._status else "")
        room = self._bar.width() - len("training ") - len(tail)
        cells = max(10, min(40, room))
        filled = round(cells * done / total)
        self._bar.show(f"training {'#' * filled}{'-' * (cells - filled)}{tail}")

    def console_line(self, record: dict) -> str:
        """loss, the headline metrics, grad_norm, learning rate, tokens/s: a short line whatever the method logs."""
        names = headline_names(self.headline, record)
        parts = [f"loss {record['loss']:.4f}"] + [f"{short_name(n)} {_number(record[n])}" for n in names
                                                   if record.get(n) is not None]
        if record.get("grad_norm") is not None:
            parts.append(f"grad_norm {record['grad_norm']:.3g}")
        if record.get("learning_rate") is not None and not names:  # room for the method's own instead
            parts.append(f"lr {record['learning_rate']:.2e}")
        if record.get("tokens_per_second"):
            parts.append(f"{record['tokens_per_second']:,.0f} tok/s")
        return " | ".join(parts)

    def log(self, record: dict) -> None:
        """A training step record; also moves the progress bar."""
        if not self.enabled:
            return
        self.first = self.first or record
        self.last = record
        line = self.console_line(record)
        self._write(record)
        log.info("step %d/%d | %s", record["step"], self.total_steps, line)  # above the bar, on a terminal
        if self._bar is not None:
            self._status = line
            self.advance(record["step"])

    def log_event(self, record: dict) -> None:
        """An eval result or a checkpoint."""
        if not self.enabled:
            return
        self._write(record)
        if "eval_loss" in record or any(k.startswith(self.scores) for k in record if self.scores):
            self.last_eval = record
            names = ["eval_loss"] + [f"eval_{n}" for n in headline_names(self.headline, [k[5:] for k in record
                                                                                         if k.startswith("eval_")])]
            names += [k for k in record if self.scores and k.startswith(self.scores)]
            line = " | ".join(f"{n} {_number(record[n])}" for n in names if record.get(n) is not None)
            log.info("step %d/%d | %s", record["step"], self.total_steps, line)

    def _write(self, record: dict) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self.tracker_log is not None:
            values = {k: v for k, v in record.items() if (k in TRACKED or "/" in k) and v is not None}  # + a method's own
            if values:
                self.tracker_log(values, record["step"])

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            end_status_line()
            self._bar = None
        if self._file is not None:
            self._file.close()


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"
