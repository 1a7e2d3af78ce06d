"""Reward models through the CLI, with real processes (the in-process proofs are test_reward.py):

- LoRA, margin column and centring on: 2 processes x B (with offload_embedding: the table in host memory, DDP told
  to leave it alone) give the adapter and score head of 1 process x 2B (without), and a run SIGKILLed mid-way
  resumes to exactly the uninterrupted 2-process run;
- full fine-tuning under --fsdp runs, evaluates eval_accuracy and keeps the best; the saved model, loaded with plain
  transformers, gives the rewards `praisonai-accel score` prints;
- GRPO with reward_funcs: [model:PATH] (a reward model that likes vowels) raises its logged reward, and the
  rewards it logged for its completions are the reward model's own on those texts; under --fsdp (2 processes)
  each rank holds only its shard of the reward model (its log says how much) and the logged rewards are still the
  model's own;
- QLoRA (4-bit base, bitsandbytes on CPU) trains the adapter and the head;
- `demo --method reward` (from an SFT demo model already in place) shows held-out accuracy before and after;
- bad input is one line and exit 2: a row without rejected (found by the launcher's preprocessing, which runs
  beside the starting workers), and before anything launches a base classifier of two labels, reward keys under another method, `score` on a model that is not a sequence classifier.
"""

from __future__ import annotations

import json
import signal

import pytest
import torch

from conftest import cli, load_adapter, read_metrics, read_summary, write_config
from test_checkpoint import TWO, assert_same_run, start, wait_for_step
from test_training import workers_left

from praisonai_accel.demo.text import demo_prompt, preference_records, task_records, write_jsonl

REWARD = dict(method="reward", max_seq_length=48, max_prompt_length=32, learning_rate=5e-3, logging_steps=1,
              warmup_steps=0, center_rewards_coefficient=0.01)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """The demo's preference pairs (commas chosen over spaces), with a margin column."""
    rows = preference_records(task_records(64, seed=2))
    for i, row in enumerate(rows):
        row["margin"] = [0.0, 0.5, 1.0][i % 3]
    return write_jsonl(rows, tmp_path_factory.mktemp("reward-data") / "pairs.jsonl")


def _config(directory, tiny_model, data, **overrides):
    directory.mkdir(parents=True, exist_ok=True)
    return write_config(directory, tiny_model, data, **{**REWARD, "dataset": [{"name": str(data)}], **overrides})


def _losses(out):
    return [m["loss"] for m in read_metrics(out) if "loss" in m]


def test_2_processes_x_B_equal_1_x_2B_and_a_sigkilled_run_resumes_exactly(tmp_path, tiny_model, pairs):
    exact = dict(max_steps=6, lora_r=8, lora_alpha=16, learning_rate=1e-3)
    runs = {}
    for name, flags, batch in (("2xB", TWO, 2), ("1x2B", ("--cpu",), 4)):
        # the two processes keep the embedding table in host memory (DDP told to leave it alone): the same run
        result = cli("train", str(_config(tmp_path / name, tiny_model, pairs, per_device_train_batch_size=batch,
                                          offload_embedding=name == "2xB", **exact)), *flags)
        assert result.returncode == 0, result.stderr[-3000:]
        assert ("kept in host memory (offload_embedding)" in result.stderr) == (name == "2xB")
        runs[name] = tmp_path / name / "out"
    a, b = (load_adapter(runs[n] / "lora_model") for n in ("2xB", "1x2B"))
    assert any("score" in k for k in a), sorted(a)  # the head trains in full and is saved with the adapter
    assert max((a[k].double() - b[k].double()).abs().max().item() for k in a) <= 1e-5
    assert max(abs(x - y) for x, y in zip(_losses(runs["2xB"]), _losses(runs["1x2B"]))) <= 1e-5
    first = read_metrics(runs["2xB"])[0]
    assert {"accuracy", "margin", "mean_reward", "rewards/chosen", "rewards/rejected"} <= first.keys()
    card = (runs["2xB"] / "lora_model" / "README.md").read_text()
    assert "reward model" in card and "pipeline_tag: text-classification" in card
    # the adapter (its head in modules_to_save) and its merge into a plain sequence classifier score alike
    merged = tmp_path / "merged"
    result = cli("merge", str(runs["1x2B"]), "--to", str(merged))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "ForSequenceClassification" in json.loads((merged / "config.json").read_text())["architectures"][0]
    texts = ("--prompt", "reverse the words: cy ada", "--completion", "ada, cy", "--prompt", "reverse the words: cy ada",
             "--completion", "ada cy")
    scores = [cli("score", str(d), *texts) for d in (runs["1x2B"] / "lora_model", merged)]
    assert all(r.returncode == 0 for r in scores), [r.stderr[-2000:] for r in scores]
    assert [float(x) for x in scores[0].stdout.split()] == pytest.approx([float(x) for x in scores[1].stdout.split()],
                                                                         abs=1e-4)

    config = _config(tmp_path / "killed", tiny_model, pairs, per_device_train_batch_size=2, save_steps=1,
                     offload_embedding=True, **exact)
    out = tmp_path / "killed" / "out"
    proc = start(config, *TWO)
    wait_for_step(out, 3, proc, timeout=300)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    assert not (out / "train_summary.json").exists(), "the run finished before it could be killed"
    assert not workers_left(config)
    result = cli("train", str(config), *TWO)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed from" in result.stderr
    assert_same_run(out, runs["2xB"], tol=1e-6)


def test_full_fine_tuning_under_fsdp_and_score_prints_what_transformers_gives(tmp_path, tiny_model, pairs):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    config = _config(tmp_path, tiny_model, pairs, finetune_type="full", final_model_dir="model", max_steps=4,
                     per_device_train_batch_size=2, learning_rate=1e-3, val_split_ratio=0.1, eval_steps=2,
                     save_steps=2, metric_for_best_model="eval_accuracy", greater_is_better=True)
    result = cli("train", str(config), *TWO, "--fsdp")
    assert result.returncode == 0, result.stderr[-3000:]
    out = tmp_path / "out"
    summary = read_summary(out)
    assert summary["distributed_type"] == "FSDP" and summary["weights_in_sync"]
    evals = [m for m in read_metrics(out) if "eval_loss" in m]
    assert len(evals) == 2 and all("eval_accuracy" in m for m in evals)
    best = max(evals, key=lambda m: (m["eval_accuracy"], -m["step"]))
    assert summary["best_metric"] == pytest.approx(best["eval_accuracy"])

    texts = [("reverse the words: ada bob", "bob, ada"), ("reverse the words: ada bob", "bob ada")]
    args = [a for p, c in texts for a in ("--prompt", p, "--completion", c)]
    scored = cli("score", str(out / "model"), *args)
    assert scored.returncode == 0, scored.stderr[-3000:]
    printed = [float(line) for line in scored.stdout.split()]
    model = AutoModelForSequenceClassification.from_pretrained(str(out / "model"))
    tokenizer = AutoTokenizer.from_pretrained(str(out / "model"))
    assert model.config.num_labels == 1 and model.config.pad_token_id == tokenizer.pad_token_id
    expected = []
    for prompt, completion in texts:
        messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
        ids = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, return_tensors="pt")
        with torch.no_grad():
            expected.append(model(**ids).logits[0, 0].item())
    assert printed == pytest.approx(expected, abs=1e-5)
    assert printed[0] != printed[1]

    listed = tmp_path / "texts.jsonl"
    listed.write_text("".join(json.dumps({"prompt": p, "completion": c}) + "\n" for p, c in texts))
    from_file = cli("score", str(out), "--file", str(listed))  # the output_dir finds its final model
    assert from_file.returncode == 0, from_file.stderr[-3000:]
    assert [float(line) for line in from_file.stdout.split()] == printed


def _grpo_with_vowels(directory, tiny_model, *flags, **overrides):
    """A GRPO run whose reward is a reward model that likes vowels; (its output_dir, the reward model)."""
    from test_reward import vowel_reward_model

    vowel_reward_model(tiny_model, directory / "vowels")
    rows = [{"prompt": demo_prompt(r)} for r in task_records(48, seed=0)]
    data = write_jsonl(rows, directory / "prompts.jsonl")
    config = write_config(directory, tiny_model, data, **{
        **dict(method="grpo", reward_funcs=["model:vowels"], dataset=[{"name": str(data)}], num_generations=4,
               max_completion_length=12, max_seq_length=64, max_prompt_length=32, per_device_train_batch_size=8,
               finetune_type="full", final_model_dir="model", learning_rate=1e-2, logging_steps=1, warmup_steps=0,
               num_completions_to_print=8), **overrides})
    result = cli("train", str(config), *flags)
    assert result.returncode == 0, result.stderr[-3000:]
    return directory / "out", directory / "vowels"


def _logged_rewards_are_the_models_own(out, reward_model):
    """The rewards of the completions rank 0 logged equal the reward model's forward on their texts, in this process,
    a plain copy."""
    from praisonai_accel.methods.reward import load_scorer, score_texts

    logged = [json.loads(line) for line in (out / "logs" / "completions.jsonl").read_text().splitlines()]
    model, tokenizer = load_scorer(reward_model)
    again = score_texts(model, tokenizer, [(r["prompt"], [{"role": "assistant", "content": r["completion"]}])
                                           for r in logged])
    assert logged and [r["reward"] for r in logged] == pytest.approx(again, abs=1e-5)
    assert len(set(again)) > 1  # completions that differ, scored differently


def test_grpo_with_a_reward_model_raises_its_reward_and_logs_the_models_own_rewards(tmp_path, tiny_model):
    out, reward_model = _grpo_with_vowels(tmp_path, tiny_model, "--cpu", max_steps=14, num_completions_to_print=4)
    steps = [m for m in read_metrics(out) if "loss" in m]
    rewards = [m["reward"] for m in steps]
    assert "rewards/vowels/mean" in steps[0], sorted(steps[0])
    assert sum(rewards[-4:]) / 4 > sum(rewards[:4]) / 4 + 0.1, rewards
    _logged_rewards_are_the_models_own(out, reward_model)


def test_under_fsdp_the_reward_model_is_sharded_and_logs_its_own_rewards(tmp_path, tiny_model):
    """Each rank holds part of the reward model (its log says how much: all of it for a full copy), and the rewards
    logged are still the model's own."""
    import re

    out, reward_model = _grpo_with_vowels(tmp_path, tiny_model, *TWO, "--fsdp", max_steps=2)
    assert read_summary(out)["distributed_type"] == "FSDP"
    assert all("rewards/vowels/mean" in m for m in read_metrics(out) if "loss" in m)
    held = []
    for rank in (0, 1):
        log = (out / "logs" / f"rank-{rank}.log").read_text()
        found = re.search(r"reward model vowels: sharded by FSDP2 across 2 ranks; this rank holds (\d+) of its (\d+) "
                          r"parameters", log)
        assert found, log[-3000:]
        held.append(tuple(int(x) for x in found.groups()))
    (mine, total), (theirs, total_1) = held
    assert total == total_1 == mine + theirs and 0 < mine < total, held
    _logged_rewards_are_the_models_own(out, reward_model)


def test_qlora_trains_the_adapter_and_the_score_head(tmp_path, tiny_model, pairs):
    import subprocess
    import sys

    from test_qlora import bnb_env

    if subprocess.run([sys.executable, "-c", "import bitsandbytes"], env=bnb_env(), capture_output=True).returncode:
        pytest.skip("bitsandbytes is not installed (pip install --target .bnb bitsandbytes)")
    config = _config(tmp_path, tiny_model, pairs, finetune_type="qlora", max_steps=3, per_device_train_batch_size=2)
    result = cli("train", str(config), "--cpu", env=bnb_env())
    assert result.returncode == 0, result.stderr[-3000:]
    adapter = load_adapter(tmp_path / "out" / "lora_model")
    assert any("score" in k for k in adapter) and any("lora_B" in k and v.abs().max() > 0 for k, v in adapter.items())
    assert len(_losses(tmp_path / "out")) == 3


def test_demo_reward_trains_a_reward_model_and_shows_held_out_accuracy(tmp_path, tiny_model):
    import shutil

    from praisonai_accel.commands._demo import DEMO_MARKER

    shutil.copytree(tiny_model, tmp_path / "outputs" / "model")  # stands in for the SFT demo's model
    (tmp_path / DEMO_MARKER).write_text("")  # a folder the SFT demo ran in
    result = cli("demo", "--method", "reward", "--dir", str(tmp_path), "--steps", "12")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "training it first" not in result.stderr
    shown = result.stdout.splitlines()
    chosen, rejected = (next(x.split(":", 1)[1].split() for x in shown if x.strip().startswith(side))
                        for side in ("chosen:", "rejected:"))
    assert chosen == rejected[::-1] and chosen != rejected  # the same names, reversed or in the prompt's order
    line = next(line for line in shown if line.startswith("held-out reward accuracy"))
    before, after = (int(word.rstrip("%")) for word in line.split() if word.endswith("%"))
    # a fresh head ranks about half; learning to read the prompt takes the SFT demo's model and more steps (the demo's
    # numbers are in docs/reward_models.md; accuracy rising is tested in process, tests/test_reward.py)
    assert 25 <= before <= 75 and "after 12 steps on 2 processes" in line, line
    assert (tmp_path / "reward_outputs" / "lora_model" / "adapter_config.json").is_file()


def _one_line_exit_2(result, *words):
    assert result.returncode == 2, (result.stdout, result.stderr[-2000:])
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    for word in words:
        assert word in lines[0], lines[0]


def test_bad_input_is_one_line_and_exit_2_before_launch(tmp_path, tiny_model, pairs):
    rows = [json.loads(line) for line in pairs.read_text().splitlines()]
    del rows[3]["rejected"]
    broken = write_jsonl(rows, tmp_path / "broken.jsonl")
    result = cli("train", str(_config(tmp_path / "row", tiny_model, broken, max_steps=1)), "--cpu")
    _one_line_exit_2(result, "line 4: 'rejected' is missing")  # the launcher's preprocessing, beside the workers

    two = tmp_path / "two-labels"
    (two).mkdir()
    config = json.loads((tiny_model / "config.json").read_text())
    (two / "config.json").write_text(json.dumps({**config, "architectures": ["LlamaForSequenceClassification"],
                                                 "id2label": {"0": "no", "1": "yes"}}))
    result = cli("train", str(_config(tmp_path / "head", two, pairs, max_steps=1)), "--cpu")
    _one_line_exit_2(result, "2 labels", "a reward model has one")
    assert "launching" not in result.stderr

    result = cli("train", str(_config(tmp_path / "keys", tiny_model, pairs, method="dpo")), "--cpu")
    _one_line_exit_2(result, "center_rewards_coefficient: belongs to method reward")

    result = cli("score", str(tiny_model), "--prompt", "a", "--completion", "b")
    _one_line_exit_2(result, "not a sequence classifier")
