"""eval_tasks during training: lm-eval's tasks scored at each evaluation and at the end, logged as
eval_<task>/<metric> to metrics.jsonl and `report`; metric_for_best_model naming one keeps the checkpoint with the
best task score; greater_is_better follows transformers' default; bad eval_tasks are one line before launch."""

from __future__ import annotations

import json

import pytest

from conftest import cli, read_metrics, read_summary, write_config

pytest.importorskip("lm_eval", reason="lm-eval (the [eval] extra) is not installed")

NAMES = ["ada", "bob", "cy", "dee", "eve", "fay"]

# how likely the trained answer is after the prompt: lower perplexity is a more likely answer
TASK_YAML = """task: likes_red
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: perplexity
    higher_is_better: false
"""


def _invoke(*args: str):
    from typer.testing import CliRunner

    from praisonai_accel.cli import app

    return CliRunner().invoke(app, list(args))


@pytest.fixture(scope="module")
def red_run(tmp_path_factory, tiny_model):
    """Trained to answer that everyone likes red; the task scores how likely that answer is (it gets better), while
    the eval set asks the same questions with answers of digits no training row holds (its loss gets worse): eval
    loss and the task score disagree by construction, so their best checkpoints differ."""
    root = tmp_path_factory.mktemp("red")
    rows = [{"instruction": f"what colour does {n} like", "input": "", "output": f"{n} likes red"} for n in NAMES]
    data = root / "red.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows * 4))
    held_out = root / "digits.jsonl"
    held_out.write_text("".join(json.dumps({**r, "output": "0918273645" * 2}) + "\n" for r in rows))
    tasks = root / "tasks"
    tasks.mkdir()
    docs = [{"context": r["instruction"], "answer": r["output"]} for r in rows]  # in the chat template, as trained
    (tasks / "likes_red.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (tasks / "likes_red.yaml").write_text(TASK_YAML.format(data=tasks / "likes_red.jsonl"))
    trackers = {"report_to": "tensorboard"} if _tensorboard() else {}
    config = _config(root, tiny_model, data, held_out, tasks, **trackers)
    result = cli("train", str(config))
    assert result.returncode == 0, result.stderr[-3000:]
    return root / "out", result


def _tensorboard() -> bool:
    import importlib.util

    return importlib.util.find_spec("tensorboard") is not None


def _config(root, tiny_model, data, held_out, tasks, **overrides):
    return write_config(root, tiny_model, data, **{
        "eval_dataset": [{"name": str(held_out), "format": "alpaca"}], "max_steps": 24, "eval_steps": 8,
        "save_steps": 8, "learning_rate": 2e-3, "warmup_steps": 0, "lr_scheduler_type": "constant",
        "finetune_type": "full", "final_model_dir": "model", "eval_tasks": ["likes_red"],
        "eval_include_path": str(tasks), "eval_limit": 4, "metric_for_best_model": "eval_likes_red/perplexity",
        "greater_is_better": False, "load_best_model_at_end": True, **overrides})


def test_best_checkpoint_follows_the_task_score_not_the_eval_loss(red_run):
    out, result = red_run
    evals = [m for m in read_metrics(out) if "eval_loss" in m]
    assert [m["step"] for m in evals] == [8, 16, 24]
    scores = [m["eval_likes_red/perplexity"] for m in evals]
    by_loss = min(evals, key=lambda m: m["eval_loss"])["step"]
    by_task = min(evals, key=lambda m: m["eval_likes_red/perplexity"])["step"]
    assert by_loss != by_task, (evals, "the run was built so that they disagree")
    summary = read_summary(out)
    assert summary["best_checkpoint"] == f"checkpoint-{by_task}"
    assert summary["best_metric"] == pytest.approx(min(scores))
    assert "eval_likes_red/perplexity" in result.stderr  # the console line of each evaluation
    assert summary["eval_scores"] == {"eval_likes_red/perplexity": scores[-1]} and summary["eval_scores_step"] == 24
    card = (out / "model" / "README.md").read_text()  # the model card carries the run's latest task scores
    assert "## Evaluation" in card and f"| eval_likes_red/perplexity | {scores[-1]:.4f} |" in card


def test_task_scores_are_lm_evals_own_on_the_final_model(red_run, tmp_path):
    """The logged score is lm-eval's on the model as it was at that step: `praisonai-accel eval` of the final model
    (the best checkpoint's weights), with its defaults, gives the best score the run logged. The run trained on
    alpaca rows, so both render the task's prompts with the chat template, and say so."""
    out, trained = red_run
    assert "eval_tasks: chat template applied (the run trained on alpaca rows through it" in trained.stderr
    result = _invoke("eval", str(out), "--tasks", "likes_red", "--include-path", str(out.parent / "tasks"),
                     "--limit", "4", "--output", str(tmp_path / "e.json"))
    assert result.exit_code == 0, result.output[-3000:]
    assert "chat template: applied (the run trained on alpaca rows" in result.output
    scored = json.loads((tmp_path / "e.json").read_text())["tuned"]
    assert scored["chat_template"]
    assert scored["results"]["likes_red"]["perplexity,none"] == pytest.approx(read_summary(out)["best_metric"],
                                                                               rel=1e-4)


def test_two_ranks_score_their_shares_and_log_the_one_process_number(red_run, tmp_path, tiny_model):
    """eval_tasks on 2 CPU ranks (each scores half the requests, rank 0 gathers): the best score logged is the one
    `praisonai-accel eval` gives in one process on the final model (the best checkpoint's weights)."""
    out, _ = red_run
    root = out.parent
    config = _config(tmp_path, tiny_model, root / "red.jsonl", root / "digits.jsonl", root / "tasks",
                     per_device_train_batch_size=2, eval_limit=None)
    result = cli("train", str(config), "--cpu", "--num-processes", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    summary = read_summary(tmp_path / "out")
    assert summary["num_processes"] == 2 and summary["best_checkpoint"] == "checkpoint-24"
    scored = _invoke("eval", str(tmp_path / "out"), "--tasks", "likes_red", "--include-path", str(root / "tasks"),
                     "--output", str(tmp_path / "e.json"))
    assert scored.exit_code == 0, scored.output[-3000:]
    one = json.loads((tmp_path / "e.json").read_text())["tuned"]["results"]["likes_red"]["perplexity,none"]
    assert one == pytest.approx(summary["best_metric"], rel=1e-4)


def test_task_scores_reach_the_tracker(red_run):
    """Each evaluation's task score goes to the trackers as eval_<task>/<metric>, at its step, as metrics.jsonl has
    it (the red run reports to TensorBoard)."""
    if not _tensorboard():
        pytest.skip("tensorboard is not installed: the red run reported to no tracker")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, _ = red_run
    (run,) = (out / "runs").iterdir()
    events = EventAccumulator(str(run))
    events.Reload()
    logged = [(m["step"], m["eval_likes_red/perplexity"]) for m in read_metrics(out) if "eval_likes_red/perplexity" in m]
    assert [step for step, _ in logged] == [8, 16, 24]
    scalars = events.Scalars("eval_likes_red/perplexity")
    assert [e.step for e in scalars] == [step for step, _ in logged]
    assert [e.value for e in scalars] == pytest.approx([value for _, value in logged])


def test_report_shows_the_task_scores(red_run):
    out, _ = red_run
    result = _invoke("report", str(out))
    assert result.exit_code == 0, result.output[-2000:]
    assert "eval_likes_red/perplexity (first -> last)" in result.output


def test_greater_is_better_defaults_to_transformers_rule():
    from praisonai_accel.config import parse_config

    base = {"model_name": "m", "dataset": [{"name": "d.jsonl"}], "val_split_ratio": 0.1}
    assert parse_config(base).greater_is_better is False
    assert parse_config({**base, "method": "dpo",
                         "metric_for_best_model": "eval_rewards/accuracies"}).greater_is_better is True
    assert parse_config({**base, "method": "dpo", "metric_for_best_model": "eval_rewards/accuracies",
                         "greater_is_better": False}).greater_is_better is False
    assert parse_config({**base, "eval_tasks": ["t"], "metric_for_best_model": "eval_t/acc"}).greater_is_better is True


def test_the_chat_template_is_evals_default_and_the_key_overrides_it(red_run, tiny_model):
    """eval_tasks decide as `eval` of the run does (evaluate/targets.template_default); eval_apply_chat_template
    overrides that either way; applying it without a template is one line."""
    from transformers import AutoTokenizer

    from praisonai_accel.config import ConfigError, parse_config
    from praisonai_accel.worker.task_eval import TaskEvaluation

    out, _ = red_run
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    base = {"model_name": "m", "dataset": [{"name": "d.jsonl"}], "eval_tasks": ["likes_red"],
            "eval_include_path": str(out.parent / "tasks")}

    def applied(formats, vision=False, tokenizer=tokenizer, **keys):
        evaluation = TaskEvaluation.build(parse_config({**base, **keys}), tokenizer, 4, False, formats, vision)
        return evaluation.apply_chat_template

    assert applied({"d.jsonl": "alpaca"}) and applied({"d.jsonl": "text"}, vision=True)
    assert not applied({"d.jsonl": "text"}) and not applied(None)
    assert not applied({"d.jsonl": "alpaca"}, eval_apply_chat_template=False)
    assert applied({"d.jsonl": "text"}, eval_apply_chat_template=True)
    plain = AutoTokenizer.from_pretrained(tiny_model)
    plain.chat_template = None
    with pytest.raises(ConfigError, match="the tokenizer has no chat template"):
        applied({"d.jsonl": "text"}, tokenizer=plain, eval_apply_chat_template=True)


@pytest.mark.parametrize("overrides,line", [
    ({"eval_tasks": ["no_such_task_xyz"]}, "eval_tasks: lm-eval knows no task 'no_such_task_xyz'"),
    ({"eval_tasks": ["likes_red"], "eval_include_path": "missing-dir"}, "eval_include_path missing-dir: no such "
                                                                          "directory"),
    ({"eval_tasks": ["likes_red"], "eval_include_path": "TASKS", "metric_for_best_model": "eval_likes_red/acc"},
     "metric_for_best_model: task likes_red logs no metric 'acc'; it logs eval_likes_red/perplexity"),
    ({"eval_limit": 3}, "eval_limit: needs eval_tasks"),
    ({"eval_apply_chat_template": False}, "eval_apply_chat_template: needs eval_tasks"),
])
def test_bad_eval_tasks_are_one_line_before_launch(red_run, tmp_path, tiny_model, overrides, line):
    out, _ = red_run
    tasks = str(out.parent / "tasks")
    overrides = {k: tasks if v == "TASKS" else v for k, v in overrides.items()}
    config = write_config(tmp_path, tiny_model, out.parent / "red.jsonl", **overrides)
    result = _invoke("train", str(config))
    assert result.exit_code == 2, result.output[-2000:]
    errors = [x for x in result.output.splitlines() if x.startswith("error:")]
    assert len(errors) == 1 and line in errors[0], result.output[-2000:]
    assert "Traceback" not in result.output and not (tmp_path / "out").exists()
