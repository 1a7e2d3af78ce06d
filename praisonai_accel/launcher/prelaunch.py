"""The one pass of checks before any process starts (`check_launch`, called by `train`, `--ray`, `slurm` and `k8s`),
and the checks in it that only the launching machine can make: local paths exist, a chat template file reads, the
method's own launch checks (GRPO's reward functions and tools import), the trackers, llama.cpp for a GGUF save,
lm-eval's tasks and the Hub token are there. Each raises ConfigError with one line; the CLI shows it. The rules the
worker checks again are checks.RULES, run in their place in the pass.

What a launching machine can check depends on what it shares with the machines that train: `train` and `--ray`
launch here (its files and its Python environment are the workers'), as does `slurm` (a job sees the cluster's shared
file system, and sbatch passes it the submitting shell's environment: --export=ALL, SLURM's default); a Kubernetes
manifest is applied to pods whose volume and image this machine never sees, so only the config's own rules are
checked there (each pod's `praisonai-accel train` runs the whole pass again)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from ..checks import Situation, check_run, deepspeed_rule, resume_rule
from ..config import ConfigError
from ..data import DataError, resolve_chat_template
from ..data.vision_processor import ModelInputs
from ..evaluate.tasks import build_tasks, metric_key, task_metrics
from ..publish import hub
from ..publish.gguf import GGUFError, check_before_training
from .accelerate_config import read_accelerate_config

LOCAL_SUFFIXES = (".json", ".jsonl", ".csv", ".parquet", ".txt")  # the keys of config.LOCAL_DATA_LOADERS


def looks_local(name: str) -> bool:
    """A path the user meant to be on disk, as opposed to a Hub id such as org/model."""
    return name.startswith(("/", "./", "../", "~")) or name.lower().endswith(LOCAL_SUFFIXES)


def check_local_inputs(config) -> None:
    """Missing local model/data paths, before any process is started."""
    model_dir = Path(config.model_name).expanduser()
    if looks_local(config.model_name) and not model_dir.exists():
        raise ConfigError(f"model_name: no such directory '{config.model_name}'")
    if model_dir.is_dir() and not (model_dir / "config.json").is_file() and not (
            model_dir / "adapter_config.json").is_file():
        raise ConfigError(f"model_name: '{config.model_name}' holds no model (no config.json); name the folder a "
                          "model was saved in (save_pretrained), or a Hub id")
    for key in ("output_dir", "dataset_prepared_path"):
        check_folder(key, getattr(config, key, None))
    for key in ("dataset", "eval_dataset"):
        for index, spec in enumerate(getattr(config, key) or []):
            path = Path(spec.name).expanduser()
            if looks_local(spec.name) and not path.exists():
                raise ConfigError(f"{key}[{index}].name: no such file or directory '{spec.name}'")
            if path.is_file() and path.suffix.lower() not in LOCAL_SUFFIXES:
                raise ConfigError(f"{key}[{index}].name: unsupported file type '{path.suffix}' "
                                  f"(use {', '.join(LOCAL_SUFFIXES)})")
    check_chat_template(config)
    type(config).training_method.check_launch(config)  # GRPO: reward_funcs and tools import and take TRL's call


def check_folder(key: str, value: str | None) -> None:
    """A folder the run creates and writes in: neither it nor the nearest part of its path that exists is a file."""
    if not value:
        return
    path = Path(value)  # `~` is expanded when the config is read
    existing = next((p for p in (path, *path.parents) if p.exists()), None)
    if existing == path and not path.is_dir():
        raise ConfigError(f"{key}: '{value}' is a file; name a folder (created if missing)")
    if existing is not None and not existing.is_dir():
        raise ConfigError(f"{key}: '{value}' is inside '{existing}', which is a file")


def check_chat_template(config) -> None:
    """A chat_template that is neither Jinja text nor a readable template file."""
    if not config.chat_template:
        return

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
        hub.check_hub_access(config)


def check_accelerate_config(path: Path) -> None:
    """A user's --accelerate-config: it exists, reads, and is not DeepSpeed."""
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


def check_gguf(config, inputs: ModelInputs) -> None:
    """save_gguf / huggingface_save_gguf / ollama_save need llama.cpp's converter, the engine, a known architecture
    and a token; none of them, nor ollama_model, takes a vision-language model: refused before launch, not after
    training."""
    if not (config.save_gguf or config.huggingface_save_gguf or config.ollama_save or config.ollama_model):
        return

    try:
        check_before_training(config, inputs)
    except GGUFError as exc:
        raise ConfigError(str(exc)) from None


def check_eval_tasks(config) -> None:
    """eval_tasks built as the workers will build them, and a metric_for_best_model naming one of their scores
    checked against the task's metrics."""
    if not config.eval_tasks:
        return

    include = Path(config.eval_include_path) if config.eval_include_path else None
    _, task_dict = build_tasks(config.eval_tasks, include, ("eval_tasks", "eval_include_path"))
    wanted = config.metric_for_best_model.removeprefix("eval_")
    task, _, metric = wanted.partition("/")
    metrics = task_metrics(task_dict)
    if task in metrics and metric.split(",")[0] not in metrics[task]:
        raise ConfigError(f"metric_for_best_model: task {task} logs no metric {metric!r}; it logs "
                          f"{', '.join('eval_' + metric_key(task, m) for m in metrics[task])}")


# In order, around checks.RULES (None marks where they run): (name, check of the situation, skipped on a dry run)
_MACHINE_CHECKS: tuple[tuple[str, Callable[[Situation], None] | None, bool], ...] = (
    ("local inputs", lambda s: check_local_inputs(s.config), False),
    ("trackers", lambda s: check_trackers(s.config), False),
    ("GGUF export", lambda s: check_gguf(s.config, s.inputs or ModelInputs(None)), False),
    ("rules", None, False),
    ("eval_tasks", lambda s: check_eval_tasks(s.config), False),
    ("Hub access", lambda s: check_hub_access(s.config), True),
)


def check_launch(config, num_processes: int, here: bool = True, dry_run: bool = False,
                 inputs: ModelInputs | None = None, fsdp: bool = False) -> str:
    """The one pass before any process starts; returns where the run starts (resume or fresh), as far as this
    machine can tell. `here`: the training sees this machine's files and Python environment (train, --ray, slurm);
    False for a Kubernetes manifest, where only the config's own rules are checked. `inputs`: what the model takes,
    as the caller decided it (data/vision_processor.model_inputs). `fsdp`: --fsdp."""
    reads_model = config.sequence_parallel_size > 1 or config.offload_embedding
    model_config = local_model_config(config) if here and reads_model else None
    situation = Situation(config, num_processes, "launch", sees_files=here, model_config=model_config, inputs=inputs,
                          distributed_type="FSDP" if fsdp else None)
    for _name, check, not_on_dry_run in _MACHINE_CHECKS:
        if check is None:
            check_run(situation)
        elif here and not (dry_run and not_on_dry_run):
            check(situation)
    if not here:
        return "decided in the pods (output_dir is on their volume)"
    start, _skip, _warning = resume_rule(config, num_processes)
    return f"resume from {start}" if start is not None else "fresh start"
