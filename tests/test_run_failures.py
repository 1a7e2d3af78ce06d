"""When a run goes wrong: long preprocessing, a rank that dies or hangs, a preemption in the middle of a step,
reentrant checkpointing under DDP. Real 2-process runs on CPU/gloo, with faults injected by tests/faults."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from praisonai_accel.run_dir import checkpoints as ckpt_dir
from praisonai_accel.launcher.plan import free_port

from conftest import cli, fault_env, read_summary, run, write_config
from test_checkpoint import TWO, assert_same_run, wait_for_step
from test_training import workers_left

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2"]


def torchrun(config, env, timeout=180):
    return run([*TORCHRUN, "--master_port", str(free_port()), "-m", "praisonai_accel.train", str(config)], env=env,
               timeout=timeout)


def test_preprocessing_longer_than_the_collective_timeout_still_trains(tmp_path, tiny_model, alpaca_file):
    """Under torchrun directly, rank 0 tokenizes for 10 s while rank 1 waits through the file system: with
    main_process_first rank 1 waited in a barrier and gloo gave up after ddp_timeout (4 s)."""
    config = write_config(tmp_path, tiny_model, alpaca_file, max_steps=2, ddp_timeout=4,
                          dataset_prepared_path=str(tmp_path / "prepared"))
    result = torchrun(config, fault_env(PREPROCESS="sleep:10"))
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
    config = write_config(tmp_path, tiny_model, alpaca_file, max_steps=40, logging_steps=1, hang_timeout=5)
    started = time.monotonic()
    result = cli("train", str(config), *TWO, env=fault_env(HANG="1:3"), timeout=180)
    assert result.returncode != 0 and time.monotonic() - started < 90, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr[-3000:]
    assert errors[0].startswith("error: rank 1: no step finished in") and "stuck in forward (sitecustomize.py:" in errors[0]
    progress = json.loads((tmp_path / "out" / "progress.json").read_text())
    assert (progress["status"], progress["exit_code"]) == ("failed", 124)  # report reads how it ended
    assert "called from" in errors[0] and "rank-1.log" in errors[0]
    assert "most recent call first" in (tmp_path / "out" / "logs" / "rank-1.log").read_text()
    assert not workers_left(config)


def test_sigterm_between_micro_batches_saves_at_once_and_resumes_exactly(tmp_path, tiny_model, alpaca_file):
    """Steps of 4 slow micro-batches: SIGTERM in the middle of step 2 abandons it at the next micro-batch and saves
    the last finished step (waiting for the end of the step would race torchrun's SIGKILL on a big model). Resuming
    gives the uninterrupted run's losses and adapter, dropout included."""
    common = dict(max_steps=3, per_device_train_batch_size=2, gradient_accumulation_steps=4, lora_dropout=0.1,
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
    assert [p.name for p in ckpt_dir.complete_checkpoints(out)] == ["checkpoint-1"]
    assert json.loads((out / "progress.json").read_text())["status"] == "preempted"
    resumed = cli("train", str(config), *TWO)
    assert resumed.returncode == 0 and "resumed from" in resumed.stderr, resumed.stderr[-3000:]
    assert_same_run(tmp_path / "reference" / "out", out)


def test_reentrant_checkpointing_under_ddp_trains(tmp_path, tiny_model, alpaca_file):
    """unsloth's checkpointing is reentrant; under DDP with unused-parameter detection that is 'Expected to mark a
    variable ready only once'. The same rule on CPU with torch's reentrant checkpointing: it now trains, because
    every trainable parameter is checked to get a gradient and detection is left off."""
    config = write_config(tmp_path, tiny_model, alpaca_file, max_steps=3, use_gradient_checkpointing="reentrant",
                          gradient_accumulation_steps=2)
    result = cli("train", str(config), *TWO)
    assert result.returncode == 0, result.stderr[-3000:]
    assert read_summary(tmp_path / "out")["weights_in_sync"]
    forced = write_config(tmp_path, tiny_model, alpaca_file, max_steps=3, use_gradient_checkpointing="reentrant",
                          ddp_find_unused_parameters=True)
    refused = cli("train", str(forced), *TWO)
    assert refused.returncode != 0 and refused.stderr.strip().splitlines() == [
        "error: ddp_find_unused_parameters: true cannot work with reentrant gradient checkpointing (unsloth's, or "
        "use_gradient_checkpointing: reentrant) under DDP: a parameter is marked ready twice; leave it unset"]


def test_reentrant_checkpointing_refuses_parameters_that_get_no_gradient(tiny_model):
    """Without unused-parameter detection DDP would wait forever for their gradients: found on one batch first."""
    import torch
    from transformers import AutoModelForCausalLM

    from praisonai_accel.methods.lm_loss import CausalLMLoss
    from praisonai_accel.methods.sft import SFT
    from praisonai_accel.models.loading import parameters_without_gradient

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model))
    model.requires_grad_(False)
    layers = model.model.layers
    layers[0].mlp.up_proj.weight.requires_grad_(True)
    model.lm_head.weight.requires_grad_(True)
    layers[1].self_attn.q_proj.weight.requires_grad_(True)
    module = CausalLMLoss(model)
    ids = torch.randint(0, 300, (1, 12))
    batch = {"input_ids": ids, "labels": ids, "attention_mask": torch.ones_like(ids)}
    state = torch.get_rng_state()
    forward = SFT(None).forward
    assert parameters_without_gradient(module, batch, forward) == []
    assert torch.equal(state, torch.get_rng_state())
    model.unused = torch.nn.Linear(2, 2)  # trainable, never run: a vision tower on text-only data, say
    assert parameters_without_gradient(module, batch, forward) == ["causal_lm.unused.weight", "causal_lm.unused.bias"]


def test_preflight_names_the_rank_that_does_not_answer(tmp_path, tiny_model, alpaca_file):
    """Rank 1 reaches the preflight all-reduce 30 s late (as a node on the wrong interface never does): one line names
    it and the interface variable to check, within preflight_timeout, before any model loads."""
    config = write_config(tmp_path, tiny_model, alpaca_file, max_steps=2, preflight_timeout=3)
    started = time.monotonic()
    result = torchrun(config, fault_env(PREFLIGHT="late:1:30"), timeout=120)
    assert result.returncode != 0 and time.monotonic() - started < 30, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "preflight: an all-reduce across 2 ranks (gloo) did not complete in 3 s: rank 1 on " \
        in errors[0] and "did not reach it" in errors[0] and "GLOO_SOCKET_IFNAME" in errors[0], result.stderr[-3000:]
    assert "model:" not in result.stderr  # refused before the model loaded


def test_preflight_refuses_different_package_versions_on_the_ranks(tmp_path, tiny_model, alpaca_file):
    config = write_config(tmp_path, tiny_model, alpaca_file, max_steps=2)
    result = torchrun(config, fault_env(PREFLIGHT="version:1:transformers=4.0.0"), timeout=120)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode != 0 and len(errors) == 1, result.stderr[-3000:]
    assert errors[0].startswith("error: preflight: package versions differ between ranks: transformers ")
    assert " vs 4.0.0 (" in errors[0] and "rank 1)" in errors[0] and "model:" not in result.stderr


def test_preflight_warns_of_a_small_dev_shm_and_of_too_little_ram_and_disk(tmp_path, tiny_model, monkeypatch):
    import os

    from praisonai_accel.config import parse_config
    from praisonai_accel.models.files import local_weight_bytes
    from praisonai_accel.worker.preflight import resource_warnings

    class SmallShm:
        f_frsize, f_blocks = 4096, 16384  # 64 MiB, Docker's default

    monkeypatch.setattr(os, "statvfs", lambda path: SmallShm())
    config = parse_config({"model_name": str(tiny_model), "dataset": "d", "finetune_type": "full", "save_total_limit": 3,
                           "output_dir": str(tmp_path / "out")})
    weights = local_weight_bytes(str(tiny_model))
    assert weights > 0
    warnings = resource_warnings(config, 8, cuda=True, available_ram=4 * weights, free_disk=weights)
    assert len(warnings) == 3
    assert warnings[0].startswith("/dev/shm is 64 MiB: NCCL's shared memory between the 8 processes")
    assert warnings[1].startswith("host RAM: 8 process(es) here each load a full copy of the model")
    assert warnings[2].startswith("disk: 3 checkpoint(s) of full fine-tuning and the final model need about")
    assert resource_warnings(config, 8, cuda=False, fsdp=True, available_ram=4 * weights, free_disk=100 * weights) == []


def test_a_worker_killed_by_sigkill_is_named_even_when_its_peer_fails_first(tmp_path, tiny_model, alpaca_file):
    """What the out-of-memory killer does: SIGKILL to rank 1 mid-run. Rank 0 then fails in its next all-reduce
    ('Connection reset by peer'), usually in the same second, which torchrun's report gives as the root cause;
    the one line must still name rank 1 and the signal, with what this machine's processes hold in memory. Rank 1
    is killed while it sleeps inside step 3 and rank 0 waits for it in that step's all-reduce, so that rank 0 fails
    at once; torchrun's agent, looking every 2 s here, notices both together and names rank 0, the lower one, as
    the root cause: the report of the run that lost its explanation."""
    from pathlib import Path

    from test_training import _workers_of

    config = write_config(tmp_path, tiny_model, alpaca_file, max_steps=200, logging_steps=1)
    proc = subprocess.Popen([sys.executable, "-m", "praisonai_accel", "train", str(config), *TWO],
                            env=fault_env(HANG="1:3", MONITOR_INTERVAL="2"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_step(tmp_path / "out", 2, proc)
    time.sleep(2)  # rank 1 asleep in step 3's forward, rank 0 in its all-reduce
    victims = [pid for pid in _workers_of(config) if "praisonai_accel.train" in Path(f"/proc/{pid}/cmdline").read_text()
               and "\0RANK=1\0" in "\0" + Path(f"/proc/{pid}/environ").read_text(errors="replace")]
    assert len(victims) == 1
    os.kill(victims[0], signal.SIGKILL)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode != 0
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, stderr[-3000:]
    assert errors[0].startswith("error: rank 1 was killed (SIGKILL), most likely by the out-of-memory killer: each of "
                                "the 2 processes on this machine loads a full copy of the model"), errors[0]
    assert "Traceback" not in stderr and not workers_left(config)
