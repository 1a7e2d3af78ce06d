"""Leaving a process that imported torch, once its work is written."""

from __future__ import annotations

import logging
import os
import sys


def exit_without_teardown(code: int | str | None, exit_handlers: bool = True) -> None:
    """Flush, then leave without the interpreter's teardown: tearing down torch, transformers, peft and lm-eval's
    modules takes 0.5 to 1.5 s here after the work is done, and under DDP gloo's threads can call std::terminate
    during it ("terminate called without an active exception"), turning a finished run into SIGABRT.

    What the interpreter would still do for the code it ran, user code included (a reward function's judge, say), is
    done first: its exit handlers run (`exit_handlers`), and while a thread it would wait for is alive, the process
    exits the ordinary way. `code` as sys.exit takes it: a string is printed, and exits 1."""
    import atexit
    import threading

    if exit_handlers:
        atexit._run_exitfuncs()
        if any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
            sys.exit(code)
    if isinstance(code, str):
        print(code, file=sys.stderr)
        code = 1
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)
