"""Run a launch plan on this machine (accelerate launch / torchrun / plain python) so that no worker outlives it, and
turn how the workers ended into one line."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from typing import Callable, Sequence

from ..runtime.exit import die_with_parent
from ..runtime.handoff import MEMORY_NOTE_ENV, TTY_ENV, VERBOSE_ENV
from .plan import LaunchPlan, write_plan_files


def _kill_with_parent() -> None:
    die_with_parent()


# torch elastic's own log lines ("E1202 20:01:02.123000 1234 torch/distributed/elastic/...") and its failure report
# (a traceback ending in ChildFailedError, then a block between two ===== rules) are dropped: the workers already
# said what failed. Any other traceback is dropped up to its exception line; what follows it is relayed again.
_ELASTIC_LOG = re.compile(r"^[IWE]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ ")
_TRACEBACK = "Traceback (most recent call last):"
_REPORT_RANK = re.compile(r"^\s+rank\s+:\s+(\d+)")
_REPORT_EXIT = re.compile(r"^\s+exitcode\s+:\s+(-?\d+)")
_SIGNAL_CAUSES = {
    signal.SIGSEGV: "crashed (SIGSEGV: a fault in native code, such as a CUDA kernel or a library built for another CPU)",
    signal.SIGABRT: "aborted (SIGABRT: a native library gave up; its message is at the end of the rank's log)",
    signal.SIGBUS: "crashed (SIGBUS: usually /dev/shm too small for the data loader or NCCL; give the container more)",
    signal.SIGTERM: "was stopped by SIGTERM from outside the job",
}


def describe_worker_death(rank: int, exitcode: int, memory_note: str = "") -> str | None:
    """One line for a worker that a signal ended: it printed nothing itself, torchrun only says 'exitcode: -9'."""
    if exitcode >= 0:
        return None
    number = -exitcode
    if number == signal.SIGKILL:
        return (f"rank {rank} was killed (SIGKILL), most likely by the out-of-memory killer{': ' + memory_note if memory_note else ''}; "
                "use fewer processes, QLoRA (finetune_type: qlora), --fsdp, or a smaller batch or max_seq_length")
    try:
        name = signal.Signals(number).name
    except ValueError:
        name = f"signal {number}"
    cause = _SIGNAL_CAUSES.get(number, f"was ended by {name}")
    return f"rank {rank} {cause}"
_CHAINED = ("During handling of the above exception", "The above exception was the direct cause")
# The codes a worker exits with on purpose (worker/main.py's table, the watchdog's 124): torchrun exits 1 for any
# failed worker, so the CLI exits with the worker's own code, as a single process (run without torchrun) does.
WORKER_EXIT_CODES = (2, 3, 4, 124, 130, 143)


CLEAR_LINE = "\r\x1b[2K"  # logs.CLEAR_LINE: a piece ending in "\r" after it is the line a terminal redraws in place
_PIECES = re.compile(r"[^\r\n]*(?:\r\n|[\r\n])")
# a tqdm bar ("desc: 71%|███  | 17/24 [...]"): its description and total. tqdm draws "\rBAR" at each update and a
# newline after the last, so the last state arrives as a line: the bar it completes is no longer on screen.
_TQDM = re.compile(r"^(.*?)\s*\d+%\|[^|]*\|\s*[\d.]+[A-Za-z]*/(\S+)")


# a whole tqdm bar (its "[elapsed<remaining, rate]" closed) with another process's text right after it: tqdm draws
# "\rBAR" and ends the bar only at its next update, so a line written meanwhile arrives glued to it
_GLUED_TO_BAR = re.compile(r"^(.*?\d+%\|[^|]*\|\s*[\d.]+[A-Za-z]*/\S+ \[[^\]]*\])([^\r\n]+[\r\n]+)$")


def _bar_key(text: str) -> tuple[str, str] | None:
    match = _TQDM.match(text.removeprefix("\x1b[2K").strip("\r\n"))
    return match.groups() if match else None


class LauncherOutput:
    """Relays the launcher's stderr without torchrun's failure block; remembers whether a worker said 'error:'.

    Pieces end in a newline (a line) or a carriage return (rank 0's progress bar, redrawn in place): the last bar is
    kept and drawn again below any line another process writes over it, so nothing runs into it. On a terminal
    every line first erases the one the cursor is on: this process's own progress bar (tokenizing beside the
    workers) may be there, unfinished, and is drawn again below at its next update."""

    def __init__(self, sink, terminal: bool = False):
        self.sink = sink
        self.terminal = terminal
        self.bar = ""  # the progress bar on screen, if any
        self.state = "relay"  # relay | traceback | report (ChildFailedError's ===== block)
        self.rules_seen = 0
        self.worker_error = False
        self.root_cause: tuple[int, int] | None = None  # (rank, exitcode) of the first worker that failed
        self.failures: list[tuple[int, int]] = []  # every (rank, exitcode) the report lists, root cause included
        self._in_root_cause = False
        self._rank: int | None = None

    def _dropped(self, line: str) -> bool:
        if line.startswith(_TRACEBACK) or line.startswith(_CHAINED):
            self.state = "traceback"
            return True
        if self.state == "traceback":
            if line.startswith((" ", "\t")) or not line.strip():
                return True
            self.state, self.rules_seen = ("report", 0) if "ChildFailedError" in line else ("relay", 0)
            return True  # the exception line itself
        if self.state == "report":
            self._read_report(line)
            if line.startswith("====="):
                self.rules_seen += 1
                if self.rules_seen == 2:
                    self.state = "relay"
            return True
        return bool(_ELASTIC_LOG.match(line))

    def _read_report(self, line: str) -> None:
        """Every entry of torchrun's report (its 'Failures:' and its 'Root Cause (first observed failure)'): which
        rank, and how it ended."""
        if line.startswith("Root Cause"):
            self._in_root_cause = True
        elif match := _REPORT_RANK.match(line):
            self._rank = int(match.group(1))
        elif (match := _REPORT_EXIT.match(line)) and self._rank is not None:
            failure = (self._rank, int(match.group(1)))
            self._rank = None
            if failure not in self.failures:
                self.failures.append(failure)
            if self._in_root_cause and self.root_cause is None:
                self.root_cause = failure

    def culprit(self) -> tuple[int, int] | None:
        """The failure to name. torchrun's root cause is only the first it noticed, and ranks that fail in the same
        second are ordered by rank: a rank that lost its peer (its all-reduce read 'Connection reset by peer')
        often comes before the rank a signal killed, which is the one to name. A SIGTERM is the last choice: the
        agent sends it to stop the others."""
        def preference(failure: tuple[int, int]) -> int:
            code = failure[1]
            return 0 if code < 0 and code != -signal.SIGTERM else 1 if code < 0 else 2

        candidates = ([self.root_cause] if self.root_cause else []) + self.failures
        return min(candidates, key=preference) if candidates else None

    def worker_code(self) -> int | None:
        """The code a failed worker chose (WORKER_EXIT_CODES) from torchrun's report: the root cause's, or else the
        first listed; None when no worker exited with one (a crash, a signal)."""
        chosen = [f for f in ([self.root_cause] if self.root_cause else []) + self.failures
                  if f[1] in WORKER_EXIT_CODES]
        return chosen[0][1] if chosen else None

    def feed(self, piece: str) -> None:
        if piece.endswith("\r") and not piece.endswith("\r\n"):
            self.bar = piece.removeprefix("\x1b[2K") if piece[:-1].removeprefix("\x1b[2K") else ""
            self.sink.write(piece)
            self.sink.flush()
            return
        if glued := _GLUED_TO_BAR.match(piece):
            self.feed(glued.group(1) + "\r")
            self.feed(glued.group(2))
            return
        line = piece.removeprefix("\x1b[2K")
        if self._dropped(line):
            return
        self.worker_error = self.worker_error or line.startswith("error: ")
        if self.bar and _bar_key(line) is not None and _bar_key(line) == _bar_key(self.bar):
            self.bar = ""  # the bar's own last state (tqdm closed it), not a line to draw it again below
        self.sink.write(f"{CLEAR_LINE}{line}{CLEAR_LINE}{self.bar}" if self.bar
                        else f"{CLEAR_LINE}{line}" if self.terminal else piece)
        self.sink.flush()

    def feed_stream(self, fd: int) -> None:
        """Everything the launcher writes to `fd` until it closes, a piece as soon as it ends."""
        import codecs

        decoder, pending = codecs.getincrementaldecoder("utf-8")(errors="replace"), ""
        while chunk := os.read(fd, 65536):
            pending += decoder.decode(chunk)
            end = 0
            for match in _PIECES.finditer(pending):
                self.feed(match.group())
                end = match.end()
            pending = pending[end:]
        pending += decoder.decode(b"", final=True)
        if pending:
            self.feed(pending + "\n")
        if self.bar:  # rank 0 died with its bar on screen: what we say next goes below it, not into it
            self.sink.write("\n")
            self.bar = ""


class HeldSink:
    """A stream that holds what is written to it until release() (then passes everything on), or drops it with
    discard(): the output of ranks started before the command's own checks end."""

    def __init__(self, sink, held: bool = False):
        self.sink = sink
        self._held: list[str] | None = [] if held else None
        self._lock = threading.Lock()

    def write(self, text: str) -> None:
        with self._lock:
            if self._held is None:
                self.sink.write(text)
            else:
                self._held.append(text)

    def flush(self) -> None:
        with self._lock:
            if self._held is None:
                self.sink.flush()

    def release(self) -> None:
        with self._lock:
            for text in self._held or []:
                self.sink.write(text)
            self._held = None
            self.sink.flush()

    def discard(self) -> None:
        with self._lock:
            self._held = []


class Running:
    """A launcher started in its own process group by start_subprocess; wait() for how it ended, or cancel() it."""

    def __init__(self, proc: subprocess.Popen, env: dict[str, str], output: LauncherOutput | None,
                 sink: HeldSink | None):
        self.proc, self.env, self.output, self.sink = proc, env, output, sink
        self._relay, self._relay_error = None, None
        if output is not None:
            self._relay = threading.Thread(target=self._relay_stream, args=(proc.stderr.fileno(),), daemon=True)
            self._relay.start()

    def _relay_stream(self, fd: int) -> None:
        try:
            self.output.feed_stream(fd)
        except BaseException as exc:  # our stderr gone (a closed pipe, a full disk): raised again by wait()
            self._relay_error = exc
            try:  # the pipe still drained, or the workers would block writing to it
                while os.read(fd, 65536):
                    pass
            except OSError:
                pass

    @property
    def worker_error(self) -> bool:
        """Whether a worker said what failed itself (an 'error:' line)."""
        return self.output is not None and self.output.worker_error

    def release(self) -> None:
        """Show what the launcher has written so far, and from now on as it comes."""
        if self.sink is not None:
            self.sink.release()

    def cancel(self, grace: float = 10.0) -> None:
        """Stop the launcher and its workers and drop what they wrote (started early, no longer wanted). torchrun
        starts each worker in a session of its own, out of reach of a signal to the launcher's group: SIGTERM first
        lets its agent stop them, then SIGKILL for whatever is left."""
        if self.sink is not None:
            self.sink.discard()
        self._signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
        self._signal(signal.SIGKILL)
        self.proc.wait()
        if self._relay is not None:
            self._relay.join(timeout=grace)  # a worker that still holds the pipe is not waited for

    def _signal(self, signum: int) -> None:
        try:
            os.killpg(self.proc.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass

    def wait(self, report: bool = True) -> int:
        """The launcher's exit code (a failed worker's own code where it chose one). `report`: name how a worker
        died, in one line, where no worker said it."""
        proc, output = self.proc, self.output

        def forward(signum, _frame):
            # SLURM's warning before a preemption (--signal=USR1@N) reaches us; torchrun's agent would die of it, so
            # the group gets a SIGTERM: the workers save their last finished step and exit 143.
            self._signal(signal.SIGTERM if signum == getattr(signal, "SIGUSR1", None) else signum)

        self.release()
        forwarded = [signal.SIGINT, signal.SIGTERM] + ([signal.SIGUSR1] if hasattr(signal, "SIGUSR1") else [])
        previous = {sig: signal.signal(sig, forward) for sig in forwarded}
        try:
            if self._relay is not None:
                self._relay.join()  # until every writer of the pipe is gone, as the launcher's last words come
            code = proc.wait()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self._signal(signal.SIGKILL)  # stragglers of a launcher that already exited
        if self._relay_error is not None:
            raise self._relay_error
        interrupted = code in (130, -signal.SIGINT)
        if report and output is not None and code != 0 and not output.worker_error and not interrupted:
            culprit = output.culprit()
            death = describe_worker_death(*culprit, self.env.get(MEMORY_NOTE_ENV, "")) if culprit else None
            if death:
                sys.stderr.write(f"error: {death} (each rank's log is in output_dir/logs/)\n")
            else:
                sys.stderr.write(f"error: training failed (launcher exit code {code}); each rank's log is in output_dir/logs/\n")
        if output is not None and code != 0:
            code = output.worker_code() or code
        return code


def start_subprocess(command: Sequence[str], env: dict[str, str], hold: bool = False) -> Running:
    """Start the launcher in its own process group, its stderr relayed (held back until release() with `hold`)."""
    full_env = {**os.environ, **env}
    # one worker too: it writes while this process may still draw its own tokenizing bar (preprocess_beside_workers)
    relay = ("accelerate.commands.launch" in command or "praisonai_accel.train" in command) and \
        full_env.get(VERBOSE_ENV) != "1"
    if relay and sys.stderr.isatty():
        full_env[TTY_ENV] = "1"  # the workers' progress bar is for a terminal, though it reaches it through a pipe
        columns = os.get_terminal_size(sys.stderr.fileno()).columns
        if columns > 0:  # the bar's width (0: a terminal that never said)
            full_env.setdefault("COLUMNS", str(columns))
    proc = subprocess.Popen(list(command), env=full_env, start_new_session=True, preexec_fn=_kill_with_parent,
                            stderr=subprocess.PIPE if relay else None)
    sink = HeldSink(sys.stderr, held=hold) if relay else None
    output = LauncherOutput(sink, terminal=sys.stderr.isatty()) if relay else None
    return Running(proc, full_env, output, sink)


def run_subprocess(command: Sequence[str], env: dict[str, str]) -> int:
    """Run the launcher in its own process group and take the whole group down with us.

    Ctrl-C and SIGTERM are forwarded to the group (the launcher relays them to its workers), SIGUSR1 as SIGTERM;
    if this process is killed outright, the launcher gets SIGKILL from the kernel, and each
    worker in turn dies with its launcher. A multi-process launcher's stderr is relayed without
    torchrun's failure block (unless --verbose): a failing worker prints one line naming its log.
    """
    return start_subprocess(command, env).wait()


def launch(plan: LaunchPlan, runner: Callable[[Sequence[str], dict[str, str]], int] = run_subprocess) -> int:
    write_plan_files(plan)
    return runner(plan.command, plan.env)


def start_launch(plan: LaunchPlan) -> Running:
    """The plan's launcher started now, its output held back until Running.release() or wait()."""
    write_plan_files(plan)
    return start_subprocess(plan.command, plan.env, hold=True)
