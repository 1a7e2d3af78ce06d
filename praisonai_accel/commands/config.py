"""praisonai-accel config: write a single-machine accelerate config file; `config schema`: config.yaml's JSON Schema
(or its reference page)."""

from __future__ import annotations

from pathlib import Path

import typer

from ._common import fail, one_line_errors

config_app = typer.Typer(help="Write an accelerate config for this machine's GPUs, or (config schema) the JSON Schema "
                              "of config.yaml.")


@config_app.callback(invoke_without_command=True)
@one_line_errors
def config_command(
    ctx: typer.Context,
    gpus: str = typer.Option("all", "--gpus", help="number of GPUs, 'all', or ids such as 0,1"),
    output: Path = typer.Option(Path("accelerate_config.yaml"), "--output", "-o", help="where to write it"),
    mixed_precision: str = typer.Option("auto", "--mixed-precision", help="auto | no | fp16 | bf16"),
    force: bool = typer.Option(False, "--force", help="overwrite an existing file"),
) -> None:
    """Write an accelerate config for this machine's GPUs (use it with `train --accelerate-config`)."""
    if ctx.invoked_subcommand is not None:
        return
    from ..atomic import write_yaml_atomic
    from ..runtime.distributed import gpu_has_bf16, resolve_mixed_precision
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


@config_app.command("schema")
@one_line_errors
def schema_command(
    output: Path = typer.Option(None, "--output", "-o", help="where to write it; default: print it"),
    markdown: bool = typer.Option(False, "--markdown", help="the reference page of every key (docs/reference.md) "
                                                             "instead of the JSON Schema"),
    force: bool = typer.Option(False, "--force", help="overwrite a file this command did not write"),
) -> None:
    """The JSON Schema of config.yaml, for editors (VS Code's YAML extension: `# yaml-language-server: $schema=FILE`
    as a config's first line), or with --markdown the configuration reference page."""
    from ..atomic import write_text_atomic
    from ._schema import REFERENCE_MARKER, SCHEMA_ID, reference_markdown, schema_json

    text = reference_markdown() if markdown else schema_json()
    if output is None:
        typer.echo(text, nl=False)
        return
    if output.is_dir():
        fail(f"{output} is a directory; name the file to write")
    # A file this command wrote before is regenerated in place; anything else is the user's and kept.
    if output.exists() and not force and (REFERENCE_MARKER if markdown else SCHEMA_ID) not in _head(output):
        fail(f"{output} already exists and was not written by `config schema`; pass --force to overwrite it")
    write_text_atomic(output, text)
    typer.echo(f"wrote {output}")


def _head(path: Path) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            return handle.read(4096)
    except OSError as exc:
        fail(f"{path}: cannot be read ({exc.strerror})")
