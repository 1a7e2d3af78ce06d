"""praisonai-accel train CONFIG: validate, write the accelerate config, launch the training module."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
import yaml

from ..errors import first_line
from ._common import bf16_supported, check_local_inputs, check_resume, count_cuda_gpus, fail, load_config_or_fail


def resolve_processes(gpus: Optional[str], cpu: bool, num_processes: Optional[int], available_gpus) -> tuple[int, Optional[list[int]]]:
    from ..launch import parse_gpus

    if cpu:
        if gpus is not None:
            fail("--cpu and --gpus cannot be used together")
        return num_processes or 1, None
    if gpus is None and num_processes is not None:
        gpus = str(num_processes)  # --num-processes N without --cpu means N GPUs
    if gpus is None:
        return 1, None
    return parse_gpus(gpus, available_gpus())


def train_command(
    config: Path = typer.Argument(..., help="config.yaml describing model, data and hyperparameters"),
    gpus: Optional[str] = typer.Option(None, "--gpus", help="number of GPUs, 'all', or ids such as 0,1"),
    cpu: bool = typer.Option(False, "--cpu", help="train on CPU processes (gloo), e.g. to try a config"),
    num_processes: Optional[int] = typer.Option(None, "--num-processes", min=1, help="processes to start with --cpu"),
    accelerate_config: Optional[Path] = typer.Option(None, "--accelerate-config", help="use this accelerate config file as is (multi-node, FSDP, DeepSpeed)"),
    dry_run: bool = typer.Option(False, "--dry-run", help="print the resolved config and launch command, run nothing"),
) -> None:
    """Fine-tune a model as described by CONFIG."""
    from ..distributed import resolve_mixed_precision
    from ..launch import LaunchError, launch, plan_launch

    cfg = load_config_or_fail(config)
    check_local_inputs(cfg)
    if accelerate_config is not None and not accelerate_config.is_file():
        fail(f"--accelerate-config: no such file '{accelerate_config}'")
    try:
        world, gpu_ids = resolve_processes(gpus, cpu, num_processes, count_cuda_gpus)
        # Only a generated multi-GPU accelerate config records the precision; the training module decides anyway.
        on_gpus = not cpu and world > 1 and accelerate_config is None
        precision = resolve_mixed_precision(cfg.mixed_precision, on_gpus, on_gpus and bf16_supported())
        plan = plan_launch(config, cfg, num_processes=world, gpu_ids=gpu_ids, cpu=cpu, mixed_precision=precision,
                           accelerate_config_file=accelerate_config)
    except (LaunchError, ValueError, OSError, yaml.YAMLError) as exc:
        fail(first_line(exc))

    start = check_resume(cfg, plan.num_processes)
    per_device, accum = cfg.per_device_train_batch_size, cfg.gradient_accumulation_steps
    effective = f"{per_device} x {accum} x {plan.num_processes} = {per_device * accum * plan.num_processes}"
    if dry_run:
        typer.echo("# resolved config")
        typer.echo(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False).rstrip())
        typer.echo(f"# processes: {plan.num_processes}")
        typer.echo(f"# effective batch (per device x accumulation x processes): {effective}")
        typer.echo(f"# start: {start}")
        if plan.generated_config:
            typer.echo(f"# accelerate config to write: {plan.accelerate_config_path}")
        typer.echo("# launch command")
        typer.echo(plan.printable())
        return
    typer.echo(f"launching {plan.num_processes} process(es), effective batch {effective}", err=True)
    raise typer.Exit(launch(plan))
