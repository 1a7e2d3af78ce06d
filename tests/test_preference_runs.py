"""Preference training through the CLI, with real processes (the in-process proofs are test_preference_training.py):

- DPO: 2 processes x B give the adapter of 1 process x 2B (fp32, no dropout), step-0 loss ln 2;
- DPO with precompute_ref_log_probs: the reference log-probs are written once to output_dir/reference_logps, and a
  run SIGKILLed mid-way resumes exactly (losses and adapter of the uninterrupted run), reading them, not recomputing;
- DPO fully fine-tuned under --fsdp: the frozen reference copy shards with the policy, and stays the starting model;
  metric_for_best_model: eval_rewards/accuracies picks the checkpoint with the best held-out accuracy;
- KTO on LLaMA-Factory's kto_en_demo.json.
"""

from __future__ import annotations

import math
import re
import signal

import pytest
import torch

from conftest import REPO, cli, load_adapter, read_metrics, read_summary, write_config
from test_checkpoint import TWO, assert_same_run, start, wait_for_step
from test_training import workers_left

FIXTURES = REPO.parent / "shared" / "fixtures" / "llamafactory"
DPO_DATA, KTO_DATA = FIXTURES / "dpo_en_demo.json", FIXTURES / "kto_en_demo.json"
# fp32 on CPU, pairs cut to 96 tokens (prompt first, to 48) so a step takes about a second on the tiny model
PREFERENCE = dict(method="dpo", max_seq_length=96, max_prompt_length=48, learning_rate=1e-2, logging_steps=1,
                  warmup_steps=0)


@pytest.fixture(autouse=True)
def _fixtures():
    if not FIXTURES.is_dir():
        pytest.skip("../shared/fixtures/llamafactory is absent")


def _config(directory, tiny_model, data=DPO_DATA, **overrides):
    return write_config(directory, tiny_model, data, **{**PREFERENCE, "dataset": [{"name": str(data)}], **overrides})


def _losses(out):
    return [m["loss"] for m in read_metrics(out) if "loss" in m]


def test_dpo_on_2_processes_x_B_gives_the_adapter_of_1_process_x_2B(tmp_path, tiny_model):
    adapters, losses = {}, {}
    for name, flags, batch in (("2xB", TWO, 2), ("1x2B", (), 4)):
        directory = tmp_path / name
        directory.mkdir()
        config = _config(directory, tiny_model, max_steps=3, per_device_train_batch_size=batch)
        result = cli("train", str(config), "--cpu", *flags)
        assert result.returncode == 0, result.stderr[-3000:]
        adapters[name], losses[name] = load_adapter(directory / "out" / "lora_model"), _losses(directory / "out")
    assert abs(losses["2xB"][0] - math.log(2)) < 1e-6  # policy == reference at step 0
    assert max(abs(a - b) for a, b in zip(losses["2xB"], losses["1x2B"])) <= 1e-5, losses
    assert losses["2xB"][-1] < losses["2xB"][0]
    diffs = {k: (v.double() - adapters["1x2B"][k].double()).abs().max().item() for k, v in adapters["2xB"].items()}
    assert max(diffs.values()) <= 1e-5, diffs
    assert any(v.abs().max() > 0 for k, v in adapters["2xB"].items() if "lora_B" in k)  # the adapter moved
    metrics = [m for m in read_metrics(tmp_path / "2xB" / "out") if "loss" in m]
    assert metrics[0]["rewards/margins"] == pytest.approx(0.0, abs=1e-6) and "rewards/accuracies" in metrics[-1]


def test_dpo_resumes_exactly_after_sigkill_reading_its_precomputed_reference(tmp_path, tiny_model):
    # dropout on: resuming is only exact if every rank's RNG state comes back too
    exact = dict(max_steps=14, per_device_train_batch_size=2, lora_dropout=0.1, precompute_ref_log_probs=True,
                 learning_rate=5e-3)
    (tmp_path / "reference").mkdir()
    result = cli("train", str(_config(tmp_path / "reference", tiny_model, **exact)), *TWO)
    assert result.returncode == 0, result.stderr[-3000:]
    reference = tmp_path / "reference" / "out"
    assert "reference log-probs: computed for" in result.stderr
    assert abs(_losses(reference)[0] - math.log(2)) < 1e-6

    config = _config(tmp_path, tiny_model, save_steps=1, **exact)
    out = tmp_path / "out"
    proc = start(config, *TWO)
    wait_for_step(out, 6, proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    assert not (out / "train_summary.json").exists(), "the run finished before it could be killed"
    assert not workers_left(config)
    kept = out / "reference_logps" / "train.safetensors"
    written = kept.stat().st_mtime_ns
    result = cli("train", str(config), *TWO)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed from" in result.stderr
    assert "reference log-probs: read from" in result.stderr and "computed for" not in result.stderr
    assert kept.stat().st_mtime_ns == written
    assert_same_run(out, reference)


def test_dpo_full_fine_tuning_under_fsdp_shards_the_reference_and_keeps_the_best_accuracy(tmp_path, tiny_model):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    config = _config(tmp_path, tiny_model, finetune_type="full", final_model_dir="model", max_steps=6,
                     per_device_train_batch_size=2, learning_rate=2e-3, val_split_ratio=0.05, eval_steps=2,
                     save_steps=2, metric_for_best_model="eval_rewards/accuracies", greater_is_better=True)
    result = cli("train", str(config), *TWO, "--fsdp")
    assert result.returncode == 0, result.stderr[-3000:]
    out = tmp_path / "out"
    summary = read_summary(out)
    assert summary["distributed_type"] == "FSDP" and summary["weights_in_sync"]
    assert abs(_losses(out)[0] - math.log(2)) < 1e-6
    evals = [m for m in read_metrics(out) if "eval_loss" in m]
    assert len(evals) == 3 and all("eval_rewards/accuracies" in m for m in evals)
    best = max(evals, key=lambda m: (m["eval_rewards/accuracies"], -m["step"]))
    assert summary["best_metric"] == pytest.approx(best["eval_rewards/accuracies"])
    assert summary["best_checkpoint"] == f"checkpoint-{best['step']}"
    # the policy and the frozen reference are sharded alike: each rank holds about half of both
    total = 2 * sum(p.numel() * 4 for p in AutoModelForCausalLM.from_pretrained(str(tiny_model)).parameters())
    assert all(0.4 * total <= b <= 0.6 * total for b in summary["parameter_bytes_per_rank"]), (
        summary["parameter_bytes_per_rank"], total)
    trained = load_file(str(out / "model" / "model.safetensors"))
    base = AutoModelForCausalLM.from_pretrained(str(tiny_model)).state_dict()
    assert any(not torch.equal(base[k], v) for k, v in trained.items() if k in base)
    assert not any("reference" in k for k in trained)  # the saved model is the policy alone


def test_kto_on_llamafactorys_kto_demo(tmp_path, tiny_model):
    config = _config(tmp_path, tiny_model, data=KTO_DATA, method="kto", max_steps=4, per_device_train_batch_size=4,
                     val_split_ratio=0.05, eval_steps=4, desirable_weight=1.2)
    result = cli("train", str(config), *TWO)
    assert result.returncode == 0, result.stderr[-3000:]
    out = tmp_path / "out"
    metrics = read_metrics(out)
    steps = [m for m in metrics if "loss" in m]
    assert steps[0]["kl"] == pytest.approx(0.0, abs=1e-6) and steps[0]["rewards/chosen"] == pytest.approx(0.0, abs=1e-6)
    # policy == reference: every example's loss is weight x (1 - sigmoid(0)) = weight / 2
    assert 0.5 <= steps[0]["loss"] <= 0.6 + 1e-6
    assert steps[-1]["loss"] < steps[0]["loss"]
    evals = [m for m in metrics if "eval_loss" in m]
    assert evals and "eval_kl" in evals[-1] and "eval_rewards/margins" in evals[-1]
    assert (out / "lora_model" / "adapter_model.safetensors").is_file()


def test_preview_shows_prompt_chosen_and_rejected_or_the_labelled_completion(tmp_path, tiny_model):
    for data, method, titles in ((DPO_DATA, "dpo", ["- prompt (", "- chosen (", "- rejected ("]),
                                 (KTO_DATA, "kto", ["- prompt (", "- completion (desirable) ("])):
        directory = tmp_path / method
        directory.mkdir()
        result = cli("preview", str(_config(directory, tiny_model, data=data, method=method)), "-n", "1")
        assert result.returncode == 0, result.stderr[-3000:]
        lines = result.stdout.splitlines()
        shown = [next(i for i, line in enumerate(lines) if line.startswith(title)) for title in titles]
        assert shown == sorted(shown), result.stdout  # prompt first, then each completion after it
        prompt = "\n".join(lines[shown[0] + 1:shown[1]])
        assert "[[" not in prompt and "<|im_start|>assistant" in prompt  # prompt tokens are never trained
        for title_line in shown[1:]:
            assert lines[title_line + 1].startswith("[["), result.stdout  # each completion is trained
        header = lines[shown[0] - 1]
        assert header.startswith("--- example 1 of 300:") and "trained" in header
        assert f"masking: {method}" in result.stdout and "a pair counts both" in result.stdout


PREFERENCE_AFTER = 15  # held-out four-name pairs after the demo's 30 DPO steps


def test_demo_dpo_trains_the_sft_demo_first_then_teaches_it_a_preference_it_does_not_have(tmp_path):
    """The whole demo from an empty directory: the SFT demo's model (trained first, since it is absent), then DPO
    with LoRA; held-out preference accuracy rises from near 0, and the adapter still answers: its held-out generation
    accuracy on the SFT task does not fall more than a few points below the SFT model's (an adapter that wins every
    preference while generating garbage fails here). The prompts are shown as trained, blank line visible."""
    result = cli("demo", "--method", "dpo", "--dir", str(tmp_path / "demo"), timeout=1200)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "no SFT demo model" in result.stderr and "exact-match accuracy" in result.stdout
    line = next(line for line in result.stdout.splitlines() if line.startswith("held-out preference accuracy"))
    before, after = (int(word[:-1]) for word in line.split() if word.endswith("%"))
    assert before <= 10 and after >= PREFERENCE_AFTER, line
    assert "DPO steps on 2 processes" in line
    line = next(line for line in result.stdout.splitlines() if line.startswith("held-out generation accuracy"))
    four_before, four_after, sft_before, sft_after = map(int, re.findall(r"(\d+)%", line))
    assert sft_before >= 90 and sft_after >= sft_before - 5, line
    assert four_after >= four_before, line
    assert result.stdout.count("prompt: 'reverse the words\\n\\n") == 6, result.stdout


def test_demo_refuses_a_method_it_has_no_demo_for_in_one_line(tmp_path):
    result = cli("demo", "--method", "ppo", "--dir", str(tmp_path / "demo"))
    assert result.returncode == 2
    assert result.stderr.strip() == "error: --method: 'ppo' has no demo; use sft, dpo, grpo, reward or agent"
    assert not (tmp_path / "demo").exists()
