"""Runs that cannot trample each other or trust a damaged checkpoint: one run per output_dir (run_lock), checkpoints
verified against their manifest on resume (checkpoint_manifest), with real files and real processes."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from praisonai_accel.run_dir import checkpoints as ckpt_dir
from praisonai_accel.run_dir.manifest import MANIFEST
from praisonai_accel.launcher.plan import free_port
from praisonai_accel.run_dir.lock import LOCK_NAME, RunLock, RunLocked

from conftest import cli, cpu_env, read_summary, run, write_config

HOLD = ("import sys, time; from praisonai_accel.run_dir.lock import RunLock; RunLock(sys.argv[1], sys.argv[2]).acquire(); "
        "print('held', flush=True); time.sleep(120)")


def holder(output_dir: Path, job: str = "", **env) -> subprocess.Popen:
    """Another process holding output_dir's lock, as a running launcher would."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(output_dir), job], stdout=subprocess.PIPE, text=True,
                            env=cpu_env(**env))
    assert proc.stdout.readline().strip() == "held"
    return proc


@pytest.fixture
def lock_log():
    """What the lock module logs, read from the logger object it holds: caplog reads it through the root logger,
    which a library imported earlier in the same worker may have rewired (the suite runs modules in one process)."""
    import io

    import praisonai_accel.run_dir.lock as run_lock

    stream, log = io.StringIO(), run_lock.log
    handler = logging.StreamHandler(stream)
    saved = log.level, log.disabled, logging.root.manager.disable
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.disabled = False
    logging.disable(logging.NOTSET)
    yield stream
    log.removeHandler(handler)
    log.level, log.disabled = saved[:2]
    logging.disable(saved[2])


def kill(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait()


# ---------------------------------------------------------------------------------------------- one run per output_dir


def test_the_lock_names_its_holder_refuses_a_second_run_and_takes_over_a_dead_ones(tmp_path, lock_log):
    proc = holder(tmp_path)
    with pytest.raises(RunLocked, match=rf"in use by another run \(pid {proc.pid} on {socket.gethostname()}, started "):
        RunLock(tmp_path).acquire()
    kill(proc)  # the kernel lets go of the flock; the file stays, naming a process that no longer exists
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == proc.pid
    lock = RunLock(tmp_path).acquire()
    said = lock_log.getvalue()
    assert f"taking over {tmp_path / LOCK_NAME}, left by pid {proc.pid}" in said and "no longer exists" in said
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    lock.release()
    lock.release()
    assert not (tmp_path / LOCK_NAME).exists()


def test_without_flock_the_file_is_the_lock(tmp_path, monkeypatch, lock_log):
    """On a file system without locks (an NFS mount with nolock, some FUSE file systems) O_EXCL creation is the lock
    and what the file names decides: a live process refuses, a dead one on this host is taken over."""
    import praisonai_accel.run_dir.lock as run_lock

    monkeypatch.setattr(run_lock, "_flock", lambda fd: None)
    proc = holder(tmp_path)  # holds flock, which this process now ignores: only the file's content counts
    with pytest.raises(RunLocked, match="it is still running"):
        RunLock(tmp_path).acquire()
    kill(proc)
    lock = RunLock(tmp_path).acquire()
    assert "no longer exists" in lock_log.getvalue()
    lock.release()
    assert not (tmp_path / LOCK_NAME).exists()


def test_a_lock_of_another_host_is_refused_unless_it_is_the_same_job(tmp_path, lock_log):
    (tmp_path / LOCK_NAME).write_text(json.dumps({"host": "node-17", "pid": 4242, "started": "yesterday",
                                                  "job": "slurm:99"}))
    with pytest.raises(RunLocked, match=r"pid 4242 on node-17.*delete .*run.lock"):
        RunLock(tmp_path).acquire()
    lock = RunLock(tmp_path, job="slurm:99").acquire()  # the requeued job, on another node after a crash
    assert "earlier attempt of this job" in lock_log.getvalue()
    lock.release()
    proc = holder(tmp_path, job="rdzv:node0:29500")  # another node of the same job, on this host (tests)
    joined = RunLock(tmp_path, job="rdzv:node0:29500").acquire()
    assert joined.joined is not None and joined.joined.pid == proc.pid
    with pytest.raises(RunLocked):
        RunLock(tmp_path, job="rdzv:node0:29501").acquire()
    kill(proc)


def test_a_second_launch_on_the_same_output_dir_is_refused_before_anything_starts(tmp_path, tiny_model, alpaca_file):
    config = write_config(tmp_path, tiny_model, alpaca_file, max_steps=2)
    out = tmp_path / "out"
    proc = holder(out)
    result = cli("train", str(config), timeout=60)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: output_dir: {out} is in use by another run (pid {proc.pid}")
    assert sorted(p.name for p in out.iterdir()) == [LOCK_NAME]  # nothing written: no logs, no cache
    # a worker started without the launcher (accelerate launch / torchrun) is refused by rank 0 itself
    direct = run([sys.executable, "-m", "praisonai_accel.train", str(config)], timeout=60)
    assert direct.returncode == 2 and f"is in use by another run (pid {proc.pid}" in direct.stderr
    kill(proc)


def test_the_lock_is_held_for_the_run_and_released_at_its_end(tmp_path, tiny_model, alpaca_file):
    """A direct 2-process torchrun: rank 0 holds the lock (no launcher); the launcher holds it for its workers."""
    config = write_config(tmp_path, tiny_model, alpaca_file, max_steps=2)
    out = tmp_path / "out"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port", str(free_port()),
                "-m", "praisonai_accel.train", str(config)]
    proc = subprocess.Popen(torchrun, env=cpu_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    # written under flock after the file is created: a reader that does not take the lock may see it empty
    while not _text(out / LOCK_NAME) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    held = json.loads((out / LOCK_NAME).read_text())
    assert held["host"] == socket.gethostname() and held["job"].startswith("torchrun:")
    assert psutil_parent(held["pid"]) is not None  # a worker of this torchrun, not the test
    _, stderr = proc.communicate(timeout=180)
    assert proc.returncode == 0, stderr[-3000:]
    assert not (out / LOCK_NAME).exists()
    result = cli("train", str(write_config(tmp_path, tiny_model, alpaca_file, max_steps=3)), "--cpu",
                 "--num-processes", "2")
    assert result.returncode == 0 and "warning" not in result.stderr, result.stderr[-3000:]
    assert not (out / LOCK_NAME).exists()

    # that run finished without a checkpoint (save_strategy: no): another run (seed 7) would have replaced its model,
    # metrics and summary without a word; refused before launch as another run's checkpoints are, and by the worker
    from praisonai_accel.checks import resume_rule
    from praisonai_accel.config import ConfigError, load_config

    final = out / "lora_model" / "adapter_model.safetensors"
    stamp, before = final.stat().st_mtime_ns, sorted(p.name for p in out.iterdir())
    other = write_config(tmp_path, tiny_model, alpaca_file, max_steps=3, seed=7)
    refused = cli("train", str(other), "--cpu", "--num-processes", "2")
    expected = (f"error: output_dir: {out} holds a finished run of another config (seed differ), its model in "
                f"{out / 'lora_model'}; use another output_dir, or overwrite_output_dir: true to replace it")
    assert refused.returncode == 2 and refused.stderr.strip() == expected, refused.stderr[-3000:]
    assert final.stat().st_mtime_ns == stamp and sorted(p.name for p in out.iterdir()) == before
    with pytest.raises(ConfigError, match="holds a finished run of another config"):
        resume_rule(load_config(other), 2)
    assert resume_rule(load_config(write_config(tmp_path, tiny_model, alpaca_file, max_steps=3, seed=7,
                                                overwrite_output_dir=True)), 2) == (None, 0, None)


def _text(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def psutil_parent(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])
    except OSError:
        return None


# ------------------------------------------------------------------------------------------------ verified checkpoints


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory, tiny_model, alpaca_file) -> Path:
    """A finished run of 4 steps with checkpoints at 2 and 4, copied afresh by each test that damages one."""
    directory = tmp_path_factory.mktemp("two-checkpoints")
    result = cli("train", str(write_config(directory, tiny_model, alpaca_file, max_steps=4, save_steps=2,
                                           logging_steps=1)))
    assert result.returncode == 0, result.stderr[-3000:]
    return directory


def copy_run(source: Path, target: Path, tiny_model, alpaca_file, **overrides) -> Path:
    import shutil

    shutil.copytree(source / "out", target / "out")
    return write_config(target, tiny_model, alpaca_file, max_steps=6, save_steps=2, logging_steps=1, **overrides)


def test_every_checkpoint_file_is_in_its_manifest(two_checkpoints):
    checkpoint = two_checkpoints / "out" / "checkpoint-4"
    recorded = json.loads((checkpoint / MANIFEST).read_text())
    files = {p.relative_to(checkpoint).as_posix() for p in checkpoint.rglob("*") if p.is_file()}
    assert set(recorded["files"]) == files - {MANIFEST, ckpt_dir.MARKER}
    assert {"model.safetensors", "optimizer.bin", "scheduler.json", "praisonai_state.json",
            "adapter/adapter_model.safetensors"} <= set(recorded["files"])
    assert all(entry["size"] == (checkpoint / name).stat().st_size for name, entry in recorded["files"].items())


def test_truncated_weights_heal_from_the_previous_checkpoint(tmp_path, two_checkpoints, tiny_model, alpaca_file):
    config = copy_run(two_checkpoints, tmp_path, tiny_model, alpaca_file)
    weights = tmp_path / "out" / "checkpoint-4" / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    result = cli("train", str(config))
    assert result.returncode == 0, result.stderr[-3000:]
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning: skipping")]
    assert len(warnings) == 1 and "checkpoint-4" in warnings[0] and "model.safetensors is" in warnings[0]
    assert "truncated" in warnings[0] and "Traceback" not in result.stderr
    assert "resumed from" in result.stderr and "checkpoint-2 at step 2" in result.stderr
    out = tmp_path / "out"
    assert read_summary(out)["global_step"] == 6
    assert (out / "checkpoint-4.damaged").is_dir()  # kept, renamed, no longer the newest rotation protects
    assert ckpt_dir.is_complete(out / "checkpoint-4") and ckpt_dir.is_complete(out / "checkpoint-6")  # saved again


def test_one_flipped_byte_in_the_optimizer_state_is_skipped_with_a_warning(tmp_path, two_checkpoints, tiny_model,
                                                                           alpaca_file):
    config = copy_run(two_checkpoints, tmp_path, tiny_model, alpaca_file)
    optimizer = tmp_path / "out" / "checkpoint-4" / "optimizer.bin"
    data = bytearray(optimizer.read_bytes())
    data[len(data) // 2] ^= 0x01
    optimizer.write_bytes(bytes(data))
    dry = cli("train", str(config), "--dry-run")
    assert dry.returncode == 0 and "# start: resume from" in dry.stdout and "checkpoint-2" in dry.stdout
    result = cli("train", str(config), "--cpu", "--num-processes", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning: skipping")]
    assert len(warnings) == 1, result.stderr[-3000:]  # said by the launcher, not again by a worker
    assert "checkpoint-4" in warnings[0] and "optimizer.bin does not match its recorded" in warnings[0]
    assert "checkpoint-2 at step 2" in result.stderr


def test_a_damaged_explicit_checkpoint_is_one_error_and_nothing_is_deleted(tmp_path, two_checkpoints, tiny_model,
                                                                          alpaca_file):
    out = tmp_path / "out"
    config = copy_run(two_checkpoints, tmp_path, tiny_model, alpaca_file,
                      resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-4"))
    weights = out / "checkpoint-4" / "model.safetensors"
    os.truncate(weights, 100)
    before = sorted(str(p.relative_to(out)) for p in out.rglob("*"))
    for command in (["train", str(config)], ["train", str(config), "--cpu", "--num-processes", "2"]):
        result = cli(*command)
        assert result.returncode == 2
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: resume_from_checkpoint: ") and "failed verification" in lines[0]
        assert "model.safetensors is 100 bytes" in lines[0]
    direct = run([sys.executable, "-m", "praisonai_accel.train", str(config)], timeout=120)
    assert direct.returncode == 2 and "failed verification" in direct.stderr and "Traceback" not in direct.stderr
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == before


def test_a_checkpoint_without_a_manifest_still_resumes_and_a_truncated_one_is_skipped(tmp_path, two_checkpoints,
                                                                                    tiny_model, alpaca_file):
    """Checkpoints of an earlier version have no manifest: they load with the checks loading always made, which are
    made first, so a truncated one is skipped as well."""
    config = copy_run(two_checkpoints, tmp_path, tiny_model, alpaca_file)
    for step in (2, 4):
        (tmp_path / "out" / f"checkpoint-{step}" / MANIFEST).unlink()
    weights = tmp_path / "out" / "checkpoint-4" / "model.safetensors"
    os.truncate(weights, 50)
    result = cli("train", str(config))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "warning: skipping checkpoint-4" in result.stderr and "model.safetensors cannot be read" in result.stderr
    assert "checkpoint-2 at step 2" in result.stderr
