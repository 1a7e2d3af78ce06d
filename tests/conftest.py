"""Shared fixtures: a tiny random Llama built locally, small JSONL data, and helpers to run real processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

# No test may reach the Hub; a Hub id then fails at once instead of after ~48 s of retries.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"
os.environ.setdefault("HF_HOME", str(Path(__file__).resolve().parent.parent / ".pytest_hf_home"))

from praisonai_accel.demo import demo_config, demo_records, make_tiny_model, write_jsonl  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-llama")


@pytest.fixture(scope="session")
def alpaca_file(tmp_path_factory) -> Path:
    return write_jsonl(demo_records(64), tmp_path_factory.mktemp("data") / "alpaca.jsonl")


def write_config(directory: Path, model: Path, data: Path, **overrides) -> Path:
    raw = demo_config(model, data, directory / "out", **overrides)
    path = directory / "config.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def cpu_env(**extra) -> dict:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONUNBUFFERED": "1", **extra}
    return env


def run(args: list[str], timeout: float = 300, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=kwargs.pop("env", cpu_env()), **kwargs)


def cli(*args: str, timeout: float = 300, **kwargs) -> subprocess.CompletedProcess:
    return run([sys.executable, "-m", "praisonai_accel", *args], timeout=timeout, **kwargs)


def read_metrics(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def read_summary(output_dir: Path) -> dict:
    return json.loads((output_dir / "train_summary.json").read_text())


def load_adapter(directory: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(directory / "adapter_model.safetensors"))
