"""QLoRA (4-bit base weights) and 8-bit AdamW for real, with bitsandbytes on CPU: 2 processes (the embedding table in
host memory, offload_embedding), exact resume (without it: the same adapter and losses)."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest

from conftest import BNB_DIR, cli, cpu_env, crash_env, load_adapter, read_metrics, read_summary, write_config

QLORA = dict(finetune_type="qlora", optim="adamw_8bit", max_steps=8, save_steps=2, learning_rate=1e-2,
             per_device_train_batch_size=2, lora_dropout=0.1, logging_steps=1)
TWO = ("--cpu", "--num-processes", "2")


def bnb_env(**extra) -> dict:
    """bitsandbytes lives in .bnb (installed by .ci/run) so that only these tests pay for its import."""
    path = os.pathsep.join(p for p in (str(BNB_DIR), os.environ.get("PYTHONPATH", "")) if p)
    return cpu_env(PYTHONPATH=path, **extra)


def skip_without_bitsandbytes() -> None:
    probe = subprocess.run([sys.executable, "-c", "import bitsandbytes"], env=bnb_env(), capture_output=True)
    if probe.returncode != 0:
        pytest.skip("bitsandbytes is not installed (pip install --target .bnb bitsandbytes)")


@pytest.fixture(scope="module", autouse=True)
def bitsandbytes_available():
    skip_without_bitsandbytes()


@pytest.fixture(scope="module")
def qlora_run(tmp_path_factory, tiny_model, alpaca_file):
    directory = tmp_path_factory.mktemp("qlora")
    # with the embedding table in host memory (offload_embedding), which the resumed run below does without
    config = write_config(directory, tiny_model, alpaca_file, offload_embedding=True, **QLORA)
    result = cli("train", str(config), *TWO, env=bnb_env())
    assert result.returncode == 0, result.stderr[-3000:]
    assert "kept in host memory (offload_embedding)" in result.stderr
    return directory / "out", result


def test_qlora_with_8bit_adamw_trains_on_two_processes(qlora_run):
    out, result = qlora_run
    losses = [m["loss"] for m in read_metrics(out) if "loss" in m]
    # that it trained, by rule rather than by one machine's trajectory (the last batch's loss below the first's):
    # every step's loss is finite and the adapter's B matrices, zero at initialisation, have moved
    assert len(losses) == 8 and all(math.isfinite(loss) for loss in losses)
    assert any(v.abs().max() > 0 for k, v in load_adapter(out / "lora_model").items() if "lora_B" in k)
    summary = read_summary(out)
    assert summary["weights_in_sync"] and summary["num_processes"] == 2
    assert result.stderr.count("saved adapter to") == 1
    assert (out / "lora_model" / "adapter_model.safetensors").is_file()
    import torch

    optimizer = torch.load(out / "checkpoint-8" / "optimizer.bin", weights_only=False)
    state = next(iter(optimizer["state"].values()))
    assert "__bnb_optimizer_quant_state__" in state  # bitsandbytes' 8-bit AdamW, not torch's


def test_qlora_resumes_exactly_after_a_crash(tmp_path, tiny_model, alpaca_file, qlora_run):
    config = write_config(tmp_path, tiny_model, alpaca_file, **QLORA)
    crashed = cli("train", str(config), *TWO, env=crash_env("6", bnb_env()))
    assert crashed.returncode != 0
    resumed = cli("train", str(config), *TWO, env=bnb_env())
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr and "checkpoint-4 at step 4" in resumed.stderr
    reference, final = load_adapter(qlora_run[0] / "lora_model"), load_adapter(tmp_path / "out" / "lora_model")
    assert max((reference[k].double() - final[k].double()).abs().max().item() for k in reference) <= 1e-6
    ref_losses = [m["loss"] for m in read_metrics(qlora_run[0]) if "loss" in m]
    assert [m["loss"] for m in read_metrics(tmp_path / "out") if "loss" in m] == pytest.approx(ref_losses, abs=1e-6)
