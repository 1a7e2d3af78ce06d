"""Every mistake of a config in one message, one line each, named by its YAML path; the peers' key names
(LLaMA-Factory, Axolotl, TRL, accelerate / torchrun) answered with ours or with train's flag. In process: cheap."""

from __future__ import annotations

import pytest
import yaml
from typer.testing import CliRunner

from praisonai_accel.cli import app
from praisonai_accel.config import ConfigError, parse_config
from praisonai_accel.config.mistakes import PEER_DATASET_KEYS, PEER_KEYS
from praisonai_accel.launcher.plan import LaunchError, resolve_processes

BASE = {"model_name": "./model", "dataset": [{"name": "./data.jsonl"}]}


def test_a_config_with_three_mistakes_gets_three_lines_and_nothing_written(tmp_path):
    raw = {**BASE, "output_dir": str(tmp_path / "out"), "learnin_rate": 1e-4, "lora_r": "sixteen",
           "dataset": [{"name": "./data.jsonl", "format": "chatml"}]}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    result = CliRunner().invoke(app, ["train", str(path), "--cpu"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    lines = result.output.strip().splitlines()
    assert sorted(lines) == sorted([
        f"error: {path}: unknown key 'learnin_rate' (did you mean 'learning_rate'?)",
        f"error: {path}: lora_r: expected an integer, got 'sixteen'",
        f"error: {path}: dataset[0].format: expected one of 'auto', 'alpaca', 'sharegpt', 'messages' or 'text', "
        "got 'chatml'"]), result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml"]


def test_a_union_key_wrong_in_every_member_is_one_mistake():
    with pytest.raises(ConfigError) as caught:
        parse_config({**BASE, "lora_target_modules": [1, 2], "report_to": "nowhere"})
    lines = str(caught.value).splitlines()
    assert len(lines) == 2 and lines[0].startswith("config: lora_target_modules") and "report_to: expected" in lines[1]


def _hint(raw: dict) -> str:
    with pytest.raises(ConfigError) as caught:
        parse_config(raw)
    return str(caught.value)


# a value each peer key is written with, where its hint depends on it
VALUES = {"stage": "dpo", "rl": "kto", "cutoff_len": 1024, "quantization_bit": 4, "bf16": True, "num_processes": 2,
          "adapter": "qlora", "lora_target_linear": True, "use_peft": True, "sample_packing": True}
EXPECTED = {"stage": "method: dpo", "rl": "method: kto", "cutoff_len": "max_seq_length: 1024",
            "quantization_bit": "finetune_type: qlora", "bf16": "mixed_precision: bf16",
            "num_processes": "`train --num-processes 2`", "adapter": "finetune_type: qlora",
            "lora_target_linear": "lora_target_modules: all-linear", "use_peft": "finetune_type: lora",
            "sample_packing": "packing: true"}


@pytest.mark.parametrize("key", sorted(PEER_KEYS))
def test_each_peer_key_gets_its_hint(key):
    who, ours = PEER_KEYS[key]
    message = _hint({**BASE, key: VALUES.get(key, "x")})
    assert len(message.splitlines()) == 1, message
    assert message.startswith(f"config: unknown key '{key}' ({who}'s name; did you mean "), message
    assert EXPECTED.get(key, ours) in message, message


DATASET_VALUES = {"path": "./d.jsonl", "file_name": "./d.jsonl", "hf_hub_url": "org/d", "type": "alpaca",
                  "formatting": "sharegpt", "field": "body"}
DATASET_EXPECTED = {"path": "name: ./d.jsonl", "file_name": "name: ./d.jsonl", "hf_hub_url": "name: org/d",
                    "type": "format", "formatting": "format: sharegpt", "field": "text_field: body"}


@pytest.mark.parametrize("key", sorted(PEER_DATASET_KEYS))
def test_each_peer_dataset_key_gets_its_hint_and_stands_for_ours(key):
    who, ours = PEER_DATASET_KEYS[key]
    spec = {"name": "./data.jsonl"} if ours != "name" else {}
    message = _hint({**BASE, "dataset": [{**spec, key: DATASET_VALUES[key]}]})
    # path: written for name is one mistake: not also "missing required key 'dataset[0].name'"
    assert message.splitlines() == [f"config: unknown key 'dataset[0].{key}' ({who}'s name; did you mean "
                                     f"'{DATASET_EXPECTED[key]}'?)"]


def test_an_axolotl_config_is_answered_key_by_key():
    message = _hint({"base_model": "./m", "datasets": [{"path": "d.jsonl", "type": "alpaca"}], "rl": "dpo",
                     "sequence_len": 512, "micro_batch_size": 4})
    lines = message.splitlines()
    assert len(lines) == 5 and not any("missing required key" in line for line in lines), message
    assert "unknown key 'rl' (Axolotl's name; did you mean 'method: dpo'?)" in message
    assert "unknown key 'micro_batch_size' (Axolotl's name; did you mean 'per_device_train_batch_size: 4'?)" in message


def test_deepspeed_is_answered_with_fsdp():
    assert "shard the model with --fsdp" in _hint({**BASE, "deepspeed": "ds_z3.json"})


def test_num_processes_without_gpus_suggests_cpu():
    with pytest.raises(LaunchError, match=r"^--num-processes 2: only 0 CUDA GPU\(s\) visible; add --cpu to run 2 CPU"):
        resolve_processes(None, False, 2, lambda: 0)
    with pytest.raises(LaunchError, match=r"^--num-processes 4: only 2 CUDA GPU\(s\) visible; use at most 2"):
        resolve_processes(None, False, 4, lambda: 2)
    assert resolve_processes(None, False, 2, lambda: 2) == (2, None)
    assert resolve_processes(None, True, 2, lambda: 0) == (2, None)
