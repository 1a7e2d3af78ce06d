"""Safe by default: checkpoints run no code, saves delete nothing they did not make, generated scripts carry no
injected command, and what reaches the Hub names nothing private."""

from __future__ import annotations

import io
import json
import pickle
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from praisonai_accel.run_dir import checkpoints as ckpt_dir
from praisonai_accel.config import ConfigError, parse_config
from praisonai_accel.launcher.local import LauncherOutput
from praisonai_accel.run_dir.output_dirs import MARKER, NotOurs, check_replaceable, replace_with
from praisonai_accel.launcher.slurm import slurm_script

from conftest import REPO, cli, cpu_env, read_summary, run, write_config

NASTY = ["a b", "50%", "x$(touch PWNED)y", "`touch PWNED`", 'q"uo\\te', "h#sh", "it's"]


class CreatesAFile:
    """Unpickling this runs code: it creates `path`."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return (Path.touch, (Path(self.path),))


def poison(checkpoint: Path, marker: Path) -> list[str]:
    """Replace every pickle file of a checkpoint: torch.save archives by an archive of the payload, others by a bare
    pickle of it."""
    replaced = []
    for path in sorted(checkpoint.iterdir()):
        if path.suffix in (".pkl", ".bin", ".pt"):
            if path.suffix == ".bin":
                torch.save({"state": CreatesAFile(marker)}, path)
            else:
                path.write_bytes(pickle.dumps(CreatesAFile(marker)))
            replaced.append(path.name)
    return replaced


@pytest.fixture(scope="module")
def finished(tmp_path_factory, tiny_model, alpaca_file):
    """A finished 1-process run with checkpoints at steps 2 and 4, trained with trust_remote_code (and no revision),
    into an output_dir that already holds a user's file and a push snapshot left by a crash."""
    directory = tmp_path_factory.mktemp("finished")
    out = directory / "out"
    (out / ".push-abc123" / "lora_model").mkdir(parents=True)
    (out / "notes.txt").write_text("mine")
    config = write_config(directory, tiny_model, alpaca_file, max_steps=4, save_steps=2, trust_remote_code=True)
    result = cli("train", str(config))
    assert result.returncode == 0, result.stderr[-3000:]
    return directory, result.stderr


def test_checkpoints_hold_no_pickled_scheduler_and_stale_push_snapshots_are_removed(finished):
    directory, stderr = finished
    out = directory / "out"
    names = {p.name for p in (out / "checkpoint-4").iterdir()}
    assert ckpt_dir.SCHEDULER_FILE in names and not any(n.startswith("custom_checkpoint") for n in names)
    assert json.loads((out / "checkpoint-4" / ckpt_dir.SCHEDULER_FILE).read_text())["last_epoch"] == 4
    ckpt_dir.check_safe_to_load(out / "checkpoint-4")  # what this project writes passes its own scan
    assert not (out / ".push-abc123").exists() and (out / "notes.txt").read_text() == "mine"
    assert "trust_remote_code: true without revision" in stderr
    assert stderr.count("without revision") == 1  # once, not once per rank or per load
    assert json.loads((out / "lora_model" / MARKER).read_text())["trust_remote_code"] is True


def test_a_poisoned_checkpoint_is_refused_naming_the_file_and_never_unpickled(tmp_path, finished, tiny_model,
                                                                            alpaca_file):
    directory, _ = finished
    copy = tmp_path / "run"
    shutil.copytree(directory, copy)
    marker = tmp_path / "PWNED"
    replaced = poison(copy / "out" / "checkpoint-4", marker)
    assert {"optimizer.bin", "random_states_0.pkl"} <= set(replaced)
    config = write_config(copy, tiny_model, alpaca_file, max_steps=6, save_steps=2, trust_remote_code=True)
    result = cli("train", str(config))  # refused by the CLI, before launch
    assert result.returncode == 2, result.stderr[-2000:]
    line = result.stderr.strip()
    assert len(line.splitlines()) == 1 and "cannot be loaded safely" in line and "checkpoint-4" in line
    assert re.search(r"(optimizer\.bin|random_states_0\.pkl)", line)
    worker = run([sys.executable, "-m", "praisonai_accel.train", str(config)])  # the training module itself
    assert worker.returncode == 2 and "cannot be loaded safely" in worker.stderr
    assert not marker.exists()


def test_resuming_another_runs_checkpoint_says_what_differs_and_force_resume_overrides(tmp_path, finished, tiny_model,
                                                                                     alpaca_file):
    directory, _ = finished
    checkpoint = directory / "out" / "checkpoint-4"
    other = write_config(tmp_path, tiny_model, alpaca_file, max_steps=6, seed=7, lora_r=4,
                         resume_from_checkpoint=str(checkpoint))
    result = cli("train", str(other), "--dry-run")
    assert result.returncode == 2
    assert "belongs to another run (lora_r, seed, trust_remote_code differ); set force_resume: true" in result.stderr
    forced = write_config(tmp_path, tiny_model, alpaca_file, max_steps=6, seed=7, trust_remote_code=True,
                          resume_from_checkpoint=str(checkpoint), force_resume=True)
    result = cli("train", str(forced), "--dry-run")  # the CLI and the training module decide with one function
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"# start: resume from {checkpoint}" in result.stdout


def test_chat_needs_the_runs_trust_remote_code_passed_explicitly(finished):
    """A file in the model folder says how it was trained; it never turns remote code on by itself."""
    from praisonai_accel.models.inference import ModelDirError, load_for_inference

    directory, _ = finished
    with pytest.raises(ModelDirError, match="pass --trust-remote-code"):
        load_for_inference(directory / "out", device="cpu")
    model, tokenizer = load_for_inference(directory / "out", device="cpu", trust_remote_code=True)
    assert model.peft_config and tokenizer.chat_template
    refused = cli("generate", str(directory / "out"), "-p", "hi", "--max-new-tokens", "2")  # the CLI says it in one line
    assert refused.returncode == 2 and "pass --trust-remote-code" in refused.stderr


@pytest.mark.parametrize("final, message", [
    (".", "is output_dir or holds it"),
    ("", "must name a directory"),
    ("..", "is output_dir or holds it"),
    ("checkpoint-7", "where checkpoints are saved"),
])
def test_final_model_dir_that_would_replace_output_dir_is_refused(tmp_path, final, message):
    with pytest.raises(ConfigError, match=message):
        parse_config({"model_name": "m", "dataset": "d.jsonl", "output_dir": str(tmp_path / "out"),
                      "final_model_dir": final})


def test_a_users_directory_is_never_replaced_by_the_final_save(tmp_path, tiny_model, alpaca_file):
    users = tmp_path / "my-models"
    users.mkdir()
    (users / "precious.txt").write_text("keep me")
    config = write_config(tmp_path, tiny_model, alpaca_file, max_steps=2, final_model_dir=str(users))
    result = cli("train", str(config), "--dry-run")  # the CLI, before launch
    assert result.returncode == 2 and "praisonai-accel did not write" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    worker = run([sys.executable, "-m", "praisonai_accel.train", str(config)])  # the training module, before training
    assert worker.returncode == 2 and "praisonai-accel did not write" in worker.stderr
    assert not (tmp_path / "out" / "metrics.jsonl").exists()
    assert (users / "precious.txt").read_text() == "keep me" and sorted(p.name for p in users.iterdir()) == ["precious.txt"]


def test_replace_with_replaces_only_its_own_output(tmp_path):
    target = tmp_path / "final"
    for attempt in range(2):  # absent, then ours: replaced
        tmp = tmp_path / f"tmp{attempt}"
        tmp.mkdir()
        (tmp / "weights").write_text(str(attempt))
        replace_with(tmp, target, "final_model_dir")
        assert (target / "weights").read_text() == str(attempt) and (target / MARKER).is_file()
    (target / MARKER).unlink()  # now it looks like the user's
    tmp = tmp_path / "tmp2"
    tmp.mkdir()
    with pytest.raises(NotOurs):
        replace_with(tmp, target, "final_model_dir")
    assert (target / "weights").read_text() == "1"
    (tmp_path / "empty").mkdir()
    check_replaceable(tmp_path / "empty", "k")  # an empty directory holds nothing to lose
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotOurs):
        check_replaceable(tmp_path / "file", "k")


def _sbatch_argument(line: str) -> tuple[str, str]:
    """One argument of an #SBATCH line, read the way SLURM's sbatch reads it (src/sbatch/opt.c, _get_argument): double
    or single quotes group characters, a backslash takes the next character literally, an unquoted # ends the line.
    Returns (argument, the rest of the line)."""
    i, out, quote = 0, [], None
    while i < len(line) and line[i].isspace():
        i += 1
    while i < len(line) and (quote or not line[i].isspace()):
        ch = line[i]
        if ch == "\\" and i + 1 < len(line):
            out.append(line[i + 1])
            i += 2
            continue
        if quote:
            if ch == quote:
                quote = None
            else:
                out.append(ch)
        elif ch in "\"'":
            quote = ch
        elif ch == "#":
            break
        else:
            out.append(ch)
        i += 1
    return "".join(out), line[i:]


def test_sbatch_script_quotes_every_value_and_refuses_control_characters(tmp_path):
    for value in NASTY:
        out = tmp_path / f"out {value.replace(chr(92), '')}"  # a backslash turns SLURM's filename patterns off: refused
        config = parse_config({"model_name": "m", "dataset": "d.jsonl", "output_dir": str(out)})
        script = slurm_script(tmp_path / f"c {value}.yaml", config, nodes=2, gpus_per_node=8, partition=value, time=value,
                              account=value, job_name=value)
        lines = script.splitlines()
        directives = {}
        for line in lines[1:]:
            if not line.startswith("#SBATCH"):
                break
            argument, rest = _sbatch_argument(line[len("#SBATCH"):])
            assert not rest.strip(), f"a second argument on {line!r}"
            flag, _, val = argument.partition("=")
            directives[flag] = val
        for flag in ("--job-name", "--partition", "--time", "--account"):
            assert directives[flag] == value
        assert directives["--output"] == str(out.resolve()).replace("%", "%%") + "/logs/slurm-%j.out"
        assert {"--signal", "--requeue", "--gpus-per-node"} <= set(directives)  # nothing after a bare line is lost
        script_path = tmp_path / "job.sbatch"
        script_path.write_text(script)
        assert subprocess.run(["bash", "-n", str(script_path)]).returncode == 0
        # the body: what bash assigns is the path itself, with nothing run
        probe = subprocess.run(["bash", "-c", next(l for l in lines if l.startswith("OUTPUT_DIR=")) + '; printf %s "$OUTPUT_DIR"'],
                               capture_output=True, text=True, cwd=tmp_path)
        assert probe.stdout == str(out.resolve())
    assert not (tmp_path / "PWNED").exists()
    with pytest.raises(ConfigError, match="control character"):
        slurm_script(tmp_path / "c.yaml", config, nodes=1, gpus_per_node=1, job_name="x\nrm -rf ~")
    with pytest.raises(ConfigError, match="backslash"):
        slurm_script(tmp_path / "c.yaml", parse_config({"model_name": "m", "dataset": "d.jsonl", "output_dir": "a\\b"}),
                     nodes=1, gpus_per_node=1)
    with pytest.raises(ConfigError, match="control character"):
        parse_config({"model_name": "m", "dataset": "d.jsonl", "output_dir": "out\ntouch PWNED"})


def test_slurm_command_refuses_a_newline_in_a_flag_with_one_line(tmp_path, tiny_model, alpaca_file):
    config = write_config(tmp_path, tiny_model, alpaca_file)
    result = cli("slurm", str(config), "--nodes", "2", "--gpus-per-node", "1", "--job-name", "x\necho injected")
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.strip() == ("error: --job-name: 'x\\necho injected' holds a control character (a newline?); "
                                     "it would end a line of the script")


def test_unhashable_yaml_key_and_empty_training_set_are_one_line(tmp_path, tiny_model, alpaca_file):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model_name: m\n? [a, b]\n: 1\n")
    result = cli("train", str(bad))
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1 and "line 2" in result.stderr
    config = write_config(tmp_path, tiny_model, alpaca_file, val_split_ratio=0.5,
                          dataset=[{"name": str(alpaca_file), "format": "alpaca", "num_samples": 1}])
    result = cli("train", str(config), timeout=120)
    assert result.returncode == 2 and "no example is left to train on" in result.stderr, result.stderr[-2000:]


def test_the_launcher_relay_drops_tracebacks_but_not_what_follows():
    sink = io.StringIO()
    relay = LauncherOutput(sink)
    for line in ["Traceback (most recent call last):\n", '  File "x.py", line 1, in <module>\n', "ValueError: boom\n",
                 "warning: something after a library traceback\n",
                 "Traceback (most recent call last):\n", '  File "run.py", line 9\n',
                 "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n", "=" * 60 + "\n",
                 "praisonai_accel.train FAILED\n", "Root Cause (first observed failure):\n", "=" * 60 + "\n",
                 "error: rank 1: RuntimeError: late (full log: out/logs/rank-1.log)\n"]:
        relay.feed(line)
    assert sink.getvalue() == ("warning: something after a library traceback\n"
                               "error: rank 1: RuntimeError: late (full log: out/logs/rank-1.log)\n")
    assert relay.worker_error


def test_no_fault_injector_ships_in_the_package():
    for path in (REPO / "praisonai_accel").rglob("*.py"):
        assert "TEST_CRASH" not in path.read_text() and "os._exit(17)" not in path.read_text(), path


def test_revision_is_recorded_and_a_moved_branch_refuses_to_resume(tmp_path, tiny_model, alpaca_file):
    """A Hub model in a local cache (offline): refs/main names the commit. Train at revision main, move main to another
    commit, and the resume is refused with the commit to pin."""
    repo = tmp_path / "hub" / "models--me--tiny"
    first, second = "a" * 40, "b" * 40
    for commit in (first, second):
        shutil.copytree(tiny_model, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(first)
    env = cpu_env(HF_HUB_CACHE=str(tmp_path / "hub"))
    config = write_config(tmp_path, "me/tiny", alpaca_file, max_steps=2, save_steps=2, revision="main")
    result = cli("train", str(config), env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = read_summary(tmp_path / "out")
    assert summary["revision"] == "main" and summary["model_commit"] == first
    assert (tmp_path / "out" / "lora_model" / "README.md").read_text().startswith("---\nbase_model: me/tiny\n")
    (repo / "refs" / "main").write_text(second)
    longer = write_config(tmp_path, "me/tiny", alpaca_file, max_steps=4, save_steps=2, revision="main")
    result = cli("train", str(longer), env=env)
    assert result.returncode == 2, result.stderr[-3000:]
    assert f"now resolves to commit {second}, but checkpoint-2 was trained on {first}; set revision: {first}" in result.stderr


@pytest.mark.parametrize("saves, requeued", [(True, True), (False, False)])
def test_a_preempted_slurm_job_requeues_only_after_saving_a_newer_checkpoint(tmp_path, saves, requeued):
    """A requeued job that fails during setup leaves progress.json saying "preempted"; requeueing on that alone
    loops forever. The script requeues only when this attempt saved a checkpoint newer than the one it started from.
    The training command is a stand-in that ends as preemption does, with or without saving."""
    out = tmp_path / "out"
    (out / "checkpoint-5").mkdir(parents=True)
    (out / "checkpoint-5" / "COMPLETE").write_text("5")
    (out / "progress.json").write_text('{"status": "preempted", "global_step": 5}')  # left by the previous attempt
    fake_python = tmp_path / "python"
    fake_python.write_text("#!/bin/bash\n"
                           'case "$3" in preprocess) exit 0;; esac\n'
                           + (f'mkdir -p "{out}/checkpoint-12" && echo 12 > "{out}/checkpoint-12/COMPLETE"\n' if saves else "")
                           + "exit 143\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(f'#!/bin/bash\n[ "$1" = show ] && echo localhost && exit 0\necho "$@" >> "{tmp_path}/scontrol.log"\n')
    (bin_dir / "srun").write_text('#!/bin/bash\nargs=()\nfor a in "$@"; do case $a in --*) ;; *) args+=("$a");; esac; done\n'
                                  '"${args[@]}"\n')
    for path in (fake_python, bin_dir / "scontrol", bin_dir / "srun"):
        path.chmod(0o755)
    config = parse_config({"model_name": "m", "dataset": "d.jsonl", "output_dir": str(out)})
    script = tmp_path / "job.sbatch"
    script.write_text(slurm_script(tmp_path / "c.yaml", config, nodes=1, gpus_per_node=1, cpu=True, python=str(fake_python)))
    env = cpu_env(PATH=f"{bin_dir}:/usr/bin:/bin", SLURM_NNODES="1", SLURM_JOB_NODELIST="localhost", SLURM_JOB_ID="4242")
    result = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 143
    log = tmp_path / "scontrol.log"
    if requeued:
        assert log.read_text().split() == ["requeue", "4242"] and "resume from checkpoint-12" in result.stdout
    else:
        assert not log.exists() and "no checkpoint newer than checkpoint-5 was saved: not requeueing" in result.stderr
