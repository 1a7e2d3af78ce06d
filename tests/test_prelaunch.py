"""The one pass of checks before launch (launcher/prelaunch.check_launch) and the rule list the worker runs again
(checks.RULES): `train`, `slurm` and `k8s` refuse the same broken rule with the same line before anything is
printed or started; a Kubernetes manifest skips what only the pods can see; the worker runs its phases' rules."""

from __future__ import annotations

import pytest

from conftest import cli, write_config
from praisonai_accel.checks import RULES, Situation, check_run
from praisonai_accel.config import ConfigError, parse_config

DEVICE_MAP = "device_map: 'auto' spreads one model over several GPUs and cannot be used with 2 DDP processes"
COMMANDS = {
    "train": ("train", "--cpu", "--num-processes", "2"),
    "slurm": ("slurm", "--nodes", "2", "--gpus-per-node", "1", "--cpu"),
    "k8s": ("k8s", "--nodes", "2", "--gpus-per-node", "1", "--cpu", "--image", "me/train:1", "--pvc", "runs"),
}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_train_slurm_and_k8s_refuse_a_broken_rule_with_the_same_line_before_anything(tmp_path, tiny_model,
                                                                                      alpaca_file, command):
    config = write_config(tmp_path, tiny_model, alpaca_file, device_map="auto")
    name, *flags = COMMANDS[command]
    result = cli(name, str(config), *flags)
    assert result.returncode == 2 and result.stdout == "", result.stdout[-2000:]
    assert result.stderr.strip().splitlines() == [f"error: {DEVICE_MAP}; remove device_map to load the full model "
                                                  "on each rank's GPU"]
    assert not (tmp_path / "out").exists()


def test_slurm_checks_what_the_job_will_see_and_k8s_only_the_config(tmp_path, tiny_model, alpaca_file):
    # the data file is on the pods' volume, not here: a manifest is still written; an sbatch script is not
    config = write_config(tmp_path, tiny_model, tmp_path / "on-the-volume.jsonl", dataset_prepared_path=None)
    slurm = cli("slurm", str(config), *COMMANDS["slurm"][1:])
    assert slurm.returncode == 2 and slurm.stdout == ""
    assert slurm.stderr.strip().startswith("error: dataset[0].name: no such file or directory")
    k8s = cli("k8s", str(config), *COMMANDS["k8s"][1:], "--mount-path", str(tmp_path))
    assert k8s.returncode == 0, k8s.stderr
    assert "kind: TrainJob" in k8s.stdout


def test_the_worker_runs_the_rules_of_its_phase_and_the_launch_skips_the_files_it_cannot_see(tmp_path):
    config = parse_config({"model_name": "m", "dataset": "d.jsonl", "output_dir": str(tmp_path / "out")})
    with pytest.raises(ConfigError, match="DeepSpeed"):  # a worker started by accelerate launch past the CLI
        check_run(Situation(config, 2, "worker", distributed_type="DEEPSPEED"))
    check_run(Situation(config, 2, "worker", distributed_type="MULTI_GPU"))
    reentrant = parse_config({"model_name": "m", "dataset": "d.jsonl", "use_gradient_checkpointing": "reentrant",
                              "ddp_find_unused_parameters": True})
    with pytest.raises(ConfigError, match="reentrant"):
        check_run(Situation(reentrant, 2, "worker", distributed_type="MULTI_GPU"))
    # a final model directory that is not ours: refused where output_dir is at hand, not on a machine without it
    (tmp_path / "out" / "lora_model").mkdir(parents=True)
    (tmp_path / "out" / "lora_model" / "notes.txt").write_text("the user's")
    with pytest.raises(ConfigError, match="final_model_dir"):
        check_run(Situation(config, 1, "launch"))
    check_run(Situation(config, 1, "launch", sees_files=False))
    assert [r.name for r in RULES if "worker" in r.phases and "launch" not in r.phases] == ["DeepSpeed"]
