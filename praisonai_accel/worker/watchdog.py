"""A rank that stops making progress says where it is stuck, and ends, instead of hanging the job silently.

Each rank runs a watchdog thread. When this rank has not finished an optimizer step (or an evaluation, or a save)
for `hang_timeout` seconds, the Python stack of every thread goes into the rank's log (faulthandler), one line goes
to the console, and the process exits, after which the launcher stops the other ranks. A rank that is only waiting
in a collective for a stuck peer waits a grace period longer, so the stuck rank speaks first and, once it is gone,
the collective fails on its own: the console gets one line, from the rank that is really stuck.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
import traceback
from pathlib import Path

from .outputs import record_end

HANG_EXIT_CODE = 124  # as timeout(1) reports a command it had to stop
_COLLECTIVE_GRACE_SECONDS = 30


class Watchdog:
    def __init__(self, timeout: float, rank: int, log_path: Path | None):
        self.timeout, self.rank, self.log_path = timeout, rank, log_path
        self.last_progress = time.monotonic()
        self._stopped = threading.Event()
        self._main = threading.current_thread()  # the training loop's thread (not the main one under Ray Train)
        self._thread = threading.Thread(target=self._watch, name="praisonai-accel-watchdog", daemon=True)

    def __enter__(self) -> "Watchdog":
        if self.timeout > 0:
            self._thread.start()
        return self

    def __exit__(self, *_exc) -> None:
        self._stopped.set()

    def progress(self) -> None:
        self.last_progress = time.monotonic()

    def _watch(self) -> None:
        poll = min(5.0, self.timeout / 4)
        while not self._stopped.wait(poll):
            idle = time.monotonic() - self.last_progress
            if idle <= self.timeout:  # the stack is read only once this rank looks stuck
                continue
            frame = sys._current_frames().get(self._main.ident)
            stack = traceback.extract_stack(frame) if frame is not None else []
            waiting = in_collective(stack)
            if idle > self.timeout + (min(_COLLECTIVE_GRACE_SECONDS, self.timeout) if waiting else 0):
                self._fire(idle, stack, waiting)

    def _fire(self, idle: float, stack, waiting: bool) -> None:
        where = f" (the stack of every thread is in {self.log_path})" if self._dump_stacks() else ""
        if not waiting:
            print(f"error: rank {self.rank}: no step finished in {idle:.0f} s (hang_timeout {self.timeout:g}); "
                  f"stuck in {describe(stack)}{where}", file=sys.stderr, flush=True)
        elif self.rank == 0:  # every rank waits for another: no rank is stuck elsewhere, say it once
            print(f"error: rank 0: no step finished in {idle:.0f} s (hang_timeout {self.timeout:g}); waiting for "
                  f"the other ranks in {describe(stack)}, and no rank is stuck elsewhere{where}", file=sys.stderr,
                  flush=True)
        if self.log_path is not None:  # output_dir/logs/rank-N.log: progress.json says how the run ended
            try:
                record_end(self.log_path.parent.parent, "failed", HANG_EXIT_CODE)
            except Exception:  # the line above is what matters; leave now whatever happens
                pass
        os._exit(HANG_EXIT_CODE)

    def _dump_stacks(self) -> bool:
        if self.log_path is None:
            return False
        try:
            with open(self.log_path, "a") as log:
                log.write(f"\nrank {self.rank}: no progress for hang_timeout; every thread's stack:\n")
                log.flush()
                faulthandler.dump_traceback(file=log, all_threads=True)
            return True
        except OSError:
            return False


def in_collective(stack) -> bool:
    """Whether this stack may be waiting for other ranks: inside torch.distributed (a collective, a barrier, the
    rendezvous store) or inside backward, where DDP and FSDP all-reduce the gradients."""
    return any(f"torch{os.sep}{part}{os.sep}" in frame.filename for frame in stack for part in ("distributed", "autograd"))


def describe(stack) -> str:
    """The innermost Python frame, and the innermost of this project's frames when that is another:
    `forward (sitecustomize.py:75), called from _optimizer_step (trainer.py:512)`."""
    if not stack:
        return "an unknown place"
    inner = stack[-1]
    text = f"{inner.name} ({Path(inner.filename).name}:{inner.lineno})"
    ours = next((frame for frame in reversed(stack) if f"praisonai_accel{os.sep}" in frame.filename), None)
    if ours is not None and ours is not inner:
        text += f", called from {ours.name} ({Path(ours.filename).name}:{ours.lineno})"
    return text
