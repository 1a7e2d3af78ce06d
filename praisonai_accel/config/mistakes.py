"""A config's validation errors as lines, one per mistake, each naming its key by its YAML path; a peer's key name
(LLaMA-Factory, Axolotl, TRL, accelerate / torchrun) answered with ours, or with the `train` flag that does it."""

from __future__ import annotations

import difflib
from typing import Any

# The peers' key -> (whose name it is, our key or train's flag). Keys with the same name and meaning are not here:
# they are ours too. A flag starts with "--".
PEER_KEYS: dict[str, tuple[str, str]] = {
    "stage": ("LLaMA-Factory", "method"),
    "dataset_dir": ("LLaMA-Factory", "dataset"),
    "cutoff_len": ("LLaMA-Factory", "max_seq_length"),
    "lora_rank": ("LLaMA-Factory", "lora_r"),
    "lora_target": ("LLaMA-Factory", "lora_target_modules"),
    "template": ("LLaMA-Factory", "chat_template"),
    "finetuning_type": ("LLaMA-Factory", "finetune_type"),
    "model_name_or_path": ("LLaMA-Factory / TRL", "model_name"),
    "pref_beta": ("LLaMA-Factory", "beta"),
    "pref_loss": ("LLaMA-Factory", "loss_type"),
    "val_size": ("LLaMA-Factory", "val_split_ratio"),
    "max_samples": ("LLaMA-Factory", "dataset[].num_samples"),
    "preprocessing_num_workers": ("LLaMA-Factory", "dataset_num_proc"),
    "quantization_bit": ("LLaMA-Factory", "load_in_4bit"),
    "train_on_prompt": ("LLaMA-Factory", "train_on_inputs"),
    "neat_packing": ("LLaMA-Factory", "packing"),
    "rl": ("Axolotl", "method"),
    "base_model": ("Axolotl", "model_name"),
    "tokenizer_config": ("Axolotl", "tokenizer_name"),
    "datasets": ("Axolotl", "dataset"),
    "test_datasets": ("Axolotl", "eval_dataset"),
    "sequence_len": ("Axolotl", "max_seq_length"),
    "micro_batch_size": ("Axolotl", "per_device_train_batch_size"),
    "eval_batch_size": ("Axolotl", "per_device_eval_batch_size"),
    "num_epochs": ("Axolotl", "num_train_epochs"),
    "adapter": ("Axolotl", "finetune_type"),
    "lora_target_linear": ("Axolotl", "lora_target_modules"),
    "val_set_size": ("Axolotl", "val_split_ratio"),
    "sample_packing": ("Axolotl", "packing"),
    "lr_scheduler": ("Axolotl", "lr_scheduler_type"),
    "optimizer": ("Axolotl", "optim"),
    "dataset_processes": ("Axolotl", "dataset_num_proc"),
    "wandb_project": ("Axolotl", "report_to"),
    "max_length": ("TRL", "max_seq_length"),
    "dataset_name": ("TRL", "dataset"),
    "dataset_text_field": ("TRL", "dataset[].text_field"),
    "use_peft": ("TRL", "finetune_type"),
    "gradient_checkpointing": ("TRL / Axolotl", "use_gradient_checkpointing"),
    "completion_only_loss": ("TRL", "train_on_inputs"),
    "assistant_only_loss": ("TRL", "train_on_inputs"),
    "bf16": ("TRL / LLaMA-Factory / Axolotl", "mixed_precision"),
    "fp16": ("TRL / LLaMA-Factory / Axolotl", "mixed_precision"),
    "num_processes": ("accelerate", "--num-processes"),
    "nproc_per_node": ("torchrun", "--num-processes"),
    "num_machines": ("accelerate", "--nnodes"),
    "nnodes": ("torchrun", "--nnodes"),
    "machine_rank": ("accelerate", "--node-rank"),
    "node_rank": ("torchrun", "--node-rank"),
    "main_process_ip": ("accelerate", "--main-addr"),
    "master_addr": ("torchrun", "--main-addr"),
    "main_process_port": ("accelerate", "--main-port"),
    "master_port": ("torchrun", "--main-port"),
    "gpu_ids": ("accelerate", "--gpus"),
    "fsdp": ("TRL / Axolotl", "--fsdp"),
    "fsdp_config": ("TRL / Axolotl", "--fsdp"),
}
# Inside a dataset entry.
PEER_DATASET_KEYS: dict[str, tuple[str, str]] = {
    "path": ("Axolotl", "name"),
    "type": ("Axolotl", "format"),
    "file_name": ("LLaMA-Factory", "name"),
    "hf_hub_url": ("LLaMA-Factory", "name"),
    "formatting": ("LLaMA-Factory", "format"),
    "field": ("Axolotl", "text_field"),
}
# A peer's value that says more than its key: (key, value) -> what we write for it.
PEER_VALUES: dict[tuple[str, Any], str] = {
    ("rl", "ipo"): "method: dpo with loss_type: ipo",
    ("rl", "simpo"): "method: dpo with loss_type: simpo",
    ("stage", "rm"): "method: reward",
    ("stage", "pt"): "method: sft with a text dataset (format: text)",
    ("quantization_bit", 4): "finetune_type: qlora",
    ("lora_target", "all"): "lora_target_modules: all-linear",
    ("lora_target_linear", True): "lora_target_modules: all-linear",
    ("use_peft", True): "finetune_type: lora",
    ("bf16", True): "mixed_precision: bf16",
    ("fp16", True): "mixed_precision: fp16",
    ("sample_packing", True): "packing: true",
    ("neat_packing", True): "packing: true",
    ("train_on_prompt", True): "train_on_inputs: true",
    ("completion_only_loss", False): "train_on_inputs: true",
    ("assistant_only_loss", False): "train_on_inputs: true",
    ("wandb_project", None): "report_to: wandb (the project comes from WANDB_PROJECT in the environment)",
}
# Keys whose value means the same to us: the hint shows it under our name.
_SAME_VALUES = {"stage", "rl", "cutoff_len", "lora_rank", "template", "finetuning_type", "model_name_or_path",
                "pref_beta", "pref_loss", "val_size", "max_samples", "preprocessing_num_workers", "base_model",
                "tokenizer_config", "sequence_len", "micro_batch_size", "eval_batch_size", "num_epochs", "adapter",
                "val_set_size", "lr_scheduler", "dataset_processes", "max_length", "dataset_text_field", "path",
                "file_name", "hf_hub_url", "formatting", "field", "num_processes", "nproc_per_node", "num_machines", "nnodes",
                "machine_rank", "node_rank", "main_process_ip", "master_addr", "main_process_port", "master_port",
                "gpu_ids"}
DEEPSPEED = ("DeepSpeed is not supported: its engine would step the optimizer after every micro-batch of this "
             "loop's gradient accumulation; shard the model with --fsdp (FSDP2) instead")

_EXPECTED_BY_ERROR = {
    "float_parsing": "a number", "float_type": "a number",
    "int_parsing": "an integer", "int_type": "an integer", "int_from_float": "an integer",
    "bool_parsing": "true or false", "bool_type": "true or false",
    "string_type": "a string", "list_type": "a list",
    "dict_type": "a mapping", "model_type": "a mapping", "model_attributes_type": "a mapping",
}


def peer_hint(key: str, value: Any, in_dataset: bool) -> str | None:
    """' (<whose> name; did you mean ...?)' for a peer's key, or None."""
    if key in ("deepspeed", "deepspeed_config") and not in_dataset:
        return f": {DEEPSPEED}"
    table = PEER_DATASET_KEYS if in_dataset else PEER_KEYS
    if key not in table:
        return None
    who, ours = table[key]
    scalar = value is None or isinstance(value, (str, int, float, bool))
    if ours.startswith("--"):
        flag = f"{ours} {value}" if scalar and value is not None and key in _SAME_VALUES else ours
        return f" ({who}'s name; did you mean the flag `train {flag}`? processes and machines are chosen on the " \
               "command line)"
    if scalar and (key, value) in PEER_VALUES:
        suggestion = PEER_VALUES[(key, value)]
    elif scalar and (key, None) in PEER_VALUES:
        suggestion = PEER_VALUES[(key, None)]
    elif scalar and value is not None and key in _SAME_VALUES:
        suggestion = f"{ours}: {value}"
    else:
        suggestion = ours
    return f" ({who}'s name; did you mean '{suggestion}'?)"


def _key_path(loc: tuple, fields: set[str], to_union: bool = False) -> str:
    """The YAML path of an error's location; to_union: only up to the first union member pydantic names (the
    members of one key's union each report an error: one mistake)."""
    path = ""
    for item in loc:
        if isinstance(item, int):
            path += f"[{item}]"
        elif item in fields or not path:
            path += f".{item}" if path else str(item)
        elif to_union:
            break
        # else: pydantic naming a union member, which the user never wrote
    return path or "config"


def _expected(error: dict) -> str | None:
    if error["type"] in _EXPECTED_BY_ERROR:
        return _EXPECTED_BY_ERROR[error["type"]]
    if error["type"] == "literal_error":
        return f"one of {error['ctx']['expected']}"
    return None


def _unknown_key(error: dict, fields: set[str], known_top: list[str], known_dataset: list[str]) -> str:
    loc = tuple(error["loc"])
    name = str(loc[-1])
    in_dataset = len(loc) > 1 and loc[0] in ("dataset", "eval_dataset")
    key = f"{_key_path(loc[:-1], fields)}.{name}" if len(loc) > 1 else name
    hint = peer_hint(name, error.get("input"), in_dataset)
    if hint is None:
        close = difflib.get_close_matches(name, known_dataset if in_dataset else known_top, n=1, cutoff=0.6)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
    return f"unknown key '{key}'{hint}"


def _describe(errors: list[dict], fields: set[str]) -> str:
    # Prefer errors that are not type mismatches: unions report one mismatch per member.
    error = next((e for e in errors if e["type"] in ("missing", "value_error")), errors[0])
    key = _key_path(tuple(error["loc"]), fields)
    kind = error["type"]
    if kind == "missing":
        return f"missing required key '{key}'"
    if kind == "value_error":
        return str(error["ctx"]["error"])
    if kind == "too_short" and key == "dataset":
        return "dataset: list at least one dataset"
    expected = [x for e in errors if (x := _expected(e))]
    if expected:
        return f"{key}: expected {' or '.join(dict.fromkeys(expected))}, got {error['input']!r}"
    return f"{key}: {error['msg'][0].lower()}{error['msg'][1:]}, got {error['input']!r}"


def describe_errors(errors: list[dict], fields: set[str], known_top: list[str], known_dataset: list[str]) -> list[str]:
    """One line per mistake: pydantic's errors grouped by the key the user wrote (a union's members report one
    each); an unknown key that is a peer's name for a required key of ours stands for that key's 'missing'."""
    lines: list[str] = []
    groups: dict[str, list[dict]] = {}
    peer_for: set[tuple[str, str]] = set()  # (parent path, our key) a peer's key was written for
    for error in errors:
        loc = tuple(error["loc"])
        if error["type"] == "extra_forbidden":
            in_dataset = len(loc) > 1 and loc[0] in ("dataset", "eval_dataset")
            table = PEER_DATASET_KEYS if in_dataset else PEER_KEYS
            if str(loc[-1]) in table:
                peer_for.add((_key_path(loc[:-1], fields) if len(loc) > 1 else "", table[str(loc[-1])][1]))
            groups[f"\0{len(groups)}"] = [error]
        else:
            groups.setdefault(_key_path(loc, fields, to_union=True), []).append(error)
    for path, group in groups.items():
        if path.startswith("\0"):
            lines.append(_unknown_key(group[0], fields, known_top, known_dataset))
            continue
        error = group[0]
        if error["type"] == "missing":
            loc = tuple(error["loc"])
            parent = _key_path(loc[:-1], fields) if len(loc) > 1 else ""
            if (parent, str(loc[-1])) in peer_for:
                continue
        lines.append(_describe(group, fields))
    return lines
