"""What a user sees: trackers, the loss plot and `report`, a quiet console, one-line errors from the CLI and from
workers, a full disk, the seed's command form, and MoE / multimodal models under DDP."""

from __future__ import annotations

import glob
import json
import sqlite3
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from praisonai_accel.cli import app

from conftest import cli, cpu_env, make_architecture, read_metrics, read_summary, run, write_config

TWO = ("--cpu", "--num-processes", "2")
LIBRARY_NOISE = ("Map:", "Filter:", "Writing model shards", "Loading weights", "reducer.cpp", "Generating train split",
                 "Traceback", "ChildFailedError", "torch.distributed.elastic")


# ---------------------------------------------------------------- trackers, plot, report

def _wandb_records(run_dir: Path):
    """History and config of an offline wandb run, read from its .wandb file (leveldb-style log of protobufs)."""
    from wandb.proto import wandb_internal_pb2

    raw = next(Path(run_dir).glob("run-*.wandb")).read_bytes()
    position, chunks, history, config = 7, [], [], {}
    while position + 7 <= len(raw):
        if 32768 - position % 32768 < 7:
            position += 32768 - position % 32768
            continue
        _crc, length, kind = struct.unpack("<IHB", raw[position:position + 7])
        chunks.append(raw[position + 7:position + 7 + length])
        position += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(chunks))
            chunks = []
            if record.WhichOneof("record_type") == "history":
                history.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item})
            elif record.WhichOneof("record_type") == "config":
                config.update({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.config.update})
    return history, config


def test_every_tracker_gets_the_config_and_every_metric_line(tmp_path, tiny_model, alpaca_file, monkeypatch):
    pytest.importorskip("tensorboard")
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    pytest.importorskip("trackio")
    config = write_config(tmp_path, tiny_model, alpaca_file, max_steps=4, logging_steps=1, val_split_ratio=0.2, eval_steps=2,
                          report_to=["tensorboard", "wandb", "mlflow", "trackio"], run_name="ux-run", plot_loss=True)
    env = cpu_env(WANDB_MODE="offline", WANDB_DIR=str(tmp_path / "wandb"), HF_HOME=str(tmp_path / "hf"))
    result = cli("train", str(config), env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "wandb:" not in result.stdout + result.stderr and "Trackio" not in result.stdout  # their chatter stays quiet
    out = tmp_path / "out"
    logged = [m for m in read_metrics(out) if "loss" in m]
    losses = [m["loss"] for m in logged]
    evals = [m["eval_loss"] for m in read_metrics(out) if "eval_loss" in m]

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "runs" / "ux-run"))
    events.Reload()
    assert [e.value for e in events.Scalars("loss")] == pytest.approx(losses)
    assert [e.value for e in events.Scalars("eval_loss")] == pytest.approx(evals) and len(evals) == 2
    assert {"learning_rate", "grad_norm", "tokens_per_second"} <= set(events.Tags()["scalars"])

    history, wandb_config = _wandb_records(next((tmp_path / "wandb" / "wandb").glob("offline-run-*")))
    assert [h["loss"] for h in history if "loss" in h] == pytest.approx(losses)
    assert wandb_config["learning_rate"] == 0.005 and wandb_config["lora_r"] == 8

    import mlflow

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # reading the file store back needs the same opt-in
    client = mlflow.tracking.MlflowClient((out / "mlruns").resolve().as_uri())
    (mlflow_run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert [m.value for m in client.get_metric_history(mlflow_run.info.run_id, "loss")] == pytest.approx(losses)
    assert mlflow_run.data.params["learning_rate"] == "0.005"

    (database,) = glob.glob(str(tmp_path / "hf" / "trackio" / "*.db"))
    rows = sqlite3.connect(database).execute("select step, metrics from metrics order by id").fetchall()
    trackio_losses = [json.loads(m)["loss"] for _, m in rows if "loss" in json.loads(m)]
    assert trackio_losses == pytest.approx(losses)

    assert (out / "loss.png").stat().st_size > 1000
    report = cli("report", str(out))
    assert report.returncode == 0, report.stderr
    assert "status" in report.stdout and "finished" in report.stdout and "4 of 4" in report.stdout
    assert f"{losses[0]:.4f} -> {losses[-1]:.4f}" in report.stdout and f"{min(evals):.4f}" in report.stdout
    assert str(out / "lora_model") in report.stdout


def test_a_tracker_that_is_not_installed_is_one_line_before_launch(tmp_path, tiny_model, alpaca_file, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    config = write_config(tmp_path, tiny_model, alpaca_file, report_to="wandb")
    result = CliRunner().invoke(app, ["train", str(config), "--cpu"])
    assert result.exit_code == 2
    assert result.output.strip() == "error: report_to: wandb is not installed; pip install 'praisonai-accel[wandb]'"
    assert not (tmp_path / "out").exists()


def test_report_on_a_run_that_was_interrupted(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    lines = [{"step": s, "loss": 3.0 - s / 10, "learning_rate": 1e-3, "tokens_per_second": 100.0 + s, "step_seconds": 0.5,
              "time": 1000.0 + s} for s in range(1, 6)]
    (out / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"step": 6, "lo')  # cut by a kill
    (out / "progress.json").write_text(json.dumps({"status": "running", "global_step": 5, "total_steps": 20,
                                                   "final_model_dir": str(out / "lora_model")}))
    for step in (2, 4):
        (out / f"checkpoint-{step}").mkdir()
        (out / f"checkpoint-{step}" / "COMPLETE").write_text("")
        (out / f"checkpoint-{step}" / "praisonai_state.json").write_text("{}")
    import os

    os.utime(out / "metrics.jsonl", (1000, 1000))  # written long ago: nobody is training
    result = cli("report", str(out))
    assert result.returncode == 0, result.stderr
    assert "interrupted" in result.stdout and "5 of 20" in result.stdout and "checkpoint-2, checkpoint-4" in result.stdout
    assert "2.9000 -> 2.5000" in result.stdout and "not saved yet" in result.stdout
    assert (out / "loss.png").is_file()
    # a folder that holds no run at all was 'status: not started', exit 0: now it says so, and writes no loss.png
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine")
    result = cli("report", str(tmp_path / "notes"))
    assert result.returncode == 2 and result.stderr.strip() == (
        f"error: {tmp_path / 'notes'}: holds no training run (no progress.json, metrics.jsonl, checkpoint-N or eval "
        "results); name a run's output_dir")
    assert [p.name for p in (tmp_path / "notes").iterdir()] == ["todo.txt"]


# ---------------------------------------------------------------- one-line errors before launch

def test_what_the_cli_can_know_is_refused_before_launch(tmp_path, tiny_model, alpaca_file):
    auto = write_config(tmp_path, tiny_model, alpaca_file, device_map="auto")
    result = cli("train", str(auto), *TWO)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1
    assert "device_map: 'auto' spreads one model over several GPUs and cannot be used with 2 DDP processes" in result.stderr
    (tmp_path / "data.xml").write_text("<a/>")
    xml = write_config(tmp_path, tiny_model, tmp_path / "data.xml")
    result = cli("train", str(xml), "--cpu")
    assert result.returncode == 2 and result.stderr.strip() == \
        "error: dataset[0].name: unsupported file type '.xml' (use .json, .jsonl, .csv, .parquet, .txt)"
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- real architectures under DDP, worker errors

@pytest.fixture(scope="module")
def gemma3(tmp_path_factory) -> Path:
    return make_architecture(tmp_path_factory.mktemp("gemma3") / "model", "gemma3")


def test_moe_and_multimodal_models_train_with_two_processes(tmp_path, tiny_model, alpaca_file, gemma3):
    moe = make_architecture(tmp_path / "qwen3-moe", "qwen3_moe")
    for name, model in (("moe", moe), ("gemma3", gemma3)):
        (tmp_path / name).mkdir()
        config = write_config(tmp_path / name, model, alpaca_file, max_steps=6, learning_rate=1e-2,
                              lora_target_modules="all-linear")
        result = cli("train", str(config), *TWO)
        assert result.returncode == 0, result.stderr[-3000:]
        summary = read_summary(tmp_path / name / "out")
        assert summary["weights_in_sync"] and summary["num_processes"] == 2
        assert "LM head at target positions only" in result.stderr  # the chunked loss verified these heads
        assert not [line for line in result.stderr.splitlines() if any(n in line for n in LIBRARY_NOISE)]


def test_an_error_inside_the_workers_is_one_line_with_a_hint_and_the_log(tmp_path, alpaca_file, gemma3):
    config = write_config(tmp_path, gemma3, alpaca_file, max_steps=4, lora_target_modules="all-linear",
                          ddp_find_unused_parameters=False)
    result = cli("train", str(config), *TWO)
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr[-3000:]
    assert "set ddp_find_unused_parameters: true" in errors[0] and "(full log: " in errors[0]
    log = Path(errors[0].split("(full log: ")[1].rstrip(")"))
    assert log.is_file() and "Expected to have finished reduction" in log.read_text()
    assert not any(noise in result.stderr for noise in ("Traceback", "ChildFailedError", "torch.distributed.elastic"))


# ---------------------------------------------------------------- quiet console, seed form

def test_the_seed_command_form_without_a_config_is_refused():
    """`python -m praisonai_accel.train train --config CONFIG` trains: the torchrun test in test_training uses it."""
    bad = run([sys.executable, "-m", "praisonai_accel.train", "train"])
    assert bad.returncode == 2 and "expected one config file" in bad.stderr and "Traceback" not in bad.stderr


# ---------------------------------------------------------------- a full disk

def test_a_full_disk_while_saving_is_one_line_and_a_rerun_resumes(tmp_path, tiny_model, alpaca_file):
    mount = tmp_path / "small"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=600k", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("mounting a tmpfs is not permitted here")
    try:
        raw = yaml.safe_load(write_config(tmp_path, tiny_model, alpaca_file, max_steps=12, save_steps=2,
                                          save_total_limit=None).read_text())
        raw["output_dir"] = str(mount / "out")
        config = tmp_path / "full.yaml"
        config.write_text(yaml.safe_dump(raw))
        result = cli("train", str(config))
        errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
        assert result.returncode != 0 and len(errors) == 1, result.stderr[-3000:]
        assert "no space left on device while saving checkpoint-" in errors[0]
        latest = errors[0].split("the latest complete checkpoint is ")[1].split(";")[0]
        assert (mount / "out" / latest / "COMPLETE").is_file() and "Traceback" not in result.stderr
        assert not list((mount / "out").glob("checkpoint-*.tmp"))
        subprocess.run(["mount", "-o", "remount,size=8m", str(mount)], check=True)
        again = cli("train", str(config))
        assert again.returncode == 0, again.stderr[-3000:]
        assert f"resumed from {mount / 'out' / latest}" in again.stderr
        assert read_summary(mount / "out")["global_step"] == 12
    finally:
        subprocess.run(["umount", str(mount)])
