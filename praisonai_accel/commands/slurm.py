"""praisonai-accel slurm CONFIG: print an sbatch script for a multi-node run."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from ..config import load_config
from ..data.vision_processor import model_inputs
from ..launcher.prelaunch import check_launch


def slurm_command(
    config: Path = typer.Argument(..., help="config.yaml"),
    nodes: int = typer.Option(..., "--nodes", min=1, help="machines in the allocation"),
    gpus_per_node: int = typer.Option(..., "--gpus-per-node", min=1, help="GPUs (processes) per machine"),
    partition: Optional[str] = typer.Option(None, "--partition"),
    time: Optional[str] = typer.Option(None, "--time", help="time limit, e.g. 24:00:00"),
    account: Optional[str] = typer.Option(None, "--account"),
    job_name: Optional[str] = typer.Option(None, "--job-name"),
    signal_seconds: int = typer.Option(300, "--signal-seconds", min=30, help="SIGTERM this long before the time limit"),
    cpu: bool = typer.Option(False, "--cpu", help="CPU processes instead of GPUs (gloo), e.g. to try the script"),
) -> None:
    """Print an sbatch script: preprocessing once, one srun task per node, c10d rendezvous, requeue on preemption."""
    from ..launcher.slurm import slurm_script

    cfg = load_config(config)
    check_launch(cfg, nodes * gpus_per_node, dry_run=True, inputs=model_inputs(cfg))  # a script: no call to the Hub
    script = slurm_script(config, cfg, nodes=nodes, gpus_per_node=gpus_per_node, partition=partition, time=time,
                          account=account, job_name=job_name, cpu=cpu, signal_seconds=signal_seconds)
    typer.echo(script, nl=False)
