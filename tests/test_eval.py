"""`praisonai-accel eval`: the numbers equal the lm_eval CLI's on the same model, adapter (peft=) and local tasks, on
1 and 2 processes; base against tuned and the regression gate; the chat template as the run trained; a vision
run on text tasks; every bad input one line and exit 2."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from conftest import cpu_env, run

pytest.importorskip("lm_eval", reason="lm-eval (the [eval] extra) is not installed")

from praisonai_accel.cli import app  # noqa: E402

NAMES = ["ada", "bob", "cy", "dee", "eve", "fay"]
GEN_DOCS = 12
BATCH = 4


def _gen_yaml(name: str, data: Path) -> str:
    return f"""task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 6
  do_sample: false
metric_list:
  - metric: exact_match
"""


MC_YAML = """task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
"""


def _greedy(model, tokenizer, texts: list[str]) -> list[str]:
    """What the model answers each prompt (greedy, cut at a newline, as the task's `until`)."""
    import torch

    out = []
    for text in texts:
        ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            row = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=tokenizer.pad_token_id)[0]
        out.append(tokenizer.decode(row[ids.shape[1]:], skip_special_tokens=True).split("\n")[0])
    return out


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_model):
    """A LoRA adapter with random weights on the tiny model (so tuned and base differ) and three local tasks:
    tiny_gen, whose first half of answers are the tuned model's own (tuned scores 0.5, the base less), tiny_gen_base,
    the base model's (a made regression), and a multiple-choice tiny_mc."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = tmp_path_factory.mktemp("eval")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    base = AutoModelForCausalLM.from_pretrained(tiny_model)
    questions = [f"repeat {a} {b}" for a in NAMES for b in NAMES][:GEN_DOCS]
    base_answers = _greedy(base, tokenizer, questions)
    torch.manual_seed(1)
    tuned = get_peft_model(base, LoraConfig(r=8, lora_alpha=64, target_modules=["q_proj", "v_proj", "o_proj"],
                                            init_lora_weights=False))
    tuned_answers = _greedy(tuned, tokenizer, questions)
    adapter = root / "adapter"
    tuned.save_pretrained(adapter)
    tokenizer.save_pretrained(adapter)
    tasks = root / "tasks"
    tasks.mkdir()
    half = GEN_DOCS // 2
    for name, answers in (("tiny_gen", tuned_answers), ("tiny_gen_base", base_answers)):
        rows = [{"question": q, "answer": a if i < half else "zzz"} for i, (q, a) in enumerate(zip(questions, answers))]
        (tasks / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (tasks / f"{name}.yaml").write_text(_gen_yaml(name, tasks / f"{name}.jsonl"))
    mc = [{"question": f"what colour does {n} like", "choices": ["red", "blue", "green"], "label": i % 3}
          for i, n in enumerate(NAMES * 3)]
    (tasks / "tiny_mc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in mc))
    (tasks / "tiny_mc.yaml").write_text(MC_YAML.format(data=tasks / "tiny_mc.jsonl"))
    return {"root": root, "base": tiny_model, "adapter": adapter, "tasks": tasks,
            "differ": tuned_answers[:half] != base_answers[:half]}


def _invoke(*args: str):
    return CliRunner().invoke(app, ["eval", *args])


def _metrics(results: dict, task: str) -> dict:
    return {k: v for k, v in results["results"][task].items() if "," in k}


@pytest.fixture(scope="module")
def one_process(setup):
    """Ours, in this process: tuned and base on the three tasks, gated on both generation tasks."""
    out = setup["root"] / "ours.json"
    result = _invoke(str(setup["adapter"]), "--tasks", "tiny_gen,tiny_gen_base,tiny_mc", "--include-path",
                     str(setup["tasks"]), "--batch-size", str(BATCH), "--base", "--output", str(out),
                     "--max-regression", "tiny_gen=0.1", "--max-regression", "tiny_gen_base=0.1")
    return result, json.loads(out.read_text())


def test_eval_equals_the_lm_eval_cli_on_the_adapter(setup, one_process):
    assert setup["differ"], "the random adapter must change the tiny model's answers"
    result, ours = one_process
    out = setup["root"] / "cli"
    cli = run([sys.executable, "-m", "lm_eval", "run", "--model", "hf", "--model_args",
               f"pretrained={setup['base']},peft={setup['adapter']}", "--tasks", "tiny_gen,tiny_gen_base,tiny_mc",
               "--include_path", str(setup["tasks"]), "--batch_size", str(BATCH), "--device", "cpu",
               "--output_path", str(out)], timeout=600)
    assert cli.returncode == 0, cli.stderr[-2000:]
    theirs = json.loads(next(out.rglob("results_*.json")).read_text())
    for task in ("tiny_gen", "tiny_gen_base", "tiny_mc"):
        assert _metrics(ours["tuned"], task) == _metrics(theirs, task), task
    assert ours["tuned"]["results"]["tiny_gen"]["exact_match,none"] == 0.5
    assert ours["adapter"] == str(setup["adapter"]) and ours["model"] == str(setup["base"])
    assert len(ours["config_sha256"]) == 64
    # a model that is no run keeps lm-eval's default, as the lm_eval CLI above: no chat template, and no line
    assert ours["options"]["apply_chat_template"] is False and ours["tuned"]["chat_template"] is None
    assert "chat template:" not in result.stderr


def test_base_against_tuned_and_the_regression_gate(setup, one_process):
    result, ours = one_process
    assert ours["base"]["results"]["tiny_gen_base"]["exact_match,none"] == 0.5
    rows = {(r["task"], r["metric"]): r for r in ours["comparison"]}
    gen, made = rows[("tiny_gen", "exact_match,none")], rows[("tiny_gen_base", "exact_match,none")]
    assert gen["change"] > 0.1 and made["change"] < -0.1
    assert gen["paired_n"] == GEN_DOCS and 0 <= made["paired_p"] < 1
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    # the base scored with the adapter disabled equals lm-eval's own hf model on the base alone
    plain = simple_evaluate(model="hf", model_args=f"pretrained={setup['base']}", device="cpu", batch_size=BATCH,
                            tasks=["tiny_gen", "tiny_gen_base", "tiny_mc"], log_samples=False,
                            task_manager=TaskManager(include_path=str(setup["tasks"])))
    for task in ("tiny_gen", "tiny_gen_base", "tiny_mc"):
        assert _metrics(ours["base"], task) == _metrics(plain, task), task
    for column in ("base", "tuned", "change", "paired p"):
        assert column in result.stdout
    assert result.exit_code == 1, result.output
    regressions = [line for line in result.stderr.splitlines() if line.startswith("regression: ")]
    assert len(regressions) == 1 and "tiny_gen_base exact_match" in regressions[0], result.stderr


def test_base_of_a_full_fine_tune_is_the_model_it_was_trained_from(setup, one_process, tmp_path):
    """A full fine-tune records the model it started from; --base loads it after the tuned model, with the run's
    tokenizer, and scores it as the adapter's base scores (the same weights)."""
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoTokenizer

    from praisonai_accel.run_dir.output_dirs import replace_with

    staged = tmp_path / "staged"
    AutoPeftModelForCausalLM.from_pretrained(setup["adapter"]).merge_and_unload().save_pretrained(staged)
    AutoTokenizer.from_pretrained(setup["adapter"]).save_pretrained(staged)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    replace_with(staged, run_dir / "model", "final_model_dir", kind="model", base_model=str(setup["base"]))
    (run_dir / "train_summary.json").write_text(json.dumps({"global_step": 5, "final_model_dir": str(run_dir / "model")}))
    out = tmp_path / "full.json"
    result = _invoke(str(run_dir), "--tasks", "tiny_gen,tiny_mc", "--include-path", str(setup["tasks"]),
                     "--batch-size", str(BATCH), "--base", "--output", str(out))
    assert result.exit_code == 0, result.output[-3000:]
    scored, adapter_run = json.loads(out.read_text()), one_process[1]
    assert scored["adapter"] is None and scored["base_model"] == str(setup["base"])
    for task in ("tiny_gen", "tiny_mc"):
        assert _metrics(scored["base"], task) == _metrics(adapter_run["base"], task), task
    assert scored["tuned"]["results"]["tiny_gen"]["exact_match,none"] == 0.5  # the merged adapter's answers
    assert {(r["task"], r["metric"]) for r in scored["comparison"]} >= {("tiny_gen", "exact_match,none")}
    # a model that is no run records no base
    bare = _invoke(str(setup["base"]), "--tasks", "tiny_mc", "--include-path", str(setup["tasks"]), "--base")
    assert bare.exit_code == 2 and "--base: " in bare.stderr and "records no base model" in bare.stderr


def test_two_processes_give_the_same_numbers_and_pass_the_gate(setup, one_process, tmp_path):
    """2 CPU ranks over gloo, launched as train launches: each scores half, rank 0 writes once, the same numbers;
    a gate on the task that improved exits 0."""
    _, ours = one_process
    out = tmp_path / "two.json"
    result = run([sys.executable, "-m", "praisonai_accel", "eval", str(setup["adapter"]), "--tasks",
                  "tiny_gen,tiny_gen_base,tiny_mc", "--include-path", str(setup["tasks"]), "--batch-size", str(BATCH),
                  "--cpu", "--num-processes", "2", "--max-regression", "tiny_gen=0.1", "--output", str(out),
                  "--log-samples"],
                 timeout=600, env=cpu_env())
    assert result.returncode == 0, result.stderr[-3000:]
    assert "launching 2 process(es)" in result.stderr
    # lm-eval draws its bars on every rank; rank 0's alone reach the console: its bar building tiny_mc's requests
    # (9 documents a rank) starts once for each pass (tuned, base), not once for each rank too
    assert result.stderr.count("| 0/9 [") == 2, result.stderr
    two = json.loads(out.read_text())
    for which in ("tuned", "base"):
        for task in ("tiny_gen", "tiny_gen_base", "tiny_mc"):
            assert _metrics(two[which], task) == pytest.approx(_metrics(ours[which], task)), (which, task)
    assert two["processes"] == 2 and ours["processes"] == 1
    assert len(two["tuned"]["samples"]["tiny_mc"]) == 18 and "samples" not in ours["tuned"]  # --log-samples
    assert [(r["task"], r["metric"]) for r in two["comparison"]] == [(r["task"], r["metric"]) for r in ours["comparison"]]
    assert [r["change"] for r in two["comparison"]] == pytest.approx([r["change"] for r in ours["comparison"]])


def _ranks(where: Path) -> list[int]:
    """The eval ranks (not their launcher, whose command line names the module too) under `where`."""
    import subprocess

    found = subprocess.run(["pgrep", "-f", f"praisonai_accel.evaluate.worker {where}"], capture_output=True,
                           text=True).stdout.split()
    ranks = []
    for pid in found:
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:  # gone since
            continue
        if b"accelerate.commands.launch" not in command:
            ranks.append(int(pid))
    return ranks


def _early_ranks(setup, tmp_path):
    """`eval --num-processes 2` held in its checks (a task YAML still being written: a FIFO the check reads) once
    both ranks, started early, are up; returns (the command, the FIFO)."""
    import os
    import shutil
    import subprocess
    import time

    tasks = tmp_path / "tasks"
    shutil.copytree(setup["tasks"], tasks)
    fifo = tasks / "late.yaml"
    os.mkfifo(fifo)
    command = subprocess.Popen(
        [sys.executable, "-m", "praisonai_accel", "eval", str(setup["adapter"]), "--tasks", "tiny_mc",
         "--include-path", str(tasks), "--cpu", "--num-processes", "2"],
        env={**cpu_env(), "TMPDIR": str(tmp_path)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while len(_ranks(tmp_path)) < 2:
        if command.poll() is not None or time.monotonic() > deadline:
            command.kill()
            raise AssertionError(command.communicate(timeout=60))
        time.sleep(0.1)
    return command, fifo


def _write_when_read(fifo: Path, text: str, seconds: float = 120) -> None:
    """Write to the FIFO once the command opens it to read (never blocking: a command that never reads fails)."""
    import errno
    import os
    import time

    deadline = time.monotonic() + seconds
    while True:
        try:
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            break
        except OSError as exc:
            if exc.errno != errno.ENXIO or time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    os.write(fd, text.encode())
    os.close(fd)


def _gone(where: Path, seconds: float = 20) -> bool:
    import time

    deadline = time.monotonic() + seconds
    while _ranks(where) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not _ranks(where)


def test_ranks_started_early_are_cancelled_when_a_check_fails(setup, tmp_path):
    """The ranks start while the command still checks its input and wait for the request; a check that fails then
    kills them (nothing loaded): the check's one line, exit 2, no rank left, the launch's files removed."""
    command, fifo = _early_ranks(setup, tmp_path)
    _write_when_read(fifo, "task: [unclosed\n")
    _, stderr = command.communicate(timeout=120)
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert command.returncode == 2 and len(lines) == 1, stderr
    assert "late.yaml: not a valid lm-eval task YAML" in lines[0]
    assert _gone(tmp_path) and not list(tmp_path.glob("praisonai-accel-eval-*"))


def test_ranks_waiting_for_a_command_killed_outright_die_with_it(setup, tmp_path):
    command, _ = _early_ranks(setup, tmp_path)
    command.kill()  # SIGKILL: no handler of ours runs; the kernel takes the launcher, the launcher's death the ranks
    command.communicate(timeout=60)
    assert _gone(tmp_path), "a rank outlived the command that started it"


def _interrupted_while_scoring(setup, tmp_path, *args: str):
    """`eval` on a task long enough to be stopped while it generates, sent SIGINT (Ctrl-C) once rank 0's
    generation bar is up: (exit code, stderr, the results path)."""
    import os
    import signal
    import subprocess
    import threading
    import time

    tasks = tmp_path / "tasks"
    tasks.mkdir()
    rows = (setup["tasks"] / "tiny_gen.jsonl").read_text() * 400  # 4,800 documents: still generating at the signal
    (tasks / "long_gen.jsonl").write_text(rows)
    (tasks / "long_gen.yaml").write_text(_gen_yaml("long_gen", tasks / "long_gen.jsonl"))
    out = tmp_path / "never.json"
    command = subprocess.Popen(
        [sys.executable, "-m", "praisonai_accel", "eval", str(setup["adapter"]), "--tasks", "long_gen",
         "--include-path", str(tasks), "--output", str(out), *args],
        env={**cpu_env(), "TMPDIR": str(tmp_path)}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # as from a shell's foreground
    said = []
    reader = threading.Thread(target=lambda: said.extend(iter(lambda: os.read(command.stderr.fileno(), 4096), b"")))
    reader.start()
    deadline = time.monotonic() + 240
    while b"Running generate_until requests" not in b"".join(said):
        assert command.poll() is None and time.monotonic() < deadline, b"".join(said).decode()[-3000:]
        time.sleep(0.1)
    command.send_signal(signal.SIGINT)
    code = command.wait(timeout=120)
    reader.join(timeout=60)
    return code, b"".join(said).decode(), out


@pytest.mark.parametrize("processes", [1, 2])
def test_ctrl_c_while_scoring_is_one_line_exit_130_and_no_results(setup, tmp_path, processes):
    """Ctrl-C in the middle of scoring, in this process or forwarded to 2 ranks: no rank's KeyboardInterrupt
    traceback and no line of torchrun's agent ("Received 2 death signal") reach the console, even where one
    arrives glued to lm-eval's unfinished bar; one line says it, exit 130, no results file, no rank left."""
    import re

    extra = ("--cpu", "--num-processes", "2") if processes == 2 else ()
    code, stderr, out = _interrupted_while_scoring(setup, tmp_path, *extra)
    lines = [line.replace("\x1b[2K", "") for line in re.split(r"[\r\n]+", stderr)]
    lines = [line for line in lines if line.strip()]
    assert code == 130, stderr[-3000:]
    assert lines[-1] == "praisonai-accel: eval interrupted (its results file is written when it ends)", lines[-5:]
    noise = [line for line in lines if "Traceback" in line or "KeyboardInterrupt" in line or line.startswith("[rank")
             or re.search(r"[IWE]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ ", line) or line.startswith("error:")]
    assert not noise, noise[:10]
    assert not out.exists() and _gone(tmp_path)


def test_paired_test_is_scipys_paired_t_test():
    from scipy.stats import ttest_rel

    from praisonai_accel.evaluate.compare import paired_test

    tuned = {str(i): float(v) for i, v in enumerate([1, 1, 0, 1, 1, 0, 1, 1])}
    base = {str(i): float(v) for i, v in enumerate([0, 1, 0, 0, 1, 0, 0, 1])}
    n, p = paired_test(tuned, base)
    assert n == 8 and p == pytest.approx(ttest_rel(list(tuned.values()), list(base.values())).pvalue)
    assert paired_test(base, base) == (8, 1.0)
    assert paired_test({"0": 1.0}, {"0": 0.0}) == (None, None)


def _run_around(adapter: Path, run_dir: Path, **summary) -> Path:
    """A run's output_dir holding `adapter` as its final model, with train_summary.json's `summary`."""
    import shutil

    shutil.copytree(adapter, run_dir / "lora_model")
    (run_dir / "train_summary.json").write_text(json.dumps({"global_step": 5, **summary,
                                                            "final_model_dir": str(run_dir / "lora_model")}))
    return run_dir


def _prompts(scored: dict, task: str) -> list[str]:
    """The context lm-eval scored each request of `task` with (the samples of --log-samples)."""
    return [request[0] for sample in scored["samples"][task] for request in sample["arguments"]]


def test_a_run_trained_on_conversations_is_scored_with_its_chat_template(setup, tmp_path):
    """By default as the run trained: its rows were messages, so lm-eval renders every prompt with the run's
    template (the samples show it, the results file records it as lm-eval's own does); --no-apply-chat-template
    scores the plain text."""
    from lm_eval.utils import hash_string
    from transformers import AutoTokenizer

    run_dir = _run_around(setup["adapter"], tmp_path / "run", data_formats={"chat.jsonl": "messages"})
    tokenizer = AutoTokenizer.from_pretrained(setup["adapter"])
    questions = [json.loads(line)["question"] for line in (setup["tasks"] / "tiny_mc.jsonl").read_text().splitlines()]
    templated = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                               add_generation_prompt=True) for q in questions[:4]]
    scored = {}
    for flag in ([], ["--no-apply-chat-template"]):
        out = tmp_path / f"scored{len(flag)}.json"
        result = _invoke(str(run_dir), "--tasks", "tiny_mc", "--include-path", str(setup["tasks"]), "--limit", "4",
                         "--log-samples", "--output", str(out), *flag)
        assert result.exit_code == 0, result.output[-3000:]
        scored[bool(flag)] = (result, json.loads(out.read_text()))
    result, on = scored[False]
    assert ("chat template: applied (the run trained on messages rows through it; --no-apply-chat-template to score "
            "without)") in result.stderr.splitlines()
    assert on["options"]["apply_chat_template"] is True
    assert on["tuned"]["chat_template"] == tokenizer.chat_template
    assert on["tuned"]["chat_template_sha"] == hash_string(tokenizer.chat_template)
    assert sorted(set(_prompts(on["tuned"], "tiny_mc"))) == sorted(templated)
    result, off = scored[True]
    assert "chat template: not applied (--no-apply-chat-template)" in result.stderr.splitlines()
    assert off["options"]["apply_chat_template"] is False and off["tuned"]["chat_template"] is None
    assert sorted(set(_prompts(off["tuned"], "tiny_mc"))) == sorted(questions[:4])


def test_the_default_follows_what_the_run_recorded(setup, tmp_path):
    """Rows of text train without the template, and a run that recorded no format is not guessed at: each says why;
    a model that is no run gets no line."""
    from praisonai_accel.evaluate.targets import chat_template_choice, resolve_target

    def choice(run_dir, requested=None):
        return chat_template_choice(resolve_target(str(run_dir)), requested)

    text = _run_around(setup["adapter"], tmp_path / "text", data_formats={"a.jsonl": "text"})
    assert choice(text) == (False, "chat template: not applied (the run trained on text rows; --apply-chat-template "
                                   "to apply it)")
    assert choice(text, True) == (True, "chat template: applied (--apply-chat-template)")
    mixed = _run_around(setup["adapter"], tmp_path / "mixed", data_formats={"a.jsonl": "text", "b.jsonl": "alpaca"})
    assert choice(mixed)[0] is True and "alpaca rows" in choice(mixed)[1]
    unknown = _run_around(setup["adapter"], tmp_path / "unknown")
    assert choice(unknown) == (False, "chat template: not applied (the run does not record the format of its rows; "
                                      "--apply-chat-template to apply it)")
    assert choice(setup["adapter"]) == (False, None) and choice(setup["base"]) == (False, None)


def test_a_vision_run_scores_text_tasks_as_lm_evals_hf_multimodal(setup, tmp_path):
    """A vision-language model answers a text task with its language model, through its template's typed content
    parts (Idefics3's renders a plain-string turn without its text): the prompts and the greedy generations equal
    lm-eval's own hf-multimodal model's on the same checkpoint; a multiple-choice task scores too."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from praisonai_accel.demo.vision import make_tiny_vlm, unbuildable_reason

    if unbuildable_reason("idefics3"):
        pytest.skip(unbuildable_reason("idefics3"))
    run_dir = tmp_path / "vision-run"
    make_tiny_vlm("idefics3", run_dir / "model")
    (run_dir / "train_summary.json").write_text(json.dumps({"global_step": 3, "final_model_dir": str(run_dir / "model")}))
    out = tmp_path / "vision.json"
    result = _invoke(str(run_dir), "--tasks", "tiny_gen,tiny_mc", "--include-path", str(setup["tasks"]), "--limit", "4",
                     "--batch-size", str(BATCH), "--log-samples", "--output", str(out))
    assert result.exit_code == 0, result.output[-3000:]
    assert "chat template: applied (a vision run trains on conversations through it" in result.stderr
    ours = json.loads(out.read_text())["tuned"]
    theirs = simple_evaluate(model="hf-multimodal", model_args=f"pretrained={run_dir / 'model'}", device="cpu",
                             batch_size=BATCH, tasks=["tiny_gen"], limit=4, apply_chat_template=True, log_samples=True,
                             task_manager=TaskManager(include_path=str(setup["tasks"])))
    prompts = _prompts(ours, "tiny_gen")
    assert prompts == _prompts(theirs, "tiny_gen") and all("repeat " in p and "User:" in p for p in prompts)
    assert [s["resps"] for s in ours["samples"]["tiny_gen"]] == [s["resps"] for s in theirs["samples"]["tiny_gen"]]
    assert len(ours["per_item"]["tiny_mc"]["acc"]) == 4 and "acc,none" in ours["results"]["tiny_mc"]


def _one_line(result, *expected: str):
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for text in expected:
        assert text in lines[0], lines[0]


@pytest.fixture
def no_model_loads(monkeypatch):
    import praisonai_accel.evaluate.score as score

    def refuse(*_a, **_k):
        raise AssertionError("a model was loaded before the bad input was refused")

    monkeypatch.setattr(score, "load_model", refuse)


def test_bad_inputs_are_one_line_before_any_model_loads(setup, tmp_path, no_model_loads):
    import shutil

    adapter, tasks = str(setup["adapter"]), str(setup["tasks"])
    _one_line(_invoke(adapter, "--tasks", "no_such_task", "--include-path", tasks), "no_such_task")
    _one_line(_invoke(adapter, "--tasks", "tiny_mc", "--include-path", str(tmp_path / "absent")),
              "--include-path", "no such directory")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "bad.yaml").write_text("task: [unclosed\n")
    _one_line(_invoke(adapter, "--tasks", "tiny_mc", "--include-path", str(broken)), "bad.yaml", "not a valid")
    _one_line(_invoke(str(tmp_path / "nowhere"), "--tasks", "tiny_mc", "--include-path", tasks), "no such run")
    empty = tmp_path / "empty"
    empty.mkdir()
    _one_line(_invoke(str(empty), "--tasks", "tiny_mc", "--include-path", tasks), "not a run, checkpoint or model")
    orphan = tmp_path / "orphan"
    orphan.mkdir()
    config = json.loads((setup["adapter"] / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = str(tmp_path / "deleted-base")
    (orphan / "adapter_config.json").write_text(json.dumps(config))
    _one_line(_invoke(str(orphan), "--tasks", "tiny_mc", "--include-path", tasks), "base model", "not at hand")
    _one_line(_invoke(adapter, "--tasks", "arc_easy"), "arc_easy", "cannot be reached")
    # local tasks are indexed without lm-eval's built-in ones; a built-in task, named or in a local group, still is
    _one_line(_invoke(adapter, "--tasks", "tiny_mc,arc_easy", "--include-path", tasks), "cannot be reached")
    group = tmp_path / "group"
    shutil.copytree(setup["tasks"], group)
    (group / "mixed.yaml").write_text("group: mixed\ntask:\n  - tiny_mc\n  - arc_easy\n")
    _one_line(_invoke(adapter, "--tasks", "mixed", "--include-path", str(group)), "mixed", "cannot be reached")
    _one_line(_invoke(adapter, "--tasks", "tiny_mc", "--include-path", tasks, "--max-regression", "tiny_mc"),
              "TASK=DELTA")
    images = tmp_path / "images"
    images.mkdir()
    (images / "tiny_img.yaml").write_text((setup["tasks"] / "tiny_mc.yaml").read_text().replace(
        "task: tiny_mc", "task: tiny_img") + "doc_to_image: [question]\n")
    _one_line(_invoke(adapter, "--tasks", "tiny_img", "--include-path", str(images)), "tiny_img",
              "gives the model images", "hf-multimodal")
    plain = tmp_path / "no-template"
    shutil.copytree(setup["base"], plain)
    (plain / "chat_template.jinja").unlink(missing_ok=True)
    tokenizer_config = json.loads((plain / "tokenizer_config.json").read_text())
    tokenizer_config.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    _one_line(_invoke(str(plain), "--tasks", "tiny_mc", "--include-path", tasks, "--apply-chat-template"),
              "--apply-chat-template", "has none")


def test_lm_eval_missing_is_one_line_naming_the_extra(setup, monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval", None)
    _one_line(_invoke(str(setup["adapter"]), "--tasks", "tiny_mc"), "pip install 'praisonai-accel[eval]'")


def test_report_shows_the_latest_eval(setup, one_process, tmp_path):
    _, ours = one_process
    run_dir = tmp_path / "run"
    (run_dir / "eval").mkdir(parents=True)
    older = {**ours, "comparison": [{**ours["comparison"][0], "tuned": 0.123456, "base": None}]}
    (run_dir / "eval" / "20200101-000000.json").write_text(json.dumps(older))
    (run_dir / "eval" / "20300101-000000.json").write_text(json.dumps(ours))
    result = CliRunner().invoke(app, ["report", str(run_dir)])
    assert result.exit_code == 0, result.output
    assert "20300101-000000.json" in result.stdout and "0.1235" not in result.stdout
    line = next(line for line in result.stdout.splitlines() if line.startswith("eval tiny_gen/exact_match"))
    assert "-> 0.5000" in line and "vs base" in line


def test_target_is_a_run_a_checkpoint_or_its_adapter(setup, tmp_path):
    """What TARGET names, and the run and step the results file records for it."""
    import shutil

    from praisonai_accel.errors import ConfigError
    from praisonai_accel.evaluate.targets import resolve_target

    run_dir = tmp_path / "run"
    shutil.copytree(setup["adapter"], run_dir / "lora_model")
    shutil.copytree(setup["adapter"], run_dir / "checkpoint-3" / "adapter")
    (run_dir / "checkpoint-4").mkdir()  # a full fine-tune's checkpoint: no loadable model
    (run_dir / "train_summary.json").write_text(json.dumps({"global_step": 5,
                                                            "final_model_dir": str(run_dir / "lora_model")}))
    final = resolve_target(str(run_dir))
    assert (final.model, final.step, final.output_dir, final.base) == (
        str(run_dir / "lora_model"), 5, str(run_dir), str(setup["base"]))
    for name in ("checkpoint-3", "checkpoint-3/adapter"):
        checkpoint = resolve_target(str(run_dir / name))
        assert (checkpoint.model, checkpoint.step, checkpoint.output_dir) == (
            str(run_dir / "checkpoint-3" / "adapter"), 3, str(run_dir)), name
    with pytest.raises(ConfigError, match="holds no loadable model"):
        resolve_target(str(run_dir / "checkpoint-4"))
    plain = resolve_target(str(setup["base"]))
    assert (plain.adapter, plain.step, plain.output_dir) == (False, None, None)


def test_evals_in_one_second_keep_both_files_and_the_latest_is_the_last(tmp_path):
    from praisonai_accel.evaluate.results import default_path, latest_eval

    for index in range(3):
        path = default_path(tmp_path)
        path.parent.mkdir(exist_ok=True)
        path.write_text(json.dumps({"comparison": [], "index": index}))
    assert len(list((tmp_path / "eval").glob("*.json"))) == 3
    assert latest_eval(tmp_path)["index"] == 2
