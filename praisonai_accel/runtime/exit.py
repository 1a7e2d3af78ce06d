"""How a process ends: leaving one that imported torch once its work is written, and dying with its launcher."""

from __future__ import annotations

import logging
import os
import signal
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


def die_with_parent() -> None:
    """Ask Linux to kill this process when its launcher dies, even by SIGKILL.

    Without it, killing `accelerate launch` leaves the workers training on their own. A graceful
    stop still arrives as SIGTERM forwarded by the launcher; this covers the ungraceful one.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        return
    if os.getppid() == 1:  # the launcher died before prctl took effect
        os.kill(os.getpid(), signal.SIGKILL)
