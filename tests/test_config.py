"""config.yaml validation: every bad file gets one line naming the key, exit 2, and nothing written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from praisonai_accel.cli import app
from praisonai_accel.config import ConfigError, load_config, parse_config

from conftest import cli

BASE = {"model_name": "./model", "dataset": [{"name": "./data.jsonl"}], "output_dir": "OUT"}

BAD_CONFIGS = [
    ({"learnin_rate": 1e-4}, "unknown key 'learnin_rate' (did you mean 'learning_rate'?)"),
    ({"per_device_train_batchsize": 2}, "did you mean 'per_device_train_batch_size'"),
    ({"dataset": [{"name": "x.jsonl", "formt": "alpaca"}]}, "unknown key 'dataset[0].formt' (did you mean 'format'?)"),
    ({"learning_rate": "fast"}, "learning_rate: expected a number, got 'fast'"),
    ({"lora_r": "sixteen"}, "lora_r: expected an integer, got 'sixteen'"),
    ({"lora_r": 0}, "lora_r: input should be greater than 0"),
    ({"lora_dropout": 1.5}, "lora_dropout:"),
    ({"finetune_type": "qlor"}, "finetune_type: expected one of 'lora', 'qlora' or 'full', got 'qlor'"),
    ({"mixed_precision": "fp8"}, "mixed_precision: expected one of"),
    ({"lr_scheduler_type": "cosinus"}, "lr_scheduler_type: expected one of"),
    ({"dataset": []}, "dataset: list at least one dataset"),
    ({"dataset": [{"name": "x.jsonl", "format": "chatml"}]}, "dataset[0].format: expected one of"),
    ({"dataset": [{"name": "x.jsonl", "num_samples": -3}]}, "dataset[0].num_samples:"),
    ({"max_steps": 0}, "max_steps: must be a positive number of steps"),
    ({"max_seq_length": "long"}, "max_seq_length: expected an integer, got 'long'"),
    ({"lora_target_modules": 7}, "lora_target_modules: expected a list"),
    ({"use_unsloth": "maybe"}, "use_unsloth: expected true or false"),
    ({"device_map": "everywhere"}, "device_map: unknown value 'everywhere'"),
    ({"ddp_find_unused_parameters": "perhaps"}, "ddp_find_unused_parameters: expected true or false"),
    ({"load_in_4bit": True, "finetune_type": "full"}, "load_in_4bit: 4-bit weights cannot be fully fine-tuned"),
    ({"gradient_accumulation_steps": 1.5}, "gradient_accumulation_steps: expected an integer"),
    ({"model_name": None}, "model_name: expected a string"),
    ({"push_to_hub": True}, "hub_model_id: required when push_to_hub is true"),
    ({"hub_token": "hf_abcdef"}, "hub_token: tokens never go in config files; set HF_TOKEN in the environment"),
    ({"hub_strategy": "sometimes"}, "hub_strategy: expected one of 'end', 'every_save', 'checkpoint' or 'all_checkpoints'"),
    ({"save_strategy": "steps"}, "save_steps: required when save_strategy is 'steps'"),
    ({"eval_steps": 5}, "eval_steps: evaluation needs eval_dataset or val_split_ratio"),
    ({"eval_strategy": "epoch"}, "eval_strategy: 'epoch' needs eval_dataset or val_split_ratio"),
    ({"val_split_ratio": 0.1, "load_best_model_at_end": True}, "load_best_model_at_end: needs save_strategy and eval_strategy"),
    ({"resume_from_checkpoint": 3}, "resume_from_checkpoint: expected true or false or a string"),
    ({"eval_dataset": [{"name": "e.jsonl", "splt": "test"}]}, "unknown key 'eval_dataset[0].splt' (did you mean 'split'?)"),
    ({"eval_dataset": "e.jsonl", "val_split_ratio": 0.1}, "val_split_ratio: use either val_split_ratio or eval_dataset"),
]


@pytest.mark.parametrize("override,message", BAD_CONFIGS, ids=[m.split(":")[0][:30] for _, m in BAD_CONFIGS])
def test_bad_config_is_one_line_exit_2_nothing_written(tmp_path, override, message):
    raw = {**BASE, **override, "output_dir": str(tmp_path / "out")}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    result = CliRunner().invoke(app, ["train", str(path), "--cpu"])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1, result.output
    assert lines[0].startswith("error: ") and message in lines[0], lines[0]
    assert "Traceback" not in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml"]


@pytest.mark.parametrize(
    "text,message",
    [
        ("model_name: [unclosed\n", "invalid YAML at line"),
        ("- just\n- a list\n", "expected keys (`model_name: ...` one per line) at the top level, got a list"),
        ("just words\n", "expected keys (`model_name: ...` one per line) at the top level, got a single value"),
        ("# nothing but a comment\n", "the file is empty; a config names at least model_name and dataset"),
        ("dataset: x.jsonl\n", "missing required key 'model_name'"),
    ],
)
def test_unreadable_config_files(tmp_path, text, message):
    path = tmp_path / "config.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(path)


def test_missing_config_file_from_a_real_process_has_no_traceback(tmp_path):
    result = cli("train", str(tmp_path / "nope.yaml"), "--cpu")
    assert result.returncode == 2
    assert result.stderr.strip() == f"error: {tmp_path / 'nope.yaml'}: config file not found"
    assert "Traceback" not in result.stderr + result.stdout
    with pytest.raises(ConfigError, match=r": is a directory; name the config file in it \(config.yaml\)$"):
        load_config(tmp_path)


def test_missing_local_paths_are_caught_before_launch(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({**BASE, "model_name": str(tmp_path / "no-model"), "output_dir": str(tmp_path / "o")}))
    result = CliRunner().invoke(app, ["train", str(path), "--cpu"])
    assert result.exit_code == 2 and "model_name: no such directory" in result.output
    (tmp_path / "no-model").mkdir()
    result = CliRunner().invoke(app, ["train", str(path), "--cpu"])
    assert result.exit_code == 2 and result.output.strip() == (
        f"error: model_name: '{tmp_path / 'no-model'}' holds no model (no config.json); name the folder a model was "
        "saved in (save_pretrained), or a Hub id")
    (tmp_path / "no-model" / "config.json").write_text("{}")
    result = CliRunner().invoke(app, ["train", str(path), "--cpu"])
    assert result.exit_code == 2 and "dataset[0].name: no such file or directory './data.jsonl'" in result.output


def test_an_output_dir_that_is_a_file_or_inside_one_is_one_line_before_launch(tmp_path):
    """It was `error: [Errno 17] File exists: ...` from train, and a NotADirectoryError traceback from preview (which
    writes its cache there)."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "data.jsonl").write_text('{"instruction": "q", "output": "a"}\n')
    (tmp_path / "afile").write_text("mine")
    for output_dir, expected in (
            ("afile", f"output_dir: '{tmp_path / 'afile'}' is a file; name a folder (created if missing)"),
            ("afile/run", f"output_dir: '{tmp_path / 'afile/run'}' is inside '{tmp_path / 'afile'}', which is a file")):
        path = tmp_path / "config.yaml"
        path.write_text(yaml.safe_dump({"model_name": str(tmp_path / "model"), "dataset": str(tmp_path / "data.jsonl"),
                                        "output_dir": str(tmp_path / output_dir)}))
        for command in ("train", "preview"):
            result = CliRunner().invoke(app, [command, str(path), "--cpu"] if command == "train" else [command, str(path)])
            assert result.exit_code == 2 and result.output.strip() == f"error: {expected}", (command, result.output)
    assert (tmp_path / "afile").read_text() == "mine"


def test_a_path_under_home_is_under_home_not_a_folder_named_tilde(tmp_path, monkeypatch):
    """`output_dir: ~/runs/a` was a folder named `~` in the working directory (a later `rm -rf ~` to tidy it up
    removes the home folder): paths are expanded as a shell and transformers' TrainingArguments expand them."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    cfg = parse_config({**BASE, "model_name": "~/models/m", "output_dir": "~/runs/a", "final_model_dir": "~/final",
                        "dataset_prepared_path": "~/prepared", "resume_from_checkpoint": "~/runs/a/checkpoint-2"})
    home = tmp_path / "home"
    assert (cfg.model_name, cfg.output_dir, cfg.final_model_dir, cfg.dataset_prepared_path,
            cfg.resume_from_checkpoint) == (f"{home}/models/m", f"{home}/runs/a", f"{home}/final", f"{home}/prepared",
                                            f"{home}/runs/a/checkpoint-2")
    assert parse_config({**BASE, "model_name": "org/model~1"}).model_name == "org/model~1"
    assert parse_config(BASE).resume_from_checkpoint is True


def test_max_seq_length_over_the_models_positions_is_a_warning_unless_rope_scaling_stretches_them():
    from transformers import Gemma3TextConfig, LlamaConfig

    from praisonai_accel.models.loading import context_warning

    assert context_warning(1024, LlamaConfig(max_position_embeddings=512)) == (
        "warning: max_seq_length 1024 is over the model's max_position_embeddings 512: rows longer than 512 tokens "
        "take positions it was never trained on (its quality falls there, without an error); lower max_seq_length, "
        "or use a model with a longer context")
    assert context_warning(512, LlamaConfig(max_position_embeddings=512)) is None
    assert context_warning(1024, LlamaConfig(max_position_embeddings=512,
                                             rope_scaling={"rope_type": "linear", "factor": 2.0})) is None
    gemma = Gemma3TextConfig(max_position_embeddings=512)  # rope parameters per layer type
    assert context_warning(1024, gemma) is not None and context_warning(256, gemma) is None
    # no example that long (the default max_seq_length on a small model's short rows): nothing to say
    assert context_warning(2048, LlamaConfig(max_position_embeddings=512), [35, 40, 512]) is None
    assert context_warning(2048, LlamaConfig(max_position_embeddings=512), [35, 513]) is not None


def test_numbers_in_exponent_form_are_floats_and_seed_keys_are_accepted():
    text = "model_name: m\nlearning_rate: 2e-4\nrandom_state: 7\nhf_model_name: me/model\n" \
           "dataset:\n  - name: yahma/alpaca-cleaned\n    split_type: train[:10]\n"
    raw = yaml.safe_load(text)
    assert raw["learning_rate"] == "2e-4"  # PyYAML reads it as a string...
    cfg = parse_config(raw)
    assert cfg.learning_rate == pytest.approx(2e-4) and isinstance(cfg.learning_rate, float)  # ...we read a float
    assert cfg.seed == 7 and cfg.dataset[0].split == "train[:10]" and cfg.hub_model_id == "me/model"


def test_defaults_and_derived_values():
    cfg = parse_config({"model_name": "m", "dataset": "d.jsonl", "load_in_4bit": True, "output_dir": "/tmp/x"})
    assert cfg.finetune_type == "qlora"
    assert cfg.final_model_path().as_posix() == "/tmp/x/lora_model"
    assert parse_config({"model_name": "m", "dataset": "d", "final_model_dir": "/abs/final"}).final_model_path().as_posix() == "/abs/final"
    assert cfg.ddp_find_unused_parameters is None  # decided at run time: true under DDP
    assert cfg.fingerprint() == parse_config(cfg.model_dump()).fingerprint()


@pytest.mark.parametrize("example", sorted((Path(__file__).resolve().parent.parent / "examples").glob("*.yaml")),
                         ids=lambda p: p.name)
def test_shipped_examples_are_valid(example):
    config = load_config(example)
    assert config.model_name and config.dataset


def test_a_key_written_twice_is_an_error_naming_it_and_its_lines(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text("model_name: m\ndataset: d.jsonl\nlora_r: 8\nlearning_rate: 1e-4\nlora_r: 16\n")
    result = CliRunner().invoke(app, ["train", str(path), "--cpu"])
    assert result.exit_code == 2
    assert result.output.strip() == f"error: {path}: key 'lora_r' is written twice (lines 3 and 5); keep one"
    nested = tmp_path / "nested.yaml"
    nested.write_text("model_name: m\ndataset:\n  - name: a.jsonl\n    format: alpaca\n    format: sharegpt\n")
    with pytest.raises(ConfigError, match=r"key 'format' is written twice \(lines 4 and 5\)"):
        load_config(nested)
