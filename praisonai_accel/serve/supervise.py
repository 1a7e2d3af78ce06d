"""The engine's process: a port checked free before it starts, a process group of its own (so its workers go with
it), its health check awaited while its output is kept for the lines shown if it dies, and one stop, on Ctrl-C or
SIGTERM, that leaves no process behind."""

from __future__ import annotations

import collections
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

from .engines import Launch
from .target import ServeError

TAIL_LINES = 15


def check_port(host: str, port: int) -> None:
    """Bind it as uvicorn will (SO_REUSEADDR): a server already listening there is refused in one line."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise ServeError(f"--host {host}: cannot be resolved ({exc.strerror})") from None
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            if exc.errno in (98, 48, 10048):  # EADDRINUSE on Linux, macOS, Windows
                raise ServeError(f"--port {port}: already in use on {host}; stop what listens there or pass "
                                 "another --port") from None
            raise ServeError(f"--host {host} --port {port}: cannot listen there ({exc.strerror or exc})") from None


def url_host(host: str) -> str:
    """The host as a client writes it: a wildcard bind is reached on loopback, an IPv6 address in brackets."""
    if host in ("0.0.0.0", ""):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


class Engine:
    """One engine process: start(), wait_healthy(), then wait() until it ends or stop() ends it."""

    def __init__(self, launch: Launch, base_url: str, api_key: str | None = None):
        self.launch, self.base_url, self.api_key = launch, base_url, api_key
        self.process: subprocess.Popen | None = None
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self.forward = threading.Event()  # once healthy, the engine's log (its requests) reaches our stderr
        self._reader: threading.Thread | None = None

    def start(self) -> None:
        env = {**os.environ, **self.launch.env, "PYTHONUNBUFFERED": "1"}
        self.process = subprocess.Popen(self.launch.command, cwd=self.launch.cwd, env=env, stdin=subprocess.DEVNULL,
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                        errors="replace", start_new_session=True,
                                        preexec_fn=_terminate_with_parent if sys.platform == "linux" else None)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.tail.append(line.rstrip())
            if self.forward.is_set():
                sys.stderr.write(line)
                sys.stderr.flush()

    def _answers(self) -> bool:
        request = urllib.request.Request(self.base_url.rsplit("/v1", 1)[0] + self.launch.health_path)
        if self.api_key:
            request.add_header("Authorization", f"Bearer {self.api_key}")
        try:
            with urllib.request.urlopen(request, timeout=5) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def exited_message(self, when: str) -> str:
        if self._reader is not None:
            self._reader.join(timeout=5)  # the last lines it wrote before exiting
        lines = [line for line in self.tail if line.strip()]
        shown = "\n".join(f"  | {line}" for line in lines)
        if shown:
            sys.stderr.write(f"{self.launch.label}'s last lines:\n{shown}\n")
        last = lines[-1].strip() if lines else "no output"
        return f"the engine ({self.launch.label}) exited with code {self.process.returncode} {when}: {last}"

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ServeError(self.exited_message("during start-up"))
            if self._answers():
                self.forward.set()
                return
            time.sleep(0.5)
        raise ServeError(f"the engine did not answer {self.launch.health_path} within {timeout:.0f} s "
                         "(--startup-timeout); it was stopped")

    def stop(self, grace: float = 15.0) -> None:
        """SIGTERM to the engine's whole group, SIGKILL to what is left after `grace` seconds."""
        if self.process is None:
            return
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.process.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                continue
            if not _group_alive(self.process.pid):
                break
            time.sleep(0.2)
        if self._reader is not None:
            self._reader.join(timeout=5)


def _terminate_with_parent() -> None:
    """In the engine, before it runs: SIGTERM it if serve itself dies without stopping it (SIGKILL, a crash)."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


class Stopped(Exception):
    """SIGTERM (or SIGHUP) arrived: stop as Ctrl-C does."""


def ignore_signals() -> None:
    """While the engine is being stopped: a second Ctrl-C must not cut the stop short (it escalates on its own)."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)


def stop_on_signals() -> dict:
    """SIGTERM and SIGHUP end serve like Ctrl-C: through the engine's stop, not around it. Returns the handlers
    they replace, for restore_signals."""
    def raise_stopped(signum, frame):
        raise Stopped(signal.Signals(signum).name)

    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    for sig in (signal.SIGTERM, signal.SIGHUP):
        if previous[sig] is not signal.SIG_IGN:  # nohup's SIGHUP stays ignored, as it asked
            signal.signal(sig, raise_stopped)
    return previous


def restore_signals(previous: dict) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler)
