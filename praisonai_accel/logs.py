"""Where output goes. A worker: everything it logs (tracebacks too) into output_dir/logs/rank-N.log, rank 0's INFO
and every rank's warnings on the console, and nothing from the libraries unless --verbose. The CLI: our one-line
notes on stderr, the libraries' progress bars and chatter off."""

from __future__ import annotations

import logging
import os
import sys
import warnings
from pathlib import Path

log = logging.getLogger("praisonai_accel")
FILE_ONLY = logging.getLogger("praisonai_accel.file")  # to the rank's log file only, never the console
FILE_ONLY.propagate = False
FILE_ONLY.setLevel(logging.INFO)


# ---------------------------------------------------------------- a worker

CLEAR_LINE = "\r\x1b[2K"  # back to column 0 and erase the line: what a terminal redraws in place starts with it


class StatusLine:
    """The one line a terminal redraws in place (the progress bar): each redraw ends in a carriage return, not a
    newline, and every other line is written above it, after which it is drawn again."""

    def __init__(self, stream):
        self.stream = stream
        self.text = ""

    @staticmethod
    def width() -> int:
        import shutil

        return max(20, shutil.get_terminal_size((100, 24)).columns - 1)  # COLUMNS: the launcher's terminal

    def show(self, text: str) -> None:
        self.text = text[: self.width()]
        self._write(f"{CLEAR_LINE}{self.text}\r")

    def write_above(self, line: str) -> None:
        self._write(f"{CLEAR_LINE}{line}\n" + (f"{CLEAR_LINE}{self.text}\r" if self.text else ""))

    def close(self) -> None:
        """Leave the last state of the line on the screen, and the cursor below it."""
        if self.text:
            self._write(f"{CLEAR_LINE}{self.text}\n")
        self.text = ""

    def _write(self, text: str) -> None:
        self.stream.write(text)
        self.stream.flush()


_status: StatusLine | None = None  # this process's status line while one is shown


def start_status_line(stream=None) -> StatusLine:
    global _status
    _status = StatusLine(stream or sys.stderr)
    return _status


def end_status_line() -> None:
    global _status
    if _status is not None:
        _status.close()
    _status = None


class _ConsoleHandler(logging.StreamHandler):
    """Log lines go above the status line while one is shown, never into it."""

    def emit(self, record: logging.LogRecord) -> None:
        if _status is None or _status.stream is not self.stream:
            return super().emit(record)
        try:
            _status.write_above(self.format(record))
        except Exception:
            self.handleError(record)


def console_logging(rank: int) -> None:
    console = _ConsoleHandler(sys.stderr)
    console.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    console.setFormatter(logging.Formatter("%(message)s"))
    root = logging.getLogger()
    root.addHandler(console)
    root.setLevel(logging.INFO)


def log_to_file(output_dir: Path, rank: int) -> Path | None:
    """Everything this rank logs goes to output_dir/logs/rank-N.log, at INFO level, whatever the console shows."""
    path = Path(output_dir) / "logs" / f"rank-{rank}.log"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handler = logging.FileHandler(path, mode="a")
    except OSError:
        return None
    handler.setLevel(logging.INFO)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.getLogger().addHandler(handler)
    FILE_ONLY.addHandler(handler)
    logging.captureWarnings(True)
    return path


def quiet_libraries(verbose: bool) -> None:
    """Setup facts and metrics from us; nothing from the libraries (progress bars, per-rank chatter) unless verbose."""
    import transformers

    # Every rank logs at INFO into its own log file; the console handler shows rank 0's INFO and others' warnings.
    logging.getLogger().setLevel(logging.INFO)
    log.setLevel(logging.INFO)
    if verbose:
        return
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    quiet_datasets()
    logging.getLogger("accelerate").setLevel(logging.ERROR)
    for noisy in ("torch.distributed", "torch.nn.parallel", "peft", "bitsandbytes", "huggingface_hub"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")


# ---------------------------------------------------------------- the CLI

def quiet_datasets(progress: bool = False) -> None:
    """Errors only from `datasets`, and its progress bars only when asked (a terminal): it reads these variables
    when it is imported."""
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "0" if progress else "1")
    os.environ.setdefault("DATASETS_VERBOSITY", "error")


def quiet_tokenizing(progress: bool = False) -> None:
    quiet_datasets(progress)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def show_progress_lines() -> None:
    """Our one-line notes on stderr; the libraries' progress bars and chatter off."""
    quiet_tokenizing()
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
    try:
        import transformers

        transformers.utils.logging.disable_progress_bar()
        transformers.utils.logging.set_verbosity_error()
    except ImportError:
        pass
