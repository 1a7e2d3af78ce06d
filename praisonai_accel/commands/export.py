"""praisonai-accel export gguf: a trained adapter or model as GGUF files, one per quantization method."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from ..logs import show_progress_lines
from ._common import fail, one_line_errors

export_app = typer.Typer(help="Export a trained model to another format.", no_args_is_help=True)


@export_app.command("gguf")
@one_line_errors
def gguf_command(
    path: Path = typer.Argument(..., help="the training output_dir, the adapter directory, or a full model directory"),
    quantization: List[str] = typer.Option(["q4_k_m"], "--quantization", "-q",
                                           help="q4_k_m (default), q5_k_m, q8_0, q4_0, q4_1, q5_0, q5_1, q3_k_m, q6_k, "
                                                "q2_k, f16, bf16; repeat for several files"),
    out: Optional[Path] = typer.Option(None, "--out", help="folder for the .gguf files (default: <model>-gguf)"),
    dequantize_base: Optional[bool] = typer.Option(
        None, "--dequantize-base/--original-base",
        help="merge a LoRA adapter onto the 4-bit base it was trained on (the default for QLoRA) or onto the original weights"),
    ollama: Optional[str] = typer.Option(None, "--ollama", help="also create this Ollama model (name:tag) FROM the first file"),
    host: Optional[str] = typer.Option(None, "--host", help="Ollama server (default: $OLLAMA_HOST or localhost:11434)"),
    trust_remote_code: bool = typer.Option(False, "--trust-remote-code", help="run the model's own code (as trained with trust_remote_code: true)"),
) -> None:
    """Merge the adapter in full precision, convert with llama.cpp's converter, quantize with llama.cpp's quantizer."""
    from ..publish.gguf import GGUFError, export_gguf, plan_export
    from ..publish.gguf_verify import run_conversations

    show_progress_lines()
    if ollama:
        import importlib.util

        if importlib.util.find_spec("ollama") is None:
            fail("--ollama: the ollama client is not installed; pip install 'praisonai-accel[ollama]'")
    try:
        plan = plan_export(path, quantization, out, dequantize_base=dequantize_base, trust_remote_code=trust_remote_code)
        files = export_gguf(plan, run_conversations(path, plan.source))
    except GGUFError as exc:
        fail(str(exc))
    except OSError as exc:  # disk full, permissions: the half-written files are already gone
        fail(f"gguf export: {type(exc).__name__}: {exc}")
    for file in files:
        typer.echo(f"wrote {file} ({file.stat().st_size / 2**20:.1f} MiB)")
    if ollama:
        from ..errors import first_line
        from ..publish.ollama import publish_gguf

        try:
            modelfile = publish_gguf(files[0], plan.source, ollama, host=host, trust_remote_code=trust_remote_code)
        except Exception as exc:  # connection refused, server errors: one line, the files stay
            fail(f"ollama: {type(exc).__name__}: {first_line(exc, '')}".rstrip(": "))
        typer.echo(f"created Ollama model {ollama} from {files[0].name} (Modelfile: {modelfile})")
