"""When a run goes wrong: long preprocessing, a rank that dies or hangs, a preemption in the middle of a step,
reentrant checkpointing under DDP. Real 2-process runs on CPU/gloo, with faults injected by tests/faults."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

from praisonai_accel import checkpoint as ckpt
from praisonai_accel.launch import free_port

from conftest import cli, fault_env, read_summary, run, write_config
from test_checkpoint import TWO, assert_same_run, wait_for_step
from test_training import workers_left

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2"]


def torchrun(config, env, timeout=180):
    return run([*TORCHRUN, "--master_port", str(free_port()), "-m", "praisonai_accel.train", str(config)], env=env,
               timeout=timeout)


def test_preprocessing_longer_than_the_collective_timeout_still_trains(tmp_path, tiny_model, alpaca_file):
    """Under torchrun directly, rank 0 tokenizes for 15 s while rank 1 waits through the file system: with
    main_process_first rank 1 waited in a barrier and gloo gave up after ddp_timeout (6 s)."""
    config = write_config(tmp_path, tiny_model, alpaca_file, max_steps=2, ddp_timeout=6,
                          dataset_prepared_path=str(tmp_path / "prepared"))
    result = torchrun(config, fault_env(PREPROCESS="sleep:15"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert read_summary(tmp_path / "out")["global_step"] == 2


def test_a_rank_0_crash_while_preprocessing_ends_every_rank_quickly(tmp_path, tiny_model, alpaca_file):
    config = write_config(tmp_path, tiny_model, alpaca_file, max_steps=2, dataset_prepared_path=str(tmp_path / "prepared"))
    started = time.monotonic()
    result = torchrun(config, fault_env(PREPROCESS="fail"), timeout=120)
    assert result.returncode != 0 and time.monotonic() - started < 60
    assert "injected preprocessing failure" in result.stderr


def test_a_rank_stuck_inside_a_step_is_named_and_the_job_ends(tmp_path, tiny_model, alpaca_file):
    """Rank 1 sleeps inside its third forward. After hang_timeout its watchdog writes every thread's stack to its log,
    says where it is stuck in one line, and exits; rank 0, waiting in a collective, ends with it. Nothing is left."""
    config = write_config(tmp_path, tiny_model, alpaca_file, max_steps=40, logging_steps=1, hang_timeout=8)
    started = time.monotonic()
    result = cli("train", str(config), *TWO, env=fault_env(HANG="1:3"), timeout=180)
    assert result.returncode != 0 and time.monotonic() - started < 90, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr[-3000:]
    assert errors[0].startswith("error: rank 1: no step finished in") and "stuck in forward (sitecustomize.py:" in errors[0]
    assert "called from" in errors[0] and "rank-1.log" in errors[0]
    assert "most recent call first" in (tmp_path / "out" / "logs" / "rank-1.log").read_text()
    assert not workers_left(config)


def test_sigterm_between_micro_batches_saves_at_once_and_resumes_exactly(tmp_path, tiny_model, alpaca_file):
    """Steps of 4 slow micro-batches: SIGTERM in the middle of step 2 abandons it at the next micro-batch and saves
    the last finished step (waiting for the end of the step would race torchrun's SIGKILL on a big model). Resuming
    gives the uninterrupted run's losses and adapter, dropout included."""
    common = dict(max_steps=4, per_device_train_batch_size=2, gradient_accumulation_steps=4, lora_dropout=0.1,
                  logging_steps=1)
    for name in ("reference", "run"):
        (tmp_path / name).mkdir()
    reference = write_config(tmp_path / "reference", tiny_model, alpaca_file, **common)
    assert cli("train", str(reference), *TWO).returncode == 0
    config = write_config(tmp_path / "run", tiny_model, alpaca_file, **common)
    out = tmp_path / "run" / "out"
    proc = subprocess.Popen([sys.executable, "-m", "praisonai_accel", "train", str(config), *TWO],
                            env=fault_env(SLOW_MICRO_BATCH="0.7"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_step(out, 1, proc)
    time.sleep(1)  # inside step 2, between its first and last micro-batch
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode != 0 and "stopped by SIGTERM" in stderr, stderr[-3000:]
    assert [p.name for p in ckpt.complete_checkpoints(out)] == ["checkpoint-1"]
    assert json.loads((out / "progress.json").read_text())["status"] == "preempted"
    resumed = cli("train", str(config), *TWO)
    assert resumed.returncode == 0 and "resumed from" in resumed.stderr, resumed.stderr[-3000:]
    assert_same_run(tmp_path / "reference" / "out", out)
