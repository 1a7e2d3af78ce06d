"""Stopping on a signal: Ctrl-C (SIGINT), a kill or a scheduler's stop (SIGTERM), SLURM's warning before a preemption
(sbatch --signal=USR1@60). Each only asks: every rank agrees to stop after the step it is in (or abandons it between
micro-batches), the checkpoint of the last finished step is saved whatever save_strategy says, and the run exits
with the code that names how it ended."""

from __future__ import annotations

import signal
import threading
from pathlib import Path

from .failures import Interrupted, Preempted

STOP_SIGNALS = ("SIGINT", "SIGTERM", "SIGUSR1")


class StopSignals:
    def __init__(self):
        self.signum: int | None = None  # the first stop signal that arrived

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():  # Ray Train runs the loop in another thread
            return
        for name in STOP_SIGNALS:
            if hasattr(signal, name):
                signal.signal(getattr(signal, name), self._on_signal)

    def _on_signal(self, signum, _frame) -> None:
        # Repeats (torchrun's agent forwards the launcher's SIGINT again) change nothing: the step ends, the
        # checkpoint is written, and the agent's SIGKILL 30 s later is the way out of a hung save.
        self.signum = self.signum or signum

    def stopped(self, checkpoint: Path) -> Preempted:
        """The exception that ends the run once `checkpoint` is saved (worker/main.py maps it to the exit code)."""
        return Interrupted(checkpoint) if self.name == "SIGINT" else Preempted(checkpoint, self.name)

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else "SIGTERM"
