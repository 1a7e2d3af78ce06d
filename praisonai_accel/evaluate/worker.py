"""The entry point of each rank `praisonai-accel eval --num-processes N` launches: `python -m
praisonai_accel.evaluate.worker REQUEST.json RESULT.json`. Every rank scores its share; rank 0 writes RESULT once."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
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
    request = EvalRequest.from_json(Path(request_file).read_text())
    # the timeout of a long evaluation's collectives: a rank may wait while rank 0 computes the metrics
    accelerator = Accelerator(cpu=not torch.cuda.is_available(), kwargs_handlers=[
        InitProcessGroupKwargs(timeout=datetime.timedelta(hours=24), **ddp_backend_kwargs())])

    result = score(request, accelerator)
    if accelerator.is_main_process:
        write_text_atomic(Path(result_file), json.dumps(result))
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return 0


if __name__ == "__main__":
    from ..runtime.exit import exit_without_teardown

    exit_without_teardown(main())
