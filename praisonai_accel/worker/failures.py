"""How a failed rank explains itself: a hint for errors with a known cause, silence for a rank that only lost a
peer that failed first, and one report per attempt when every rank fails the same way."""

from __future__ import annotations

import errno
import os
from pathlib import Path

from ..runtime.distributed import attempt_id
from ..errors import first_line

# Errors a rank sees when another rank has already died: its own line would only mislead.
PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "recvBytes", "NCCL communicator was aborted",
             "Socket Timeout", "failed to recv", "Connection refused")
_COLLECTIVE_TIMEOUT = ("a collective timed out after ddp_timeout: another rank is slower or stuck (its log says "
                       "where); raise ddp_timeout if it is only slow")
_HINTS = {
    "Expected to have finished reduction": (
        "DDP found parameters that received no gradient in this step (a vision tower or MoE experts unused by "
        "text-only data); set ddp_find_unused_parameters: true"),
    "mark a variable ready only once": (
        "a parameter was marked ready twice in one backward under DDP: reentrant gradient checkpointing with "
        "unused-parameter detection; leave ddp_find_unused_parameters unset, or use use_gradient_checkpointing: true"),
    "Timed out waiting": _COLLECTIVE_TIMEOUT,
    "collective operation timeout": _COLLECTIVE_TIMEOUT,  # NCCL's watchdog
    "CUDA out of memory": "out of GPU memory; lower per_device_train_batch_size or max_seq_length, or turn on "
                          "use_gradient_checkpointing",
}


def explain(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {first_line(exc, '')}".rstrip(": ")
    hint = next((hint for marker, hint in _HINTS.items() if marker in str(exc)), None)
    return hint or text


def first_to_report(output_dir: Path) -> bool:
    """Ranks failing together (every rank hits the same DDP error) say it once: the first to claim this attempt's
    marker in the shared output_dir prints, the others only log."""
    attempt = attempt_id()
    try:
        os.close(os.open(Path(output_dir) / "logs" / f".reported-{attempt}", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False
    except OSError:
        return True


class Preempted(Exception):
    """A stop signal arrived (SIGTERM, or a scheduler's warning such as SLURM's SIGUSR1); the checkpoint of the last
    finished step was saved at `checkpoint`."""

    status = "preempted"  # progress.json: what a SLURM requeue script looks for

    def __init__(self, checkpoint: Path, signal_name: str = "SIGTERM"):
        super().__init__(f"stopped by {signal_name}; checkpoint of the last finished step saved at {checkpoint}")
        self.checkpoint = checkpoint


class Interrupted(Preempted):
    """Ctrl-C (SIGINT): stopped the same way, told as an interrupt."""

    status = "interrupted"

    def __init__(self, checkpoint: Path, signal_name: str = "SIGINT"):
        Exception.__init__(self, f"interrupted; checkpoint of the last finished step saved at {checkpoint}")
        self.checkpoint = checkpoint


class DiskFull(Exception):
    """No space left while saving; earlier checkpoints are intact."""


def is_disk_full(exc: BaseException) -> bool:
    while exc is not None:
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
            return True
        text = str(exc)
        if "No space left" in text or "unexpected pos" in text or "file write failed" in text:
            return True  # torch.save reports a short write this way
        exc = exc.__cause__ or exc.__context__
    return False
