"""FSDP2 for real on CPU processes (gloo): each rank holds half of every layer, the numbers are DDP's, sharded
checkpoints resume exactly (a killed worker healed by --max-restarts), and what is saved loads in plain
transformers + peft. (LoRA under FSDP against DDP, with SGD and accumulation, is a layout of test_training's SGD test.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch

from praisonai_accel.run_dir import checkpoints as ckpt_dir

from conftest import cli, cpu_env, load_adapter, read_metrics, read_summary, write_config
from test_checkpoint import wait_for_step
from test_multinode import _environ
from test_training import _workers_of, workers_left

FSDP = ("--cpu", "--num-processes", "2", "--fsdp")
DDP = ("--cpu", "--num-processes", "2")
# Adam, dropout and a save every step: resuming is exact only if every shard of the weights and of the optimizer
# state, and every rank's RNG state, come back.
HEAL = dict(max_steps=24, per_device_train_batch_size=2, lora_dropout=0.1, logging_steps=1, save_steps=1,
            learning_rate=1e-2)


def half_of(fsdp_bytes: list[int], ddp_bytes: list[int]) -> bool:
    """Each rank holds about half of the parameters DDP keeps whole on every rank (shards round up)."""
    return all(0.45 * d <= f <= 0.55 * d for f, d in zip(fsdp_bytes, ddp_bytes))


@pytest.fixture(scope="module")
def full_fine_tuning(tmp_path_factory, tiny_model, alpaca_file):
    """Full fine-tuning with SGD and no clipping, accumulation 2, one eval row for two ranks, under DDP and FSDP2;
    with trust_remote_code (the tiny Llama has no code of its own), whose warning every rank must not repeat."""
    outs = {}
    for name, flags in (("ddp", DDP), ("fsdp", FSDP)):
        directory = tmp_path_factory.mktemp(f"full-{name}")
        config = write_config(directory, tiny_model, alpaca_file, finetune_type="full", final_model_dir="model",
                              max_steps=4, logging_steps=1, optim="sgd", learning_rate=0.05, max_grad_norm=0,
                              warmup_steps=0, lr_scheduler_type="constant", per_device_train_batch_size=2,
                              gradient_accumulation_steps=2, eval_steps=2, per_device_eval_batch_size=1, save_steps=4,
                              eval_dataset=[{"name": str(alpaca_file), "format": "alpaca", "num_samples": 1}],
                              trust_remote_code=True)
        result = cli("train", str(config), *flags, timeout=240)  # an eval deadlock would hang here
        assert result.returncode == 0, result.stderr[-3000:]
        assert result.stderr.count("trust_remote_code: true without revision") == 1  # once, not once per rank
        outs[name] = directory / "out"
    return outs


def test_full_fine_tuning_under_fsdp_gives_ddps_loss_and_weights_with_half_the_parameters(full_fine_tuning, tiny_model):
    from safetensors import safe_open
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    ddp, fsdp = full_fine_tuning["ddp"], full_fine_tuning["fsdp"]
    summaries = read_summary(ddp), read_summary(fsdp)
    assert [s["distributed_type"] for s in summaries] == ["MULTI_CPU", "FSDP"]
    assert half_of(summaries[1]["parameter_bytes_per_rank"], summaries[0]["parameter_bytes_per_rank"])
    metrics = [read_metrics(out) for out in (ddp, fsdp)]
    for key in ("loss", "grad_norm", "eval_loss"):
        a, b = ([m[key] for m in ms if key in m] for ms in metrics)
        assert len(a) == (2 if key == "eval_loss" else 4) and a == pytest.approx(b, rel=1e-5, abs=1e-7), key
    a, b = load_file(str(ddp / "model" / "model.safetensors")), load_file(str(fsdp / "model" / "model.safetensors"))
    assert a.keys() == b.keys()
    assert max((a[k].double() - b[k].double()).abs().max().item() for k in a) <= 1e-5
    model = AutoModelForCausalLM.from_pretrained(str(fsdp / "model"))  # plain transformers, no FSDP
    assert torch.equal(model.state_dict()["model.embed_tokens.weight"], b["model.embed_tokens.weight"])
    base = AutoModelForCausalLM.from_pretrained(str(tiny_model)).state_dict()
    assert all(not torch.equal(base[k], v) for k, v in b.items())  # full fine-tuning trained every weight
    assert not (fsdp / "model" / "adapter_config.json").exists()
    with safe_open(str(ddp / "checkpoint-4" / "model.safetensors"), framework="pt") as handle:
        assert set(handle.keys()) == {f"causal_lm.{k}" for k in base}  # a DDP checkpoint holds every trainable weight
    assert not (ddp / "checkpoint-4" / "adapter").exists()
    shards = [load_file(str(fsdp / "checkpoint-4" / f"model_shard_{rank}.safetensors")) for rank in (0, 1)]
    assert shards[0].keys() == shards[1].keys() == {f"causal_lm.{k}" for k in base}  # an FSDP one, a shard of each


@pytest.fixture(scope="module")
def fsdp_reference(tmp_path_factory, tiny_model, alpaca_file):
    directory = tmp_path_factory.mktemp("fsdp-reference")
    result = cli("train", str(write_config(directory, tiny_model, alpaca_file, **HEAL)), *FSDP, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    return directory / "out"


def test_a_killed_fsdp_worker_is_healed_then_a_killed_job_resumes_exactly_from_sharded_checkpoints(
        tmp_path, tiny_model, alpaca_file, fsdp_reference):
    """One run: rank 1 is SIGKILLed at step 3 and --max-restarts 1 heals it; at step 10 the launcher itself is SIGKILLed
    (every worker with it); the same command again resumes. The adapter must be the uninterrupted run's, bitwise.
    (This is also the suite's --max-restarts test: the restart and its resume are the launcher's, whatever the sharding.)"""
    config = write_config(tmp_path, tiny_model, alpaca_file, **HEAL)
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "praisonai_accel", "train", str(config), *FSDP, "--max-restarts", "1"],
                            env=cpu_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_step(out, 3, proc)
        worker = next(pid for pid in _workers_of(config) if "\0RANK=1\0" in _environ(pid))
        os.kill(worker, signal.SIGKILL)
        wait_for_step(out, 10, proc, timeout=180)
        healed = (out / "logs" / "rank-1.log").read_text().count("resumed from")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert healed == 1, "the restarted workers did not resume"
    assert not (out / "train_summary.json").exists() and not workers_left(config)
    checkpoint = ckpt_dir.latest_complete(out)
    assert {"model_shard_0.safetensors", "model_shard_1.safetensors", "optimizer_shard_1.safetensors"} <= {
        p.name for p in checkpoint.iterdir()}  # each rank wrote its own shard; nothing gathered, nothing pickled
    result = cli("train", str(config), *FSDP, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resumed from {checkpoint}" in result.stderr
    final, reference = load_adapter(out / "lora_model"), load_adapter(fsdp_reference / "lora_model")
    assert final.keys() == reference.keys() and all(torch.equal(final[k], reference[k]) for k in reference)
    losses = [[m["loss"] for m in read_metrics(o) if "loss" in m] for o in (out, fsdp_reference)]
    assert losses[0] == losses[1]


def test_an_fsdp_adapter_loads_in_plain_peft(fsdp_reference, tiny_model):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    summary = read_summary(fsdp_reference)
    assert summary["distributed_type"] == "FSDP" and summary["weights_in_sync"]
    saved = load_adapter(fsdp_reference / "lora_model")
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(tiny_model)), str(fsdp_reference / "lora_model"))
    loaded = {k: v for k, v in model.state_dict().items() if "lora_" in k}
    assert len(loaded) == len(saved) and any(v.abs().max() > 0 for k, v in loaded.items() if "lora_B" in k)
    assert all(torch.equal(loaded[k.replace(".weight", ".default.weight")], v) for k, v in saved.items())
