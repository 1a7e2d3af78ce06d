"""Rank 0's view of the run: a metrics.jsonl line per logging step and a rich progress bar."""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
from pathlib import Path

log = logging.getLogger("praisonai_accel")
_NOT_SHOWN = ("step", "time", "tokens", "positions")


def write_json_atomic(data: dict, path: Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w") as handle:
        json.dump(data, handle, indent=2)
    os.replace(tmp, path)


class MetricsLogger:
    """Does nothing on ranks other than 0, so callers need no `if is_main_process`."""

    def __init__(self, path: Path, total_steps: int, enabled: bool, start_step: int = 0, append: bool = False):
        self.path = Path(path)
        self.total_steps = total_steps
        self.enabled = enabled
        self.start_step = start_step
        self.append = append
        self._file = None
        self._progress = None
        self._task = None

    def __enter__(self) -> "MetricsLogger":
        if not self.enabled:
            return self
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a" if self.append else "w")
        if sys.stderr.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._progress = Progress(
                TextColumn("[bold]training"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                TextColumn("{task.fields[loss]}"), transient=False,
            )
            self._progress.start()
            self._task = self._progress.add_task("train", total=self.total_steps, completed=self.start_step, loss="")
        return self

    def log(self, record: dict) -> None:
        """A training step record; also moves the progress bar."""
        if self.enabled and self._progress is not None:
            self._progress.update(self._task, completed=record["step"], loss=f"loss {record['loss']:.4f}")
        self._write(record)

    def log_event(self, record: dict) -> None:
        """An eval result or a checkpoint."""
        self._write(record)

    def _write(self, record: dict) -> None:
        """One line in metrics.jsonl, and a readable line on the console (bookkeeping keys left out)."""
        if not self.enabled:
            return
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
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
