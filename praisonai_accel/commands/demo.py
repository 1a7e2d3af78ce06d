"""praisonai-accel demo: a real fine-tune, offline, on CPU processes, in well under three minutes."""

from __future__ import annotations

import json
from pathlib import Path

import typer


def demo_command(
    directory: Path = typer.Option(Path("praisonai-accel-demo"), "--dir", help="where model, data and outputs go"),
    processes: int = typer.Option(2, "--num-processes", min=1, help="CPU processes (DDP over gloo)"),
    steps: int = typer.Option(80, "--steps", min=1, help="optimizer steps"),
) -> None:
    """Build a tiny local model and dataset, then LoRA-train it with N CPU processes."""
    import yaml

    from ..demo import demo_config, demo_records, make_tiny_model, write_jsonl
    from ..launch import launch, plan_launch
    from ..config import parse_config

    model_dir = directory / "tiny-llama"
    if not (model_dir / "config.json").exists():
        typer.echo(f"building a tiny model in {model_dir}", err=True)
        make_tiny_model(model_dir)
    data = directory / "data.jsonl"
    if not data.exists():
        write_jsonl(demo_records(512), data)
    raw = demo_config(model_dir.resolve(), data.resolve(), (directory / "outputs").resolve(), max_steps=steps,
                      learning_rate=1e-2, logging_steps=10, val_split_ratio=0.1, eval_steps=max(steps // 4, 1))
    config_path = directory / "config.yaml"
    config_path.write_text(yaml.safe_dump(raw, sort_keys=False))
    plan = plan_launch(config_path, parse_config(raw), num_processes=processes, cpu=True)
    typer.echo(f"$ {plan.printable()}", err=True)
    code = launch(plan)
    summary_path = directory / "outputs" / "train_summary.json"
    if code == 0 and summary_path.exists():
        summary = json.loads(summary_path.read_text())
        metrics = [json.loads(line) for line in (directory / "outputs" / "metrics.jsonl").read_text().splitlines()]
        evals = [m["eval_loss"] for m in metrics if "eval_loss" in m]
        typer.echo(f"eval loss {evals[0]:.3f} -> {evals[-1]:.3f} over {summary['global_step']} steps on "
                   f"{summary['num_processes']} processes; adapter in {summary['final_model_dir']}")
    raise typer.Exit(code)
