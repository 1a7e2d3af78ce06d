"""Real training runs on the tiny model: 1 process, 2 processes through accelerate launch and torchrun."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from praisonai_accel.launch import free_port

from conftest import cli, cpu_env, load_adapter, read_metrics, read_summary, run, write_config


def assert_single_clean_adapter(output_dir):
    final = output_dir / "lora_model"
    assert (final / "adapter_model.safetensors").is_file() and (final / "adapter_config.json").is_file()
    assert (final / "tokenizer.json").is_file()
    assert not [p for p in output_dir.iterdir() if p.name.startswith(".lora_model")]  # no temp/old dirs left


def test_one_process_without_launcher_loss_decreases(tmp_path, tiny_model, alpaca_file):
    config = write_config(tmp_path, tiny_model, alpaca_file, max_steps=40, learning_rate=1e-2, logging_steps=5,
                          eval_steps=5, eval_dataset=[{"name": str(alpaca_file), "num_samples": 32}])
    result = cli("train", str(config))
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = read_metrics(tmp_path / "out")
    assert [m["step"] for m in metrics if "loss" in m] == list(range(5, 41, 5))
    evals = [m["eval_loss"] for m in metrics if "eval_loss" in m]
    assert len(evals) == 8 and evals[-1] < evals[0] - 0.15, evals  # the same held-out set, scored each time
    assert all(0 <= m["padding_fraction"] < 0.5 for m in metrics if "loss" in m)
    summary = read_summary(tmp_path / "out")
    assert summary["num_processes"] == 1 and summary["global_step"] == 40
    assert_single_clean_adapter(tmp_path / "out")
    assert "accelerate.commands.launch" not in result.stderr


def test_two_processes_via_cli_and_via_torchrun_agree(tmp_path, tiny_model, alpaca_file):
    runs = {}
    for name, launcher in [
        ("cli", lambda cfg: cli("train", str(cfg), "--cpu", "--num-processes", "2")),
        ("torchrun", lambda cfg: run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                                      "--master_port", str(free_port()), "-m", "praisonai_accel.train", str(cfg)])),
    ]:
        directory = tmp_path / name
        directory.mkdir()
        config = write_config(directory, tiny_model, alpaca_file, max_steps=6, logging_steps=1)
        result = launcher(config)
        assert result.returncode == 0, result.stderr[-3000:]
        summary = read_summary(directory / "out")
        assert summary["num_processes"] == 2
        assert summary["weights_in_sync"] and len(summary["rank_weight_digests"]) == 2
        assert result.stderr.count("saved adapter to") == 1  # rank 0 alone saves and reports
        assert len(read_metrics(directory / "out")) == 6  # one writer: no duplicated lines
        assert_single_clean_adapter(directory / "out")
        runs[name] = (summary, load_adapter(directory / "out" / "lora_model"))
    assert runs["cli"][0]["rank_weight_digests"] == runs["torchrun"][0]["rank_weight_digests"]
    for key, value in runs["cli"][1].items():
        assert torch.equal(value, runs["torchrun"][1][key])
    assert (tmp_path / "cli" / "out" / "accelerate_config.yaml").is_file()


def test_accelerate_launch_directly(tmp_path, tiny_model, alpaca_file):
    config = write_config(tmp_path, tiny_model, alpaca_file, max_steps=3)
    result = run([sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                  "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                  "--main_process_port", str(free_port()), "-m", "praisonai_accel.train", str(config)])
    assert result.returncode == 0, result.stderr[-3000:]
    assert read_summary(tmp_path / "out")["num_processes"] == 2


@pytest.mark.parametrize("group_by_length", [False, True])
def test_two_by_b_equals_one_by_2b_equals_b_with_accumulation(tmp_path, tiny_model, alpaca_file, group_by_length):
    """Token-normalised loss: the same samples per optimizer step give the same update, however split."""
    variants = {
        "2xB": (["--cpu", "--num-processes", "2"], {"per_device_train_batch_size": 2}),
        "1x2B": ([], {"per_device_train_batch_size": 4}),
        "1xBxaccum2": ([], {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 2}),
    }
    adapters = {}
    for name, (flags, overrides) in variants.items():
        directory = tmp_path / name
        directory.mkdir()
        config = write_config(directory, tiny_model, alpaca_file, max_steps=5, learning_rate=1e-2,
                              group_by_length=group_by_length, group_by_length_window=16, **overrides)
        result = cli("train", str(config), *flags)
        assert result.returncode == 0, result.stderr[-3000:]
        adapters[name] = load_adapter(directory / "out" / "lora_model")
        losses = [m["loss"] for m in read_metrics(directory / "out")]
        adapters[name]["__loss__"] = torch.tensor(losses, dtype=torch.float64)
    reference = adapters.pop("2xB")
    for name, adapter in adapters.items():
        for key, value in reference.items():
            diff = (value.double() - adapter[key].double()).abs().max().item()
            assert diff <= 1e-5, f"{name} {key}: {diff}"
    if group_by_length:
        padding = [m["padding_fraction"] for m in read_metrics(tmp_path / "2xB" / "out")]
        assert max(padding) < 0.2  # windows sorted by length: little padding even at batch 2
    lora_b = [k for k in reference if "lora_B" in k]
    assert lora_b and any(reference[k].abs().max() > 0 for k in lora_b)  # training really moved the adapter


@pytest.mark.parametrize("launcher", ["praisonai-accel", "accelerate"])
def test_killing_the_launcher_takes_its_workers_down(tmp_path, tiny_model, alpaca_file, launcher):
    config = write_config(tmp_path, tiny_model, alpaca_file, max_steps=100000, logging_steps=1)
    command = {
        "praisonai-accel": [sys.executable, "-m", "praisonai_accel", "train", str(config), "--cpu", "--num-processes", "2"],
        "accelerate": [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                       "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                       "--main_process_port", str(free_port()), "-m", "praisonai_accel.train", str(config)],
    }[launcher]
    proc = subprocess.Popen(command, env=cpu_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics = tmp_path / "out" / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and not (metrics.exists() and metrics.read_text().count("\n") >= 2):
        time.sleep(0.2)
    assert metrics.exists(), "training never started"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    deadline = time.time() + 20
    while time.time() < deadline and _workers_of(config):
        time.sleep(0.2)
    assert not _workers_of(config), "workers kept running after the launcher was killed"


def _workers_of(config) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as handle:
                cmdline = handle.read().decode(errors="replace")
        except OSError:
            continue
        if str(config) in cmdline:
            pids.append(int(entry))
    return pids
