"""Checkpoints with real processes: SIGKILL and resume, crash mid-save, rotation, epochs, world size, SIGTERM."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from praisonai_accel.run_dir import checkpoints as ckpt_dir

from conftest import cli, cpu_env, crash_env, load_adapter, read_metrics, read_summary, write_config
from test_training import _workers_of, workers_left

TWO = ("--cpu", "--num-processes", "2")
# Dropout on, so resuming is only exact if every rank's RNG state comes back too; packed rows (about 7 steps
# an epoch), so exact resume is proven with packing on and across epochs.
EXACT = dict(max_steps=40, per_device_train_batch_size=2, lora_dropout=0.1, logging_steps=1, warmup_steps=3,
             packing=True, max_seq_length=64)


def losses(output_dir: Path) -> list[tuple[int, float]]:
    return [(m["step"], m["loss"]) for m in read_metrics(output_dir) if "loss" in m]


def assert_same_run(a: Path, b: Path, tol: float = 1e-6) -> None:
    la, lb = losses(a), losses(b)
    assert [s for s, _ in la] == [s for s, _ in lb]
    assert max(abs(x - y) for (_, x), (_, y) in zip(la, lb)) <= tol
    wa, wb = load_adapter(a / "lora_model"), load_adapter(b / "lora_model")
    assert max((wa[k].double() - wb[k].double()).abs().max().item() for k in wa) <= tol


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_model, alpaca_file):
    """The uninterrupted 2-process run every interrupted one must reproduce."""
    directory = tmp_path_factory.mktemp("reference")
    result = cli("train", str(write_config(directory, tiny_model, alpaca_file, **EXACT)), *TWO)
    assert result.returncode == 0, result.stderr[-3000:]
    return directory / "out"


def start(config: Path, *flags: str, **env) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "praisonai_accel", "train", str(config), *flags],
                            env=cpu_env(**env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_step(output_dir: Path, step: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    path, deadline = output_dir / "metrics.jsonl", time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        if path.exists() and sum('"loss"' in line for line in path.open()) >= step:
            return
        time.sleep(0.01)
    raise AssertionError(f"run ended or stalled before step {step}")


class Terminal:
    """`praisonai-accel train` on a pseudo-terminal of 100 columns, its controlling terminal: Ctrl-C is the byte
    0x03 typed into it, and what the terminal got is read as it comes (a full pty would block the run)."""

    def __init__(self, config: Path, *flags: str):
        import fcntl
        import pty
        import struct
        import termios
        import threading

        self.master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))

        def take_the_terminal():
            os.setsid()
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)

        self.proc = subprocess.Popen([sys.executable, "-m", "praisonai_accel", "train", str(config), *flags],
                                     env=cpu_env(), stdin=slave, stdout=slave, stderr=slave,
                                     preexec_fn=take_the_terminal)
        os.close(slave)
        self.received = bytearray()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        while True:
            try:
                chunk = os.read(self.master, 65536)
            except OSError:  # EIO: the other side is closed
                return
            if not chunk:
                return
            self.received += chunk

    def ctrl_c(self) -> None:
        os.write(self.master, b"\x03")

    def wait(self, timeout: float = 120) -> str:
        self.proc.wait(timeout=timeout)
        self.reader.join(timeout=10)
        os.close(self.master)
        return self.received.decode(errors="replace")


def test_ctrl_c_on_a_terminal_then_sigterm_then_sigkill_then_resume_is_exact(tmp_path, tiny_model, alpaca_file, reference):
    """save_strategy: no (the default). Ctrl-C typed on a real terminal at a random step: the bar redrew in place,
    the checkpoint of the last finished step is written on the way out and progress.json says how the run ended.
    The same command resumes exactly there; SIGTERM at a later random step does the same. Then with a save every
    step, SIGKILLed in a later epoch (packed rows: about 7 steps an epoch), then again to the end: the adapter and
    every logged loss are the uninterrupted run's."""
    from conftest import screen_of

    rng = random.Random()
    first, later = rng.randint(2, 6), rng.randint(2, 5)
    print(f"Ctrl-C after step {first}, SIGTERM {later} steps after the resume")  # shown when the test fails
    config = write_config(tmp_path, tiny_model, alpaca_file, **EXACT)
    out = tmp_path / "out"
    terminal = Terminal(config, *TWO)
    wait_for_step(out, first, terminal.proc)
    terminal.ctrl_c()
    shown = terminal.wait()
    assert terminal.proc.returncode == 130, shown[-3000:]
    progress = json.loads((out / "progress.json").read_text())
    stopped = progress["global_step"]
    assert stopped >= first and progress["status"] == "interrupted" and progress["signal"] == "SIGINT"
    assert [p.name for p in ckpt_dir.complete_checkpoints(out)] == [f"checkpoint-{stopped}"]
    lines = screen_of(shown)
    assert sum(line.startswith("training ") for line in lines) == 1, lines  # redrawn in place, not a line a refresh
    assert shown.count("\r\x1b[2Ktraining ") >= stopped  # the bar moved
    assert f"saved checkpoint {out / f'checkpoint-{stopped}'}" in lines, lines  # nothing ran into it
    assert any(line.startswith("praisonai-accel: interrupted; checkpoint of the last finished step saved at")
               for line in lines), lines
    assert "death signal" not in shown and "Traceback" not in shown  # the libraries' shutdown noise: rank logs only
    assert not _workers_of(config)
    report = cli("report", str(out))
    assert f"interrupted by SIGINT at step {stopped}; re-run the same command to resume from checkpoint-{stopped}" \
        in report.stdout, report.stdout

    proc = start(config, *TWO)
    wait_for_step(out, stopped + later, proc)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 143 and f"resumed from {out / f'checkpoint-{stopped}'} at step {stopped}" in stderr, \
        stderr[-3000:]
    progress = json.loads((out / "progress.json").read_text())
    assert progress["status"] == "preempted" and progress["global_step"] >= stopped + later
    assert ckpt_dir.latest_complete(out).name == f"checkpoint-{progress['global_step']}" and "stopped by SIGTERM" in stderr
    assert not _workers_of(config)

    config = write_config(tmp_path, tiny_model, alpaca_file, save_steps=1, **EXACT)
    proc = start(config, *TWO)
    wait_for_step(out, max(10, progress["global_step"] + 3), proc)  # in epoch 1 or later
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    assert not (out / "train_summary.json").exists(), "the run finished before it could be killed"
    assert not workers_left(config)  # SIGKILL of the praisonai-accel launcher takes its workers down
    result = cli("train", str(config), *TWO)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed from" in result.stderr and re.search(r"\(epoch [1-9]\d*,", result.stderr), result.stderr[-3000:]
    assert_same_run(out, reference)
    assert json.loads((out / "progress.json").read_text())["status"] == "finished"


def test_crash_while_saving_resumes_from_the_previous_complete_checkpoint(tmp_path, tiny_model, alpaca_file, reference):
    """save_total_limit 1: rotation may delete the previous checkpoint only once the new one is complete, so a
    crash inside the save (in accelerator.save_state, or after it before the marker) leaves the previous one whole.
    First a crash inside save_state at step 10, then, resumed from 5, a crash before the marker at step 15."""
    config = write_config(tmp_path, tiny_model, alpaca_file, save_steps=5, save_total_limit=1, **EXACT)
    out = tmp_path / "out"
    for crash_at, previous in (("10:state", "checkpoint-5"), ("15", "checkpoint-10")):
        crashed = cli("train", str(config), *TWO, env=crash_env(crash_at))
        assert crashed.returncode != 0
        step = crash_at.split(":")[0]
        assert (out / f"checkpoint-{step}.tmp").is_dir() and not (out / f"checkpoint-{step}").exists()
        assert [p.name for p in ckpt_dir.complete_checkpoints(out)] == [previous]
        if crash_at.endswith("state"):
            assert not (out / "checkpoint-10.tmp" / "model.safetensors").exists()  # it died before the weights
        else:
            assert "removing" in crashed.stderr and f"resumed from {out / 'checkpoint-5'} at step 5" in crashed.stderr
    result = cli("train", str(config), *TWO)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "removing" in result.stderr and f"resumed from {out / 'checkpoint-10'} at step 10" in result.stderr
    assert_same_run(out, reference)


def test_slurms_sigusr1_on_a_single_process_exits_143_with_a_checkpoint(tmp_path, tiny_model, alpaca_file):
    """SLURM's warning before a preemption (sbatch --signal=USR1@60) reaches praisonai-accel, which stops the run as
    SIGTERM does (SIGTERM itself: the 2-process tests)."""
    config = write_config(tmp_path, tiny_model, alpaca_file, max_steps=100000)
    proc = start(config)
    wait_for_step(tmp_path / "out", 3, proc)
    proc.send_signal(signal.SIGUSR1)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 143, stderr[-2000:]
    assert len(ckpt_dir.complete_checkpoints(tmp_path / "out")) == 1 and "stopped by SIGTERM" in stderr
    assert json.loads((tmp_path / "out" / "progress.json").read_text())["status"] == "preempted"  # what SLURM requeues on


def test_report_on_a_run_in_progress_then_ctrl_c_on_the_launcher_leaves_no_workers(tmp_path, tiny_model, alpaca_file):
    """(Killing the launcher with SIGKILL takes its workers down too: the SIGKILL test checks that.)"""
    config = write_config(tmp_path, tiny_model, alpaca_file, max_steps=100000)
    proc = start(config, *TWO)
    wait_for_step(tmp_path / "out", 2, proc)
    report = cli("report", str(tmp_path / "out"))
    assert report.returncode == 0 and "running" in report.stdout and "of 100000" in report.stdout, report.stdout
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=60)
    assert proc.returncode != 0 and not workers_left(config)


def test_epoch_boundary_resume(tmp_path, tiny_model, alpaca_file):
    """One epoch, then the same run extended to two: it resumes at the start of epoch 1 (one process: resuming
    every rank exactly is the SIGKILL test's)."""
    common = dict(per_device_train_batch_size=8, lora_dropout=0.1, max_steps=-1, lr_scheduler_type="constant",
                  warmup_steps=0, save_strategy="epoch", logging_steps=1)
    (tmp_path / "ref").mkdir()
    ref = write_config(tmp_path / "ref", tiny_model, alpaca_file, num_train_epochs=2, **common)
    assert cli("train", str(ref)).returncode == 0
    first = write_config(tmp_path, tiny_model, alpaca_file, num_train_epochs=1, **common)
    assert cli("train", str(first)).returncode == 0
    assert [p.name for p in ckpt_dir.complete_checkpoints(tmp_path / "out")] == ["checkpoint-8"]  # 64 / 8 per epoch
    second = write_config(tmp_path, tiny_model, alpaca_file, num_train_epochs=2, **common)
    result = cli("train", str(second))
    assert result.returncode == 0 and "resumed from" in result.stderr and "epoch 1, 0 batch(es) in" in result.stderr
    assert_same_run(tmp_path / "out", tmp_path / "ref" / "out")


def test_rotation_keeps_the_best_and_early_stopping_ends_every_rank(tmp_path, tiny_model, alpaca_file):
    """Early stopping by its rule, on any machine: with early_stopping_threshold 1000 no evaluation can improve on the
    best by that much, so patience 3 runs out at the 4th evaluation (step 8 of 30) whatever the losses are. The best
    checkpoint is the one of the lowest eval loss recorded (the first of equal ones); save_total_limit 1 keeps it and
    the newest; the final adapter is the best one's. (A learning rate this high usually makes the best come before
    the last, so rotation keeps two; rotate's own test covers that case for certain.)"""
    config = write_config(tmp_path, tiny_model, alpaca_file, max_steps=30, val_split_ratio=0.25, eval_steps=2,
                          save_steps=2, save_total_limit=1, load_best_model_at_end=True, early_stopping_patience=3,
                          early_stopping_threshold=1000.0, learning_rate=0.3, lr_scheduler_type="constant",
                          warmup_steps=0)
    result = cli("train", str(config), *TWO)
    assert result.returncode == 0, result.stderr[-3000:]
    out = tmp_path / "out"
    summary = read_summary(out)
    assert summary["stopped_early"] and summary["global_step"] == 8
    evals = [m for m in read_metrics(out) if "eval_loss" in m]
    assert [m["step"] for m in evals] == [2, 4, 6, 8]
    best_eval = min(evals, key=lambda m: m["eval_loss"])
    assert summary["best_checkpoint"] == f"checkpoint-{best_eval['step']}"
    last = "checkpoint-8"
    kept = [summary["best_checkpoint"]] + ([last] if summary["best_checkpoint"] != last else [])
    assert [p.name for p in ckpt_dir.complete_checkpoints(out)] == kept
    best = load_adapter(out / summary["best_checkpoint"] / "adapter")
    newest = load_adapter(out / last / "adapter")
    final = load_adapter(out / "lora_model")
    assert all(torch.equal(best[k], final[k]) for k in final)
    if summary["best_checkpoint"] != last:
        assert not all(torch.equal(newest[k], final[k]) for k in final)
    assert not _workers_of(config)


def test_resume_choices_and_refusals(tmp_path, tiny_model, alpaca_file):
    out = tmp_path / "out"
    config = write_config(tmp_path, tiny_model, alpaca_file, max_steps=4, save_steps=2)
    assert cli("train", str(config)).returncode == 0
    before = sorted(p.name for p in out.iterdir())

    fresh = write_config(tmp_path, tiny_model, alpaca_file, max_steps=4, save_steps=2, resume_from_checkpoint=False)
    result = cli("train", str(fresh))
    assert result.returncode == 2 and "already holds checkpoints (checkpoint-4)" in result.stderr

    other = write_config(tmp_path, tiny_model, alpaca_file, max_steps=4, save_steps=2, lora_r=4)
    result = cli("train", str(other), *TWO)  # refused before any process starts: one line, no launcher traceback
    assert result.returncode == 2 and "holds checkpoints of another run" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr

    same = write_config(tmp_path, tiny_model, alpaca_file, max_steps=4, save_steps=2)
    dry = cli("train", str(same), "--dry-run")
    assert dry.returncode == 0 and f"# start: resume from {out / 'checkpoint-4'}" in dry.stdout

    missing = write_config(tmp_path, tiny_model, alpaca_file, resume_from_checkpoint=str(out / "checkpoint-99"))
    result = cli("train", str(missing))
    assert result.returncode == 2 and "no such checkpoint directory" in result.stderr
    assert sorted(p.name for p in out.iterdir()) == before  # refusals change nothing on disk

    (out / "checkpoint-4" / ckpt_dir.MARKER).unlink()
    partial = write_config(tmp_path, tiny_model, alpaca_file, resume_from_checkpoint=str(out / "checkpoint-4"))
    result = cli("train", str(partial))
    assert result.returncode == 2 and "is incomplete" in result.stderr

    longer = write_config(tmp_path, tiny_model, alpaca_file, max_steps=6, save_steps=2)
    result = cli("train", str(longer))
    assert result.returncode == 0
    assert "skipping incomplete checkpoint" in result.stderr and "resumed from" in result.stderr and "checkpoint-2 at step 2" in result.stderr

    over = write_config(tmp_path, tiny_model, alpaca_file, max_steps=2, save_steps=2, lora_r=4, overwrite_output_dir=True)
    assert cli("train", str(over)).returncode == 0
    assert [p.name for p in ckpt_dir.complete_checkpoints(out)] == ["checkpoint-2"]


def test_rotate_never_deletes_the_best(tmp_path):
    for step in (2, 4, 6, 8):
        path = tmp_path / f"checkpoint-{step}"
        path.mkdir()
        (path / ckpt_dir.MARKER).write_text("")
        (path / ckpt_dir.STATE_FILE).write_text("{}")
    (tmp_path / "checkpoint-10").mkdir()  # incomplete: never counted, never picked
    deleted = ckpt_dir.rotate(tmp_path, limit=2, keep="checkpoint-2")
    assert [p.name for p in deleted] == ["checkpoint-4", "checkpoint-6"]
    assert [p.name for p in ckpt_dir.complete_checkpoints(tmp_path)] == ["checkpoint-2", "checkpoint-8"]
    assert ckpt_dir.latest_complete(tmp_path).name == "checkpoint-8"
    deleted = ckpt_dir.rotate(tmp_path, limit=1, keep="checkpoint-2")  # the best and the newest both stay
    assert deleted == [] and [p.name for p in ckpt_dir.complete_checkpoints(tmp_path)] == ["checkpoint-2", "checkpoint-8"]
    assert [p.name for p in ckpt_dir.rotate(tmp_path, limit=1, keep="checkpoint-8")] == ["checkpoint-2"]
