"""Ray Train as an engine: the same training module inside TorchTrainer's workers.

Ray starts the workers, creates the process group (gloo on CPU, nccl on GPU) and sets RANK, LOCAL_RANK and
WORLD_SIZE; Accelerate inside each worker uses that group as it is (accelerator.prepare, never Ray's
prepare_model). Restarts (`FailureConfig(max_failures=K)` from --max-restarts) resume from this project's own latest
complete checkpoint in output_dir, never from a checkpoint reported to Ray: nothing is reported, so nothing is
stored twice, and a restart cannot go back to an older one.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..config import ConfigError, TrainConfig
from ..errors import first_line

RAY_MISSING = "--ray needs Ray Train: pip install 'praisonai-accel[ray]'"


def import_ray():
    try:
        import ray
        from ray import train as ray_train  # noqa: F401
        from ray.train.torch import TorchTrainer  # noqa: F401
    except ImportError:
        raise ConfigError(RAY_MISSING) from None
    return ray


def _worker_loop(settings: dict) -> None:
    """One Ray Train worker: the training module's main, as torchrun would run it."""
    from praisonai_accel.train import main

    code = main([settings["config"]])
    if code != 0:
        raise RuntimeError(f"praisonai-accel: this worker's training ended with exit code {code} "
                           f"(its log is in output_dir/logs/)")


def worker_environment(cpu: bool, handoff: dict[str, str] | None = None) -> dict[str, str]:
    """Set when each worker process starts, before it imports torch (which reads TORCH_CPP_LOG_LEVEL then)."""
    env = {"TOKENIZERS_PARALLELISM": "false", "TORCH_CPP_LOG_LEVEL": os.environ.get("TORCH_CPP_LOG_LEVEL", "ERROR")}
    if cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    for name in ("HF_HUB_OFFLINE", "HF_HOME", "PYTHONPATH"):
        if name in os.environ:
            env[name] = os.environ[name]
    return {**env, **(handoff or {})}


def run_with_ray(config_path: Path, config: TrainConfig, num_workers: int, address: str | None, cpu: bool,
                 max_restarts: int, handoff: dict[str, str] | None = None) -> int:
    ray = import_ray()
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    runtime_env = {"env_vars": worker_environment(cpu, handoff)}
    if address:
        ray.init(address=address, runtime_env=runtime_env)
    else:
        ray.init(num_cpus=max(num_workers, os.cpu_count() or 1), include_dashboard=False, runtime_env=runtime_env)
    try:
        trainer = TorchTrainer(
            _worker_loop,
            train_loop_config={"config": str(Path(config_path).resolve())},
            torch_config=TorchConfig(backend="gloo" if cpu else "nccl", timeout_s=config.ddp_timeout),
            scaling_config=ScalingConfig(num_workers=num_workers, use_gpu=not cpu,
                                         resources_per_worker={"CPU": 1} if cpu else {"CPU": 1, "GPU": 1}),
            run_config=RunConfig(name="ray", storage_path=str(config.output_path().resolve()),
                                 failure_config=FailureConfig(max_failures=max_restarts)),
        )
        trainer.fit()
        return 0
    except Exception as exc:  # TrainingFailedError: the workers already said why, each in its log
        print(f"error: Ray Train stopped: {first_line(exc, type(exc).__name__)}", flush=True)
        return 1
    finally:
        ray.shutdown()
