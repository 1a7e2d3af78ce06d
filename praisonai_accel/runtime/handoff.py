"""Everything the launcher (`praisonai-accel train`) hands its workers: the environment variables it sets, the
preprocessing status file, and the one way a process waits for another through the file system.

A worker started without the launcher (`accelerate launch -m praisonai_accel.train`, torchrun, Ray, SLURM) finds
none of these variables and does the work itself. No waiting here involves a collective: a preprocessing step
longer than ddp_timeout cannot time the other ranks out.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable, TypeVar

from ..atomic import write_json_atomic

VERBOSE_ENV = "PRAISONAI_ACCEL_VERBOSE"  # train --verbose: the libraries' own output is shown
TTY_ENV = "PRAISONAI_ACCEL_TTY"  # the user's console is a terminal, though the launcher pipes the workers' stderr
MEMORY_NOTE_ENV = "PRAISONAI_ACCEL_MEMORY_NOTE"  # what a worker killed by SIGKILL most likely ran out of
PREPROCESSING_ENV = "PRAISONAI_ACCEL_PREPROCESSING"  # the status file of a launcher that tokenizes for its workers
RUN_LOCK_ENV = "PRAISONAI_ACCEL_RUN_LOCK"  # the launcher holds output_dir's run lock for the job (run_lock.py)
CHECKED_CHECKPOINTS_ENV = "PRAISONAI_ACCEL_CHECKED_CHECKPOINTS"  # checkpoints the launcher verified, and its verdicts

T = TypeVar("T")


class HandoffFailed(Exception):
    """The process this one waited for failed; the message is its one line."""


def worker_environment(*, verbose: bool = False, memory_note: str = "", preprocessing_status: Path | None = None,
                       run_lock: bool = False, checked_checkpoints: dict[str, str] | None = None) -> dict[str, str]:
    env = {}
    if run_lock:
        env[RUN_LOCK_ENV] = "launcher"
    if checked_checkpoints:
        env[CHECKED_CHECKPOINTS_ENV] = json.dumps(checked_checkpoints)
    if verbose:
        env[VERBOSE_ENV] = "1"
    if memory_note:
        env[MEMORY_NOTE_ENV] = memory_note
    if preprocessing_status is not None:
        env[PREPROCESSING_ENV] = str(Path(preprocessing_status).resolve())
    return env


def wait_for(ready: Callable[[], T | None], failure: Callable[[], str | None], poll_seconds: float = 0.2) -> T:
    """Poll, with no time limit, until `ready()` returns something other than None, or `failure()` a message
    (raised as HandoffFailed). If the other process dies instead, the launcher stops this one."""
    while True:
        value = ready()
        if value is not None:
            return value
        message = failure()
        if message is not None:
            raise HandoffFailed(message)
        time.sleep(poll_seconds)


def write_preprocessing_status(path: Path, status: str, error: str = "", cached: bool = False) -> None:
    write_json_atomic({"status": status, "error": error, "cached": cached}, path)


def read_preprocessing_status(path: Path) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):  # not written yet
        return {"status": "running"}


def wait_for_launcher(status_file: Path, poll_seconds: float = 0.2) -> bool:
    """Wait for `praisonai-accel train`, which tokenizes while its workers start; its error, if it failed,
    becomes this rank's. Returns whether it found the cache filled already."""

    def ready():
        status = read_preprocessing_status(status_file)
        return bool(status.get("cached")) if status["status"] == "done" else None

    def failure():
        status = read_preprocessing_status(status_file)
        return status["error"] if status["status"] == "failed" else None

    return wait_for(ready, failure, poll_seconds)
