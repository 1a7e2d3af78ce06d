"""From `train --gpus ...` to one argument list; the accelerate config file; dry runs."""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from praisonai_accel.atomic import write_yaml_atomic
from praisonai_accel.launcher.accelerate_config import build_accelerate_config
from praisonai_accel.cli import app
from praisonai_accel.config import parse_config
from praisonai_accel.launcher.local import launch
from praisonai_accel.launcher.plan import LaunchError, Nodes, free_port, parse_gpus, plan_launch

from conftest import REPO, cli, run, write_config


@pytest.mark.parametrize(
    "spec,available,expected",
    [(None, 0, (1, None)), ("1", 1, (1, None)), ("2", 4, (2, None)), ("all", 8, (8, None)), ("0,1", 2, (2, [0, 1])),
     ("2,3", 4, (2, [2, 3])), ("ALL", 2, (2, None))],
)
def test_parse_gpus(spec, available, expected):
    assert parse_gpus(spec, available) == expected


@pytest.mark.parametrize(
    "spec,available,message",
    [("4", 2, "--gpus 4: only 2 CUDA GPU(s) visible"), ("all", 0, "no CUDA GPU is visible"),
     ("0,5", 2, "GPU 5 does not exist"), ("0,0", 2, "listed twice"), ("two", 2, "expected a count"), ("0", 2, "expected a count")],
)
def test_parse_gpus_errors(spec, available, message):
    with pytest.raises(LaunchError, match=re.escape(message)):
        parse_gpus(spec, available)


def _config(tmp_path):
    return parse_config({"model_name": "m", "dataset": "d.jsonl", "output_dir": str(tmp_path / "out")})


def test_multi_process_plan_is_an_argument_list_with_explicit_config_file(tmp_path):
    plan = plan_launch(Path("cfg.yaml"), _config(tmp_path), num_processes=2, gpu_ids=[0, 1], port=29999, python="py")
    assert plan.command == [
        "py", "-m", "accelerate.commands.launch", "--config_file", str(tmp_path / "out" / "accelerate_config.yaml"),
        "--main_process_port", "29999", "-m", "praisonai_accel.train", "cfg.yaml",
    ]
    assert plan.env == {"CUDA_VISIBLE_DEVICES": "0,1", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "120"}  # the preemption save's grace
    assert plan.accelerate_config["distributed_type"] == "MULTI_GPU" and plan.accelerate_config["num_processes"] == 2


def test_single_process_runs_without_a_launcher(tmp_path):
    plan = plan_launch(Path("cfg.yaml"), _config(tmp_path), num_processes=1, python="py")
    assert plan.command == ["py", "-m", "praisonai_accel.train", "cfg.yaml"] and not plan.generated_config


def test_cpu_processes_hide_gpus_and_still_use_a_multi_gpu_config(tmp_path):
    # `--cpu --num_processes 2` in accelerate silently starts ONE process; MULTI_GPU with no GPU gives gloo DDP.
    plan = plan_launch(Path("c.yaml"), _config(tmp_path), num_processes=2, cpu=True)
    assert plan.env["CUDA_VISIBLE_DEVICES"] == "" and plan.accelerate_config["distributed_type"] == "MULTI_GPU"


def test_launch_writes_generated_config_then_calls_the_launch_function(tmp_path):
    plan = plan_launch(Path("c.yaml"), _config(tmp_path), num_processes=2, cpu=True, mixed_precision="no")
    calls = []
    assert launch(plan, runner=lambda cmd, env: calls.append((cmd, env)) or 7) == 7
    assert calls == [(plan.command, plan.env)]
    written = (tmp_path / "out" / "accelerate_config.yaml").read_text()
    assert "mixed_precision: 'no'" in written and "downcast_bf16: 'no'" in written  # quoted: bare no reads as false
    assert yaml.safe_load(written) == plan.accelerate_config


def test_user_accelerate_config_is_used_as_is_and_never_rewritten(tmp_path):
    user = tmp_path / "fsdp.yaml"
    user.write_text("distributed_type: FSDP\nnum_machines: 2\nnum_processes: 16\nmain_process_ip: 10.0.0.1\nmain_process_port: 1234\n")
    before = user.read_text()
    plan = plan_launch(Path("c.yaml"), _config(tmp_path), num_processes=1, accelerate_config_file=user)
    assert plan.num_processes == 16  # total over all machines
    assert "--main_process_port" not in plan.command and plan.command[plan.command.index("--config_file") + 1] == str(user)
    launch(plan, runner=lambda cmd, env: 0)
    assert user.read_text() == before and not (tmp_path / "out").exists()


@pytest.mark.parametrize("name,count,fsdp", [("single_gpu.yaml", 1, False), ("multi_gpu.yaml", 2, False),
                                             ("fsdp2.yaml", 2, True)])
def test_shipped_templates_match_the_generator(name, count, fsdp):
    shipped = yaml.safe_load((REPO / "accelerate_configs" / name).read_text())
    assert shipped == build_accelerate_config(count, "bf16", fsdp=fsdp)


def test_fsdp_plan_writes_an_fsdp2_config(tmp_path):
    plan = plan_launch(Path("c.yaml"), _config(tmp_path), num_processes=2, mixed_precision="bf16", fsdp=True)
    assert plan.accelerate_config["distributed_type"] == "FSDP"
    assert plan.accelerate_config["fsdp_config"]["fsdp_version"] == 2
    single = plan_launch(Path("c.yaml"), _config(tmp_path), num_processes=1, fsdp=True)  # FSDP even on one GPU
    assert single.generated_config and single.accelerate_config["distributed_type"] == "FSDP"


def test_restarts_use_a_rendezvous_that_keys_every_round_apart(tmp_path):
    """torchrun's static rendezvous keeps one store across restarts (restarted workers can read stale addresses)."""
    single = plan_launch(Path("c.yaml"), _config(tmp_path), num_processes=2, cpu=True, max_restarts=1)
    assert single.command[single.command.index("--rdzv_backend") + 1] == "c10d"
    assert single.env["PET_RDZV_ENDPOINT"].startswith("127.0.0.1:")  # torchrun's own variable for its endpoint
    assert single.command[single.command.index("--max_restarts") + 1] == "1"
    assert single.env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"  # a fresh store for every attempt
    static = plan_launch(Path("c.yaml"), _config(tmp_path), num_processes=2, cpu=True, max_restarts=1,
                         nodes=Nodes(2, rank=1, main_addr="10.0.0.1", main_port=29400))
    assert static.command[static.command.index("--rdzv_backend") + 1] == "c10d"
    assert static.accelerate_config["main_process_ip"] == "10.0.0.1"
    assert static.accelerate_config["main_process_port"] == 29400 and static.accelerate_config["rdzv_backend"] == "c10d"


def test_free_port_is_bindable():
    import socket

    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def test_dry_run_prints_config_batch_and_exact_command_and_runs_nothing(tmp_path, tiny_model, alpaca_file):
    config = write_config(tmp_path, tiny_model, alpaca_file, per_device_train_batch_size=3, gradient_accumulation_steps=2)
    result = CliRunner().invoke(app, ["train", str(config), "--cpu", "--num-processes", "2", "--dry-run"])
    assert result.exit_code == 0, result.output
    out = result.output
    assert "effective batch (per device x accumulation x processes): 3 x 2 x 2 = 12" in out
    assert f"model_name: {tiny_model}" in out
    command = out.strip().splitlines()[-1]
    words = shlex.split(command)
    assert words[:2] == ["CUDA_VISIBLE_DEVICES=", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT=120"] and words[2] == sys.executable
    assert words[3:6] == ["-m", "accelerate.commands.launch", "--config_file"]
    assert words[-3:] == ["-m", "praisonai_accel.train", str(config)]
    assert not (tmp_path / "out").exists()


def test_asking_for_more_gpus_than_exist_is_a_clear_error(tmp_path, tiny_model, alpaca_file):
    config = write_config(tmp_path, tiny_model, alpaca_file)
    result = cli("train", str(config), "--gpus", "4", "--dry-run")
    assert result.returncode == 2
    assert result.stderr.strip() == ("error: --gpus 4: no CUDA GPU is visible on this machine; --cpu --num-processes "
                                     "4 runs 4 CPU processes (gloo)")
    assert not (tmp_path / "out").exists()
    from praisonai_accel.launcher.plan import LaunchError, parse_gpus

    with pytest.raises(LaunchError, match=r"^--gpus 4: only 2 CUDA GPU\(s\) visible on this machine$"):
        parse_gpus("4", 2)


def test_config_command_writes_and_refuses_to_overwrite(tmp_path, monkeypatch):
    from praisonai_accel.runtime import distributed
    from praisonai_accel.launcher import plan

    monkeypatch.setattr(plan, "count_cuda_gpus", lambda: 4)  # a machine with 4 GPUs, bf16-capable
    monkeypatch.setattr(distributed, "gpu_has_bf16", lambda: True)
    target = tmp_path / "acc.yaml"
    result = CliRunner().invoke(app, ["config", "--gpus", "0,2", "--output", str(target)])
    assert result.exit_code == 0, result.output
    assert yaml.safe_load(target.read_text()) == build_accelerate_config(2, "bf16", "0,2")
    target.write_text("keep me\n")
    result = CliRunner().invoke(app, ["config", "--gpus", "1", "--output", str(target)])
    assert result.exit_code == 2 and "already exists" in result.output and target.read_text() == "keep me\n"
    result = CliRunner().invoke(app, ["config", "--gpus", "all", "--mixed-precision", "fp16", "--output", str(target), "--force"])
    assert result.exit_code == 0 and yaml.safe_load(target.read_text()) == build_accelerate_config(4, "fp16", "all")
    monkeypatch.setattr(plan, "count_cuda_gpus", lambda: 0)
    result = CliRunner().invoke(app, ["config", "--gpus", "all", "--output", str(tmp_path / "x.yaml")])
    assert result.exit_code == 2 and "no CUDA GPU is visible" in result.output


def test_a_users_accelerate_config_runs_a_real_two_process_job(tmp_path, tiny_model, alpaca_file):
    user = tmp_path / "my_accelerate.yaml"
    write_yaml_atomic(build_accelerate_config(2, "no"), user)
    before = user.read_text()
    config = write_config(tmp_path, tiny_model, alpaca_file, max_steps=2)
    result = cli("train", str(config), "--cpu", "--accelerate-config", str(user))
    assert result.returncode == 0, result.stderr[-3000:]
    from conftest import read_summary

    assert read_summary(tmp_path / "out")["num_processes"] == 2
    assert user.read_text() == before and not list((tmp_path / "out").glob("accelerate_config*.yaml"))


def test_write_yaml_atomic_leaves_no_temp_files(tmp_path):
    write_yaml_atomic({"a": "no"}, tmp_path / "f.yaml")
    assert [p.name for p in tmp_path.iterdir()] == ["f.yaml"]
    assert yaml.safe_load((tmp_path / "f.yaml").read_text()) == {"a": "no"}


def test_help_does_not_import_torch():
    code = "import sys; from praisonai_accel.cli import app; print('torch' in sys.modules)"

    result = run([sys.executable, "-c", code])
    assert result.stdout.strip() == "False"
    help_run = cli("--help")
    assert help_run.returncode == 0 and "train" in help_run.stdout


def test_env_command_reports_versions_devices_and_optional_backends():
    result = cli("env")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    import torch

    assert f"torch: {torch.__version__.split('+')[0]}" in out or f"torch: {torch.__version__}" in out
    assert "cuda: no GPU visible" in out and "gloo yes" in out
    assert "not usable (needs a CUDA GPU)" in out.split("unsloth: ")[1] or "unsloth: not installed" in out
    assert out.count("bitsandbytes:") == 1 and out.count("unsloth:") == 1, out  # one line each, installed or not


def test_the_demo_refuses_a_folder_of_the_users_before_writing_anything(tmp_path):
    """`demo --dir` on a folder holding the user's own data.jsonl and config.yaml replaced them with the demo's; a
    folder no demo marked that holds anything, or a file, is now one line, exit 2, untouched."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "data.jsonl").write_text('{"my": "rows"}\n')
    (mine / "config.yaml").write_text("model_name: mine\n")
    for method in ("sft", "dpo", "agent"):
        result = CliRunner().invoke(app, ["demo", "--method", method, "--dir", str(mine)])
        assert result.exit_code == 2 and result.output.strip() == (
            f"error: --dir {mine}: holds files no demo wrote (config.yaml, data.jsonl); the demo writes its model, data "
            "and config there, so name a new or empty folder"), result.output
    assert sorted(p.name for p in mine.iterdir()) == ["config.yaml", "data.jsonl"]
    assert (mine / "data.jsonl").read_text() == '{"my": "rows"}\n'
    result = CliRunner().invoke(app, ["demo", "--vision", "--dir", str(mine / "data.jsonl")])
    assert result.exit_code == 2 and "is a file; name a new or empty folder" in result.output
    # a demo's folder from before the marker (its config trains the demo's model in it) is still the demo's
    from praisonai_accel.commands._demo import DEMO_MARKER, claim_demo_dir
    from praisonai_accel.config import ConfigError

    earlier = tmp_path / "earlier"
    earlier.mkdir()
    (earlier / "data.jsonl").write_text("")
    (earlier / "config.yaml").write_text(yaml.safe_dump({"model_name": str(earlier / "tiny-llama")}))
    claim_demo_dir(earlier)
    assert (earlier / DEMO_MARKER).is_file()
    (mine / "config.yaml").write_text(yaml.safe_dump({"model_name": str(mine / "models" / "llama")}))
    with pytest.raises(ConfigError, match="holds files no demo wrote"):
        claim_demo_dir(mine)


def test_demo_command_visibly_learns_on_two_cpu_processes(tmp_path):
    """The demo's tiny model learns to reverse names it never saw in that order: held-out exact-match accuracy
    from about 0% to at least 90%, with 3 answers shown before and after; building it prints nothing."""
    import re

    result = cli("demo", "--dir", str(tmp_path / "demo"))
    assert result.returncode == 0, result.stderr[-3000:]
    accuracy = re.search(r"exact-match accuracy on 100 held-out prompts: (\d+)% before, (\d+)% after 250 steps on "
                         r"2 processes", result.stdout)
    assert accuracy, result.stdout
    before, after = map(int, accuracy.groups())
    assert before <= 5 and after >= 90, result.stdout
    assert result.stdout.count("  before: ") == 3 and result.stdout.count("  after:  ") == 3
    assert not result.stdout.startswith("\n") and "Writing model shards" not in result.stdout + result.stderr
    assert result.stderr.splitlines()[:2][0].startswith("building a tiny model")
    assert result.stderr.splitlines()[1].startswith("$ ")  # nothing from the libraries before the launch
    assert (tmp_path / "demo" / "outputs" / "model" / "model.safetensors").is_file()
    assert (tmp_path / "demo" / ".praisonai-accel-demo").is_file()  # the folder is the demo's: later demos write there
    if importlib.util.find_spec("lm_eval") is not None:  # it ends with the eval table of its own task
        assert "demo_reverse: base against tuned (lm-eval)" in result.stdout
        latest = json.loads(next((tmp_path / "demo" / "outputs" / "eval").glob("*.json")).read_text())
        row = next(r for r in latest["comparison"] if r["metric"] == "exact_match,none")
        assert (row["base"], row["tuned"]) == (pytest.approx(before / 100), pytest.approx(after / 100))


def test_gpu_benchmark_script_parses_and_refuses_without_a_gpu():
    script = REPO / "bench" / "gpu.sh"
    assert run(["bash", "-n", str(script)]).returncode == 0
    result = run(["bash", str(script)], timeout=120)
    assert result.returncode != 0 and "no CUDA GPU visible" in result.stderr


TORCHRUN_REPORT = """Traceback (most recent call last):
  File "/usr/lib/python3/site-packages/torch/distributed/run.py", line 1028, in main
torch.distributed.elastic.multiprocessing.errors.ChildFailedError: 
=======================================================
praisonai_accel.train FAILED
-------------------------------------------------------
Failures:
[1]:
  time      : 2026-12-03_18:13:30
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 16675)  (SIGTERM)
-------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-03_18:13:30
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 16676)  (SIGKILL)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 16676
=======================================================
"""


def test_a_worker_ended_by_a_signal_is_explained_in_one_line():
    """torchrun only says 'exitcode: -9'; the relay reads its root cause and the launcher says what it means."""
    import io
    import signal as signals

    from praisonai_accel.launcher.local import LauncherOutput, describe_worker_death

    relay = LauncherOutput(io.StringIO())
    for line in TORCHRUN_REPORT.splitlines(keepends=True):
        relay.feed(line)
    assert relay.sink.getvalue() == "" and relay.root_cause == (1, -9)
    line = describe_worker_death(*relay.root_cause, "each of the 2 processes loads a full copy (0.5 GiB)")
    assert line.startswith("rank 1 was killed (SIGKILL), most likely by the out-of-memory killer: each of the 2")
    assert "QLoRA" in line and "--fsdp" in line
    assert "SIGBUS" in describe_worker_death(0, -signals.SIGBUS) and "/dev/shm" in describe_worker_death(0, -signals.SIGBUS)
    assert describe_worker_death(0, -signals.SIGSEGV).startswith("rank 0 crashed (SIGSEGV")
    assert describe_worker_death(0, 1) is None


def test_a_rank_killed_by_a_signal_is_named_though_its_peer_failed_first():
    """The report torchrun gave when rank 1 was SIGKILLed and rank 0 died of 'Connection reset by peer' in the same
    second: rank 0 is the 'root cause' (ties go to the lower rank); the signal death is the one to name."""
    import io

    from praisonai_accel.launcher.local import LauncherOutput

    report = TORCHRUN_REPORT.replace("rank      : 0 (local_rank: 0)\n  exitcode  : -15 (pid: 16675)  (SIGTERM)",
                                     "rank      : 1 (local_rank: 1)\n  exitcode  : -9 (pid: 16676)  (SIGKILL)", 1)
    report = report.replace("rank      : 1 (local_rank: 1)\n  exitcode  : -9 (pid: 16676)  (SIGKILL)\n  error_file",
                            "rank      : 0 (local_rank: 0)\n  exitcode  : 1 (pid: 16675)\n  error_file")
    relay = LauncherOutput(io.StringIO())
    for line in report.splitlines(keepends=True):
        relay.feed(line)
    assert relay.root_cause == (0, 1) and relay.failures == [(1, -9), (0, 1)]
    assert relay.culprit() == (1, -9)
    relay = LauncherOutput(io.StringIO())
    for line in TORCHRUN_REPORT.splitlines(keepends=True):  # SIGTERM (the agent stopping a rank) is the last choice
        relay.feed(line)
    assert relay.culprit() == (1, -9)


def test_leaving_without_teardown_still_runs_exit_handlers_waits_for_threads_and_keeps_the_code(tmp_path):
    """runtime/exit.py (eval's ranks and command): the user's exit handlers run, a thread the interpreter would wait
    for is waited for, and the exit code (or sys.exit's message) is the process's."""
    import textwrap

    mark = tmp_path / "thread-finished"
    script = textwrap.dedent(f"""
        import atexit, sys, threading, time
        from praisonai_accel.runtime.exit import exit_without_teardown
        atexit.register(lambda: print("handler ran", flush=True))
        if sys.argv[1] == "thread":
            threading.Thread(target=lambda: (time.sleep(0.5), open({str(mark)!r}, "w").close())).start()
        exit_without_teardown(3 if sys.argv[1] != "message" else "error: a message")
    """)
    for case, code in (("plain", 3), ("thread", 3), ("message", 1)):
        done = subprocess.run([sys.executable, "-c", script, case], capture_output=True, text=True, timeout=60)
        assert done.returncode == code and done.stdout == "handler ran\n", (case, done)
        assert ("error: a message" in done.stderr) == (case == "message")
    assert mark.exists()
