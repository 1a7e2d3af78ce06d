"""config.yaml schema: one validated object that every later stage reads.

Errors are turned into a single line that names the offending key, so the CLI can
print it and exit 2 without a traceback.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError, ValidationInfo, field_validator, model_validator

from .mistakes import describe_errors
from .keys import (CheckpointKeys, DataKeys, DatasetSpec, EvalKeys, FinetuneKeys, GGUFKeys,
                          LossAndLengthKeys, ModelKeys, OptimizerKeys, OutputKeys, ProcessKeys, PublishKeys)
from .method import MethodChoice, config_model
from .vision import VisionKeys
from ..errors import ConfigError  # noqa: F401  (raised here; imported from here by most modules)

# Local data files by extension, and the datasets loader that reads them (checked by the CLI before launch).
LOCAL_DATA_LOADERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text"}
TRACKERS = ("tensorboard", "wandb", "mlflow", "trackio")
MULTI_DEVICE_MAPS = {"auto", "balanced", "balanced_low_0", "sequential"}

# Keys of the original PraisonAI train config, accepted under their old names.
KEY_ALIASES = {"split_type": "split", "hf_model_name": "hub_model_id", "random_state": "seed",
               "huggingface_save": "push_to_hub"}
SECRET_KEYS = {"hub_token", "hf_token", "token", "huggingface_token", "hf_hub_token"}  # hf_hub_token: LLaMA-Factory


# Keys that may change between an interrupted run and its resumption without making it another run.
RESUMABLE_KEYS = {
    "max_steps", "num_train_epochs", "logging_steps", "save_strategy", "save_steps", "save_total_limit",
    "resume_from_checkpoint", "overwrite_output_dir", "per_device_train_batch_size", "gradient_accumulation_steps",
    "eval_strategy", "eval_steps", "per_device_eval_batch_size", "load_best_model_at_end", "early_stopping_patience",
    "early_stopping_threshold", "eval_tasks", "eval_include_path", "eval_limit", "eval_apply_chat_template",
    "final_model_dir", "dataset_num_proc", "dataset_prepared_path", "mixed_precision",
    "output_dir", "push_to_hub", "hub_model_id", "hub_strategy", "hub_private", "ollama_model", "ollama_base", "ollama_push",
    "report_to", "run_name", "plot_loss", "use_liger", "chunked_loss", "offload_embedding", "force_resume",
    "quantization_method", "save_gguf", "huggingface_save_gguf", "ollama_save",
}
REENTRANT_WITH_UNUSED = (
    "ddp_find_unused_parameters: true cannot work with reentrant gradient checkpointing (unsloth's, or "
    "use_gradient_checkpointing: reentrant) under DDP: a parameter is marked ready twice; leave it unset")
DEEPSPEED_REFUSED = ("DeepSpeed is not supported: its engine would step the optimizer after every micro-batch of this "
                     "loop's gradient accumulation; shard the model with --fsdp (FSDP2) instead")
# Control characters in a path or name end a line of a generated script or manifest: never accepted.
CONTROL_CHARACTERS = re.compile(r"[\x00-\x1f\x7f]")


# the keys that name a path on this machine (a model, a Hub id otherwise)
HOME_RELATIVE_KEYS = ("model_name", "tokenizer_name", "output_dir", "final_model_dir", "dataset_prepared_path",
                      "eval_include_path", "resume_from_checkpoint")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True)


# The groups are listed last to first: pydantic orders fields from the last base to the first, and this keeps
# the order the keys are validated (and printed by train --dry-run) in: vision, method, model, ..., GGUF.
class TrainConfig(GGUFKeys, PublishKeys, EvalKeys, CheckpointKeys, OutputKeys, LossAndLengthKeys, ProcessKeys,
                  OptimizerKeys, FinetuneKeys, DataKeys, ModelKeys, MethodChoice, VisionKeys, _Strict):
    """Every key of config.yaml: the groups of config_keys.py, `method:` (the chosen method's own keys are composed
    in: config_method.py) and the vision keys, and the rules that span groups."""

    @field_validator(*HOME_RELATIVE_KEYS)
    @classmethod
    def _home(cls, value):
        """`~/runs/a` is under the home folder, as in a shell and in transformers' TrainingArguments (not a folder
        named `~` in the working directory)."""
        return os.path.expanduser(value) if isinstance(value, str) and value.startswith("~") else value

    @field_validator("sequence_parallel_size")
    @classmethod
    def _sequence_parallel_backend(cls, value: int, info: ValidationInfo) -> int:
        if value > 1 and info.data.get("use_unsloth") is True:
            raise ValueError("sequence_parallel_size: unsloth's own attention cannot be split over ranks; "
                             "set use_unsloth: false (or auto)")
        return value

    @field_validator("tiled_mlp_shards")
    @classmethod
    def _shards_need_tiling(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and not info.data.get("tiled_mlp"):
            raise ValueError("tiled_mlp_shards: only used with tiled_mlp: true; set it, or remove tiled_mlp_shards")
        return value

    @model_validator(mode="after")
    def _check_gguf(self) -> "TrainConfig":
        methods = [self.quantization_method] if isinstance(self.quantization_method, str) else self.quantization_method
        for method in methods or [None]:
            if str(method).lower() not in self.GGUF_METHODS:
                raise ValueError(f"quantization_method: '{method}' is not a GGUF quantization; use one of "
                                 f"{', '.join(self.GGUF_METHODS)}")
        self.quantization_method = list(dict.fromkeys(str(m).lower() for m in methods))
        if self.huggingface_save_gguf and not self.hub_model_id:
            raise ValueError("hub_model_id: required when huggingface_save_gguf is true (e.g. your-name/my-model)")
        if self.ollama_save and not self.ollama_model:
            raise ValueError("ollama_save: needs ollama_model (name:tag)")
        return self

    @model_validator(mode="after")
    def _check_combinations(self) -> "TrainConfig":
        if self.load_in_4bit and self.finetune_type == "full":
            raise ValueError("load_in_4bit: 4-bit weights cannot be fully fine-tuned; use finetune_type: qlora")
        if self.load_in_4bit:
            self.finetune_type = "qlora"
        if self.max_steps == 0 or self.max_steps < -1:
            raise ValueError("max_steps: must be a positive number of steps, or -1 to train num_train_epochs")
        if isinstance(self.device_map, str) and self.device_map not in MULTI_DEVICE_MAPS | {"cpu", "cuda"}:
            if not self.device_map.startswith("cuda:"):
                raise ValueError(
                    f"device_map: unknown value '{self.device_map}'; use auto, balanced, sequential, cpu, cuda:N or a mapping"
                )
        self._check_save_and_eval()
        if self.push_to_hub and not self.hub_model_id:
            raise ValueError("hub_model_id: required when push_to_hub is true (e.g. your-name/my-model)")
        if self.ollama_push and not self.ollama_model:
            raise ValueError("ollama_push: needs ollama_model (name:tag)")
        if self.packing and self.group_by_length:
            raise ValueError("packing: rows are already full; turn group_by_length off when packing")
        for key in ("output_dir", "final_model_dir", "model_name", "tokenizer_name", "revision", "run_name",
                    "dataset_prepared_path", "hub_model_id"):
            value = getattr(self, key)
            if value is not None and CONTROL_CHARACTERS.search(value):
                raise ValueError(f"{key}: {value!r} holds a control character (a newline?); remove it")
        self._check_final_model_dir()
        return self

    def _check_final_model_dir(self) -> None:
        """The final save replaces final_model_dir: it must not be output_dir, hold it, or sit where checkpoints go."""
        if self.final_model_dir is None:
            self.final_model_dir = "lora_model" if self.uses_lora else "model"
        if not self.final_model_dir.strip():
            raise ValueError("final_model_dir: must name a directory (default lora_model, or model for a full "
                             "fine-tune, inside output_dir)")
        output, final = self.output_path().resolve(), self.final_model_path().resolve()
        if output == final or output.is_relative_to(final):
            raise ValueError(f"final_model_dir: '{self.final_model_dir}' is output_dir or holds it; the final save would "
                             "replace it with everything in it; name a directory inside it, such as lora_model")
        if final.is_relative_to(output) and re.match(r"^checkpoint-\d+", final.relative_to(output).parts[0]):
            raise ValueError(f"final_model_dir: '{self.final_model_dir}' is where checkpoints are saved and rotated; "
                             "use another name")

    @property
    def trackers(self) -> list[str]:
        if self.report_to == "none":
            return []
        return [self.report_to] if isinstance(self.report_to, str) else list(dict.fromkeys(self.report_to))

    def _check_save_and_eval(self) -> None:
        if self.save_strategy is None:
            self.save_strategy = "steps" if self.save_steps else "no"
        if self.save_strategy == "steps" and not self.save_steps:
            raise ValueError("save_steps: required when save_strategy is 'steps'")
        if self.eval_dataset and self.val_split_ratio > 0:
            raise ValueError("val_split_ratio: use either val_split_ratio or eval_dataset, not both")
        has_eval_data = bool(self.eval_dataset) or self.val_split_ratio > 0 or bool(self.eval_tasks)
        if self.eval_steps and not has_eval_data:
            raise ValueError("eval_steps: evaluation needs eval_dataset or val_split_ratio (or eval_tasks)")
        if self.eval_strategy is None:
            self.eval_strategy = ("steps" if self.eval_steps else "epoch") if has_eval_data else "no"
        if self.eval_strategy != "no" and not has_eval_data:
            raise ValueError(f"eval_strategy: '{self.eval_strategy}' needs eval_dataset or val_split_ratio (or eval_tasks)")
        needs_tasks = [key for key in ("eval_include_path", "eval_limit", "eval_apply_chat_template")
                       if getattr(self, key) is not None]
        if needs_tasks and not self.eval_tasks:
            raise ValueError(f"{needs_tasks[0]}: needs eval_tasks")
        if self.greater_is_better is None:  # transformers' rule
            self.greater_is_better = not self.metric_for_best_model.endswith("loss")
        if self.eval_strategy == "steps" and not self.eval_steps:
            raise ValueError("eval_steps: required when eval_strategy is 'steps'")
        if self.early_stopping_patience and self.eval_strategy == "no":
            raise ValueError("early_stopping_patience: needs evaluation (eval_dataset or val_split_ratio)")
        if self.load_best_model_at_end:
            if self.eval_strategy == "no" or self.save_strategy != self.eval_strategy:
                raise ValueError("load_best_model_at_end: needs save_strategy and eval_strategy to be the same, and not 'no'")
            if self.save_strategy == "steps" and self.save_steps % self.eval_steps:
                raise ValueError("load_best_model_at_end: save_steps must be a multiple of eval_steps")

    def run_identity(self) -> dict:
        """What makes two runs the same run (model, revision, data, method, seed)."""
        return {k: v for k, v in self.model_dump(mode="json").items() if k not in RESUMABLE_KEYS}

    def run_fingerprint(self) -> str:
        """Hash of run_identity, for resume safety."""
        return hashlib.sha256(json.dumps(self.run_identity(), sort_keys=True).encode()).hexdigest()[:16]

    @property
    def uses_lora(self) -> bool:
        return self.finetune_type in ("lora", "qlora")

    def output_path(self) -> Path:
        return Path(self.output_dir)

    def final_model_path(self) -> Path:
        final = Path(self.final_model_dir)
        return final if final.is_absolute() else self.output_path() / final

    def fingerprint(self) -> str:
        """Stable hash of everything that shapes the run, for checkpoint metadata and caches."""
        blob = json.dumps(self.model_dump(mode="json"), sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _dataset_list(value: Any) -> Any:
    """A single dataset, or a bare name, stands for a list of one; old key names inside are renamed."""
    items = [value] if isinstance(value, (dict, str)) else value
    if not isinstance(items, list):
        return value  # let validation name the type error
    return [{"name": d} if isinstance(d, str) else ({KEY_ALIASES.get(k, k): v for k, v in d.items()} if isinstance(d, dict) else d)
            for d in items]


def parse_config(data: Any, source: str = "config", config_dir: str | None = None) -> TrainConfig:
    """The validated config of `data`, as TrainConfig composed with the chosen method's keys; ConfigError (one line,
    starting with `source`). `config_dir`: where the method's and reward functions' modules are looked for first."""
    if data is None:
        raise ConfigError(f"{source}: the file is empty; a config names at least model_name and dataset")
    if not isinstance(data, dict):
        kind = {list: "a list", str: "a single value"}.get(type(data), type(data).__name__)
        raise ConfigError(f"{source}: expected keys (`model_name: ...` one per line) at the top level, got {kind}")
    secret = next((k for k in data if str(k).lower() in SECRET_KEYS), None)
    if secret is not None:
        raise ConfigError(f"{source}: {secret}: tokens never go in config files; set HF_TOKEN in the environment")
    data = {KEY_ALIASES.get(k, k): v for k, v in data.items()}
    for key in ("dataset", "eval_dataset"):
        if key in data:
            data[key] = _dataset_list(data[key])
    try:
        model, data = config_model(TrainConfig, data, config_dir)
    except ValueError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    try:
        config = model.model_validate(data)
    except ValidationError as exc:
        fields = set(model.model_fields) | set(DatasetSpec.model_fields)
        lines = describe_errors(exc.errors(), fields, list(model.model_fields), list(DatasetSpec.model_fields))
        raise ConfigError("\n".join(f"{source}: {line}" for line in lines)) from None
    config._config_dir = config_dir
    return config


class _DuplicateKey(yaml.YAMLError):
    def __init__(self, key: str, first: int, second: int):
        super().__init__(f"key '{key}' is written twice (lines {first} and {second}); keep one")


class _UnhashableKey(yaml.YAMLError):
    def __init__(self, line: int):
        super().__init__(f"the key at line {line} is a list or mapping; keys are names such as learning_rate")


class _StrictLoader(yaml.SafeLoader):
    """safe_load that refuses a key written twice in one mapping, instead of silently keeping the last value."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _value in node.value:
            key = self.construct_object(key_node, deep=deep)
            line = key_node.start_mark.line + 1
            if isinstance(key, (list, dict, set)):
                raise _UnhashableKey(line)
            if key in seen:
                raise _DuplicateKey(str(key), seen[key], line)
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def read_yaml(path: Path):
    return yaml.load(Path(path).read_text(), Loader=_StrictLoader)


def load_config(path: str | Path) -> TrainConfig:
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"{path}: is a directory; name the config file in it (config.yaml)")
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found")
    try:
        data = read_yaml(path)
    except (_DuplicateKey, _UnhashableKey) as exc:
        raise ConfigError(f"{path}: {exc}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise ConfigError(f"{path}: invalid YAML{where}: {getattr(exc, 'problem', None) or exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a text file") from None
    config = parse_config(data, source=str(path), config_dir=str(path.resolve().parent))
    config._config_file = str(path.resolve())
    return config
