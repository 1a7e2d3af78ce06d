"""Leaving a process that imported torch, once its work is written."""

from __future__ import annotations

import logging
import os
import sys


def exit_without_teardown(code: int | str | None) -> None:
    """Flush, then leave without the interpreter's teardown: tearing down torch, transformers, peft and lm-eval's
    modules takes 0.5 to 1.5 s here after the work is done, and under DDP gloo's threads can call std::terminate
    during it ("terminate called without an active exception"), turning a finished run into SIGABRT. Only for a
    process that holds nothing an exit handler would release. `code` as sys.exit takes it: a string is printed, and
    exits 1."""
    if isinstance(code, str):
        print(code, file=sys.stderr)
        code = 1
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)
