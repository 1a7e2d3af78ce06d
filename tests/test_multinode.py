"""Several "machines" on localhost: static and c10d rendezvous, a node dying, resume, the SLURM script,
self-healing restarts and the shared-filesystem check. Every node is a real CLI process with --cpu."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from praisonai_accel.launcher.plan import free_port

from conftest import cli, cpu_env, load_adapter, read_summary, write_config
from test_checkpoint import wait_for_step
from test_training import _workers_of, workers_left

# Dropout on: a resumed or restarted run matches only if every rank's RNG state comes back too.
RUN = dict(max_steps=12, per_device_train_batch_size=2, lora_dropout=0.1, logging_steps=1, save_steps=1)


def node(config: Path, *flags: str, **env) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "praisonai_accel", "train", str(config), "--cpu", "--num-processes", "1",
                             "--nnodes", "2", *flags], env=cpu_env(**env), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def finish(procs: list[subprocess.Popen], timeout: float = 240) -> list[tuple[int, str]]:
    return [(p.wait(timeout=timeout), p.communicate()[1]) for p in procs]


def max_diff(a: Path, b: Path) -> float:
    wa, wb = load_adapter(a / "lora_model"), load_adapter(b / "lora_model")
    assert wa.keys() == wb.keys()
    return max((wa[k].double() - wb[k].double()).abs().max().item() for k in wa)


@pytest.fixture(scope="module")
def one_node_two_processes(tmp_path_factory, tiny_model, alpaca_file) -> Path:
    directory = tmp_path_factory.mktemp("one-node")
    result = cli("train", str(write_config(directory, tiny_model, alpaca_file, **RUN)), "--cpu", "--num-processes", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    return directory / "out"


def test_a_dead_node_ends_the_job_and_both_nodes_resume_exactly(tmp_path, tiny_model, alpaca_file, one_node_two_processes):
    """Two Kubeflow TrainJob "pods" (static rendezvous from the PET_* variables, see trainjob_pods): SIGKILL node 1's
    worker, then run both pods again. (--node-rank/--main-addr give the same plan: test_multi_node_dry_run_and_bad_flags.)"""
    config = write_config(tmp_path, tiny_model, alpaca_file, **RUN)
    procs = trainjob_pods(config)
    wait_for_step(tmp_path / "out", 4, procs[0])
    victims = [pid for pid in _workers_of(config) if "praisonai_accel.train" in Path(f"/proc/{pid}/cmdline").read_text()
               and "\0RANK=1\0" in _environ(pid)]
    assert len(victims) == 1, "the second node's worker"
    killed = time.time()
    os.kill(victims[0], signal.SIGKILL)
    results = finish(procs, timeout=60)
    assert time.time() - killed < 60 and all(code != 0 for code, _ in results)
    assert not workers_left(config), "processes left on a node"
    assert "Traceback" not in results[0][1] + results[1][1]
    assert "error: rank 1 was killed (SIGKILL), most likely by the out-of-memory killer" in results[1][1]
    resumed = finish(trainjob_pods(config))
    assert [code for code, _ in resumed] == [0, 0], resumed[0][1][-2000:]
    assert "resumed from" in resumed[0][1] + resumed[1][1]
    assert read_summary(tmp_path / "out")["num_processes"] == 2
    assert max_diff(tmp_path / "out", one_node_two_processes) <= 1e-6
    assert {p.name for p in (tmp_path / "out").glob("accelerate_config*.yaml")} == {  # each node writes its own
        "accelerate_config.node-0.yaml", "accelerate_config.node-1.yaml"}


def _environ(pid: int) -> str:
    try:
        return "\0" + Path(f"/proc/{pid}/environ").read_text(errors="replace")
    except OSError:
        return ""


def test_slurm_script_runs_its_per_node_commands_on_a_simulated_two_node_allocation(tmp_path, tiny_model, alpaca_file,
                                                                                   one_node_two_processes):
    # output_dir holds a space, a % (SLURM's filename patterns) and shell syntax: all of it must stay a path
    run_dir = tmp_path / "a b 50% $(touch PWNED) `touch PWNED`"
    run_dir.mkdir()
    config = write_config(run_dir, tiny_model, alpaca_file, **RUN)
    result = cli("slurm", str(config), "--nodes", "2", "--gpus-per-node", "1", "--cpu", "--time", "01:00:00",
                 "--partition", "gpu", "--job-name", "t $(touch PWNED)")
    assert result.returncode == 0, result.stderr
    script = tmp_path / "job.sbatch"
    script.write_text(result.stdout)
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    text = result.stdout
    assert '#SBATCH --nodes="2"' in text and '#SBATCH --signal="TERM@300"' in text and "--requeue" in text
    assert '--output="' + str(run_dir / "out").replace("%", "%%") + '/logs/slurm-%j.out"' in text
    assert "NODE_COMMAND='" in text and "$SLURM_NODEID" in text  # single-quoted: expanded on each node
    # srun and scontrol stand-ins: srun runs the task once per node with that node's SLURM_* variables
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/bash\n[ \"$1\" = show ] && echo localhost\n")
    (bin_dir / "srun").write_text(
        "#!/bin/bash\nnodes=$SLURM_NNODES\nargs=()\nfor a in \"$@\"; do case $a in --nodes=*) nodes=${a#--nodes=};; "
        "--*) ;; *) args+=(\"$a\");; esac; done\npids=()\nfor ((i=0; i<nodes; i++)); do SLURM_NODEID=$i SLURM_PROCID=$i "
        "\"${args[@]}\" & pids+=($!); done\nstatus=0\nfor p in \"${pids[@]}\"; do wait $p || status=$?; done\nexit $status\n")
    for name in ("scontrol", "srun"):
        (bin_dir / name).chmod(0o755)
    port = free_port()
    env = cpu_env(PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_NNODES="2", SLURM_JOB_NODELIST="localhost",
                  SLURM_JOB_ID=str(port - 20000))
    run = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    assert "node 0 of 2" in run.stdout and "node 1 of 2" in run.stdout
    assert "cached in" in run.stdout  # preprocessing ran once, before training
    summary = read_summary(run_dir / "out")
    assert summary["global_step"] == RUN["max_steps"] and summary["num_processes"] == 2 and summary["weights_in_sync"]
    assert max_diff(run_dir / "out", one_node_two_processes) <= 1e-6  # 2 nodes (c10d rendezvous) = 1 node x 2
    assert not list(tmp_path.rglob("PWNED"))


def test_multi_node_dry_run_and_bad_flags(tmp_path, tiny_model, alpaca_file):
    config = write_config(tmp_path, tiny_model, alpaca_file)
    dry = cli("train", str(config), "--cpu", "--num-processes", "2", "--nnodes", "3", "--node-rank", "2",
              "--main-addr", "10.1.2.3", "--main-port", "29600", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert "# processes: 6 (2 per node x 3 nodes)" in dry.stdout
    assert "num_processes: 6" in dry.stdout and "machine_rank: 2" in dry.stdout and "main_process_ip: 10.1.2.3" in dry.stdout
    assert "effective batch (per device x accumulation x processes): 4 x 1 x 6 = 24" in dry.stdout
    for flags, message in [
        (["--nnodes", "2"], "give --node-rank R and --main-addr HOST"),
        (["--nnodes", "2", "--node-rank", "2", "--main-addr", "h"], "--node-rank 2: must be between 0 and 1"),
        (["--nnodes", "2", "--rdzv-endpoint", "nohost"], "expected HOST:PORT"),
        (["--node-rank", "1"], "need --nnodes greater than 1"),
    ]:
        bad = cli("train", str(config), "--cpu", *flags)
        assert bad.returncode == 2 and message in bad.stderr and len(bad.stderr.strip().splitlines()) == 1, bad.stderr


def test_output_dir_not_shared_between_nodes_is_one_line(tmp_path, tiny_model, alpaca_file):
    """Node 1 sees its own private output_dir (a tmpfs mounted over it in its own mount namespace)."""
    if shutil.which("unshare") is None or subprocess.run(["unshare", "--mount", "true"]).returncode != 0:
        pytest.skip("unshare --mount is not permitted here")
    config = write_config(tmp_path, tiny_model, alpaca_file, max_steps=2)
    (tmp_path / "out").mkdir()
    port = free_port()
    first = node(config, "--node-rank", "0", "--main-addr", "127.0.0.1", "--main-port", str(port))
    private = f"mount -t tmpfs tmpfs {tmp_path / 'out'} && exec " + " ".join(
        [sys.executable, "-m", "praisonai_accel", "train", str(config), "--cpu", "--num-processes", "1", "--nnodes", "2",
         "--node-rank", "1", "--main-addr", "127.0.0.1", "--main-port", str(port)])
    second = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "bash", "-c", private], env=cpu_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    results = finish([first, second])
    assert all(code != 0 for code, _ in results)
    message = "output_dir must be on storage all nodes share"
    assert message in results[0][1] and results[0][1].count("error:") == 1, results[0][1][-2000:]


def trainjob_pods(config: Path) -> list[subprocess.Popen]:
    """Two "pods" of a TrainJob on localhost: the manifest's own pod command, with the PET_* variables the
    torch-distributed runtime gives each pod (and nothing on the command line about the rendezvous)."""
    from praisonai_accel.launcher.kubernetes import KubernetesJob, pod_command

    command = pod_command(KubernetesJob(config_path=str(config), image="x", nodes=2, gpus_per_node=1, cpu=True,
                                        pvc="shared"))
    assert command[:3] == ["praisonai-accel", "train", str(config)] and "--nnodes" not in command
    port = str(free_port())
    return [subprocess.Popen([sys.executable, "-m", "praisonai_accel", *command[1:]], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True,
                             env=cpu_env(PET_NNODES="2", PET_NPROC_PER_NODE="1", PET_NODE_RANK=str(rank),
                                         PET_MASTER_ADDR="127.0.0.1", PET_MASTER_PORT=port))
            for rank in (0, 1)]


def _ray_processes() -> set[int]:
    pids = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if cmdline.startswith("ray::") or "/ray/" in cmdline.split("\0")[0] or "raylet" in cmdline or "gcs_server" in cmdline:
                pids.add(int(entry))
    return pids


def test_ray_train_workers_killed_mid_run_restart_and_end_with_the_ddp_adapter(tmp_path, tiny_model, alpaca_file,
                                                                               one_node_two_processes):
    """`--ray --num-workers 2`: the training module in Ray Train's TorchTrainer workers (gloo). One worker is
    SIGKILLed mid-run; with --max-restarts 1 Ray restarts the group, which resumes from this project's latest
    checkpoint, and the final adapter is bitwise the one of 1 node x 2 processes under DDP. No process is left."""
    before = _ray_processes()
    config = write_config(tmp_path, tiny_model, alpaca_file, **RUN)
    proc = subprocess.Popen([sys.executable, "-m", "praisonai_accel", "train", str(config), "--ray", "--num-workers", "2",
                             "--cpu", "--max-restarts", "1"], env=cpu_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    wait_for_step(tmp_path / "out", 4, proc, timeout=180)
    workers = [pid for pid in _ray_processes() - before
               if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"ray::RayTrainWorker")]
    assert len(workers) == 2, workers
    os.kill(max(workers), signal.SIGKILL)
    output, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, output[-4000:]
    assert "resumed from" in output
    assert read_summary(tmp_path / "out")["num_processes"] == 2
    assert max_diff(tmp_path / "out", one_node_two_processes) == 0.0
    deadline = time.time() + 20
    while (left := _ray_processes() - before) and time.time() < deadline:
        time.sleep(0.5)
    assert not left, "Ray processes left behind"


def test_ray_without_ray_installed_is_one_line(tmp_path, tiny_model, alpaca_file):
    config = write_config(tmp_path, tiny_model, alpaca_file, max_steps=2)
    blocker = tmp_path / "noray"
    (blocker / "ray").mkdir(parents=True)
    (blocker / "ray" / "__init__.py").write_text("raise ImportError('No module named ray')\n")
    result = cli("train", str(config), "--ray", "--cpu", env=cpu_env(PYTHONPATH=str(blocker)))
    assert result.returncode != 0 and result.stderr.strip().splitlines() == [
        "error: --ray needs Ray Train: pip install 'praisonai-accel[ray]'"]
