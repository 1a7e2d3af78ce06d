"""Shared CLI plumbing: one-line errors and cheap checks that run before anything heavy."""

from __future__ import annotations

from pathlib import Path
from typing import NoReturn

import typer

LOCAL_SUFFIXES = (".json", ".jsonl", ".csv", ".parquet", ".txt")  # the keys of config.LOCAL_DATA_LOADERS


def fail(message: str, code: int = 2) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def looks_local(name: str) -> bool:
    """A path the user meant to be on disk, as opposed to a Hub id such as org/model."""
    return name.startswith(("/", "./", "../", "~")) or name.lower().endswith(LOCAL_SUFFIXES)


def check_local_inputs(config) -> None:
    """Catch missing local model/data paths before any process is started."""
    if looks_local(config.model_name) and not Path(config.model_name).expanduser().exists():
        fail(f"model_name: no such directory '{config.model_name}'")
    for key in ("dataset", "eval_dataset"):
        for index, spec in enumerate(getattr(config, key) or []):
            path = Path(spec.name).expanduser()
            if looks_local(spec.name) and not path.exists():
                fail(f"{key}[{index}].name: no such file or directory '{spec.name}'")
            if path.is_file() and path.suffix.lower() not in LOCAL_SUFFIXES:
                fail(f"{key}[{index}].name: unsupported file type '{path.suffix}' (use {', '.join(LOCAL_SUFFIXES)})")
    check_chat_template(config)


def check_chat_template(config) -> None:
    """A chat_template that is neither Jinja text nor a readable template file: one line, before anything starts."""
    if not config.chat_template:
        return
    from ..data import DataError, resolve_chat_template

    try:
        resolve_chat_template(config.chat_template)
    except (DataError, OSError, UnicodeDecodeError) as exc:
        fail(str(exc))


def check_trackers(config) -> None:
    """A tracker asked for in report_to whose package is missing: one line, before anything starts."""
    import importlib.util

    for tracker in config.trackers:  # each tracker's module has its name (mlflow-skinny installs `mlflow`)
        if importlib.util.find_spec(tracker) is None:
            fail(f"report_to: {tracker} is not installed; pip install 'praisonai-accel[{tracker}]'")


def check_device_map(config, num_processes: int) -> None:
    from ..config import MULTI_DEVICE_MAPS

    if num_processes > 1 and isinstance(config.device_map, str) and config.device_map in MULTI_DEVICE_MAPS:
        fail(f"device_map: '{config.device_map}' spreads one model over several GPUs and cannot be used with "
             f"{num_processes} DDP processes; remove device_map to load the full model on each rank's GPU")


def check_checkpointing(config, num_processes: int) -> None:
    from ..config import REENTRANT_WITH_UNUSED

    if num_processes > 1 and config.use_gradient_checkpointing == "reentrant" and config.ddp_find_unused_parameters:
        fail(REENTRANT_WITH_UNUSED)


def check_resume(config, num_processes: int) -> str:
    """Refuse a resume that the training module would refuse, before any process starts; describe the start."""
    import os

    from .. import checkpoint as ckpt
    from .. import checkpoint_manifest as manifest
    from ..config import ConfigError

    try:
        start = ckpt.checkpoint_to_resume(config.output_path(), config.resume_from_checkpoint,
                                          config.run_fingerprint(), config.overwrite_output_dir, config.run_identity(),
                                          config.force_resume)
        os.environ.update(manifest.verdicts_env())  # the workers inherit what was verified here
        if start is None:
            return "fresh start"
        ckpt.resume_skip(ckpt.CheckpointState.read(start), num_processes, config.per_device_train_batch_size)
    except ConfigError as exc:
        fail(str(exc))
    return f"resume from {start}"


def check_final_model_dir(config) -> None:
    """The final save may replace only an earlier final model of ours: refuse anything else before launch."""
    from ..config import ConfigError
    from ..output_dirs import check_replaceable

    try:
        check_replaceable(config.final_model_path(), "final_model_dir")
    except ConfigError as exc:
        fail(str(exc))


def check_hub_access(config) -> None:
    """push_to_hub without a token, or into a public repo with hub_private: refused before launch."""
    if not config.push_to_hub:
        return
    from ..config import ConfigError
    from ..hub import check_hub_access as check

    try:
        check(config)
    except ConfigError as exc:
        fail(str(exc))


def check_not_deepspeed(accelerate_config: Path) -> None:
    from ..accelerate_config import read_accelerate_config
    from ..config import DEEPSPEED_REFUSED

    try:
        data = read_accelerate_config(accelerate_config)
    except (OSError, ValueError) as exc:
        fail(f"--accelerate-config: {exc}")
    except Exception:  # invalid YAML: accelerate would say so; say it in one line here
        fail(f"--accelerate-config: {accelerate_config} is not valid YAML")
    if str(data.get("distributed_type", "")).upper() == "DEEPSPEED" or "deepspeed_config" in data:
        fail(f"--accelerate-config: {DEEPSPEED_REFUSED}")


def load_config_or_fail(path: Path):
    from ..config import ConfigError, load_config

    try:
        return load_config(path)
    except ConfigError as exc:
        fail(str(exc))


def count_cuda_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def bf16_supported() -> bool:
    from ..distributed import gpu_has_bf16

    return gpu_has_bf16()


def tokenized_or_fail(config):
    """The tokenizer and the tokenized datasets exactly as training sees them (the same cache), or one line.
    Preprocessing shows progress bars on a terminal."""
    import sys

    from ..data import DataError, ensure_chat_template, load_datasets
    from ..model import load_tokenizer

    quiet_tokenizing(progress=sys.stderr.isatty())
    try:
        tokenizer = load_tokenizer(config)
    except (OSError, ValueError) as exc:
        fail(cannot_load_tokenizer(config, exc))
    ensure_chat_template(tokenizer, config.chat_template)
    try:
        return (tokenizer, *load_datasets(config, tokenizer))
    except DataError as exc:
        fail(str(exc))


def cannot_load_tokenizer(config, exc: BaseException) -> str:
    from ..errors import first_line

    return f"model_name: cannot load the tokenizer of '{config.tokenizer_name or config.model_name}': {first_line(exc)}"


def quiet_tokenizing(progress: bool = False) -> None:
    import os

    from ..data import quiet_datasets

    quiet_datasets(progress)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def show_progress_lines() -> None:
    """Our one-line notes on stderr; the libraries' progress bars and chatter off."""
    import logging
    import os

    quiet_tokenizing()
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    logger = logging.getLogger("praisonai_accel")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    try:
        import transformers

        transformers.utils.logging.disable_progress_bar()
        transformers.utils.logging.set_verbosity_error()
    except ImportError:
        pass
