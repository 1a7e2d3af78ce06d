"""Each engine's command line, the environment it reads its API key from (never argv, which `ps` shows), where it
answers its health check, and the folder it starts in."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

from ..models.inference import base_model_of
from .model_view import make_view, merged_model
from .target import ServeError, Target

# transformers serve takes no API key: the one engine that is refused --api-key
TAKES_API_KEY = {"transformers": False, "llama-cpp": True, "vllm": True}


@dataclass
class Launch:
    command: list[str]
    health_path: str  # GET, 200 once the model answers
    cwd: Path | None = None
    env: dict[str, str] = field(default_factory=dict)
    view_folder: Path | None = None  # ours, removed when the server stops
    note: str = ""  # a line about what was prepared (the merge, its reuse)
    label: str = "the engine"  # how lines name it: transformers serve, llama_cpp.server, vllm


def check_api_key(engine: str, api_key: str | None) -> None:
    if api_key and not TAKES_API_KEY[engine]:
        raise ServeError(f"--api-key: {engine} serve has no authentication; serve on 127.0.0.1 without --api-key, or "
                         "use --engine llama-cpp (a GGUF export) or --engine vllm")


def transformers_launch(target: Target, host: str, port: int, trust_remote_code: bool = False) -> Launch:
    """`transformers serve NAME` in a folder where NAME is a view of the model: transformers takes an existing local
    path as the model's name, so requests and /v1/models call it NAME. An adapter is merged first (model_view)."""
    model_dir, note = target.model_dir, ""
    if target.adapter:
        model_dir, reused = merged_model(target.model_dir, trust_remote_code)
        note = f"{'reusing the merge' if reused else 'merged the adapter'} in {model_dir}"
    folder, _ = make_view(model_dir, target.name, trust_remote_code)
    command = [sys.executable, "-m", "transformers.cli.transformers", "serve", target.name, "--host", host,
               "--port", str(port), "--device", "auto", "--dtype", "auto", "--log-level", "warning"]
    if trust_remote_code:
        command.append("--trust-remote-code")
    return Launch(command, "/health", cwd=folder, view_folder=folder, note=note, label="transformers serve")


def llama_cpp_launch(target: Target, host: str, port: int, api_key: str | None, n_ctx: int | None = None) -> Launch:
    """llama-cpp-python's server on the GGUF file: the chat template and end-of-turn token are the ones the export
    wrote into the file's metadata (tokenizer.chat_template, eos), which the server's default chat format reads."""
    command = [sys.executable, "-m", "llama_cpp.server", "--model", str(target.gguf), "--model_alias", target.name,
               "--host", host, "--port", str(port)]
    if gguf_chat_template(target.gguf):  # the file's own template, rather than a built-in format guessed from it
        command += ["--chat_format", "chat_template.default"]
    if n_ctx:
        command += ["--n_ctx", str(n_ctx)]
    return Launch(command, "/v1/models", env={"API_KEY": api_key} if api_key else {}, label="llama_cpp.server")


def gguf_chat_template(path: Path) -> bool:
    """Whether the GGUF's metadata holds a chat template (gguf-py, from the gguf extra; False where it is absent)."""
    try:
        from gguf import GGUFReader

        return "tokenizer.chat_template" in GGUFReader(str(path)).fields
    except Exception:  # gguf-py missing, or a file llama.cpp will refuse itself, in its own words
        return False


def vllm_launch(target: Target, host: str, port: int, api_key: str | None) -> Launch:
    """vLLM's OpenAI server: a full model as it is, an adapter on its base with --enable-lora (no merge), the
    tokenizer (and so the chat template) of the run's directory, and a generation config that stops at its end of
    turn (model_view)."""
    folder, view = make_view(target.model_dir, target.name)
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--host", host, "--port", str(port),
               "--tokenizer", str(target.model_dir), "--generation-config", str(view)]
    if target.adapter:
        command += ["--model", base_model_of(target.model_dir), "--enable-lora",
                    "--lora-modules", f"{target.name}={target.model_dir}"]
    else:
        command += ["--model", str(target.model_dir), "--served-model-name", target.name]
    return Launch(command, "/health", env={"VLLM_API_KEY": api_key} if api_key else {}, view_folder=folder,
                  label="vllm")


def plan_launch(target: Target, host: str, port: int, api_key: str | None = None,
                trust_remote_code: bool = False) -> Launch:
    check_api_key(target.engine, api_key)
    if target.engine == "llama-cpp":
        return llama_cpp_launch(target, host, port, api_key)
    if target.engine == "vllm":
        return vllm_launch(target, host, port, api_key)
    return transformers_launch(target, host, port, trust_remote_code)
