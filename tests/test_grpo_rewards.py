"""GRPO's reward functions: loading and checking before launch (one line, exit 2, nothing launched), the call as
TRL 1.16's GRPOTrainer._calculate_rewards makes it (compared by calling TRL's method on a stub), None and weights,
RewardError naming the function and the row, and the built-ins."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from typer.testing import CliRunner

from conftest import cli
from praisonai_accel.cli import app
from praisonai_accel.config import ConfigError, load_config, parse_config
from praisonai_accel.data import DataError
from praisonai_accel.methods import grpo_loss as gl
from praisonai_accel.methods import rewards as rw


def _grpo(**keys):
    return parse_config({"model_name": "org/model", "dataset": "d.jsonl", "method": "grpo", "num_generations": 2, **keys})


def _write(tmp_path: Path, module_source: str | None = None, **keys) -> tuple[Path, str]:
    """config.yaml (and a reward module with a fresh name next to it); returns the config and the module's name."""
    module = f"rewards_{uuid.uuid4().hex[:8]}"
    if module_source is not None:
        (tmp_path / f"{module}.py").write_text(module_source)
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"prompt": "2+2?", "answer": "4"}) + "\n")
    keys = {k: [v.format(module=module) for v in val] if k == "reward_funcs" else val for k, val in keys.items()}
    config = {"model_name": "org/model", "dataset": [{"name": str(data)}], "method": "grpo", "num_generations": 2,
              "output_dir": str(tmp_path / "out"), **keys}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path, module


GOOD = "def reward(prompts, completions, **kwargs):\n    return [float(len(c)) for c in completions]\n"

BAD_CONFIGS = [  # (module source, reward_funcs, the line after "error: ")
    (None, ["no module here"], "{config}: reward_funcs[0]: 'no module here' is neither a built-in (exact_match, format), "
                               "\"package.module:function\" nor a reward model \"model:PATH\""),
    (None, ["{module}:reward"], "reward_funcs[0]: no module named '{module}' (looked in {dir} (the config's directory) "
                                "and sys.path); put {module}.py next to the config file or install it"),
    ("import not_installed_anywhere_xyz\n", ["{module}:reward"],
     "reward_funcs[0]: module '{module}' cannot be imported: No module named 'not_installed_anywhere_xyz'"),
    ("def reward(:\n", ["{module}:reward"], "reward_funcs[0]: module '{module}' cannot be imported: SyntaxError: "),
    ("raise RuntimeError('needs an API key\\nsecond line')\n", ["{module}:reward"],
     "reward_funcs[0]: module '{module}' cannot be imported: RuntimeError: needs an API key"),
    (GOOD, ["exact_match", "{module}:rewrad"], "reward_funcs[1]: module '{module}' ({dir}/{module}.py) has no "
                                               "attribute 'rewrad'"),
    ("reward = 3\n", ["{module}:reward"], "reward_funcs[0]: '{module}:reward' is a int, not a function"),
    ("def reward(prompts, answer):\n    return []\n", ["{module}.reward"],
     "reward_funcs[0]: {module}.reward: it does not take completions=; reward functions are called as TRL calls "
     "them: def reward(prompts, completions, **kwargs) -> list[float | None]"),
    ("def reward(completions, /, **kwargs):\n    return []\n", ["{module}:reward"],
     "reward_funcs[0]: {module}:reward: parameter 'completions' is positional-only, but reward functions are called "
     "with keywords; define it as def reward(prompts, completions, **kwargs) -> list[float | None]"),
    ("def reward(prompt, completions, **kwargs):\n    return []\n", ["{module}:reward"],
     "reward_funcs[0]: {module}:reward: it requires 'prompt', which is never passed (the batch comes as prompts=); "
     "define it as def reward(prompts, completions, **kwargs) -> list[float | None]"),
    ("def reward(prompts, completions, log_metric, **kwargs):\n    return []\n", ["{module}:reward"],
     "reward_funcs[0]: {module}:reward: it requires 'log_metric', which TRL passes but praisonai-accel does not; "
     "give it a default (None)"),
]


@pytest.mark.parametrize("source,funcs,line", BAD_CONFIGS)
def test_a_bad_reward_function_is_one_line_before_launch(tmp_path, source, funcs, line):
    config, module = _write(tmp_path, source, reward_funcs=funcs)
    result = CliRunner().invoke(app, ["train", str(config), "--cpu"])
    expected = "error: " + line.format(module=module, dir=tmp_path.resolve(), config=config)
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(expected), result.output
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("keys,line", [
    ({"reward_funcs": ["format"], "reward_format_pattern": "<think>(.*"},
     "reward_format_pattern: '<think>(.*' is not a valid regular expression: missing ), unterminated subpattern at "
     "position 7"),
    ({"reward_funcs": ["exact_match"], "reward_format_pattern": "x"},
     "reward_format_pattern: only the built-in format reward reads it; add format to reward_funcs or remove it"),
    ({"reward_funcs": ["exact_match", "format"], "reward_weights": [1.0]},
     "reward_weights: 1 weight(s) for 2 reward function(s); give one per function"),
])
def test_reward_keys_are_checked_with_the_config(tmp_path, keys, line):
    config, _ = _write(tmp_path, **keys)
    result = CliRunner().invoke(app, ["train", str(config), "--cpu"])
    assert result.exit_code == 2
    assert result.output.strip() == f"error: {config}: {line}"
    assert not (tmp_path / "out").exists()


def test_the_real_cli_refuses_a_bad_reward_and_imports_a_good_one_next_to_the_config(tmp_path):
    """python -m praisonai_accel, from another directory: the module next to config.yaml imports (dry run: nothing
    launched), and a missing function is one line on stderr, exit 2, no output_dir."""
    env = {**__import__("os").environ, "CUDA_VISIBLE_DEVICES": ""}
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    good_dir, bad_dir = tmp_path / "good", tmp_path / "bad"
    good_dir.mkdir(), bad_dir.mkdir()
    good, _ = _write(good_dir, GOOD, reward_funcs=["{module}:reward", "exact_match"])
    result = subprocess.run([sys.executable, "-m", "praisonai_accel", "train", str(good), "--cpu", "--dry-run"],
                            cwd=elsewhere, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "# launch command" in result.stdout
    bad, module = _write(bad_dir, GOOD, reward_funcs=["{module}:missing"])
    result = subprocess.run([sys.executable, "-m", "praisonai_accel", "train", str(bad), "--cpu"],
                            cwd=elsewhere, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"error: reward_funcs[0]: module '{module}' ({bad_dir.resolve()}/{module}.py) has no attribute 'missing'"]
    assert not (bad_dir / "out").exists()


def test_the_worker_finds_the_module_next_to_the_config(tmp_path, monkeypatch):
    """load_config records the config's directory; load_reward_functions looks there first, whatever the cwd."""
    config, module = _write(tmp_path, GOOD, reward_funcs=["{module}:reward", "format"], reward_weights=[0.5, 2.0])
    monkeypatch.chdir("/")
    path_before = list(sys.path)
    functions = rw.load_reward_functions(load_config(config))
    assert sys.path == path_before  # the config's directory is searched for the reward module only
    assert [f.name for f in functions] == [f"{module}:reward", "format"]
    assert [f.weight for f in functions] == [0.5, 2.0]
    assert functions[0].func(prompts=["p"], completions=["abc"]) == [3.0]
    assert functions[0].short_name == "reward"
    with pytest.raises(ConfigError, match="no module named"):
        rw.load_reward_functions(_grpo(reward_funcs=[f"{module}_absent:reward"]))


# ---------------------------------------------------------------- the call, against TRL's

def _recording(name: str, seen: list, values):
    def func(prompts, completions, **kwargs):
        seen.append({"prompts": prompts, "completions": completions, **kwargs})
        return list(values)

    func.__name__ = name
    return func


def _trl_rewards(funcs, rows: list[dict], prompts, completions, completion_ids, monkeypatch):
    """TRL's own _calculate_rewards on a stub trainer (one process: its gather is the identity)."""
    from trl.trainer import grpo_trainer
    from trl import GRPOTrainer

    monkeypatch.setattr(grpo_trainer, "gather", lambda t: t)
    monkeypatch.setattr(grpo_trainer, "logger", logging.getLogger("trl-under-test"))  # accelerate's needs its state
    stub = SimpleNamespace(
        accelerator=SimpleNamespace(device=torch.device("cpu"), is_main_process=True), reward_funcs=funcs,
        reward_processing_classes=[None] * len(funcs), reward_func_names=[f.__name__ for f in funcs],
        state=SimpleNamespace(global_step=3), args=SimpleNamespace(report_to=[]), environments=None,
        _log_completion_extra=lambda *a: None, _log_metric=lambda *a: None)
    return GRPOTrainer._calculate_rewards(stub, rows, prompts, completions, completion_ids)


@pytest.mark.parametrize("conversational", [False, True])
def test_score_calls_as_trl_and_gives_its_rewards(conversational, monkeypatch):
    """Text and conversational prompts; a prompt's row repeated per generation; None from one function on some
    completions, from both on one: the keywords each function gets and the [N, F] rewards equal TRL's, and the
    weighted totals equal TRL's nansum (a completion no function scored: NaN)."""
    G = 2
    rows = [{"prompt": "Reverse: a b", "answer": "b a", "level": 1}, {"prompt": "Reverse: c d e", "answer": "e d c", "level": 2}]
    if conversational:
        rows = [{**r, "prompt": [{"role": "user", "content": r["prompt"]}]} for r in rows]
    inputs = [dict(r) for r in rows for _ in range(G)]
    texts = ["b a", "a b", "<answer>e d c</answer>", "e c d"]
    completions = [[{"role": "assistant", "content": t}] for t in texts] if conversational else texts
    ids = [[5, 6], [6, 5], [1, 2, 3], [3, 1, 2]]
    prompts = [x["prompt"] for x in inputs]
    first = [1.0, None, 0.5, None]
    second = [None, 2, None, None]
    trl_seen, our_seen = [], []
    trl = _trl_rewards([_recording("first", trl_seen, first), _recording("second", trl_seen, second)], inputs,
                       prompts, completions, ids, monkeypatch)
    functions = [rw._checked(name, _recording(name, our_seen, values), weight, name)
                 for name, values, weight in (("first", first, 2.0), ("second", second, 0.5))]
    columns = {k: [x[k] for x in inputs] for k in inputs[0]}
    ours = rw.score(functions, prompts, completions, ids, columns, rows=[0, 0, 1, 1],
                    trainer_state=SimpleNamespace(global_step=3))
    torch.testing.assert_close(ours, trl, equal_nan=True)
    assert len(trl_seen) == len(our_seen) == 2
    for theirs, mine in zip(trl_seen, our_seen):
        theirs = {k: v for k, v in theirs.items() if k not in rw.NOT_PASSED}
        assert mine == theirs
    totals = gl.weighted_rewards(ours, torch.tensor([2.0, 0.5]))
    trl_totals = (trl * torch.tensor([2.0, 0.5]).unsqueeze(0)).nansum(dim=1)
    trl_totals[torch.isnan(trl).all(dim=1)] = torch.nan
    torch.testing.assert_close(totals, trl_totals, equal_nan=True)
    assert torch.isnan(totals[3]) and totals[1].item() == 1.0


def test_a_function_without_kwargs_gets_only_what_it_names():
    def reward(prompts, completions, answer):
        return [1.0 if c == a else 0.0 for c, a in zip(completions, answer)]

    function = rw._checked("r", reward, 1.0, "r")
    assert function.columns == ("answer",)
    out = rw.score([function], ["p", "p"], ["x", "y"], [[1], [2]], {"answer": ["x", "x"], "other": [0, 0]}, [0, 0])
    assert out[:, 0].tolist() == [1.0, 0.0]


# ---------------------------------------------------------------- RewardError

def _one(func):
    return [rw._checked("rewards:" + func.__name__, func, 1.0, "x")]


def test_a_raising_function_names_the_function_and_the_row():
    def divide(prompts, completions, **kwargs):
        return [1.0 / len(c) for c in completions]

    with pytest.raises(rw.RewardError) as error:
        rw.score(_one(divide), ["p"] * 4, ["ab", "a", "", "abc"], [[1]] * 4, {}, rows=[10, 10, 11, 11])
    assert str(error.value) == "reward function rewards:divide failed on row 11: ZeroDivisionError: float division by zero"
    assert "\n" not in str(error.value)


def test_a_failure_no_row_causes_alone_names_the_batch():
    def needs_two(prompts, completions, **kwargs):
        if len(completions) > 1:
            raise ValueError("batch too large\nmore detail")
        return [0.0]

    with pytest.raises(rw.RewardError) as error:
        rw.score(_one(needs_two), ["p"] * 2, ["a", "b"], [[1]] * 2, {}, rows=["line 3", "line 3"])
    assert str(error.value) == ("reward function rewards:needs_two failed on the batch of line 3 and 1 other "
                                "completion(s) (no completion alone fails): ValueError: batch too large")


@pytest.mark.parametrize("returned,message", [
    ([1.0], "returned 1 reward(s) for 2 completions (row 4 and the rest of its batch); return one per completion"),
    ([1.0, "good"], "returned 'good' (str) for row 5; return a float or None per completion"),
    ([1.0, [2.0]], "returned [2.0] (list) for row 5; return a float or None per completion"),
    (0.5, "returned 0.5 (float) for row 4 and the rest of its batch; return a list with one float (or None) per "
          "completion"),
    ([1.0, float("inf")], "returned inf for row 5; return a finite float, or None where the function does not apply"),
    ([float("nan"), 1.0], "returned nan for row 4; return a finite float, or None where the function does not apply"),
])
def test_a_wrong_return_is_one_line(returned, message):
    def bad(prompts, completions, **kwargs):
        return returned

    with pytest.raises(rw.RewardError) as error:
        rw.score(_one(bad), ["p", "q"], ["a", "b"], [[1], [2]], {}, rows=[4, 5])
    assert str(error.value) == f"reward function rewards:bad {message}"


def test_numbers_of_any_kind_and_async_functions_are_accepted():
    import numpy as np

    async def coroutine(prompts, completions, **kwargs):
        return [np.float32(0.25), torch.tensor(2.0), True, None]

    out = rw.score(_one(coroutine), ["p"] * 4, ["a"] * 4, [[1]] * 4, {}, rows=[0, 0, 1, 1])
    assert out[:3, 0].tolist() == [0.25, 2.0, 1.0] and torch.isnan(out[3, 0])


def test_the_worker_exits_with_the_reward_failure_code(tmp_path, capsys, monkeypatch):
    from praisonai_accel.runtime.distributed import DistEnv
    from praisonai_accel.logs import FILE_ONLY
    from praisonai_accel.worker import main

    monkeypatch.setattr(FILE_ONLY, "handlers", [logging.NullHandler()])  # a worker's goes to its rank's log file

    env = DistEnv.from_environ()
    from praisonai_accel.config import parse_config
    from praisonai_accel.methods.grpo import REWARD_FAILED_EXIT_CODE

    config = parse_config({"model_name": "m", "dataset": "d.jsonl", "method": "grpo", "reward_funcs": ["exact_match"],
                           "output_dir": str(tmp_path)})
    (tmp_path / "logs").mkdir()
    code = main._failed(rw.RewardError("reward function r failed on row 2: KeyError: 'x'"), env, config, None)
    assert code == REWARD_FAILED_EXIT_CODE not in (main.FAILED_EXIT_CODE, main.BAD_INPUT_EXIT_CODE)
    assert capsys.readouterr().err == "error: reward function r failed on row 2: KeyError: 'x'\n"
    # another rank failing in the same attempt only logs: the job says it once
    assert main._failed(rw.RewardError("reward function r failed on row 9: KeyError: 'x'"), env, config, None) == 3
    assert capsys.readouterr().err == ""


def test_a_reward_failure_on_several_ranks_names_the_rank_whose_batch_held_the_row(tmp_path, capsys, monkeypatch):
    from praisonai_accel.runtime.distributed import DistEnv
    from praisonai_accel.logs import FILE_ONLY
    from praisonai_accel.worker import main

    monkeypatch.setattr(FILE_ONLY, "handlers", [logging.NullHandler()])
    monkeypatch.setattr(main, "_close_process_group", lambda wait_for_others: None)  # no process group here
    config = parse_config({"model_name": "m", "method": "grpo", "reward_funcs": ["exact_match"],
                           "dataset": [{"name": str(tmp_path / "d.jsonl")}], "output_dir": str(tmp_path)})
    (tmp_path / "logs").mkdir()
    error = rw.RewardError("reward function r failed on data.jsonl line 7: KeyError: 'x'")
    assert main._failed(error, DistEnv(rank=1, local_rank=1, world_size=2), config, None) == 3
    assert capsys.readouterr().err == "error: rank 1: reward function r failed on data.jsonl line 7: KeyError: 'x'\n"


# ---------------------------------------------------------------- built-ins

@pytest.mark.parametrize("completion,answer,expected", [
    ("  42\n", "42", 1.0),
    ("42", " 42 ", 1.0),
    ("42", 42, 1.0),
    ("4 2", "42", 0.0),
    ("<think>maybe 41</think>\n<answer> 42 </answer>", "42", 1.0),
    ("<answer>41</answer> then <answer>42</answer>", "42", 1.0),  # the last block is the answer
    ("<answer>41</answer>", "42", 0.0),
    ("The answer is 42", "42", 0.0),
    ("", "", 1.0),
    ([{"role": "assistant", "content": "<answer>b a</answer>"}], "b a", 1.0),
    ([{"role": "assistant", "content": [{"type": "text", "text": "42"}]}], "42", 1.0),
    ("42", None, None),
])
def test_exact_match(completion, answer, expected):
    assert rw.exact_match(prompts=["p"], completions=[completion], answer=[answer]) == [expected]


@pytest.mark.parametrize("completion,expected", [
    ("<think>\nstep 1\nstep 2\n</think>\n<answer>42</answer>", 1.0),
    ("<think>x</think><answer>42</answer>", 1.0),
    ("<think>x</think><answer>42</answer>\n", 1.0),
    ("Sure! <think>x</think><answer>42</answer>", 0.0),
    ("<think>x</think>", 0.0),
    ("<answer>42</answer>", 0.0),
    ([{"role": "assistant", "content": "<think>x</think> <answer>y</answer>"}], 1.0),
])
def test_format_with_the_default_pattern(completion, expected):
    (function,) = rw.load_reward_functions(_grpo(reward_funcs=["format"]))
    assert function.func(prompts=["p"], completions=[completion]) == [expected]


def test_format_with_a_pattern_of_ones_own():
    (function,) = rw.load_reward_functions(_grpo(reward_funcs=["format"], reward_format_pattern=r"\d+$"))
    assert function.func(completions=["123", "12a", "a12"]) == [1.0, 0.0, 0.0]


def test_a_column_a_reward_reads_must_be_in_the_dataset():
    functions = rw.load_reward_functions(_grpo(reward_funcs=["format", "exact_match"]))
    rw.check_columns(functions, ["prompt", "answer"])
    with pytest.raises(DataError) as error:
        rw.check_columns(functions, ["prompt", "solution"], "dataset math.jsonl")
    assert str(error.value) == ("dataset math.jsonl: reward function exact_match reads column 'answer', which the "
                                "dataset does not have (its columns: prompt, solution); add it or give the parameter "
                                "a default")


def test_a_missing_reward_column_is_one_line_from_preprocessing_before_training(tmp_path):
    """The dataset's columns are checked against what the reward functions read when the launcher preprocesses,
    before any model loads: not blamed on the first row's rollout."""
    from praisonai_accel.demo.text import make_tiny_model

    model = make_tiny_model(tmp_path / "model")
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": f"say {w}", "solution": w}) for w in ("ada", "bob")) + "\n")
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({
        "model_name": str(model), "dataset": [{"name": str(data)}], "output_dir": str(tmp_path / "out"),
        "method": "grpo", "reward_funcs": ["exact_match"], "num_generations": 2, "per_device_train_batch_size": 2,
        "max_completion_length": 8, "max_seq_length": 64, "max_prompt_length": 32, "max_steps": 1}))
    result = cli("train", str(config), "--cpu", "--num-processes", "1")
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert lines == [f"error: dataset {data}: reward function exact_match reads column 'answer', which the dataset "
                     "does not have (its columns: prompt, solution); add it or give the parameter a default"], \
        result.stderr
    assert not (tmp_path / "out" / "checkpoint-1").exists()


def test_an_eval_batch_of_partial_groups_is_refused():
    with pytest.raises(ConfigError, match="per_device_eval_batch_size: counts completions for method grpo, and 6 "
                                          "does not hold whole groups of num_generations 4"):
        _grpo(reward_funcs=["format"], num_generations=4, per_device_train_batch_size=4, per_device_eval_batch_size=6)
