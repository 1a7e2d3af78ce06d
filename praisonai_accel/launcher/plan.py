"""Turn `train CONFIG --gpus ...` into one complete LaunchPlan: the command line, the processes, the environment the
workers get (handoff.py names it) and the accelerate config to write. Nothing is added to a plan after it is built.
"""

from __future__ import annotations

import os
import shlex
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ..atomic import write_yaml_atomic
from ..config import ConfigError, TrainConfig
from ..models.files import local_weight_bytes
from .accelerate_config import build_accelerate_config, read_accelerate_config, total_processes

TRAIN_MODULE = "praisonai_accel.train"

GENERATED_CONFIG_NAME = "accelerate_config.yaml"


class LaunchError(ConfigError):
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
        raise LaunchError(f"--gpus {count}: no CUDA GPU is visible on this machine; --cpu --num-processes {count} runs "
                          f"{count} CPU processes (gloo)" if available == 0 else
                          f"--gpus {count}: only {available} CUDA GPU(s) visible on this machine")
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
    worker_env: dict[str, str] | None = None,
) -> LaunchPlan:
    """`num_processes` is per node; the accelerate config written holds the total over all nodes. `worker_env`:
    what the launcher hands its workers (handoff.worker_environment)."""
    nodes = nodes or Nodes()
    env: dict[str, str] = dict(worker_env or {})
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


def count_cuda_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_processes(gpus: str | None, cpu: bool, num_processes: int | None, available_gpus) -> tuple[int, list[int] | None]:
    if cpu:
        if gpus is not None:
            raise LaunchError("--cpu and --gpus cannot be used together")
        return num_processes or 1, None
    if gpus is None and num_processes is not None:  # --num-processes N without --cpu means N GPUs
        visible = available_gpus()
        if num_processes > visible:
            raise LaunchError(f"--num-processes {num_processes}: only {visible} CUDA GPU(s) visible; add --cpu to run "
                              f"{num_processes} CPU processes (gloo)" if visible == 0 else
                              f"--num-processes {num_processes}: only {visible} CUDA GPU(s) visible; use at most "
                              f"{visible}, or --cpu for CPU processes")
        return parse_gpus(str(num_processes), visible)
    if gpus is None:
        return 1, None
    return parse_gpus(gpus, available_gpus())


def rendezvous_from_environment(environ=None) -> tuple[int, int, str, int] | None:
    """(nodes, node rank, main address, main port) from the variables a Kubeflow TrainJob gives its pods
    (PET_NNODES, PET_NODE_RANK, PET_MASTER_ADDR, PET_MASTER_PORT), or None when they are absent."""
    environ = os.environ if environ is None else environ
    names = ("PET_NNODES", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT")
    if not all(environ.get(name) for name in names):
        return None
    values = [environ[name] for name in names]
    if not values[0].isdigit() or not values[1].isdigit() or not values[3].isdigit():
        raise LaunchError(f"PET_NNODES={values[0]}, PET_NODE_RANK={values[1]}, PET_MASTER_PORT={values[3]}: expected "
                          "whole numbers (a fixed node count: an elastic range such as 1:4 is not supported)")
    return int(values[0]), int(values[1]), values[2], int(values[3])


def resolve_nodes(nnodes: int, node_rank: int | None, main_addr: str | None, main_port: int | None,
                  rdzv_endpoint: str | None) -> Nodes:
    from_pods = rendezvous_from_environment()
    if from_pods and from_pods[0] > 1 and nnodes == 1 and node_rank is None and not main_addr and not rdzv_endpoint:
        nnodes, node_rank, main_addr, main_port = from_pods

    if nnodes == 1:
        if node_rank or main_addr or rdzv_endpoint:
            raise LaunchError("--node-rank, --main-addr and --rdzv-endpoint need --nnodes greater than 1")
        return Nodes()
    if rdzv_endpoint:
        if node_rank is not None or main_addr:
            raise LaunchError("--rdzv-endpoint assigns ranks itself: leave out --node-rank and --main-addr")
        host, _, port = rdzv_endpoint.rpartition(":")
        if not host or not port.isdigit():
            raise LaunchError(f"--rdzv-endpoint {rdzv_endpoint}: expected HOST:PORT")
        return Nodes(count=nnodes, rdzv_endpoint=rdzv_endpoint)
    if node_rank is None or not main_addr:
        raise LaunchError(f"--nnodes {nnodes}: give --node-rank R and --main-addr HOST (static), or --rdzv-endpoint "
                          "HOST:PORT (c10d)")
    if not 0 <= node_rank < nnodes:
        raise LaunchError(f"--node-rank {node_rank}: must be between 0 and {nnodes - 1}")
    return Nodes(count=nnodes, rank=node_rank, main_addr=main_addr, main_port=main_port)


def memory_note(config: TrainConfig, processes_here: int, fsdp: bool = False) -> str:
    """What the processes of this machine hold in host memory, for a worker the out-of-memory killer ended."""
    weights = local_weight_bytes(config.model_name)
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        ram = 0
    held = ("rank 0 loads the whole model before FSDP shards it" if fsdp else
            f"each of the {processes_here} processes on this machine loads a full copy of the model")
    held += f" ({weights / 2**30:.1f} GiB of weights)" if weights else ""
    return held + (f" and it has {ram / 2**30:.1f} GiB of RAM" if ram else "")
