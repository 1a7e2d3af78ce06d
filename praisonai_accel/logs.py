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

def console_logging(rank: int) -> None:
    console = logging.StreamHandler(sys.stderr)
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
