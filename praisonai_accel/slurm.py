"""An sbatch script for a multi-node run: one srun task per node, c10d rendezvous on the first node.

Everything that differs between nodes ($SLURM_NODEID, the host name) sits inside single quotes and is
expanded by the shell srun starts on each node, not once at submission. Tokenization runs once, on one
node, before training. SLURM sends SIGTERM ahead of the time limit: every rank saves a checkpoint and
the job requeues itself; the requeued job resumes from that checkpoint.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from .config import TrainConfig


def slurm_script(config_path: Path, config: TrainConfig, *, nodes: int, gpus_per_node: int, partition: str | None = None,
                 time: str | None = None, account: str | None = None, job_name: str | None = None, cpu: bool = False,
                 signal_seconds: int = 300, python: str = sys.executable) -> str:
    config_path = Path(config_path).resolve()
    output_dir = config.output_path().resolve()
    directives = [f"--job-name={job_name or 'praisonai-accel'}", f"--nodes={nodes}", "--ntasks-per-node=1",
                  f"--output={output_dir}/logs/slurm-%j.out", f"--signal=TERM@{signal_seconds}", "--requeue"]
    if not cpu:
        directives.append(f"--gpus-per-node={gpus_per_node}")
    directives += [f"--partition={partition}"] * bool(partition) + [f"--time={time}"] * bool(time) + \
                  [f"--account={account}"] * bool(account)
    devices = f"--cpu --num-processes {gpus_per_node}" if cpu else f"--gpus {gpus_per_node}"
    node_command = (
        'echo "node $SLURM_NODEID of $SLURM_NNODES on $(hostname): $PRAISONAI_ACCEL_GPUS"; '
        'exec "$PRAISONAI_ACCEL_PYTHON" -m praisonai_accel train "$PRAISONAI_ACCEL_CONFIG" $PRAISONAI_ACCEL_GPUS '
        '--nnodes "$SLURM_NNODES" --rdzv-endpoint "$MAIN_ADDR:$MAIN_PORT"'
    )
    lines = ["#!/bin/bash"] + [f"#SBATCH {d}" for d in directives] + [
        "set -uo pipefail",
        "",
        f"export PRAISONAI_ACCEL_CONFIG={shlex.quote(str(config_path))}",
        f"export PRAISONAI_ACCEL_PYTHON={shlex.quote(python)}",
        f"export PRAISONAI_ACCEL_GPUS={shlex.quote(devices)}",
        f"OUTPUT_DIR={shlex.quote(str(output_dir))}",
        "mkdir -p \"$OUTPUT_DIR/logs\"",
        "",
        "# The rendezvous lives on the first node of the allocation; the port is derived from the job id.",
        'export MAIN_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        "export MAIN_PORT=$((20000 + SLURM_JOB_ID % 20000))",
        "",
        "# Tokenize once, on one node, into output_dir's cache (shared storage); every rank then reads it.",
        'srun --nodes=1 --ntasks=1 "$PRAISONAI_ACCEL_PYTHON" -m praisonai_accel preprocess "$PRAISONAI_ACCEL_CONFIG" || exit $?',
        "",
        "# One task per node. Single quotes: $SLURM_NODEID and the host name are expanded on each node.",
        f"NODE_COMMAND={shlex.quote(node_command)}",
        'srun --ntasks-per-node=1 --kill-on-bad-exit=1 bash -c "$NODE_COMMAND"',
        "status=$?",
        "",
        "# Stopped by SIGTERM ahead of the time limit: a checkpoint was saved; requeue to resume from it.",
        'if grep -q \'"status": "preempted"\' "$OUTPUT_DIR/progress.json" 2>/dev/null; then',
        '  echo "preempted: requeueing job $SLURM_JOB_ID to resume from the latest checkpoint"',
        '  scontrol requeue "$SLURM_JOB_ID"',
        "fi",
        "exit $status",
    ]
    return "\n".join(lines) + "\n"
