"""praisonai-accel env: what this machine offers for training."""

from __future__ import annotations

import importlib
import importlib.metadata
import platform

import typer

from ..errors import first_line

PACKAGES = ["praisonai-accel", "torch", "transformers", "accelerate", "peft", "trl", "datasets", "huggingface_hub"]


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _usable(module: str, needs_gpu: bool = False) -> str:
    """One answer for an optional backend: its version and whether it imports here, or that it is not installed."""
    if importlib.util.find_spec(module) is None:
        return "not installed"
    version = _version(module)
    if needs_gpu:
        return f"{version}, not usable (needs a CUDA GPU)"
    try:
        importlib.import_module(module)
        return f"{version}, usable"
    except Exception as exc:  # unsloth raises NotImplementedError and friends without a GPU
        return f"{version}, not usable ({type(exc).__name__}: {first_line(exc, '')})"


def env_command() -> None:
    """Print versions, devices, and whether unsloth / bitsandbytes can be used here."""
    import torch

    typer.echo(f"python: {platform.python_version()} ({platform.platform()})")
    for name in PACKAGES:
        typer.echo(f"{name}: {_version(name)}")
    if torch.cuda.is_available():
        from ..runtime.distributed import gpu_has_bf16

        bf16 = "yes" if gpu_has_bf16() else "no (fp16 with loss scaling)"
        typer.echo(f"cuda: {torch.version.cuda}, {torch.cuda.device_count()} GPU(s), native bf16 {bf16}")
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            typer.echo(f"  gpu {index}: {props.name}, {props.total_memory / 2**30:.1f} GiB")
    else:
        typer.echo("cuda: no GPU visible (training runs on CPU processes over gloo)")
    typer.echo(f"distributed backends: nccl {'yes' if torch.distributed.is_nccl_available() else 'no'}, gloo {'yes' if torch.distributed.is_gloo_available() else 'no'}")
    typer.echo(f"bitsandbytes: {_usable('bitsandbytes')}")
    typer.echo(f"unsloth: {_usable('unsloth', needs_gpu=not torch.cuda.is_available())}")
