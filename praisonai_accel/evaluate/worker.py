"""The entry point of each rank `praisonai-accel eval --num-processes N` launches: `python -m
praisonai_accel.evaluate.worker REQUEST.json RESULT.json`. Every rank scores its share; rank 0 writes RESULT once.

A rank is started while the command still checks its input: it imports what scoring needs and joins its process
group, then waits for REQUEST to appear (the command writes it once every check passed, or kills the ranks)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from ..errors import INTERRUPTED_EXIT_CODE


def wait_for(path: Path, launcher: int, poll: float = 0.02) -> Path:
    """Until `path` appears; a rank whose launcher is gone (reparented: the kernel's death signal was set too late,
    or never reached it) leaves instead of waiting for a request that cannot come."""
    while not path.exists():
        if os.getppid() != launcher:
            raise SystemExit(1)
        time.sleep(poll)
    return path


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:  # the command forwards Ctrl-C to every rank: each leaves quietly, the command says it
        return INTERRUPTED_EXIT_CODE


def _main(argv: list[str] | None) -> int:
    from ..runtime.exit import die_with_parent  # imports nothing heavy: the death signal is set first

    die_with_parent()  # a rank waiting for its request must not outlive a launcher killed outright
    launcher = os.getppid()
    if os.environ.get("RANK", "0") != "0":  # lm-eval draws its bars on every rank: one set is enough
        os.environ["TQDM_DISABLE"] = "1"  # read when tqdm is imported
    import datetime

    import torch
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    from ..runtime.distributed import ddp_backend_kwargs

    from ..atomic import write_text_atomic
    from ..logs import show_progress_lines
    from .score import EvalRequest, score

    show_progress_lines()
    request_file, result_file = (argv or sys.argv[1:])[:2]
    import peft  # noqa: F401  (what loading the model imports: seconds, spent while the command checks)
    from lm_eval.models.huggingface import HFLM  # noqa: F401

    # the timeout of a long evaluation's collectives: a rank may wait while rank 0 computes the metrics, and every
    # rank waits here for the command's checks (a Hub task's data may take minutes to fetch)
    accelerator = Accelerator(cpu=not torch.cuda.is_available(), kwargs_handlers=[
        InitProcessGroupKwargs(timeout=datetime.timedelta(hours=24), **ddp_backend_kwargs())])
    request = EvalRequest.from_json(wait_for(Path(request_file), launcher).read_text())

    result = score(request, accelerator)
    if accelerator.is_main_process:
        write_text_atomic(Path(result_file), json.dumps(result))
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return 0


if __name__ == "__main__":
    from ..runtime.exit import exit_without_teardown

    exit_without_teardown(main())
