"""GRPO with tools through the CLI, with real processes, on a tiny model taught to call an add tool
(praisonai_accel.demo.agent): 2 processes x B prompts give the run of 1 process x 2B (trajectories, losses, tool
metrics, adapter), SIGKILL + the same command resumes with the same trajectories and adapter, a tool that raises or
hangs is counted and the run goes on, and a bad tool definition is one line before launch."""

from __future__ import annotations

import json
import re
import signal

import pytest

from conftest import cli, read_metrics, read_summary, write_config
from test_checkpoint import TWO, start, wait_for_step
from test_grpo_runs import _adapter_diff, _steps
from test_grpo_runs import _completions as _trajectories
from test_training import workers_left

pytest.importorskip("trl")

TOOLS = '''
import time


def add(a: int, b: int) -> int:
    """Add two whole numbers.

    Args:
        a: The first number.
        b: The second number.
    """
    if a == 7:
        raise ValueError("7 is not supported")
    if a == 3:
        time.sleep(3)  # past tool_timeout: abandoned
    print("add was called")  # to the rank's log file, never the console
    return a + b


def undocumented(a: int) -> int:
    return a
'''
REWARDS = '''
def correct(completions, answer, **kwargs):
    return [float(c[-1]["content"].strip() == a) for c, a in zip(completions, answer)]


def used_a_tool(completions, **kwargs):
    return [float(any(m["role"] == "tool" for m in c)) for c in completions]
'''
AGENT = dict(method="grpo", tools=["agent_tools:add"], reward_funcs=["rewards:correct", "rewards:used_a_tool"],
             num_generations=4, max_completion_length=96, max_seq_length=160, max_prompt_length=48,
             max_tool_calling_iterations=2, tool_timeout=0.5, learning_rate=5e-3, logging_steps=1, warmup_steps=0,
             num_completions_to_print=8, lora_dropout=0.0)


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory):
    from praisonai_accel.demo.agent import make_tool_model

    return make_tool_model(tmp_path_factory.mktemp("agent") / "tool-model")


def _config(directory, model, **overrides):
    from praisonai_accel.demo.agent import add_records

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "agent_tools.py").write_text(TOOLS)
    (directory / "rewards.py").write_text(REWARDS)
    data = directory / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in add_records(64, seed=1)))
    return write_config(directory, model, data, **{**AGENT, "dataset": [{"name": str(data)}], **overrides})


def test_2_processes_x_B_give_the_trajectories_and_adapter_of_1_process_x_2B_and_failing_tools_are_counted(
        tmp_path, tool_model):
    for name, flags, batch in (("2xB", TWO, 8), ("1x2B", ("--cpu",), 16)):
        # Adam turns summation-order noise in near-zero gradients into whole steps: a small rate keeps it below 1e-5
        config = _config(tmp_path / name, tool_model, max_steps=3, per_device_train_batch_size=batch, learning_rate=1e-3)
        result = cli("train", str(config), *flags)
        assert result.returncode == 0, result.stderr[-3000:]
        assert "add was called" not in result.stdout + result.stderr
    two, one = tmp_path / "2xB" / "out", tmp_path / "1x2B" / "out"
    steps = _steps(two)
    for key in ("loss", "reward", "rewards/correct/mean", "tools/call_frequency", "tools/failure_frequency",
                "tools/mean_turns", "completions/mean_length", "completions/mean_turn_length"):
        assert max(abs(a[key] - b[key]) for a, b in zip(steps, _steps(one))) <= 1e-5, key
    assert _trajectories(two) == _trajectories(one)
    assert _adapter_diff(two, one) <= 1e-5
    # the model calls its tool; some calls fail (a = 7 raises, a = 3 hangs past tool_timeout) and the run goes on
    assert all(m["tools/call_frequency"] >= 0.4 for m in steps), steps
    assert any(m["tools/failure_frequency"] > 0 for m in steps), steps
    assert all(0 < m["completions/mean_turn_length"] < m["completions/mean_length"] for m in steps), steps
    trajectories = _trajectories(two)
    tool_results = [m["content"] for t in trajectories for m in t["completion"] if m["role"] == "tool"]
    assert any(r.isdigit() for r in tool_results), tool_results
    failures = [r for r in tool_results if "error" in r]
    assert all("not supported" in r or "did not answer within 0.5 seconds" in r for r in failures), failures
    assert "add was called" in (two / "logs" / "rank-0.log").read_text()
    assert read_summary(two)["global_step"] == 3
    # preview shows the run's rollouts as sampled: the model's turns trained, the tool results and glue not
    shown = cli("preview", str(tmp_path / "2xB" / "config.yaml"), "-n", "8")
    assert shown.returncode == 0, shown.stderr[-2000:]
    rollouts = shown.stdout.split("logged rollout(s), as sampled")[1].split("=== ")[0]
    called = [part for part in rollouts.split("- completion")[1:] if "<tool_response>" in part]
    assert called, rollouts
    for part in called:
        assert "[[<tool_call>" in part and "<tool_response>" not in "".join(re.findall(r"\[\[(.*?)\]\]", part, re.S))


def test_under_fsdp_the_ranks_roll_out_their_own_turns_and_sample_what_ddp_samples(tmp_path, tool_model):
    # each rank's rollouts take their own number of turns and tokens; FSDP2's forwards are collectives, so a rank
    # done early keeps up with the other: the first step (the same weights) samples exactly what DDP samples
    full = dict(max_steps=2, per_device_train_batch_size=8, finetune_type="full", final_model_dir="model",
                learning_rate=1e-5)
    for name, flags in (("fsdp", (*TWO, "--fsdp")), ("ddp", TWO)):
        result = cli("train", str(_config(tmp_path / name, tool_model, **full)), *flags)
        assert result.returncode == 0, result.stderr[-3000:]
    fsdp, ddp = tmp_path / "fsdp" / "out", tmp_path / "ddp" / "out"
    assert read_summary(fsdp)["distributed_type"] == "FSDP" and read_summary(fsdp)["global_step"] == 2
    first = [t for t in _trajectories(fsdp) if t["step"] == _trajectories(fsdp)[0]["step"]]
    assert first == [t for t in _trajectories(ddp) if t["step"] == first[0]["step"]]
    assert any(m["role"] == "tool" for t in first for m in t["completion"])
    a, b = _steps(fsdp)[0], _steps(ddp)[0]
    for key in ("reward", "tools/call_frequency", "tools/mean_turns", "completions/mean_length"):
        assert abs(a[key] - b[key]) <= 1e-6, key


def test_qlora_with_tools_trains_on_2_processes(tmp_path, tool_model):
    from test_qlora import bnb_env, skip_without_bitsandbytes

    skip_without_bitsandbytes()
    config = _config(tmp_path, tool_model, max_steps=2, per_device_train_batch_size=8, finetune_type="qlora",
                     learning_rate=1e-3)
    result = cli("train", str(config), *TWO, env=bnb_env())
    assert result.returncode == 0, result.stderr[-3000:]
    out = tmp_path / "out"
    steps = _steps(out)
    assert len(steps) == 2 and all(m["tools/call_frequency"] > 0 for m in steps), steps
    assert any(m["role"] == "tool" for t in _trajectories(out) for m in t["completion"])
    assert (out / "lora_model" / "adapter_model.safetensors").is_file()


def test_sigkill_then_resume_gives_the_same_trajectories_and_adapter(tmp_path, tool_model):
    exact = dict(max_steps=5, per_device_train_batch_size=8, use_gradient_checkpointing=True)
    result = cli("train", str(_config(tmp_path / "reference", tool_model, **exact)), *TWO)
    assert result.returncode == 0, result.stderr[-3000:]
    reference = tmp_path / "reference" / "out"
    config = _config(tmp_path / "killed", tool_model, save_steps=1, **exact)
    out = tmp_path / "killed" / "out"
    proc = start(config, *TWO)
    wait_for_step(out, 3, proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    assert not (out / "train_summary.json").exists(), "the run finished before it could be killed"
    assert not workers_left(config)
    result = cli("train", str(config), *TWO)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed from" in result.stderr
    assert _trajectories(out) == _trajectories(reference)
    assert [m["loss"] for m in _steps(out)] == [m["loss"] for m in _steps(reference)]
    assert _adapter_diff(out, reference) <= 1e-6


@pytest.mark.parametrize("tools, words", [
    (["agent_tools:undocumented"], "tools[0]: agent_tools:undocumented: undocumented cannot be a tool"),
    (["agent_tools:add", "agent_tools:add"], "is listed already"),
    (["agent_tools:absent"], "has no attribute 'absent'"),
    (["agent_tools"], "is not \"package.module:name\""),
])
def test_a_bad_tool_is_one_line_before_launch(tmp_path, tool_model, tools, words):
    config = _config(tmp_path, tool_model, max_steps=1, per_device_train_batch_size=4, tools=tools)
    result = cli("train", str(config), "--cpu")
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0], result.stderr
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


def test_demo_agent_teaches_a_tiny_model_to_use_its_tool_from_a_reward(tmp_path):
    result = cli("demo", "--method", "agent", "--dir", str(tmp_path / "demo"), timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    line = next(line for line in result.stdout.splitlines() if line.startswith("success on 100 held-out prompts"))
    before, after = (int(word[:-1]) for word in line.split() if word.endswith("%"))
    assert after >= before + 10, line
    steps = [m for m in read_metrics(tmp_path / "demo" / "agent_outputs") if "reward" in m]
    assert steps[-1]["reward"] > steps[0]["reward"] + 0.05 and steps[-1]["tools/call_frequency"] > 0.5, steps
    assert "Loading weights" not in result.stdout + result.stderr
