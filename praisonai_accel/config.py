"""config.yaml schema: one validated object that every later stage reads.

Errors are turned into a single line that names the offending key, so the CLI can
print it and exit 2 without a traceback.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import re
from pathlib import Path
from typing import Any, ClassVar, Literal, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from .config_method import MethodChoice, config_model
from .config_vision import VisionKeys
from .errors import ConfigError  # noqa: F401  (raised here; imported from here by most modules)

# Local data files by extension, and the datasets loader that reads them (checked by the CLI before launch).
LOCAL_DATA_LOADERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text"}
TRACKERS = ("tensorboard", "wandb", "mlflow", "trackio")
DEFAULT_LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MULTI_DEVICE_MAPS = {"auto", "balanced", "balanced_low_0", "sequential"}

# Keys of the original PraisonAI train config, accepted under their old names.
KEY_ALIASES = {"split_type": "split", "hf_model_name": "hub_model_id", "random_state": "seed",
               "huggingface_save": "push_to_hub"}
SECRET_KEYS = {"hub_token", "hf_token", "token", "huggingface_token"}


# Keys that may change between an interrupted run and its resumption without making it another run.
RESUMABLE_KEYS = {
    "max_steps", "num_train_epochs", "logging_steps", "save_strategy", "save_steps", "save_total_limit",
    "resume_from_checkpoint", "overwrite_output_dir", "per_device_train_batch_size", "gradient_accumulation_steps",
    "eval_strategy", "eval_steps", "per_device_eval_batch_size", "load_best_model_at_end", "early_stopping_patience",
    "early_stopping_threshold", "final_model_dir", "dataset_num_proc", "dataset_prepared_path", "mixed_precision",
    "output_dir", "push_to_hub", "hub_model_id", "hub_strategy", "hub_private", "ollama_model", "ollama_base", "ollama_push",
    "report_to", "run_name", "plot_loss", "use_liger", "chunked_loss", "force_resume",
    "quantization_method", "save_gguf", "huggingface_save_gguf", "ollama_save",
}
REENTRANT_WITH_UNUSED = (
    "ddp_find_unused_parameters: true cannot work with reentrant gradient checkpointing (unsloth's, or "
    "use_gradient_checkpointing: reentrant) under DDP: a parameter is marked ready twice; leave it unset")
DEEPSPEED_REFUSED = ("DeepSpeed is not supported: its engine would step the optimizer after every micro-batch of this "
                     "loop's gradient accumulation; shard the model with --fsdp (FSDP2) instead")
# Control characters in a path or name end a line of a generated script or manifest: never accepted.
CONTROL_CHARACTERS = re.compile(r"[\x00-\x1f\x7f]")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True)


class DatasetSpec(_Strict):
    name: str
    split: str = "train"
    subset: str | None = None
    data_files: str | list[str] | None = None
    format: Literal["auto", "alpaca", "sharegpt", "messages", "text"] = "auto"
    text_field: str = "text"
    num_samples: int | None = Field(default=None, gt=0)
    system_prompt: str | None = None


class TrainConfig(MethodChoice, VisionKeys, _Strict):
    # model
    model_name: str
    tokenizer_name: str | None = None
    revision: str | None = None  # a branch, tag or commit of model_name (and tokenizer_name) on the Hub
    max_seq_length: int = Field(default=2048, gt=0)
    torch_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device_map: Union[str, dict[str, Union[int, str]], None] = None
    use_unsloth: Union[bool, Literal["auto"]] = "auto"
    use_gradient_checkpointing: Union[bool, Literal["unsloth", "reentrant"]] = False
    trust_remote_code: bool = False

    # data
    dataset: list[DatasetSpec] = Field(min_length=1)
    train_on_inputs: bool = False
    chat_template: str | None = None
    dataset_num_proc: int | None = Field(default=None, gt=0)
    dataset_prepared_path: str | None = None  # the preprocessing cache; default output_dir/.cache/preprocessed
    group_by_length: bool = False  # batch samples of similar length: far less padding, same sequence for any layout
    group_by_length_window: int = Field(default=256, gt=0)
    truncation: Literal["keep_response", "right"] = "keep_response"
    # When even the response does not fit: cut its end (truncate) or leave the example out (drop)
    excess_length_strategy: Literal["truncate", "drop"] = "truncate"
    packing: bool = False
    skip_invalid_rows: bool = False  # train on the valid rows; every other one is listed in logs/skipped_rows.jsonl

    # fine-tune method
    finetune_type: Literal["lora", "qlora", "full"] = "lora"
    load_in_4bit: bool | None = None
    lora_r: int = Field(default=16, gt=0)
    lora_alpha: int = Field(default=16, gt=0)
    lora_dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    lora_target_modules: Union[list[str], Literal["all-linear"]] = Field(default_factory=lambda: list(DEFAULT_LORA_TARGETS))
    lora_bias: Literal["none", "all", "lora_only"] = "none"
    use_rslora: bool = False
    # optimisation
    per_device_train_batch_size: int = Field(default=2, gt=0)
    gradient_accumulation_steps: int = Field(default=1, gt=0)
    learning_rate: float = Field(default=2e-4, gt=0)
    weight_decay: float = Field(default=0.0, ge=0)
    max_grad_norm: float = Field(default=1.0, ge=0)
    adam_beta1: float = Field(default=0.9, ge=0, lt=1)
    adam_beta2: float = Field(default=0.999, ge=0, lt=1)
    adam_epsilon: float = Field(default=1e-8, gt=0)
    num_train_epochs: int = Field(default=1, gt=0)
    max_steps: int = -1
    warmup_steps: int = Field(default=0, ge=0)
    warmup_ratio: float = Field(default=0.0, ge=0, lt=1)
    lr_scheduler_type: Literal[
        "linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup", "inverse_sqrt"
    ] = "linear"
    optim: Literal["adamw_torch", "adamw_torch_fused", "adamw_8bit", "paged_adamw_8bit", "sgd"] = "adamw_torch"
    seed: int = 3407
    mixed_precision: Literal["auto", "no", "fp16", "bf16"] = "auto"
    ddp_find_unused_parameters: bool | None = None
    ddp_timeout: int = Field(default=1800, gt=0)  # seconds a collective waits for every rank (torch's default)
    preflight_timeout: float = Field(default=60, gt=0)  # seconds for the all-reduce every rank does before loading
    hang_timeout: float = Field(default=1800, ge=0)  # seconds without a finished step before a rank reports a hang; 0: off
    preemption_grace_seconds: int = Field(default=120, ge=0)  # SIGTERM to SIGKILL, for the save (torchrun's default: 30)
    chunked_loss: bool = True  # LM head + cross-entropy at target positions only, in chunks; false: the model's full logits
    use_liger: Union[bool, Literal["auto"]] = "auto"  # liger-kernel's fused linear cross-entropy, on a GPU
    # long context (README "Long context"): ranks sharing every row (Ulysses), and the MLP over tiles of the row
    sequence_parallel_size: int = Field(default=1, ge=1)
    tiled_mlp: bool = False
    tiled_mlp_shards: int | None = Field(default=None, gt=0)  # default: about hidden_size tokens per tile

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

    # outputs
    output_dir: str = "outputs"
    final_model_dir: str = "lora_model"
    logging_steps: int = Field(default=1, gt=0)
    report_to: Union[Literal["none", "tensorboard", "wandb", "mlflow", "trackio"],
                     list[Literal["tensorboard", "wandb", "mlflow", "trackio"]]] = "none"
    run_name: str | None = None
    plot_loss: bool = True  # output_dir/loss.png at the end of training (LLaMA-Factory's key)

    # checkpoints and resume
    save_strategy: Literal["no", "steps", "epoch"] | None = None  # default: "steps" if save_steps is set, else "no"
    save_steps: int | None = Field(default=None, gt=0)
    save_total_limit: int | None = Field(default=None, gt=0)
    resume_from_checkpoint: Union[bool, str] = True
    force_resume: bool = False  # resume from a resume_from_checkpoint path that belongs to another run, on purpose
    overwrite_output_dir: bool = False

    # evaluation and early stopping
    eval_dataset: list[DatasetSpec] | None = None
    val_split_ratio: float = Field(default=0.0, ge=0.0, lt=1.0)
    eval_strategy: Literal["no", "steps", "epoch"] | None = None  # default: steps/epoch when eval data is given
    eval_steps: int | None = Field(default=None, gt=0)
    per_device_eval_batch_size: int | None = Field(default=None, gt=0)
    load_best_model_at_end: bool = False
    metric_for_best_model: str = "eval_loss"  # eval_loss, or an eval metric of the method (eval_rewards/accuracies)
    greater_is_better: bool = False
    early_stopping_patience: int | None = Field(default=None, gt=0)
    early_stopping_threshold: float = Field(default=0.0, ge=0.0)

    # publishing (rank 0 only, after training; the token comes from HF_TOKEN, never from this file)
    push_to_hub: bool = False
    hub_model_id: str | None = None
    hub_strategy: Literal["end", "every_save", "checkpoint", "all_checkpoints"] = "end"
    hub_private: bool = True
    ollama_model: str | None = None
    ollama_base: str | None = None  # an Ollama model to use as FROM; default: upload the base model's files
    ollama_push: bool = False
    # GGUF after training, under praisonai-train's names (rank 0, after the final save; publish/gguf.py does it)
    GGUF_METHODS: ClassVar[tuple] = ("q4_k_m", "q5_k_m", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q3_k_m", "q6_k",
                                     "q2_k", "f16", "bf16")
    quantization_method: Union[str, list[str]] = "q4_k_m"  # one method or several; a .gguf file for each
    save_gguf: bool = False  # write output_dir/gguf/<final_model_dir>-<METHOD>.gguf
    huggingface_save_gguf: bool = False  # also upload the .gguf files to hub_model_id (hf_model_name)
    ollama_save: bool = False  # create ollama_model FROM the first method's .gguf instead of from safetensors

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
        if not self.final_model_dir.strip():
            raise ValueError("final_model_dir: must name a directory (default lora_model, inside output_dir)")
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
        has_eval_data = bool(self.eval_dataset) or self.val_split_ratio > 0
        if self.eval_steps and not has_eval_data:
            raise ValueError("eval_steps: evaluation needs eval_dataset or val_split_ratio")
        if self.eval_strategy is None:
            self.eval_strategy = ("steps" if self.eval_steps else "epoch") if has_eval_data else "no"
        if self.eval_strategy != "no" and not has_eval_data:
            raise ValueError(f"eval_strategy: '{self.eval_strategy}' needs eval_dataset or val_split_ratio")
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


_EXPECTED_BY_ERROR = {
    "float_parsing": "a number",
    "float_type": "a number",
    "int_parsing": "an integer",
    "int_type": "an integer",
    "int_from_float": "an integer",
    "bool_parsing": "true or false",
    "bool_type": "true or false",
    "string_type": "a string",
    "list_type": "a list",
    "dict_type": "a mapping",
    "model_type": "a mapping",
    "model_attributes_type": "a mapping",
}


def _key_path(loc: tuple, model: type[BaseModel] = TrainConfig) -> str:
    fields = set(model.model_fields) | set(DatasetSpec.model_fields)
    path = ""
    for item in loc:
        if isinstance(item, int):
            path += f"[{item}]"
        elif item in fields or not path:
            path += f".{item}" if path else str(item)
        # anything else is pydantic naming a union member, which the user never wrote
    return path or "config"


def _known_keys(loc: tuple, model: type[BaseModel] = TrainConfig) -> list[str]:
    if loc and loc[0] in ("dataset", "eval_dataset"):
        model = DatasetSpec
    return list(model.model_fields)


def _expected(error: dict) -> str | None:
    if error["type"] in _EXPECTED_BY_ERROR:
        return _EXPECTED_BY_ERROR[error["type"]]
    if error["type"] == "literal_error":
        return f"one of {error['ctx']['expected']}"
    return None


def _describe(errors: list[dict], model: type[BaseModel] = TrainConfig) -> str:
    # Prefer errors that are not type mismatches: unions report one mismatch per member.
    error = next((e for e in errors if e["type"] in ("extra_forbidden", "missing", "value_error")), errors[0])
    loc = tuple(error["loc"])
    kind = error["type"]
    key = _key_path(loc, model)
    if kind == "extra_forbidden":
        key = f"{_key_path(loc[:-1], model)}.{loc[-1]}" if len(loc) > 1 else str(loc[-1])
        close = difflib.get_close_matches(str(loc[-1]), _known_keys(loc, model), n=1, cutoff=0.6)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        return f"unknown key '{key}'{hint}"
    if kind == "missing":
        return f"missing required key '{key}'"
    if kind == "value_error":
        return str(error["ctx"]["error"])
    if kind == "too_short" and key == "dataset":
        return "dataset: list at least one dataset"
    expected = [x for e in errors if _key_path(tuple(e["loc"]), model) == key and (x := _expected(e))]
    if expected:
        return f"{key}: expected {' or '.join(dict.fromkeys(expected))}, got {error['input']!r}"
    return f"{key}: {error['msg'][0].lower()}{error['msg'][1:]}, got {error['input']!r}"


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
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping of keys at the top level, got {type(data).__name__}")
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
        raise ConfigError(f"{source}: {_describe(exc.errors(), model)}") from None
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
    return parse_config(data, source=str(path), config_dir=str(path.resolve().parent))
