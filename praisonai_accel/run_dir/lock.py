"""One run per output_dir: a lock file in output_dir that names its holder (host, pid, start time).

Taken by the `praisonai-accel train` launcher for the whole job (its restarts included) and, when workers are started
without it (`accelerate launch -m praisonai_accel.train`, torchrun), by global rank 0's worker. A launcher tells its
workers through RUN_LOCK_ENV that the job's lock is taken care of, on whichever node holds it.

The file is held with flock(2) while the run lives: the kernel lets go of it however the process ends, SIGKILL
included. What the file says decides the rest:
- held (flock refused), or naming a live process on this host: refused, naming the holder;
- naming a process that no longer exists on this host (same boot, pid gone or reused): taken over with a warning;
- naming the same job (SLURM_JOB_ID, torchrun's agent or run id): a requeued or restarted attempt, taken over;
- naming a process of another job on another host: refused, naming the file to delete if that run is over; another
  host's processes cannot be checked from here, and where flock is local to each client a free flock proves nothing.
Where flock is not supported at all, creating the file with O_EXCL is the lock, and the same rules apply to a file
that is already there.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from ..runtime.handoff import RUN_LOCK_ENV

LOCK_NAME = "run.lock"

log = logging.getLogger("praisonai_accel")


class RunLocked(Exception):
    """output_dir is in use by another run; the message names it."""


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _process_start(pid: int) -> str:
    """The process's start time in clock ticks since boot (field 22 of /proc/PID/stat): with the boot id, it tells a
    process from a later one that reuses its pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat.rpartition(")")[2].split()[19]


def job_key(environ=None, rendezvous: str = "") -> str:
    """What stays the same over the attempts of one job: a SLURM job id survives requeues; a multi-node job's
    rendezvous address survives a pod's restart; torchrun's run id, or its agent (the parent of every attempt's
    workers on this host), survives --max-restarts."""
    environ = os.environ if environ is None else environ
    if environ.get("SLURM_JOB_ID"):
        return f"slurm:{environ['SLURM_JOB_ID']}"
    if rendezvous:
        return f"rdzv:{rendezvous}"
    if "LOCAL_RANK" in environ and "TORCHELASTIC_RUN_ID" in environ:
        run_id = environ["TORCHELASTIC_RUN_ID"]
        return f"torchrun:{run_id}" if run_id not in ("", "none") else f"torchrun:{socket.gethostname()}:{os.getppid()}"
    return ""


@dataclass
class Holder:
    host: str
    pid: int
    started: str
    boot_id: str = ""
    process_start: str = ""
    job: str = ""
    token: str = ""

    @classmethod
    def me(cls, job: str = "") -> "Holder":
        return cls(socket.gethostname(), os.getpid(), time.strftime("%Y-%m-%d %H:%M:%S %Z"), _boot_id(),
                   _process_start(os.getpid()), job or job_key(), uuid.uuid4().hex)

    @classmethod
    def parse(cls, text: str) -> "Holder | None":
        try:
            data = json.loads(text)
            return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})
        except (ValueError, TypeError, KeyError):
            return None

    def describe(self) -> str:
        return f"pid {self.pid} on {self.host}, started {self.started}"

    def on_this_host(self) -> bool:
        return self.host == socket.gethostname() and (not self.boot_id or self.boot_id == _boot_id())

    def alive(self) -> bool:
        """Only answerable on this host, this boot."""
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return not self.process_start or _process_start(self.pid) == self.process_start


class RunLock:
    """Held from acquire() to release(); release is safe to call twice."""

    def __init__(self, output_dir: Path, job: str = ""):
        self.path = Path(output_dir) / LOCK_NAME
        self.holder = Holder.me(job)
        self.joined: Holder | None = None  # another node of this job holds it
        self._fd: int | None = None

    def acquire(self) -> "RunLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for attempt in range(20):  # the file can be replaced or removed under us, or not written yet: look again
            created = True
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                created = False
                try:
                    fd = os.open(self.path, os.O_RDWR)
                except FileNotFoundError:
                    continue
            try:
                done = self._try(fd, created, last=attempt == 19)
            except BaseException:
                os.close(fd)
                raise
            if done:
                if self._fd != fd:  # joined: the flock is another process's
                    os.close(fd)
                return self
            os.close(fd)
            time.sleep(0.05)
        raise RunLocked(f"output_dir: {self.path} keeps changing under us; is another run starting or ending?")

    def _try(self, fd: int, created: bool, last: bool) -> bool:
        """True when this process now holds the lock (or joined the job that does); False to look again."""
        flocked = _flock(fd)
        previous = None if created else Holder.parse(_read(fd))
        if flocked is False:
            if previous is None and not last:  # its holder is still writing it
                return False
            if previous is not None and previous.job and previous.job == self.holder.job:
                self.joined = previous  # another node of this job holds it for all of us
                return True
            raise RunLocked(self._refusal(previous, "it holds the lock"))
        try:
            if os.fstat(fd).st_ino != os.stat(self.path).st_ino:
                return False
        except FileNotFoundError:
            return False
        if flocked is None and not created:  # no flock on this file system: the file's existence is the lock
            if previous is None and not last:
                return False
            self._check_previous(previous)
            self.path.unlink(missing_ok=True)  # a dead holder's: create it afresh with O_EXCL
            return False
        if not created:
            self._check_previous(previous)
        _write(fd, json.dumps(self.holder.__dict__))
        self._fd = fd
        return True

    def _check_previous(self, previous: Holder | None) -> None:
        """Raise if the file names a run that may still be going; warn when taking over one that is not."""
        if previous is None:  # empty (a holder killed while writing it) or left by a release: free
            return
        if previous.job and previous.job == self.holder.job:
            log.info("run lock %s: taking over from an earlier attempt of this job (%s)", self.path, previous.describe())
            return
        if previous.on_this_host():
            if previous.alive():  # without flock, or with one that is not enforced here
                raise RunLocked(self._refusal(previous, "it is still running"))
            log.warning("warning: output_dir: taking over %s, left by %s, which no longer exists", self.path,
                        previous.describe())
            return
        raise RunLocked(self._refusal(previous, "another host's processes cannot be checked from here") +
                        f"; if that run is over, delete {self.path}")

    def _refusal(self, previous: Holder | None, why: str) -> str:
        holder = previous.describe() if previous else "another process"
        return f"output_dir: {self.path.parent} is in use by another run ({holder}; {why}); wait for it to end or use another output_dir"

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            if Holder.parse(_read(self._fd)) == self.holder:
                self.path.unlink(missing_ok=True)  # while still holding the flock: nobody can have taken it
        except OSError:
            pass
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *_exc) -> None:
        self.release()


def _flock(fd: int) -> bool | None:
    """True when taken, False when another process holds it, None when this file system has no flock."""
    import fcntl

    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError as exc:
        if exc.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            return None
        raise


def _read(fd: int) -> str:
    os.lseek(fd, 0, os.SEEK_SET)
    chunks = []
    while chunk := os.read(fd, 65536):
        chunks.append(chunk)
    return b"".join(chunks).decode("utf-8", "replace")


def _write(fd: int, text: str) -> None:
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    os.write(fd, text.encode())
    os.fsync(fd)


def _is_this_machine(host: str) -> bool:
    names = {"localhost", socket.gethostname(), socket.getfqdn()}
    if host in names:
        return True
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
        local = {info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None)}
    except OSError:
        return False
    return any(a.startswith("127.") or a == "::1" for a in addresses) or bool(addresses & local)


def owns_output_dir(nodes) -> bool:
    """The node that holds a multi-node job's lock: node 0 of a static rendezvous; with c10d (ranks assigned at
    rendezvous), the node the endpoint names, where the rendezvous store and so rank 0's agent usually live."""
    if nodes is None or nodes.count == 1:
        return True
    if nodes.backend == "static":
        return nodes.rank == 0
    return _is_this_machine(nodes.address()[0] or "")


def launcher_lock(output_dir: Path, nodes) -> RunLock | None:
    """The launcher's lock for the whole job, released when this process exits (atexit; flock by the kernel
    whatever happens). Its workers are told (handoff.RUN_LOCK_ENV) not to take one themselves."""
    import atexit

    if not owns_output_dir(nodes):
        return None
    rendezvous = ""
    if nodes is not None and nodes.count > 1:
        host, port = nodes.address()
        rendezvous = f"{host}:{port}"
    lock = RunLock(output_dir, job_key(rendezvous=rendezvous)).acquire()
    atexit.register(lock.release)
    return lock


_WORKER_LOCK: RunLock | None = None


def lock_for_worker(output_dir: Path, rank: int, environ=None) -> RunLock | None:
    """Workers started without the launcher: global rank 0 takes the job's lock and keeps it until it exits."""
    global _WORKER_LOCK
    environ = os.environ if environ is None else environ
    if rank != 0 or environ.get(RUN_LOCK_ENV) or _WORKER_LOCK is not None:
        return None
    _WORKER_LOCK = RunLock(output_dir).acquire()
    return _WORKER_LOCK


def release_worker_lock() -> None:
    global _WORKER_LOCK
    if _WORKER_LOCK is not None:
        _WORKER_LOCK.release()
        _WORKER_LOCK = None
