"""The SFT demo's last word: its own task written as a local lm-eval YAML task, scored by `praisonai-accel eval`'s
code on the base model and the tuned one, printed as the eval table (and written where `report` finds it)."""

from __future__ import annotations

import json
from pathlib import Path

import typer

TASK = "demo_reverse"

TASK_YAML = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{output}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 16
  do_sample: false
metric_list:
  - metric: exact_match
    regexes_to_ignore: ["^\\\\s+", "\\\\s+$"]
"""


def write_task(directory: Path, held_out: list[dict]) -> Path:
    """The demo's held-out prompts as a local YAML task (its data file named by absolute path: lm-eval resolves a
    relative one against the working directory, not the YAML)."""
    directory.mkdir(parents=True, exist_ok=True)
    data = (directory / f"{TASK}.jsonl").resolve()
    rows = [{"prompt": f"{r['instruction']}\n\n{r['input']}", "output": r["output"]} for r in held_out]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    (directory / f"{TASK}.yaml").write_text(TASK_YAML.format(name=TASK, data=json.dumps(str(data))))
    return directory


def eval_table(directory: Path, base_model: Path, tuned_model: Path, output_dir: Path, held_out: list[dict]) -> None:
    """Base against tuned on the demo's task, the table printed and the results file written under output_dir/eval/;
    a hint instead when lm-eval (the [eval] extra) is not installed."""
    import importlib.util

    if importlib.util.find_spec("lm_eval") is None:
        typer.echo("(pip install 'praisonai-accel[eval]' to end with the eval table: base against tuned on the "
                   "demo's task through lm-evaluation-harness)", err=True)
        return
    from ..evaluate.compare import render, rows
    from ..evaluate.results import default_path, write_results
    from ..evaluate.score import EvalRequest, score
    from ..evaluate.targets import resolve_target
    from ..evaluate.tasks import build_tasks
    from ..logs import show_progress_lines

    tasks = write_task(directory / "tasks", held_out)
    manager, _ = build_tasks([TASK], tasks)
    show_progress_lines()
    scored, requests = {}, {}
    for name, model in (("base", base_model), ("tuned", tuned_model)):
        # the run trained on its chat template, so the task's prompts are rendered with it
        requests[name] = EvalRequest(resolve_target(str(model)), [TASK], str(tasks.resolve()), batch_size=16,
                                     apply_chat_template=True)
        scored[name] = score(requests[name], manager=manager, device="cpu")["tuned"]
    table = rows(scored["tuned"], scored["base"])
    path = write_results(default_path(output_dir), {**requests["tuned"].target.description(),
                                                     "base_model": str(base_model)},
                         json.loads(requests["tuned"].to_json()), {"processes": 1, **scored},
                         [row.as_dict() for row in table])
    render(table, f"{TASK}: base against tuned (lm-eval)")
    typer.echo(f"eval results: {path} (praisonai-accel eval {tuned_model} --tasks {TASK} --include-path {tasks} "
               "--apply-chat-template)", err=True)
