"""Checks only the launching machine can make, before any process starts: local paths exist, a chat template
file reads, the method's own launch checks (GRPO's reward functions import), the trackers and the Hub token are there, an --accelerate-config is not
DeepSpeed. Each raises ConfigError with one line; the CLI shows it (the rules the worker checks again are in checks.py)."""

from __future__ import annotations

from pathlib import Path

from ..checks import deepspeed_rule
from ..config import ConfigError

LOCAL_SUFFIXES = (".json", ".jsonl", ".csv", ".parquet", ".txt")  # the keys of config.LOCAL_DATA_LOADERS


def looks_local(name: str) -> bool:
    """A path the user meant to be on disk, as opposed to a Hub id such as org/model."""
    return name.startswith(("/", "./", "../", "~")) or name.lower().endswith(LOCAL_SUFFIXES)


def check_local_inputs(config) -> None:
    """Missing local model/data paths, before any process is started."""
    if looks_local(config.model_name) and not Path(config.model_name).expanduser().exists():
        raise ConfigError(f"model_name: no such directory '{config.model_name}'")
    for key in ("dataset", "eval_dataset"):
        for index, spec in enumerate(getattr(config, key) or []):
            path = Path(spec.name).expanduser()
            if looks_local(spec.name) and not path.exists():
                raise ConfigError(f"{key}[{index}].name: no such file or directory '{spec.name}'")
            if path.is_file() and path.suffix.lower() not in LOCAL_SUFFIXES:
                raise ConfigError(f"{key}[{index}].name: unsupported file type '{path.suffix}' "
                                  f"(use {', '.join(LOCAL_SUFFIXES)})")
    check_chat_template(config)
    type(config).training_method.check_launch(config)  # GRPO: reward_funcs import and take TRL's call


def check_chat_template(config) -> None:
    """A chat_template that is neither Jinja text nor a readable template file."""
    if not config.chat_template:
        return
    from ..data import DataError, resolve_chat_template

    try:
        resolve_chat_template(config.chat_template)
    except (DataError, OSError, UnicodeDecodeError) as exc:
        raise ConfigError(str(exc)) from None


def check_trackers(config) -> None:
    """A tracker asked for in report_to whose package is missing."""
    import importlib.util

    for tracker in config.trackers:  # each tracker's module has its name (mlflow-skinny installs `mlflow`)
        if importlib.util.find_spec(tracker) is None:
            raise ConfigError(f"report_to: {tracker} is not installed; pip install 'praisonai-accel[{tracker}]'")


def check_hub_access(config) -> None:
    """push_to_hub without a token, or into a public repo with hub_private."""
    if config.push_to_hub:
        from ..publish.hub import check_hub_access as check

        check(config)


def check_accelerate_config(path: Path) -> None:
    """A user's --accelerate-config: it exists, reads, and is not DeepSpeed."""
    from .accelerate_config import read_accelerate_config

    if not path.is_file():
        raise ConfigError(f"--accelerate-config: no such file '{path}'")
    try:
        data = read_accelerate_config(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--accelerate-config: {exc}") from None
    except Exception:  # invalid YAML: accelerate would say so; say it in one line here
        raise ConfigError(f"--accelerate-config: {path} is not valid YAML") from None
    deepspeed_rule("DEEPSPEED" if "deepspeed_config" in data else data.get("distributed_type", ""), "--accelerate-config")


def local_model_config(config):
    """The model's config when it is on this machine (a directory, or in the Hub cache), read without downloading
    or running remote code; None otherwise (the worker checks what needed it once the model loads)."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(config.model_name, revision=config.revision, local_files_only=True)
    except Exception:  # not here, or its code is remote: nothing to read before launch
        return None
