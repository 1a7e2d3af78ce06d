"""The launch of `praisonai-accel eval`: N ranks started as `train` starts its workers (accelerate launch with a
generated config: DDP over NCCL, or over gloo for CPU processes), each running praisonai_accel.evaluate.worker."""

from __future__ import annotations

import sys
from pathlib import Path

from .accelerate_config import build_accelerate_config
from .plan import LaunchPlan, free_port

EVAL_MODULE = "praisonai_accel.evaluate.worker"


def plan_eval_launch(request_file: Path, result_file: Path, *, num_processes: int, gpu_ids: list[int] | None = None,
                     cpu: bool = False, work_dir: Path, python: str = sys.executable) -> LaunchPlan:
    env: dict[str, str] = {}
    if cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    elif gpu_ids is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpu_ids))
    args = ["-m", EVAL_MODULE, str(request_file), str(result_file)]
    if num_processes == 1:
        return LaunchPlan([python] + args, 1, env)
    accel = build_accelerate_config(num_processes)
    path = Path(work_dir) / "accelerate_config.yaml"
    command = [python, "-m", "accelerate.commands.launch", "--config_file", str(path),
               "--main_process_port", str(free_port())]
    return LaunchPlan(command + args, num_processes, env, accel, path, generated_config=True)
