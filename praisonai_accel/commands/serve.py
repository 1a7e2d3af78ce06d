"""praisonai-accel serve: the trained model behind an OpenAI-compatible endpoint, on the engine that fits."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Optional

import typer

from ..logs import show_progress_lines
from ._common import fail

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def usage_lines(base_url: str, name: str, api_key: bool) -> list[str]:
    """The one-line curl and openai-client examples; a key is named by its variable, never printed."""
    body = json.dumps({"model": name, "messages": [{"role": "user", "content": "Hello!"}]})
    auth = ' -H "Authorization: Bearer $OPENAI_API_KEY"' if api_key else ""
    key = 'os.environ["OPENAI_API_KEY"]' if api_key else '"none"'
    imports = "import os; " if api_key else ""
    return [
        f"  curl {base_url}/chat/completions -H 'Content-Type: application/json'{auth} -d {shlex.quote(body)}",
        f"  python -c '{imports}from openai import OpenAI; client = OpenAI(base_url=\"{base_url}\", api_key={key}); "
        f"print(client.chat.completions.create(model=\"{name}\", messages=[{{\"role\": \"user\", \"content\": "
        f"\"Hello!\"}}]).choices[0].message.content)'",
    ]


def serve_command(
    target: Path = typer.Argument(..., help="a run's output_dir, a checkpoint, a model or adapter directory, or a .gguf file"),
    engine: str = typer.Option("auto", "--engine", help="auto (a .gguf or a run's GGUF export: llama-cpp; a model "
                               "directory: transformers) | transformers | llama-cpp | vllm"),
    host: str = typer.Option("127.0.0.1", "--host", help="address to listen on; another than 127.0.0.1 is reachable "
                             "from the network"),
    port: int = typer.Option(8000, "--port", min=1, max=65535),
    name: Optional[str] = typer.Option(None, "--name", help="the model name requests use (default: the run's name)"),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="PRAISONAI_ACCEL_API_KEY", show_envvar=True,
                                          help="the key clients must send (llama-cpp, vllm); better from the "
                                               "environment than the command line"),
    quantization: Optional[str] = typer.Option(None, "--quantization", "-q",
                                               help="which of the run's GGUF exports (default: the most precise)"),
    startup_timeout: float = typer.Option(600.0, "--startup-timeout", min=1.0, help="seconds to wait for the engine's health check"),
    trust_remote_code: bool = typer.Option(False, "--trust-remote-code", help="run the model's own code (as trained with trust_remote_code: true)"),
) -> None:
    """Serve the model behind an OpenAI-compatible API (/v1/chat/completions) until Ctrl-C or SIGTERM."""
    from ..run_dir.output_dirs import read_marker
    from ..serve.engines import check_api_key, plan_launch
    from ..serve.model_view import remove_view
    from ..serve.supervise import (Engine, Stopped, check_port, ignore_signals, restore_signals, stop_on_signals,
                                   url_host)
    from ..serve.target import resolve_target

    show_progress_lines()
    chosen = resolve_target(target, engine, name, quantization, trust_remote_code)
    check_api_key(chosen.engine, api_key)
    if chosen.model_dir is not None and (read_marker(chosen.model_dir) or {}).get("trust_remote_code") \
            and not trust_remote_code:
        fail(f"{chosen.model_dir}: was trained with trust_remote_code: true; pass --trust-remote-code to run the "
             "model's own code")
    if host not in LOOPBACK and not api_key:
        typer.echo(f"warning: --host {host}: the endpoint is reachable from the network and has no authentication "
                   "(pass --api-key with --engine llama-cpp or vllm)", err=True)
    check_port(host, port)
    base_url = f"http://{url_host(host)}:{port}/v1"
    previous_handlers = stop_on_signals()
    launch = None
    server = None
    try:
        launch = plan_launch(chosen, host, port, api_key, trust_remote_code)
        if launch.note:
            typer.echo(launch.note, err=True)
        typer.echo(f"starting {chosen.engine} on {chosen.gguf or chosen.model_dir} ...", err=True)
        server = Engine(launch, base_url, api_key)
        server.start()
        server.wait_healthy(startup_timeout)
        for line in [f"serving '{chosen.name}' ({chosen.engine}) at {base_url}", *usage_lines(base_url, chosen.name, bool(api_key)),
                     "Ctrl-C stops it."]:
            typer.echo(line)
        code = server.process.wait()
        fail(server.exited_message("while serving"), code=code or 1)
    except (KeyboardInterrupt, Stopped):
        typer.echo("stopping ...", err=True)
    finally:
        ignore_signals()
        if server is not None:
            server.stop()
        if launch is not None and launch.view_folder is not None:
            remove_view(launch.view_folder)
        restore_signals(previous_handlers)
    typer.echo("stopped", err=True)
