"""praisonai-accel k8s CONFIG: print a Kubeflow Trainer manifest (TrainJob, or the older PyTorchJob)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from ..config import load_config


def k8s_command(
    config: Path = typer.Argument(..., help="config.yaml, at the path the pods see it (on the volume, or in the image)"),
    nodes: int = typer.Option(..., "--nodes", min=1, help="pods, one per machine"),
    gpus_per_node: int = typer.Option(..., "--gpus-per-node", min=1, help="GPUs (processes) per pod"),
    image: str = typer.Option(..., "--image", help="a container image with praisonai-accel installed"),
    kind: str = typer.Option("trainjob", "--kind", help="trainjob (Kubeflow Trainer v2) or pytorchjob (Training Operator v1)"),
    pvc: Optional[str] = typer.Option(None, "--pvc", help="PersistentVolumeClaim holding output_dir and the cache, mounted in every pod"),
    mount_path: str = typer.Option("/workspace", "--mount-path", help="where the volume is mounted in every pod"),
    namespace: Optional[str] = typer.Option(None, "--namespace"),
    name: str = typer.Option("praisonai-accel", "--name", help="the job's name"),
    max_restarts: int = typer.Option(0, "--max-restarts", min=0, help="restart failed workers up to K times; they resume from the latest checkpoint"),
    hf_token_secret: str = typer.Option("hf-token", "--hf-token-secret", help="Secret whose key 'token' becomes HF_TOKEN (never inlined)"),
    cpu: bool = typer.Option(False, "--cpu", help="CPU processes instead of GPUs (gloo), e.g. to try the manifest"),
) -> None:
    """Print a manifest for kubectl apply -f -: one `praisonai-accel train` launcher per pod."""
    from ..launcher.kubernetes import KubernetesJob, check_job, render
    from ..launcher.prelaunch import check_launch

    cfg = load_config(config)
    check_launch(cfg, nodes * gpus_per_node, here=False)
    job = KubernetesJob(config_path=str(config), image=image, nodes=nodes, gpus_per_node=gpus_per_node, kind=kind,
                        name=name, namespace=namespace, pvc=pvc, mount_path=mount_path, cpu=cpu,
                        max_restarts=max_restarts, hf_token_secret=hf_token_secret,
                        grace_seconds=cfg.preemption_grace_seconds + 30)
    check_job(job, cfg)
    typer.echo(render(job), nl=False)
