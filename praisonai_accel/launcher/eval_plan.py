"""The launch of `praisonai-accel eval`: N ranks started as `train` starts its workers (accelerate launch with a
generated config: DDP over NCCL, or over gloo for CPU processes), each running praisonai_accel.evaluate.worker.

The ranks start before the command's checks end: their imports and process group (seconds) overlap the checks, and
each waits for the request file before it loads anything. A check that fails cancels them."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from ..atomic import write_text_atomic
from .accelerate_config import build_accelerate_config
from .local import start_launch
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


class EvalLaunch:
    """N eval ranks started now, waiting for their request. As a context manager: cancelled (stopped, their output
    dropped) when the block ends with the launcher still running: a failed check, Ctrl-C or any error before run()
    has waited for it."""

    def __init__(self, num_processes: int, gpu_ids: list[int] | None, cpu: bool):
        self._work = tempfile.TemporaryDirectory(prefix="praisonai-accel-eval-")
        work = Path(self._work.name)
        self.request_file, self.result_file = work / "request.json", work / "result.json"
        self.plan = plan_eval_launch(self.request_file, self.result_file, num_processes=num_processes,
                                     gpu_ids=gpu_ids, cpu=cpu, work_dir=work)
        try:
            self._running = start_launch(self.plan)
        except BaseException:
            self._work.cleanup()
            raise

    def run(self, request_json: str) -> tuple[int, dict | None, bool]:
        """(the launcher's exit code, rank 0's result or None, whether a rank said what failed): the request handed
        to the waiting ranks."""
        write_text_atomic(self.request_file, request_json)
        code = self._running.wait(report=False)
        result = json.loads(self.result_file.read_text()) if self.result_file.is_file() else None
        return code, result, self._running.worker_error

    def __enter__(self) -> "EvalLaunch":
        return self

    def __exit__(self, *exc) -> None:
        try:
            if self._running.proc.poll() is None:  # not run, or left early: a check failed, Ctrl-C, an error
                self._running.cancel()
        finally:
            self._work.cleanup()
