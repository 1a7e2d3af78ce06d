"""Keys described as data: the JSON Schema `config schema` writes, and docs/reference.md generated from it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import yaml
from typer.testing import CliRunner

from praisonai_accel.cli import app
from praisonai_accel.config import KEY_ALIASES, TrainConfig, parse_config
from praisonai_accel.config.keys import DatasetSpec
from praisonai_accel.commands._schema import REFERENCE_COMMAND, config_schema, reference_markdown

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))


class _EditorYaml(yaml.SafeLoader):
    """YAML as an editor's language server reads it (1.2): `2e-4` is a float there, a string to PyYAML (1.1), which
    the config's loader then converts."""


_EditorYaml.add_implicit_resolver("tag:yaml.org,2002:float",
                                  re.compile(r"^[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?$"),
                                  list("-+0123456789."))


def _errors(data) -> list[str]:
    validator = jsonschema.Draft202012Validator(config_schema())
    return [error.message for error in validator.iter_errors(data)]


def test_the_schema_is_a_valid_json_schema_naming_itself():
    schema = config_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert schema["$id"] and schema["title"].startswith("praisonai-accel config.yaml")
    assert set(schema["required"]) == {"model_name", "dataset"}


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_the_schema_accepts_every_example(example):
    data = yaml.load(example.read_text(), Loader=_EditorYaml)
    assert _errors(data) == []
    parse_config(yaml.safe_load(example.read_text()), source=example.name)  # and the loader agrees


def test_the_schema_rejects_what_the_loader_rejects():
    base = yaml.load((REPO / "examples" / "lora.yaml").read_text(), Loader=_EditorYaml)
    assert _errors({**base, "learnin_rate": 1e-4}) == [
        "Additional properties are not allowed ('learnin_rate' was unexpected)"]
    assert len(_errors({**base, "lora_r": "sixteen"})) == 1
    assert len(_errors({**base, "finetune_type": "lorra"})) == 1
    assert len(_errors({**base, "lora_dropout": 1.0})) == 1  # lt=1
    assert len(_errors({**base, "dataset": [{"name": "x", "splt": "train"}]})) >= 1
    assert len(_errors({**base, "dataset": []})) >= 1
    assert len(_errors({key: v for key, v in base.items() if key != "model_name"})) == 1
    assert len(_errors({**base, "hf_token": "hf_x"})) == 1  # tokens never go in config files


def test_the_schema_accepts_the_shapes_and_old_names_the_loader_accepts():
    """A dataset may be one mapping or a bare name; praisonai-train's key names are accepted, in a dataset too."""
    for dataset in ("yahma/alpaca-cleaned", {"name": "data.jsonl"}, ["a.jsonl", {"name": "b", "split_type": "test"}]):
        data = {"model_name": "m", "dataset": dataset, "hf_model_name": "me/m", "random_state": 1,
                "huggingface_save": False, "eval_dataset": "e.jsonl"}
        assert _errors(data) == []
        parse_config(data)


def test_the_schema_names_exactly_the_keys_the_loader_reads():
    """TrainConfig's keys and every built-in method's own (each naming the methods that read it)."""
    from praisonai_accel.methods.registry import builtin_methods

    schema = config_schema()
    method_keys = {name for cls in builtin_methods() for name in cls.keys.model_fields}
    assert {"beta", "loss_type", "desirable_weight", "reward_funcs", "center_rewards_coefficient"} <= method_keys
    assert set(schema["properties"]) == set(TrainConfig.model_fields) | set(KEY_ALIASES) - {"split_type"} | method_keys
    properties = schema["properties"]
    assert properties["center_rewards_coefficient"]["description"].endswith("Read by method: reward.")
    assert "Default: 0.1 (dpo), 0.1 (orpo), 0.1 (kto), 0.0 (grpo)." in properties["beta"]["description"]
    grpo = {"model_name": "m", "dataset": "d.jsonl", "method": "grpo", "reward_funcs": ["format"], "loss_type": "dapo"}
    assert _errors(grpo) == [] and len(_errors({**grpo, "loss_type": "dappo"})) == 1
    page = reference_markdown()
    for cls in builtin_methods():
        assert f"### method: {cls.name}" in page
        section = page.split(f"### method: {cls.name}")[1].split("###")[0]
        assert all(f"| `{name}` |" in section for name in cls.keys.model_fields), cls.name
    assert set(schema["$defs"]["DatasetSpec"]["properties"]) == set(DatasetSpec.model_fields) | {"split_type"}


def test_every_key_of_the_config_groups_and_the_vision_keys_is_described():
    """The groups of config_keys.py, DatasetSpec and VisionKeys (the method's keys are described by their methods)."""
    owned = [name for name in TrainConfig.model_fields
             if next(c for c in reversed(TrainConfig.__mro__) if name in getattr(c, "model_fields", {})).__module__
             in ("praisonai_accel.config.keys", "praisonai_accel.config.vision")]
    assert len(owned) > 90
    for model, names in ((TrainConfig, owned), (DatasetSpec, list(DatasetSpec.model_fields))):
        missing = [n for n in names if len((model.model_fields[n].description or "").strip()) < 10]
        assert missing == []
    for key in ("dataset_num_proc", "load_in_4bit", "lora_bias", "use_rslora", "adam_beta2"):
        assert key in reference_markdown()


def test_the_committed_reference_page_is_current():
    page = REPO / "docs" / "reference.md"
    assert page.is_file() and page.read_text() == reference_markdown(), (
        f"docs/reference.md is stale: regenerate it with `{REFERENCE_COMMAND}`")


def test_config_schema_command_writes_the_schema_and_keeps_a_file_it_did_not_write(tmp_path):
    runner, target = CliRunner(), tmp_path / "config.schema.json"
    result = runner.invoke(app, ["config", "schema", "-o", str(target)])
    assert result.exit_code == 0, result.output
    assert json.loads(target.read_text()) == config_schema()
    assert runner.invoke(app, ["config", "schema", "-o", str(target)]).exit_code == 0  # its own file: regenerated
    page = tmp_path / "reference.md"
    assert runner.invoke(app, ["config", "schema", "--markdown", "-o", str(page)]).exit_code == 0
    assert page.read_text() == reference_markdown()
    mine = tmp_path / "mine.json"
    mine.write_text("{}\n")
    result = runner.invoke(app, ["config", "schema", "-o", str(mine)])
    assert result.exit_code == 2 and mine.read_text() == "{}\n"
    assert result.output.strip().splitlines() == [
        f"error: {mine} already exists and was not written by `config schema`; pass --force to overwrite it"]
    assert runner.invoke(app, ["config", "schema", "-o", str(mine), "--force"]).exit_code == 0
    assert json.loads(mine.read_text())["$id"] == config_schema()["$id"]
    printed = runner.invoke(app, ["config", "schema"])
    assert printed.exit_code == 0 and json.loads(printed.output) == config_schema()
