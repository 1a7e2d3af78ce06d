"""Turn `train CONFIG --gpus ...` into one command line, and run it so no worker outlives it."""

from __future__ import annotations

import os
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
) -> LaunchPlan:
    env: dict[str, str] = {}
    if cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    elif gpu_ids is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpu_ids))
    train_args = ["-m", TRAIN_MODULE, str(config_path)]

    if accelerate_config_file is not None:
        accel = read_accelerate_config(accelerate_config_file)
        command = [python, "-m", "accelerate.commands.launch", "--config_file", str(accelerate_config_file)]
        if not accel.get("main_process_port") and int(accel.get("num_machines", 1)) == 1:
            command += ["--main_process_port", str(port or free_port())]
        return LaunchPlan(command + train_args, total_processes(accel), env, accel, Path(accelerate_config_file))

    if num_processes == 1:
        return LaunchPlan([python] + train_args, 1, env)

    accel = build_accelerate_config(num_processes, mixed_precision)
    accel_path = config.output_path() / GENERATED_CONFIG_NAME
    command = [
        python, "-m", "accelerate.commands.launch",
        "--config_file", str(accel_path),
        "--main_process_port", str(port or free_port()),
    ]
    return LaunchPlan(command + train_args, num_processes, env, accel, accel_path, generated_config=True)


def write_plan_files(plan: LaunchPlan) -> None:
    """Write the generated accelerate config; a user-supplied one is never touched."""
    if plan.generated_config:
        write_yaml_atomic(plan.accelerate_config, plan.accelerate_config_path)


def _kill_with_parent() -> None:
    from .distributed import die_with_parent

    die_with_parent()


def run_subprocess(command: Sequence[str], env: dict[str, str]) -> int:
    """Run the launcher in its own process group and take the whole group down with us.

    Ctrl-C and SIGTERM are forwarded to the group (the launcher relays them to its workers);
    if this process is killed outright, the launcher gets SIGKILL from the kernel, and each
    worker in turn dies with its launcher.
    """
    full_env = {**os.environ, **env}
    proc = subprocess.Popen(list(command), env=full_env, start_new_session=True, preexec_fn=_kill_with_parent)

    def forward(signum, _frame):
        try:
            os.killpg(proc.pid, signum)
        except ProcessLookupError:
            pass

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # stragglers of a launcher that already exited
        except (ProcessLookupError, PermissionError):
            pass


def launch(plan: LaunchPlan, runner: Callable[[Sequence[str], dict[str, str]], int] = run_subprocess) -> int:
    write_plan_files(plan)
    return runner(plan.command, plan.env)
