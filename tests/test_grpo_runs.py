"""GRPO through the CLI, with real processes (the in-process proofs are test_grpo.py):

- 2 processes x B prompts give the losses, the logged completions and the adapter of 1 process x 2B, and of 1 process
  x B with accumulation 2 (each prompt's group samples from its own generator, so the completions are the same), and
  kl is 0 at step 0 with beta > 0;
- the reward rises on 2 processes under FSDP2, fully fine-tuned (generation through the sharded module, the ranks
  stopping together; the frozen reference copy sharded too), and evaluation rolls out held-out prompts (eval_reward);
- SIGKILL mid-run, then the same command: the resumed run samples the same completions (completions.jsonl) and ends
  with the adapter of the uninterrupted run; with num_iterations 2 from a checkpoint taken mid-way through a
  generated batch's two steps (its rollout saved with it);
- use_vllm is refused before launch, with one line;
- a reward function that raises stops a 2-process run with one line and the worker's exit code, 3.
"""

from __future__ import annotations

import json
import re
import signal

import pytest

from conftest import cli, load_adapter, read_metrics, read_summary, write_config
from test_checkpoint import TWO, start, wait_for_step
from test_training import workers_left

REWARDS = '''
def short(completions, **kwargs):
    return [-len(c[0]["content"]) / 10 for c in completions]


def letters(completions, **kwargs):
    return [sum(ch in "aeiou" for ch in c[0]["content"]) / 4 for c in completions]


def reversed_words(completions, answer, **kwargs):
    return [float(c[0]["content"].strip() == a) for c, a in zip(completions, answer)]


def picky(completions, answer, **kwargs):
    raise ValueError("cannot score this")
'''
GRPO = dict(method="grpo", reward_funcs=["rewards:short", "rewards:reversed_words"], num_generations=4,
            max_completion_length=8, max_seq_length=64, max_prompt_length=32, beta=0.05, learning_rate=2e-2,
            logging_steps=1, warmup_steps=0, num_completions_to_print=4, lora_dropout=0.0)


def _data(directory, count=48):
    from praisonai_accel.demo.text import demo_prompt, task_records

    rows = [{"prompt": demo_prompt(r), "answer": r["output"]} for r in task_records(count, seed=0)]
    path = directory / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _config(directory, tiny_model, **overrides):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "rewards.py").write_text(REWARDS)  # next to config.yaml, where reward_funcs' modules are looked for
    data = _data(directory)
    return write_config(directory, tiny_model, data, **{**GRPO, "dataset": [{"name": str(data)}], **overrides})


def _completions(out):
    return [json.loads(line) for line in (out / "logs" / "completions.jsonl").read_text().splitlines()]


def _steps(out):
    return [m for m in read_metrics(out) if "loss" in m]


def _adapter_diff(a, b):
    wa, wb = load_adapter(a / "lora_model"), load_adapter(b / "lora_model")
    return max((wa[k].double() - wb[k].double()).abs().max().item() for k in wa)


def test_2_processes_x_B_prompts_give_the_run_of_1_process_x_2B(tmp_path, tiny_model):
    runs = (("2xB", TWO, 8, 1), ("1x2B", ("--cpu",), 16, 1), ("1xBx2", ("--cpu",), 8, 2))  # the last: accumulation 2
    for name, flags, batch, accumulation in runs:
        config = _config(tmp_path / name, tiny_model, max_steps=3, per_device_train_batch_size=batch,
                         gradient_accumulation_steps=accumulation, learning_rate=5e-3)
        result = cli("train", str(config), *flags)
        assert result.returncode == 0, result.stderr[-3000:]
    two = tmp_path / "2xB" / "out"
    steps2 = _steps(two)
    assert steps2[0]["kl"] == 0.0 and steps2[-1]["kl"] > 0  # the reference is the adapter disabled
    for other in ("1x2B", "1xBx2"):
        out = tmp_path / other / "out"
        for key in ("loss", "reward", "reward_std", "completions/mean_length", "rewards/short/mean"):
            assert max(abs(a[key] - b[key]) for a, b in zip(steps2, _steps(out))) <= 1e-5, (other, key)
        # rank 0's first prompts are the single process's first: the same completions, the same rewards
        assert [(c["step"], c["completion"]) for c in _completions(two)] == \
            [(c["step"], c["completion"]) for c in _completions(out)]
        assert _adapter_diff(two, out) <= 1e-5, other


def test_the_reward_rises_on_2_processes_under_fsdp_and_evaluation_rolls_out(tmp_path, tiny_model):
    config = _config(tmp_path, tiny_model, max_steps=16, per_device_train_batch_size=8, val_split_ratio=0.1,
                     eval_strategy="steps", eval_steps=8, reward_funcs=["rewards:letters"], max_completion_length=12,
                     finetune_type="full", final_model_dir="model", learning_rate=1e-2)
    result = cli("train", str(config), *TWO, "--fsdp")
    assert result.returncode == 0, result.stderr[-3000:]
    out = tmp_path / "out"
    assert read_summary(out)["distributed_type"] == "FSDP"
    rewards = [m["reward"] for m in _steps(out)]
    assert sum(rewards[-4:]) / 4 > sum(rewards[:4]) / 4 + 0.5, rewards
    evals = [m for m in read_metrics(out) if "eval_loss" in m]
    assert len(evals) == 2 and evals[-1]["eval_reward"] > evals[0]["eval_reward"]  # held-out prompts, rolled out
    assert all("eval_completions/mean_length" in m for m in evals)
    report = cli("report", str(out))
    rows = {line.split("  ")[0]: line.split("  ", 1)[1].strip() for line in report.stdout.splitlines()}
    assert report.returncode == 0 and rows["reward (first -> last)"] == f"{rewards[0]:.4f} -> {rewards[-1]:.4f}", report.stdout
    lengths = [m["completions/mean_length"] for m in _steps(out)]  # the method's other headline metrics, after it
    assert rows["rewards/letters/mean (first -> last)"].startswith(f"{_steps(out)[0]['rewards/letters/mean']:.4f} -> ")
    assert rows["completions/mean_length (first -> last)"] == f"{lengths[0]:.4f} -> {lengths[-1]:.4f}"


@pytest.mark.parametrize("num_iterations", [1, 2])
def test_sigkill_then_resume_samples_the_same_completions_and_ends_with_the_same_adapter(tmp_path, tiny_model,
                                                                                        num_iterations):
    # gradient checkpointing on: generation still runs with the KV cache (eval mode), and training recomputes
    exact = dict(max_steps=8, per_device_train_batch_size=8, num_completions_to_print=8,
                 use_gradient_checkpointing=True, num_iterations=num_iterations)
    save_steps = 1 if num_iterations == 1 else 3  # 3: mid-way through the batch generated at step 2
    result = cli("train", str(_config(tmp_path / "reference", tiny_model, **exact)), *TWO)
    assert result.returncode == 0, result.stderr[-3000:]
    reference = tmp_path / "reference" / "out"
    if num_iterations > 1:  # a generated batch's second step: the policy has moved away from the one that sampled
        clipped = [m["clip_ratio"] for m in _steps(reference)]
        assert clipped[0::2] == [0.0] * 4 and any(c > 0 for c in clipped[1::2]), clipped

    config = _config(tmp_path / "killed", tiny_model, save_steps=save_steps, **exact)
    out = tmp_path / "killed" / "out"
    proc = start(config, *TWO)
    wait_for_step(out, 4, proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    assert not (out / "train_summary.json").exists(), "the run finished before it could be killed"
    assert not workers_left(config)
    if num_iterations > 1:
        manifest = json.loads((out / "checkpoint-3" / "MANIFEST.json").read_text())
        assert {"rollout_0.safetensors", "rollout_1.safetensors"} <= set(json.dumps(manifest).split('"'))
    result = cli("train", str(config), *TWO)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed from" in result.stderr and (num_iterations == 1 or "checkpoint-3 at step 3" in result.stderr)
    assert _completions(out) == _completions(reference)
    assert [m["loss"] for m in _steps(out)] == [m["loss"] for m in _steps(reference)]
    assert _adapter_diff(out, reference) <= 1e-6


def test_use_vllm_is_refused_before_launch(tmp_path, tiny_model):
    for key, value, words in (("use_vllm", True, "use_vllm:"),):
        config = _config(tmp_path / key, tiny_model, max_steps=1, per_device_train_batch_size=4, **{key: value})
        result = cli("train", str(config), "--cpu")
        assert result.returncode == 2, result.stderr[-2000:]
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0], result.stderr
        assert not (tmp_path / key / "out" / "metrics.jsonl").exists()


def test_demo_grpo_trains_the_sft_demo_first_then_teaches_it_to_reverse_four_names_from_a_reward(tmp_path):
    """The whole demo from an empty directory: the SFT demo's model (2 or 3 names; trained first, since it is absent)
    answers four-name prompts with three names; GRPO with 2 processes, rewarded for names in place, teaches it."""
    result = cli("demo", "--method", "grpo", "--dir", str(tmp_path / "demo"), timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "no SFT demo model" in result.stderr
    line = next(line for line in result.stdout.splitlines()
                if line.startswith("exact-match accuracy on 100 held-out four"))
    before, after = (int(word[:-1]) for word in line.split() if word.endswith("%"))
    assert before == 0 and after >= 15, line
    assert "after 150 GRPO steps on 2 processes" in line
    rewards = [m["reward"] for m in read_metrics(tmp_path / "demo" / "grpo_outputs") if "reward" in m]
    assert rewards[-1] > rewards[0] + 0.1, rewards


def test_a_reward_function_that_raises_exits_3_through_the_cli_on_2_processes(tmp_path, tiny_model):
    """The worker exits 3 (worker/main.py's table); torchrun would make it 1: the CLI passes the worker's code on."""
    config = _config(tmp_path, tiny_model, max_steps=2, per_device_train_batch_size=8, reward_funcs=["rewards:picky"])
    result = cli("train", str(config), *TWO)
    assert result.returncode == 3, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error")]
    assert len(errors) == 1, result.stderr
    assert re.match(r"error: rank [01]: reward function rewards:picky failed on ", errors[0]), result.stderr
    assert "ValueError: cannot score this" in errors[0] and "Traceback" not in result.stderr
