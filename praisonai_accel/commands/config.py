"""praisonai-accel config: write a single-machine accelerate config file."""

from __future__ import annotations

from pathlib import Path

import typer

from ._common import fail


def config_command(
    gpus: str = typer.Option("all", "--gpus", help="number of GPUs, 'all', or ids such as 0,1"),
    output: Path = typer.Option(Path("accelerate_config.yaml"), "--output", "-o", help="where to write it"),
    mixed_precision: str = typer.Option("auto", "--mixed-precision", help="auto | no | fp16 | bf16"),
    force: bool = typer.Option(False, "--force", help="overwrite an existing file"),
) -> None:
    """Write an accelerate config for this machine's GPUs (use it with `train --accelerate-config`)."""
    from ..atomic import write_yaml_atomic
    from ..distributed import gpu_has_bf16, resolve_mixed_precision
    from ..launcher.accelerate_config import build_accelerate_config
    from ..launcher.plan import count_cuda_gpus, parse_gpus

    if mixed_precision not in ("auto", "no", "fp16", "bf16"):
        fail(f"--mixed-precision: expected auto, no, fp16 or bf16, got '{mixed_precision}'")
    if output.exists() and not force:
        fail(f"{output} already exists; pass --force to overwrite it")
    count, ids = parse_gpus(gpus, count_cuda_gpus())
    precision = resolve_mixed_precision(mixed_precision, True, gpu_has_bf16())
    gpu_ids = ",".join(map(str, ids)) if ids is not None else "all"
    write_yaml_atomic(build_accelerate_config(count, precision, gpu_ids), output)
    typer.echo(f"wrote {output} ({count} process(es), mixed precision {precision})")
