"""What a run shows and leaves to read, in process: the progress bar redrawn in place with log lines above it (a
worker's and the launcher's relay of several processes), the methods' headline metrics on short console lines, in
`report` and in loss.png, grad_norm averaged like the loss, the end summary, and progress.json read back as how the
run ended. The same console under a real pseudo-terminal, with Ctrl-C, is tests/test_checkpoint.py's."""

from __future__ import annotations

import io
import json
import logging
import os
import re
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from praisonai_accel import logs
from praisonai_accel.launcher.local import LauncherOutput
from praisonai_accel.run_dir.report import read_run, write_loss_plot
from praisonai_accel.worker import outputs
from praisonai_accel.worker.metrics import MetricsLogger, StepResult, Window
from praisonai_accel.run_dir.metrics import headline_names

from conftest import screen_of

GRPO_RECORD = {  # what a GRPO step logs (about 400 characters as one line)
    "step": 4, "epoch": 0.5, "loss": 0.0123, "reward": 0.75, "reward_std": 0.2, "rewards/correct/mean": 0.5,
    "rewards/correct/std": 0.5, "rewards/format/mean": 1.0, "rewards/format/std": 0.0, "frac_reward_zero_std": 0.25,
    "kl": 0.001, "clip_ratio": 0.0, "clip_ratio/low_mean": 0.0, "clip_ratio/high_mean": 0.0,
    "completions/mean_length": 12.5, "learning_rate": 1e-5, "grad_norm": 0.42, "tokens_per_second": 5987.0,
    "model_tflops_per_second": 0.01, "step_seconds": 0.5, "padding_fraction": 0.1, "tokens": 100, "positions": 110,
    "targets": 50, "examples": 8, "model_flops": 1e9, "time": 0.0,
}


@pytest.fixture
def terminal(monkeypatch):
    """A worker's stderr as the launcher's pipe to a terminal, and its console logging."""
    stream = io.StringIO()  # made sys.stderr in the test itself: pytest's capture takes it back between setup and call
    monkeypatch.setenv("PRAISONAI_ACCEL_TTY", "1")
    monkeypatch.setenv("COLUMNS", "100")
    handler = logs._ConsoleHandler(stream)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger = logging.getLogger("praisonai_accel")
    saved = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield stream
    logger.removeHandler(handler)
    logger.setLevel(saved)
    logs.end_status_line()


def test_the_bar_redraws_in_place_every_step_and_log_lines_go_above_it(tmp_path, terminal, monkeypatch):
    monkeypatch.setattr("sys.stderr", terminal)
    metrics = MetricsLogger(tmp_path / "metrics.jsonl", 8, enabled=True, headline=("reward", "rewards/*/mean",
                                                                                   "completions/mean_length"))
    with metrics:
        for step in range(1, 9):
            metrics.advance(step)
            if step % 4 == 0:  # logging_steps 4: the bar still moved at every step
                metrics.log({**GRPO_RECORD, "step": step})
            if step == 6:
                logging.getLogger("praisonai_accel").info("saved checkpoint out/checkpoint-6")
    text = terminal.getvalue()
    redraws = [piece for piece in text.split("\r") if piece.startswith("\x1b[2Ktraining")]
    counts = [int(re.search(r" (\d+)/8", piece).group(1)) for piece in redraws]
    assert counts == sorted(counts) and sorted(set(counts)) == list(range(9)), counts  # every step, not every log
    shown = screen_of(text)
    assert sum(line.startswith("training") for line in shown) == 1, shown  # one bar, not a line per refresh
    assert shown[-1].startswith("training ") and " 8/8" in shown[-1]
    assert "saved checkpoint out/checkpoint-6" in shown and "step 4/8 | loss 0.0123 | reward 0.75 | correct 0.5 | format 1 " \
        "| mean_length 12.5 | grad_norm 0.42 | 5,987 tok/s" in shown
    assert len(shown[-1]) <= 99, shown  # the bar is never wider than the terminal: a wrapped line cannot be redrawn
    assert all(len(line) <= 120 for line in shown), shown  # short lines, whatever the method logs
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [4, 8]


def test_the_launcher_keeps_the_bar_below_what_other_processes_write(tmp_path):
    sink = io.StringIO()
    relay = LauncherOutput(sink)
    read, write = os.pipe()
    rank0_bar = f"{logs.CLEAR_LINE}training ###------- 3/10 | loss 1.0000\r"
    os.write(write, (f"{rank0_bar}rank 1: warning: something\n{logs.CLEAR_LINE}step 3/10 | loss 1.0000\n"
                     f"{rank0_bar}W1206 04:00:00.123000 99 api.py:1] Received 2 death signal, shutting down workers\n"
                     f"{logs.CLEAR_LINE}training ##########-- 10/10\n{logs.CLEAR_LINE}error: rank 0: boom\n").encode())
    os.close(write)
    relay.feed_stream(read)
    os.close(read)
    shown = screen_of(sink.getvalue())
    assert shown == ["rank 1: warning: something", "step 3/10 | loss 1.0000", "training ##########-- 10/10",
                     "error: rank 0: boom"], shown
    assert relay.worker_error  # its "error:" line is known as one, cleared or not

    sink = io.StringIO()
    relay = LauncherOutput(sink)
    read, write = os.pipe()
    os.write(write, rank0_bar.encode())  # rank 0 killed with its bar on screen
    os.close(write)
    relay.feed_stream(read)
    os.close(read)
    sink.write("error: rank 0 was killed (SIGKILL)\n")  # what the launcher says next
    assert screen_of(sink.getvalue()) == ["training ###------- 3/10 | loss 1.0000", "error: rank 0 was killed (SIGKILL)"]


def test_on_a_terminal_a_workers_line_never_runs_into_this_processs_own_bar():
    """Tokenizing beside the workers, the launching process draws datasets' bar ("\rMap: ..." without a newline)
    on the terminal the workers' lines are relayed to: each line erases it first, and the bar's next update draws it
    below (a newcomer saw 'Map: 31%|###| 93/300 [00:03<00:04]backend: transformers ...')."""
    for terminal, expected in ((True, ["backend: transformers | processes: 2", "model: tiny | trainable 1,024",
                                       "Map: 76%|#### | 229/300"]),
                               (False, ["Map: 31%|##   | 93/300backend: transformers | processes: 2",
                                        "model: tiny | trainable 1,024", "Map: 76%|#### | 229/300"])):
        sink = io.StringIO()
        relay = LauncherOutput(sink, terminal=terminal)
        sink.write("\rMap: 31%|##   | 93/300")  # this process's own bar, drawn by tqdm
        relay.feed("backend: transformers | processes: 2\n")
        relay.feed(f"{logs.CLEAR_LINE}model: tiny | trainable 1,024\n")
        sink.write("\rMap: 76%|#### | 229/300")
        assert screen_of(sink.getvalue()) == expected


def test_a_tqdm_bar_that_ends_is_not_drawn_again_below_its_last_state():
    """lm-eval's bars in the eval ranks ("\rdesc: N%|...| k/n" at each update, a newline after the last): the last
    state arrives as a line, and the bar it completes was drawn again below it, stale ('Running generate_until
    requests: 71%' under its own 100%). Another process's line still goes above a bar that is still running."""
    sink = io.StringIO()
    relay = LauncherOutput(sink, terminal=True)
    read, write = os.pipe()
    bar = "Running generate_until requests: {:>3}%|{:<10}| {}/24 [00:00<00:00, 49.74it/s]"
    os.write(write, ("\r  0%|          | 0/100\r 46%|####      | 46/100\r" + "rank 1: a warning\n" +
                     "100%|##########| 100/100\n" +
                     "".join("\r" + bar.format(p, "#" * (p // 10), n) for p, n in ((0, 0), (4, 1), (71, 17), (100, 24)))
                     + "\n").encode())
    os.close(write)
    relay.feed_stream(read)
    os.close(read)
    assert screen_of(sink.getvalue()) == ["rank 1: a warning", "100%|##########| 100/100", bar.format(100, "#" * 10, 24)]


def test_a_line_glued_to_an_unfinished_tqdm_bar_is_split_from_it():
    """tqdm draws "\rBAR" and ends a bar only at its next update, so a line another process writes meanwhile
    arrives glued to it ('... [00:00<05:33, 7.20it/s]W1207 ... Received 2 death signal' at Ctrl-C in `eval`): the
    agent's log line is dropped as when it arrives alone, a rank's line goes above the bar, and the bar stays."""
    sink = io.StringIO()
    relay = LauncherOutput(sink, terminal=True)
    read, write = os.pipe()
    bar = "Running generate_until requests:   0%|          | 1/2400 [00:00<05:33,  7.20it/s]"
    os.write(write, (f"\r{bar}W1207 19:03:09.897000 27020 torch/distributed/elastic/agent/server/api.py:753] "
                     f"Received 2 death signal, shutting down workers\n\r{bar}rank 1: a warning\n").encode())
    os.close(write)
    relay.feed_stream(read)
    os.close(read)
    assert screen_of(sink.getvalue()) == ["rank 1: a warning", bar]


def test_a_relay_that_fails_still_drains_the_workers_pipe_and_its_error_is_raised():
    """The launcher's stderr is relayed on a thread: where our own stderr fails (a closed pipe, a full disk), the
    thread keeps reading the workers' pipe (a full pipe would block them for good) and wait() raises the error."""
    import subprocess
    import sys

    from praisonai_accel.launcher.local import HeldSink, Running

    class Broken:
        def write(self, _text):
            raise BrokenPipeError("stderr closed")

        def flush(self):
            pass

    writer = "import sys\nfor _ in range(4000): sys.stderr.write('x' * 99 + '\\n')"  # 400 kB: a pipe holds 64
    proc = subprocess.Popen(["timeout", "60", sys.executable, "-c", writer], stderr=subprocess.PIPE,
                            start_new_session=True)  # blocked for good, it would end at 60 s with 124
    sink = HeldSink(Broken())
    running = Running(proc, {}, LauncherOutput(sink), sink)
    with pytest.raises(BrokenPipeError):
        running.wait()
    assert proc.returncode == 0  # it wrote everything: nothing blocked it


def test_headline_metrics_are_declared_per_method_and_name_logged_metrics():
    from praisonai_accel.methods.base import TrainingMethod
    from praisonai_accel.methods.grpo import GRPO
    from praisonai_accel.methods.method_keys import GRPO_METRICS, KTO_METRICS, PAIR_METRICS
    from praisonai_accel.methods.preference import PreferenceMethod
    from praisonai_accel.methods.sft import SFT

    assert SFT.headline_metrics == () and TrainingMethod.headline_metrics == ()
    assert set(PreferenceMethod.headline_metrics) <= set(PAIR_METRICS)
    assert headline_names(PreferenceMethod.headline_metrics, KTO_METRICS) == ["rewards/margins"]
    logged = GRPO_METRICS + ("rewards/correct/mean", "rewards/correct/std", "rewards/format/mean", "eval_reward")
    assert headline_names(GRPO.headline_metrics, logged) == ["reward", "rewards/correct/mean", "rewards/format/mean",
                                                             "completions/mean_length"]


def test_grad_norm_is_the_windows_mean_like_the_loss():
    window = Window()
    for loss, norm in ((4.0, 1.0), (2.0, 0.0), (3.0, 0.5)):
        window.add(StepResult(loss_sum=loss, targets=1, tokens=1, positions=1, grad_norm=norm, stop=False))
    record = window.record(SimpleNamespace(global_step=3, epoch=0, batches_in_epoch=3), 1e-4, 10)
    assert record["loss"] == pytest.approx(3.0) and record["grad_norm"] == pytest.approx(0.5)


def _run_dir(tmp_path: Path, status: str, full: bool = False, **progress) -> Path:
    out = tmp_path / "out"
    final = out / ("model" if full else "lora_model")
    final.mkdir(parents=True)
    (final / ("config.json" if full else "adapter_config.json")).write_text("{}")
    records = [{"step": s, "loss": 2.0 - s / 10, "rewards/accuracies": s / 10, "rewards/margins": s / 5,
                "step_seconds": 0.5, "time": 1000.0 + s + (3600 if s > 2 else 0), "learning_rate": 1e-4}
               for s in (1, 2, 3, 4)]  # resumed an hour after step 2
    records.insert(2, {"step": 2, "eval_loss": 1.9, "eval_rewards/accuracies": 0.6, "time": 1003.0})
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (out / "progress.json").write_text(json.dumps({
        "status": status, "global_step": 4, "total_steps": 10, "num_processes": 2, "updated": time.time(),
        "final_model_dir": str(final), "headline_metrics": ["rewards/accuracies", "rewards/margins"], **progress}))
    return out


def test_report_reads_how_the_run_ended_and_shows_the_headline_first_to_last(tmp_path):
    out = _run_dir(tmp_path, "interrupted", signal="SIGINT")
    (out / "checkpoint-4").mkdir()
    run = read_run(out)
    rows = dict(run.rows())
    assert run.status.startswith("interrupted by SIGINT at step 4; ") and run.status.endswith("no checkpoint: a re-run "
                                                                                                "starts from step 0")
    assert list(rows)[2:5] == ["loss (first -> last)", "rewards/accuracies (first -> last)",
                               "rewards/margins (first -> last)"]
    assert rows["rewards/accuracies (first -> last)"] == "0.1000 -> 0.4000" and rows["steps"] == "4 of 10"
    assert rows["training time"] == "2.0 s"  # 4 steps of 0.5 s, not the hour between the attempts
    assert rows["adapter"] == str(out / "lora_model")
    assert write_loss_plot(out) == out / "loss.png"
    from matplotlib.image import imread

    height, width = imread(str(out / "loss.png")).shape[:2]
    assert width == 1600 and height == 450  # the loss, then one panel per headline metric

    failed = read_run(_run_dir(tmp_path / "f", "failed", full=True, exit_code=1))
    assert failed.status == "failed (exit code 1); no checkpoint: a re-run starts from step 0"
    assert dict(failed.rows())["model"] == str(tmp_path / "f" / "out" / "model")  # a full fine-tune: no adapter


def test_report_tells_a_live_run_from_a_killed_one_by_its_lock(tmp_path):
    import fcntl

    out = _run_dir(tmp_path, "running")
    lock = out / "run.lock"
    fd = os.open(lock, os.O_CREAT | os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        assert read_run(out).status == "running"
    finally:
        os.close(fd)  # as the kernel does when the run is SIGKILLed
    assert read_run(out).status == "interrupted without saying how (killed?); no checkpoint: a re-run starts from step 0"


def test_a_run_that_failed_outside_the_loop_records_it_and_an_ended_one_keeps_its_status(tmp_path):
    out = _run_dir(tmp_path, "running")
    outputs.record_end(out, "failed", 1)
    assert json.loads((out / "progress.json").read_text())["status"] == "failed"
    outputs.record_end(out, "interrupted", 130)  # already ended: kept
    assert json.loads((out / "progress.json").read_text())["exit_code"] == 1
    (out / "train_summary.json").write_text("{}")
    outputs.record_end(out, "finished", 4, replaces=("finished",))  # that one was already recorded as failed
    assert json.loads((out / "progress.json").read_text())["exit_code"] == 1
    progress = json.loads((out / "progress.json").read_text())
    (out / "progress.json").write_text(json.dumps({**progress, "status": "finished", "exit_code": 0}))
    outputs.record_end(out, "finished", 4, replaces=("finished",))  # trained and saved, then a push failed
    assert read_run(out).status == "finished, but a push or an Ollama create failed (exit code 4)"
    outputs.record_end(tmp_path / "never-started", "failed", 1)
    assert not (tmp_path / "never-started" / "progress.json").exists()


def test_the_end_summary_is_a_few_lines(tmp_path):
    metrics = MetricsLogger(tmp_path / "m.jsonl", 4, enabled=False, headline=("rewards/accuracies",))
    metrics.first = {"step": 1, "loss": 0.69, "rewards/accuracies": 0.5}
    metrics.last = {"step": 4, "loss": 0.31, "rewards/accuracies": 0.875}
    metrics.last_eval = {"step": 4, "eval_loss": 0.4}
    summary = {"global_step": 4, "num_processes": 2, "train_seconds": 83.2, "best_checkpoint": "checkpoint-2",
               "best_metric": 0.35, "final_model_dir": "out/model"}
    assert outputs.end_summary(summary, metrics, adapter=False, resumed_from=Path("out/checkpoint-2")) == [
        "done: 4 steps in 1m 23s on 2 process(es), resumed from checkpoint-2",
        "loss 0.6900 -> 0.3100 | accuracies 0.5000 -> 0.8750",
        "eval_loss 0.4000 at step 4 | best checkpoint: checkpoint-2 (0.3500)",
        "saved model to out/model",
    ]


def test_a_full_fine_tune_is_saved_as_model_and_lora_as_lora_model(tmp_path):
    from praisonai_accel.config import TrainConfig
    from praisonai_accel.models.inference import resolve_model_dir

    common = dict(model_name="m", dataset=[{"name": "d.jsonl"}], output_dir=str(tmp_path))
    assert TrainConfig(**common, finetune_type="full").final_model_path() == tmp_path / "model"
    assert TrainConfig(**common).final_model_path() == tmp_path / "lora_model"
    assert TrainConfig(**common, finetune_type="full", final_model_dir="lora_model").final_model_dir == "lora_model"
    old = tmp_path / "lora_model"  # a full fine-tune saved before it had its own name
    old.mkdir()
    (old / "config.json").write_text("{}")
    assert resolve_model_dir(tmp_path) == old
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    assert resolve_model_dir(tmp_path) == tmp_path / "model"


def test_ctrl_c_before_training_says_whether_there_is_anything_to_resume(tmp_path):
    from praisonai_accel.config import TrainConfig
    from praisonai_accel.run_dir import checkpoints as ckpt_dir
    from praisonai_accel.worker.failures import Interrupted
    from praisonai_accel.worker.main import _message

    config = TrainConfig(model_name="m", dataset=[{"name": "d.jsonl"}], output_dir=str(tmp_path))
    assert _message(KeyboardInterrupt(), config) == ("praisonai-accel: interrupted before training began; nothing to "
                                                     "resume, a re-run starts from step 0")
    earlier = tmp_path / "checkpoint-7"
    earlier.mkdir()
    (earlier / ckpt_dir.MARKER).write_text("")
    (earlier / ckpt_dir.STATE_FILE).write_text("{}")
    assert _message(KeyboardInterrupt(), config).endswith(f"re-run the same command to resume from {earlier}")
    assert _message(Interrupted(earlier), config) == (f"praisonai-accel: interrupted; checkpoint of the last finished "
                                                      f"step saved at {earlier}; re-run the same command to resume")


def test_sigint_sigterm_and_slurms_sigusr1_each_ask_for_a_stop_named_after_it(tmp_path):
    import signal

    from praisonai_accel.worker.failures import Interrupted, Preempted
    from praisonai_accel.worker.stop import STOP_SIGNALS, StopSignals

    saved = {name: signal.getsignal(getattr(signal, name)) for name in STOP_SIGNALS}
    try:
        for name, kind, status in (("SIGUSR1", Preempted, "preempted"), ("SIGTERM", Preempted, "preempted"),
                                   ("SIGINT", Interrupted, "interrupted")):
            stop = StopSignals()
            stop.install()
            assert not stop.requested
            os.kill(os.getpid(), getattr(signal, name))
            os.kill(os.getpid(), signal.SIGINT)  # a repeat (torchrun's agent forwards it again) changes nothing
            assert stop.requested and stop.name == name
            stopped = stop.stopped(tmp_path / "checkpoint-3")
            assert type(stopped) is kind and stopped.status == status
    finally:
        for name, handler in saved.items():
            signal.signal(getattr(signal, name), handler)
    assert "stopped by SIGUSR1; checkpoint of the last finished step saved at" in str(Preempted(tmp_path, "SIGUSR1"))
