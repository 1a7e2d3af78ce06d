"""Real training runs on the tiny model: 1 process, 2 processes through accelerate launch and torchrun."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from praisonai_accel.launcher.plan import free_port

from conftest import cli, cpu_env, load_adapter, read_metrics, read_summary, run, write_config


def assert_single_clean_adapter(output_dir):
    final = output_dir / "lora_model"
    assert (final / "adapter_model.safetensors").is_file() and (final / "adapter_config.json").is_file()
    assert (final / "tokenizer.json").is_file()
    assert not [p for p in output_dir.iterdir() if p.name.startswith(".lora_model")]  # no temp/old dirs left


def test_one_process_without_launcher_loss_decreases(tmp_path, tiny_model, alpaca_file):
    from praisonai_accel.demo.text import demo_records, write_jsonl

    held_out = write_jsonl(demo_records(32, seed=99), tmp_path / "held_out.jsonl")  # rows never trained on
    config = write_config(tmp_path, tiny_model, alpaca_file, max_steps=40, learning_rate=1e-2, logging_steps=5,
                          eval_steps=5, eval_dataset=[{"name": str(held_out)}])
    dry = cli("train", str(config), "--dry-run")
    command = dry.stdout.strip().splitlines()[-1]
    assert command == f"{sys.executable} -m praisonai_accel.train {config}"  # the module itself, no launcher
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
    assert not list((tmp_path / "out").glob("accelerate_config*.yaml"))
    assert not (tmp_path / "out" / "loss.png").exists()  # plot_loss: false (the tracker test draws one)


@pytest.fixture(scope="module")
def two_process_cli_run(tmp_path_factory, tiny_model, alpaca_file):
    directory = tmp_path_factory.mktemp("cli-two")
    config = write_config(directory, tiny_model, alpaca_file, max_steps=6, logging_steps=1)
    result = cli("train", str(config), "--cpu", "--num-processes", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    return directory / "out", result


def test_two_processes_via_cli_and_via_torchrun_agree(tmp_path, tiny_model, alpaca_file, two_process_cli_run):
    cli_out, cli_result = two_process_cli_run
    config = write_config(tmp_path, tiny_model, alpaca_file, max_steps=6, logging_steps=1)
    result = run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port", str(free_port()),
                  "-m", "praisonai_accel.train", "train", "--config", str(config)])  # the PraisonAI seed's command form
    assert result.returncode == 0, result.stderr[-3000:]
    for out, stderr in ((cli_out, cli_result.stderr), (tmp_path / "out", result.stderr)):
        summary = read_summary(out)
        assert summary["num_processes"] == 2
        assert summary["weights_in_sync"] and len(summary["rank_weight_digests"]) == 2
        assert summary["data_formats"] == {str(alpaca_file): "alpaca"}  # eval renders its prompts as they trained
        assert stderr.count("saved adapter to") == 1  # rank 0 alone saves and reports
        assert len(read_metrics(out)) == 6  # one writer: no duplicated lines
        assert_single_clean_adapter(out)
    assert read_summary(cli_out)["rank_weight_digests"] == read_summary(tmp_path / "out")["rank_weight_digests"]
    a, b = load_adapter(cli_out / "lora_model"), load_adapter(tmp_path / "out" / "lora_model")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert (cli_out / "accelerate_config.yaml").is_file()


def test_accelerate_launch_directly_gives_the_cli_adapter_bitwise(tmp_path, tiny_model, alpaca_file, two_process_cli_run):
    config = write_config(tmp_path, tiny_model, alpaca_file, max_steps=6, logging_steps=1)
    result = run(accelerate_launch(config))
    assert result.returncode == 0, result.stderr[-3000:]
    assert read_summary(tmp_path / "out")["num_processes"] == 2
    a, b = load_adapter(two_process_cli_run[0] / "lora_model"), load_adapter(tmp_path / "out" / "lora_model")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_sgd_without_clipping_gives_the_same_weights_and_grad_norms_for_every_layout_and_loss(tmp_path, tiny_model,
                                                                                            alpaca_file):
    """SGD and max_grad_norm 0, so a constant factor in the loss scale cannot hide behind Adam or clipping.
    2 processes x batch 2 x accumulation 2 (the layout that runs no_sync under DDP) against 1 process x batch 8,
    the same layout under FSDP2 (each rank holding half of every layer), and once in bf16 autocast (with a tolerance: bf16 hidden
    states, fp32 accumulation in the loss). group_by_length is on: its sample order must not depend on the layout
    either. Every run scores 3 eval rows each step (2 ranks: one scores a masked filler row) and must agree."""
    two = ["--cpu", "--num-processes", "2"]
    layout = {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 2}
    variants = {
        "2x2xaccum2": (two, layout),
        "2x2xaccum2-fsdp": (two + ["--fsdp"], layout),
        "2x2xaccum2-bf16": (two, {**layout, "mixed_precision": "bf16"}),
        "1x8": ([], {"per_device_train_batch_size": 8}),
    }
    runs = {}
    for name, (flags, overrides) in variants.items():
        (tmp_path / name).mkdir()
        config = write_config(tmp_path / name, tiny_model, alpaca_file, max_steps=5, logging_steps=1, learning_rate=0.5, optim="sgd",
                              max_grad_norm=0, warmup_steps=0, lr_scheduler_type="constant", group_by_length=True,
                              group_by_length_window=16, eval_steps=1, per_device_eval_batch_size=1,
                              eval_dataset=[{"name": str(alpaca_file), "format": "alpaca", "num_samples": 3}], **overrides)
        result = cli("train", str(config), *flags)
        assert result.returncode == 0, result.stderr[-3000:]
        metrics = read_metrics(tmp_path / name / "out")
        runs[name] = (load_adapter(tmp_path / name / "out" / "lora_model"), [m["grad_norm"] for m in metrics if "loss" in m],
                      [m["loss"] for m in metrics if "loss" in m], [m["eval_loss"] for m in metrics if "eval_loss" in m])
    reference, ref_norms, ref_losses, ref_evals = runs.pop("2x2xaccum2")
    assert len(ref_norms) == 5 and all(n > 0 for n in ref_norms) and len(ref_evals) == 5
    for name, (adapter, norms, losses, evals) in runs.items():
        rel, weights = (2e-2, 2e-3) if name.endswith("bf16") else (1e-5, 1e-5)
        assert norms == pytest.approx(ref_norms, rel=rel, abs=1e-7), name
        assert losses == pytest.approx(ref_losses, rel=rel), name
        assert evals == pytest.approx(ref_evals, rel=rel), name
        diff = max((reference[k].double() - adapter[k].double()).abs().max().item() for k in reference)
        assert diff <= weights, f"{name}: {diff}"
    assert any(reference[k].abs().max() > 0 for k in reference if "lora_B" in k)
    padding = [m["padding_fraction"] for m in read_metrics(tmp_path / "2x2xaccum2" / "out") if "loss" in m]
    assert max(padding) < 0.2  # examples of similar length share a batch
    ddp, fsdp = (read_summary(tmp_path / name / "out") for name in ("2x2xaccum2", "2x2xaccum2-fsdp"))
    assert (ddp["distributed_type"], fsdp["distributed_type"]) == ("MULTI_CPU", "FSDP")
    assert all(0.45 * d <= f <= 0.55 * d for f, d in zip(fsdp["parameter_bytes_per_rank"], ddp["parameter_bytes_per_rank"]))
    bf16 = read_metrics(tmp_path / "2x2xaccum2-bf16" / "out")
    assert [m["loss"] for m in bf16 if "loss" in m] != ref_losses  # bf16 really ran: not bitwise fp32


def test_packed_rows_give_the_same_update_on_2xB_and_on_1xB_with_accumulation(tmp_path, tiny_model, alpaca_file):
    """Token-normalised loss: the same packed rows per optimizer step give the same update, however split."""
    variants = {
        "2xB": (["--cpu", "--num-processes", "2"], {"per_device_train_batch_size": 2}),
        "1xBxaccum2": ([], {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 2}),
    }
    adapters = {}
    for name, (flags, overrides) in variants.items():
        directory = tmp_path / name
        directory.mkdir()
        # 64 examples pack into 14 rows: 3 full steps of 4 rows (a 4th, partial step would be padded by
        # accelerate's even_batches with repeated rows on 2 processes, so it is not the same samples)
        config = write_config(directory, tiny_model, alpaca_file, max_steps=3, learning_rate=1e-2, packing=True,
                              **overrides)
        result = cli("train", str(config), *flags)
        assert result.returncode == 0, result.stderr[-3000:]
        adapters[name] = load_adapter(directory / "out" / "lora_model")
        losses = [m["loss"] for m in read_metrics(directory / "out")]
        adapters[name]["__loss__"] = torch.tensor(losses, dtype=torch.float64)
    reference, adapter = adapters["2xB"], adapters["1xBxaccum2"]
    for key, value in reference.items():
        diff = (value.double() - adapter[key].double()).abs().max().item()
        assert diff <= 1e-5, f"{key}: {diff}"
    # the model FLOPs and examples of a step are the same however its rows are split (summed over ranks and
    # micro-batches), and several examples share a packed row
    for key in ("model_flops", "examples", "targets"):
        values = {name: [m[key] for m in read_metrics(tmp_path / name / "out")] for name in variants}
        assert values["2xB"] == values["1xBxaccum2"] and min(values["2xB"]) > 0, (key, values)
    assert sum(m["examples"] for m in read_metrics(tmp_path / "2xB" / "out")) > 3 * 4
    padding = [m["padding_fraction"] for m in read_metrics(tmp_path / "2xB" / "out")]
    # packed rows nearly full (~30-token examples in 128-token rows here; the 2% target at realistic lengths is
    # test_best_fit_decreasing_fills_rows)
    assert max(padding) < 0.03
    lora_b = [k for k in reference if "lora_B" in k]
    assert lora_b and any(reference[k].abs().max() > 0 for k in lora_b)  # training really moved the adapter


def test_killing_accelerate_launch_takes_its_workers_down(tmp_path, tiny_model, alpaca_file):
    """Workers started by `accelerate launch` itself, not by us, still die with it (die_with_parent); the
    praisonai-accel launcher's case is the SIGKILL resume test's."""
    config = write_config(tmp_path, tiny_model, alpaca_file, max_steps=100000, logging_steps=1)
    proc = subprocess.Popen(accelerate_launch(config), env=cpu_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics = tmp_path / "out" / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and not (metrics.exists() and metrics.read_text().count("\n") >= 2):
        time.sleep(0.2)
    assert metrics.exists(), "training never started"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    assert not workers_left(config), "workers kept running after the launcher was killed"


def accelerate_launch(config) -> list[str]:
    """`accelerate launch` run by hand, as a user would, on 2 CPU processes."""
    return [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
            "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
            "--main_process_port", str(free_port()), "-m", "praisonai_accel.train", str(config)]


def workers_left(config, timeout: float = 20) -> list[int]:
    """The processes still running with this config once they are gone, or `timeout` seconds have passed."""
    deadline = time.time() + timeout
    while (pids := _workers_of(config)) and time.time() < deadline:
        time.sleep(0.1)
    return pids


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
