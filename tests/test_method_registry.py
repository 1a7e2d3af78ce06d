"""The method registry: a method is one class that declares its keys, checks, preview and report rows, found by
name (built-ins, register_method, the praisonai_accel.methods entry points, "package.module:Class"). A toy method
defined in tests/toy_method.py, outside the package, trains through the CLI on 2 processes."""

from __future__ import annotations

import ast
import importlib
import os
import shutil
from pathlib import Path

import pytest

from conftest import REPO, cli, cpu_env, read_metrics, write_config
from praisonai_accel.config import ConfigError, parse_config
from praisonai_accel.methods import register_method
from praisonai_accel.methods.registry import BUILTINS, method_class

TOY = Path(__file__).resolve().parent / "toy_method.py"
BASE = {"model_name": "m", "dataset": "d.jsonl"}
# each built-in's `method:` name, as its class declares it
NAMES = [getattr(importlib.import_module(f"praisonai_accel.methods.{module}"), cls).name
         for module, cls in (entry.split(":") for entry in BUILTINS)]


def _toy_package(directory: Path) -> dict:
    """toy_method.py in `directory`, declared as the entry point `toy` of a distribution installed there (what
    `pip install` of a package with [project.entry-points."praisonai_accel.methods"] leaves); its environment."""
    shutil.copy(TOY, directory / "toy_method.py")
    info = directory / "toy_methods-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-methods\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[praisonai_accel.methods]\ntoy = toy_method:ToyMethod\n")
    env = cpu_env()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(directory), env.get("PYTHONPATH", "")) if p)
    return env


def test_each_builtin_declares_its_own_keys_and_defaults():
    grpo = parse_config({**BASE, "method": "grpo", "reward_funcs": ["exact_match"]})
    dpo = parse_config({**BASE, "method": "dpo"})
    assert (grpo.beta, grpo.loss_type, dpo.beta, dpo.loss_type) == (0.0, "dapo", 0.1, "sigmoid")  # TRL's, each its own
    assert NAMES == ["sft", "dpo", "orpo", "kto", "grpo", "reward"]
    assert [method_class(name).__name__ for name in NAMES] == ["SFT", "DPO", "ORPO", "KTO", "GRPO", "RewardMethod"]
    reward = parse_config({**BASE, "method": "reward", "center_rewards_coefficient": 0.01})
    assert (reward.center_rewards_coefficient, reward.max_prompt_length) == (0.01, 512) and not hasattr(reward, "beta")
    for name in NAMES:
        cls = method_class(name)
        assert all(field.description for field in cls.keys.model_fields.values()), cls.name
    assert not hasattr(parse_config(BASE), "beta")  # sft reads no method key


def test_a_config_pickles_by_its_method_and_state(tmp_path):
    """The composed config class is made at run time: datasets' map (its fingerprint, its worker processes) pickles
    the config with dill, by how to compose the class again."""
    import pickle

    import dill

    from praisonai_accel.methods import registry

    shutil.copy(TOY, tmp_path / "toy_pickled.py")
    try:
        for extra in ({}, {"method": "dpo", "beta": 0.3}, {"method": "toy_pickled:ToyMethod", "toy_loss_scale": 2.0}):
            config = parse_config({**BASE, **extra}, config_dir=str(tmp_path))
            for library in (pickle, dill):
                again = library.loads(library.dumps(config))
                assert again == config and type(again) is type(config) and again._config_dir == str(tmp_path)
    finally:  # a second owner of toy_loss_scale would change the next test's error line
        registry._registered.pop("toy_pickled:ToyMethod", None)


def test_a_method_by_import_path_and_register_method(tmp_path):
    shutil.copy(TOY, tmp_path / "toy_path_method.py")
    config = parse_config({**BASE, "method": "toy_path_method:ToyMethod", "toy_loss_scale": 2.0},
                          config_dir=str(tmp_path))
    assert type(config).training_method.__name__ == "ToyMethod" and config.toy_loss_scale == 2.0
    with pytest.raises(ConfigError, match=r"^config: toy_loss_scale: belongs to method toy_path_method:ToyMethod, "
                                          r"not to method: sft; remove it or set method: toy_path_method:ToyMethod$"):
        parse_config({**BASE, "toy_loss_scale": 2.0})
    with pytest.raises(ConfigError, match="toy_loss_scale: 500.0 would blow the loss up"):
        from praisonai_accel.checks import method_rule

        method_rule(parse_config({**BASE, "method": "toy_path_method:ToyMethod", "toy_loss_scale": 500}))
    cls = type(config).training_method
    assert register_method("toy-again", cls) is cls and method_class("toy-again") is cls
    with pytest.raises(ValueError, match="already registered"):
        register_method("toy-again", type("Other", (cls,), {}))
    with pytest.raises(ValueError, match="not a subclass"):
        register_method("not-a-method", dict)
    with pytest.raises(ConfigError, match=r"method: nowhere_at_all:Method: no module named 'nowhere_at_all'"):
        parse_config({**BASE, "method": "nowhere_at_all:Method"})


def test_a_toy_method_outside_the_package_trains_on_2_processes_with_its_keys_preview_and_report(tmp_path,
                                                                                                  tiny_model,
                                                                                                  alpaca_file):
    env = _toy_package(tmp_path)
    config = write_config(tmp_path, tiny_model, alpaca_file, method="toy", toy_loss_scale=3.0, max_steps=2,
                          per_device_train_batch_size=2, logging_steps=1)
    result = cli("train", str(config), "--cpu", "--num-processes", "2", env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    steps = [m for m in read_metrics(tmp_path / "out") if "loss" in m]
    assert len(steps) == 2 and all(m["loss"] == pytest.approx(3.0 * m["unscaled_loss"], rel=1e-5) for m in steps)
    report = cli("report", str(tmp_path / "out"), env=env)
    first, last = steps[0]["unscaled_loss"], steps[-1]["unscaled_loss"]
    assert report.returncode == 0 and f"unscaled_loss (first -> last)  {first:.4f} -> {last:.4f}" in report.stdout
    preview = cli("preview", str(config), "-n", "1", env=env)
    assert preview.returncode == 0 and "- toy example (" in preview.stdout, preview.stderr[-2000:]

    wrong = write_config(tmp_path, tiny_model, alpaca_file, toy_loss_scale=3.0)  # method: sft
    refused = cli("train", str(wrong), "--cpu", env=env)
    assert refused.returncode == 2 and refused.stderr.strip().splitlines() == [
        f"error: {wrong}: toy_loss_scale: belongs to method toy, not to method: sft; remove it or set method: toy"]


def _method_name_literals(path: Path) -> list[str]:
    names = set(NAMES)
    tree = ast.parse(path.read_text())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr)}
    return [node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and node.value in names
            and id(node) not in docstrings]


def test_method_names_are_written_as_strings_outside_methods_at_most_twice():
    """The house asks the registry; only methods/ and the demo commands name a method."""
    package = REPO / "praisonai_accel"
    found = {str(path.relative_to(package)): literals for path in sorted(package.rglob("*.py"))
             if not path.relative_to(package).parts[0] == "methods" and not path.name.startswith("demo")
             and (literals := _method_name_literals(path))}
    assert sum(len(v) for v in found.values()) <= 2, found
