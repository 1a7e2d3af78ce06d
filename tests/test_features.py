"""README claims, each exercised by a real run: LoRA options, schedules, evaluation strategies, aliases, full
fine-tuning, explicit resume paths, run identity on resume, the preprocessing cache, and the seed's Hub keys.
Runs are shared between assertions so the suite stays short."""

from __future__ import annotations

import json
import math

import pytest
import torch
import yaml
from safetensors import safe_open

from praisonai_accel.run_dir import checkpoints as ckpt_dir
from praisonai_accel.data import INPUTS_INDEX

from conftest import cli, cpu_env, fault_env, load_adapter, read_metrics, read_summary, write_config
from fake_servers import FakeHub

TWO = ("--cpu", "--num-processes", "2")
TOKEN = "hf_FEATUREStoken0123456789"


@pytest.fixture(scope="module")
def feature_run(tmp_path_factory, tiny_model, alpaca_file):
    """2 processes: all-linear LoRA with rsLoRA, weight decay, warmup_ratio, gradient checkpointing, epoch-wise eval and
    saves, metric_for_best_model: loss, and the seed's key names (huggingface_save, hf_model_name) pushing to a Hub."""
    directory = tmp_path_factory.mktemp("features")
    raw = yaml.safe_load(write_config(
        directory, tiny_model, alpaca_file, max_steps=-1, num_train_epochs=2, per_device_train_batch_size=4,
        lora_target_modules="all-linear", use_rslora=True, weight_decay=0.1, warmup_ratio=0.5, warmup_steps=0,
        lr_scheduler_type="linear", learning_rate=1e-2, use_gradient_checkpointing=True, val_split_ratio=0.25,
        eval_strategy="epoch", save_strategy="epoch", load_best_model_at_end=True, metric_for_best_model="loss",
        logging_steps=1, dataset_prepared_path=None).read_text())
    raw.update({"huggingface_save": True, "hf_model_name": "me/features"})
    config = directory / "config.yaml"
    config.write_text(yaml.safe_dump(raw))
    with FakeHub(token=TOKEN) as hub:
        env = cpu_env(HF_ENDPOINT=hub.url, HF_HUB_OFFLINE="0", HF_HUB_DISABLE_XET="1", HF_TOKEN=TOKEN)
        result = cli("train", str(config), *TWO, env=env)
        commits = hub.of_kind("commit")
    assert result.returncode == 0, result.stderr[-3000:]
    return directory / "out", result, commits


def test_lora_options_reach_the_adapter(feature_run):
    out, _, _ = feature_run
    adapter_config = json.loads((out / "lora_model" / "adapter_config.json").read_text())
    assert adapter_config["use_rslora"] is True
    suffixes = {name.rsplit(".", 1)[-1] for name in adapter_config["target_modules"]}
    assert suffixes == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}  # not lm_head


def test_weight_decay_groups_and_warmup_ratio_schedule(feature_run):
    out, _, _ = feature_run
    steps = [m for m in read_metrics(out) if "loss" in m]
    total = len(steps)
    assert total == 12  # 48 training rows / (4 x 2) per step, 2 epochs
    warmup = math.ceil(0.5 * total)
    expected = [1e-2 * s / warmup if s < warmup else 1e-2 * (total - s) / (total - warmup) for s in range(1, total + 1)]
    assert [m["learning_rate"] for m in steps] == pytest.approx(expected)
    assert all(m["grad_norm"] > 0 and m["tokens_per_second"] > 0 and 0 <= m["padding_fraction"] < 1 for m in steps)
    optimizer = torch.load(out / "checkpoint-12" / "optimizer.bin", weights_only=False)
    decays = sorted(group["weight_decay"] for group in optimizer["param_groups"])
    assert decays == [0.0, 0.1]
    decayed = next(g for g in optimizer["param_groups"] if g["weight_decay"] == 0.1)
    assert len(decayed["params"]) > 0


def test_epoch_evaluation_and_loss_as_the_best_metric(feature_run):
    out, result, _ = feature_run
    evals = [m for m in read_metrics(out) if "eval_loss" in m]
    assert [m["step"] for m in evals] == [6, 12]  # once per epoch
    summary = read_summary(out)
    best = min(evals, key=lambda m: m["eval_loss"])
    assert summary["best_metric"] == pytest.approx(best["eval_loss"])  # "loss" means the eval loss, as in transformers
    assert summary["best_checkpoint"] == f"checkpoint-{best['step']}"
    assert [p.name for p in ckpt_dir.complete_checkpoints(out)] == ["checkpoint-6", "checkpoint-12"]
    assert summary["weights_in_sync"]  # gradient checkpointing under 2-process DDP (use_reentrant false)


def test_checkpoints_hold_trainable_weights_only(feature_run):
    out, _, _ = feature_run
    with safe_open(str(out / "checkpoint-12" / "model.safetensors"), framework="pt") as handle:
        keys = list(handle.keys())
    assert keys and all("lora_" in key for key in keys)
    adapter = safe_open(str(out / "lora_model" / "adapter_model.safetensors"), framework="pt")
    assert len(keys) == len(list(adapter.keys()))


def test_seed_key_names_push_to_the_hub(feature_run):
    _, _, commits = feature_run
    assert [c["summary"] for c in commits] == ["End of training"] and commits[0]["repo"] == "me/features"


def test_preprocessing_cache_is_built_once_and_read_by_other_ranks_and_later_runs(feature_run):
    out, result, _ = feature_run
    entries = [p for p in (out / ".cache" / "preprocessed").iterdir() if p.name != INPUTS_INDEX]
    assert len(entries) == 1 and not [p for p in entries if ".tmp" in p.name]
    index = list((out / ".cache" / "preprocessed" / INPUTS_INDEX).iterdir())
    assert len(index) == 1 and json.loads(index[0].read_text())["entries"] == [entries[0].name]
    assert "data: " in result.stderr and "(cached)" not in result.stderr  # the launcher tokenized, once...
    assert "(cached)" not in (out / "logs" / "rank-1.log").read_text()  # ...for this run, and every rank read it
    assert not list((out / "logs").glob(".preprocessing-*"))  # its status file is gone with it


def test_resume_from_an_explicit_checkpoint_with_more_processes_and_refusals(tmp_path, tiny_model, alpaca_file):
    common = dict(per_device_train_batch_size=4, save_steps=2, logging_steps=1)
    first = write_config(tmp_path, tiny_model, alpaca_file, max_steps=4, **common)
    assert cli("train", str(first)).returncode == 0
    out = tmp_path / "out"
    explicit = write_config(tmp_path, tiny_model, alpaca_file, max_steps=6, resume_from_checkpoint=str(out / "checkpoint-2"),
                            **{**common, "per_device_train_batch_size": 2})
    result = cli("train", str(explicit), *TWO)  # 1 process x 4 -> 2 processes x 2: the same samples per step
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resumed from {out / 'checkpoint-2'} at step 2" in result.stderr
    assert "(cached)" in result.stderr  # a later run reads the first run's preprocessing
    assert "resuming with 2 process(es) x batch 2 (checkpoint: 1 x 4)" in result.stderr
    assert read_summary(out)["global_step"] == 6 and read_summary(out)["num_processes"] == 2
    for change, value in (("model_name", str(tmp_path / "other-model")), ("seed", 7),
                          ("dataset", [{"name": str(alpaca_file), "num_samples": 10}])):
        if change == "model_name":  # another model's folder (its config is all the refusal needs)
            (tmp_path / "other-model").mkdir(exist_ok=True)
            (tmp_path / "other-model" / "config.json").write_text((tiny_model / "config.json").read_text())
        other = write_config(tmp_path, tiny_model, alpaca_file, max_steps=8, **{**common, change: value})
        refused = cli("train", str(other), "--dry-run")
        assert refused.returncode == 2 and "holds checkpoints of another run" in refused.stderr, (change, refused.stderr)
    odd = write_config(tmp_path, tiny_model, alpaca_file, max_steps=8, **{**common, "per_device_train_batch_size": 5})
    refused = cli("train", str(odd), "--dry-run")  # 24 samples done: batch 5 x 1 process cannot continue there
    assert refused.returncode == 2 and "cannot continue at exactly that sample" in refused.stderr, refused.stderr
    assert ckpt_dir.latest_complete(out).name == "checkpoint-6"  # refusing touched nothing


def test_preprocess_preview_and_train_share_one_cache(tmp_path, tiny_model, alpaca_file):
    prepared = tmp_path / "prepared"  # dataset_prepared_path: the cache outside output_dir
    config = write_config(tmp_path, tiny_model, alpaca_file, max_steps=2, max_seq_length=40,
                          dataset_prepared_path=str(prepared))
    pre = cli("preprocess", str(config))
    assert pre.returncode == 0, pre.stderr
    assert "64 of 64 examples" in pre.stdout and f"cached in {prepared}" in pre.stdout
    preview = cli("preview", str(config), "-n", "2")
    assert preview.returncode == 0, preview.stderr
    out = preview.stdout
    assert out.count("--- example") == 2 and "[[" in out and "<|im_end|>]]" in out  # piped: brackets, not colour
    assert "trained fraction" in out and "truncated by max_seq_length" in out and "lengths (max_seq_length 40):" in out
    assert "(from the cache; training reads the same cache)" in out
    imports = tmp_path / "launcher-imports"
    train = cli("train", str(config), env=fault_env(LAUNCHER_IMPORTS=str(imports)))
    assert train.returncode == 0 and "(cached)" in train.stderr
    entries = [p for p in prepared.iterdir() if p.name != INPUTS_INDEX]
    assert len(entries) == 1 and not (tmp_path / "out" / ".cache").exists()
    # the launcher found the cache through the index preprocess wrote: no tokenizer, so no transformers import
    assert imports.read_text() == "transformers=False"


def test_lora_on_lm_head_trains_it(tmp_path, tiny_model, alpaca_file):
    """The chunked loss multiplies by the head's base weight; a LoRA on lm_head is trained through full logits."""
    config = write_config(tmp_path, tiny_model, alpaca_file, max_steps=4, learning_rate=1e-2,
                          lora_target_modules=["q_proj", "v_proj", "lm_head"])
    result = cli("train", str(config))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "lm_head is trained through peft" in result.stderr
    adapter = load_adapter(tmp_path / "out" / "lora_model")
    head_b = [v for k, v in adapter.items() if "lm_head" in k and "lora_B" in k]
    assert len(head_b) == 1 and head_b[0].abs().max() > 0


def test_a_deepspeed_config_is_refused_before_launch(tmp_path, tiny_model, alpaca_file):
    config = write_config(tmp_path, tiny_model, alpaca_file)
    deepspeed = tmp_path / "ds.yaml"
    deepspeed.write_text(yaml.safe_dump({"distributed_type": "DEEPSPEED", "num_processes": 2,
                                         "deepspeed_config": {"zero_stage": 2, "gradient_accumulation_steps": 4}}))
    result = cli("train", str(config), "--accelerate-config", str(deepspeed))
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1
    assert "DeepSpeed is not supported" in result.stderr and "--fsdp" in result.stderr
    assert not (tmp_path / "out").exists()
