"""Turn `train CONFIG --gpus ...` into one command line, and run it so no worker outlives it."""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from .accelerate_config import build_accelerate_config, read_accelerate_config, total_processes, write_yaml_atomic
from .config import TrainConfig
from .distributed import TTY_ENV, VERBOSE_ENV

TRAIN_MODULE = "praisonai_accel.train"

GENERATED_CONFIG_NAME = "accelerate_config.yaml"


class LaunchError(Exception):
    """A launch request that cannot be satisfied, phrased for the user."""


@dataclass
class LaunchPlan:
    command: list[str]
    num_processes: int
    env: dict[str, str] = field(default_factory=dict)
    accelerate_config: dict | None = None
    accelerate_config_path: Path | None = None
    generated_config: bool = False

    def printable(self) -> str:
        prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(self.env.items()))
        return f"{prefix} {shlex.join(self.command)}".strip()


def parse_gpus(spec: str | None, available: int) -> tuple[int, list[int] | None]:
    """--gpus N | all | 0,1  ->  (process count, explicit device ids or None)."""
    if spec is None:
        return 1, None
    spec = spec.strip().lower()
    if spec == "all":
        if available == 0:
            raise LaunchError("--gpus all: no CUDA GPU is visible on this machine (use --cpu --num-processes N)")
        return available, None
    if "," in spec:
        try:
            ids = [int(part) for part in spec.split(",") if part.strip()]
        except ValueError:
            raise LaunchError(f"--gpus {spec}: expected a count, 'all' or a list of GPU ids such as 0,1") from None
        if len(set(ids)) != len(ids):
            raise LaunchError(f"--gpus {spec}: a GPU id is listed twice")
        missing = [i for i in ids if i >= available or i < 0]
        if missing:
            raise LaunchError(f"--gpus {spec}: GPU {missing[0]} does not exist ({available} visible)")
        return len(ids), ids
    if not spec.isdigit() or int(spec) < 1:
        raise LaunchError(f"--gpus {spec}: expected a count, 'all' or a list of GPU ids such as 0,1")
    count = int(spec)
    if count > available:
        raise LaunchError(f"--gpus {count}: only {available} CUDA GPU(s) visible on this machine")
    return count, None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


DEFAULT_MAIN_PORT = 29500


@dataclass
class Nodes:
    """Where this machine sits in a multi-node job. static: node_rank + main_addr; c10d: a rendezvous endpoint."""

    count: int = 1
    rank: int = 0
    main_addr: str | None = None
    main_port: int | None = None
    rdzv_endpoint: str | None = None

    @property
    def backend(self) -> str:
        return "c10d" if self.rdzv_endpoint else "static"

    def address(self) -> tuple[str | None, int | None]:
        if self.rdzv_endpoint:
            host, _, port = self.rdzv_endpoint.rpartition(":")
            return host, int(port)
        return self.main_addr, self.main_port or DEFAULT_MAIN_PORT


def shutdown_grace(config: TrainConfig) -> dict[str, str]:
    """torchrun SIGKILLs its workers this long after relaying SIGTERM (30 s of its own): long enough for the
    preemption save. A value in the environment is the user's and wins."""
    if "TORCH_ELASTIC_SHUTDOWN_TIMEOUT" in os.environ:
        return {}
    return {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(config.preemption_grace_seconds)}


def plan_launch(
    config_path: Path,
    config: TrainConfig,
    *,
    num_processes: int,
    gpu_ids: list[int] | None = None,
    cpu: bool = False,
    mixed_precision: str = "no",
    accelerate_config_file: Path | None = None,
    port: int | None = None,
    python: str = sys.executable,
    nodes: Nodes | None = None,
    max_restarts: int = 0,
    fsdp: bool = False,
) -> LaunchPlan:
    """`num_processes` is per node; the accelerate config written holds the total over all nodes."""
    nodes = nodes or Nodes()
    env: dict[str, str] = {}
    if cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    elif gpu_ids is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpu_ids))
    train_args = ["-m", TRAIN_MODULE, str(config_path)]
    restarts = ["--max_restarts", str(max_restarts)] if max_restarts else []

    if accelerate_config_file is not None:
        env.update(shutdown_grace(config))
        accel = read_accelerate_config(accelerate_config_file)
        command = [python, "-m", "accelerate.commands.launch", "--config_file", str(accelerate_config_file)] + restarts
        if not accel.get("main_process_port") and int(accel.get("num_machines", 1)) == 1:
            command += ["--main_process_port", str(port or free_port())]
        return LaunchPlan(command + train_args, total_processes(accel), env, accel, Path(accelerate_config_file))

    if num_processes == 1 and nodes.count == 1 and not max_restarts and not fsdp:
        return LaunchPlan([python] + train_args, 1, env)
    env.update(shutdown_grace(config))

    ip, main_port = nodes.address()
    if max_restarts:
        # Restarted workers must not meet the previous attempt's keys: torchrun's static rendezvous, and c10d
        # with its shared store, keep one TCP store across restarts and the workers' process-group keys are not
        # per attempt, so a restarted rank can read a dead peer's address ("Connection refused"). c10d without
        # store sharing gives every round a fresh store on a fresh port.
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        if nodes.backend == "static" and nodes.count > 1:
            nodes = Nodes(nodes.count, rdzv_endpoint=f"{ip}:{main_port}")
    accel = build_accelerate_config(
        num_processes * nodes.count, mixed_precision,
        num_machines=nodes.count,
        # c10d assigns ranks itself; machine 1 everywhere keeps accelerate from insisting that the
        # endpoint's port be free on every machine (only machine 0 checks it)
        machine_rank=nodes.rank if nodes.backend == "static" else 1,
        main_process_ip=ip, main_process_port=main_port, rdzv_backend=nodes.backend, fsdp=fsdp,
    )
    if nodes.count > 1 and nodes.backend == "static":
        name = f"accelerate_config.node-{nodes.rank}.yaml"  # every node writes its own into the shared output_dir
    else:
        name = GENERATED_CONFIG_NAME
    accel_path = config.output_path() / name
    command = [python, "-m", "accelerate.commands.launch", "--config_file", str(accel_path)] + restarts
    single_node_restarts = nodes.count == 1 and max_restarts
    # accelerate reads the rendezvous backend from its command line only
    if nodes.backend == "c10d" or single_node_restarts:
        command += ["--rdzv_backend", "c10d"]
    if single_node_restarts:
        # accelerate passes a rendezvous endpoint to torchrun only for several machines; torchrun reads its
        # own arguments from PET_* variables too
        env["PET_RDZV_ENDPOINT"] = f"127.0.0.1:{port or free_port()}"
    elif nodes.count == 1:
        command += ["--main_process_port", str(port or free_port())]
    return LaunchPlan(command + train_args, num_processes * nodes.count, env, accel, accel_path, generated_config=True)


def write_plan_files(plan: LaunchPlan) -> None:
    """Write the generated accelerate config; a user-supplied one is never touched."""
    if plan.generated_config:
        write_yaml_atomic(plan.accelerate_config, plan.accelerate_config_path)


def _kill_with_parent() -> None:
    from .distributed import die_with_parent

    die_with_parent()


# torch elastic's own log lines ("E1202 20:01:02.123000 1234 torch/distributed/elastic/...") and its failure report
# (a traceback ending in ChildFailedError, then a block between two ===== rules) are dropped: the workers already
# said what failed. Any other traceback is dropped up to its exception line; what follows it is relayed again.
_ELASTIC_LOG = re.compile(r"^[IWE]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ ")
_TRACEBACK = "Traceback (most recent call last):"
_REPORT_RANK = re.compile(r"^\s+rank\s+:\s+(\d+)")
_REPORT_EXIT = re.compile(r"^\s+exitcode\s+:\s+(-?\d+)")
MEMORY_NOTE_ENV = "PRAISONAI_ACCEL_MEMORY_NOTE"  # what a worker killed by SIGKILL most likely ran out of
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


class LauncherOutput:
    """Relays the launcher's stderr without torchrun's failure block; remembers whether a worker said 'error:'."""

    def __init__(self, sink):
        self.sink = sink
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

    def feed(self, line: str) -> None:
        if self._dropped(line):
            return
        self.worker_error = self.worker_error or line.startswith("error: ")
        self.sink.write(line)
        self.sink.flush()


def run_subprocess(command: Sequence[str], env: dict[str, str]) -> int:
    """Run the launcher in its own process group and take the whole group down with us.

    Ctrl-C and SIGTERM are forwarded to the group (the launcher relays them to its workers);
    if this process is killed outright, the launcher gets SIGKILL from the kernel, and each
    worker in turn dies with its launcher. A multi-process launcher's stderr is relayed without
    torchrun's failure block (unless --verbose): a failing worker prints one line naming its log.
    """
    full_env = {**os.environ, **env}
    relay = "accelerate.commands.launch" in command and full_env.get(VERBOSE_ENV) != "1"
    if relay and sys.stderr.isatty():
        full_env[TTY_ENV] = "1"  # the workers' progress bar is for a terminal, though it reaches it through a pipe
    proc = subprocess.Popen(list(command), env=full_env, start_new_session=True, preexec_fn=_kill_with_parent,
                            stderr=subprocess.PIPE if relay else None, text=relay, errors="replace" if relay else None)

    def forward(signum, _frame):
        try:
            os.killpg(proc.pid, signum)
        except ProcessLookupError:
            pass

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    output = LauncherOutput(sys.stderr) if relay else None
    try:
        if output is not None:
            for line in proc.stderr:
                output.feed(line)
        code = proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # stragglers of a launcher that already exited
        except (ProcessLookupError, PermissionError):
            pass
    if output is not None and code != 0 and not output.worker_error and code not in (130, -signal.SIGINT):
        culprit = output.culprit()
        death = describe_worker_death(*culprit, full_env.get(MEMORY_NOTE_ENV, "")) if culprit else None
        if death:
            sys.stderr.write(f"error: {death} (each rank's log is in output_dir/logs/)\n")
        else:
            sys.stderr.write(f"error: training failed (launcher exit code {code}); each rank's log is in output_dir/logs/\n")
    return code


def launch(plan: LaunchPlan, runner: Callable[[Sequence[str], dict[str, str]], int] = run_subprocess) -> int:
    write_plan_files(plan)
    return runner(plan.command, plan.env)
