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

from ..config import CONTROL_CHARACTERS, ConfigError, TrainConfig


def sbatch_quote(value: str) -> str:
    """One argument of an #SBATCH line. sbatch's own directive parser (not a shell) groups characters inside
    double quotes, takes the next character literally after a backslash, and ends the line at an unquoted #."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _checked(name: str, value: str) -> str:
    if CONTROL_CHARACTERS.search(value):
        raise ConfigError(f"{name}: {value!r} holds a control character (a newline?); it would end a line of the script")
    return value


def slurm_script(config_path: Path, config: TrainConfig, *, nodes: int, gpus_per_node: int, partition: str | None = None,
                 time: str | None = None, account: str | None = None, job_name: str | None = None, cpu: bool = False,
                 signal_seconds: int = 300, python: str = sys.executable) -> str:
    """Every value from the user is refused if it holds a control character, and quoted for sbatch (#SBATCH lines)
    or for bash (the body); a path in --output has its % doubled, since SLURM expands %j and friends there."""
    config_path = Path(_checked("config", str(Path(config_path).resolve())))
    output_dir = config.output_path().resolve()
    if "\\" in str(output_dir):  # SLURM turns every filename pattern off when the name holds a backslash
        raise ConfigError(f"output_dir: {output_dir} holds a backslash, which SLURM's --output cannot take")
    log_file = str(_checked("output_dir", str(output_dir))).replace("%", "%%") + "/logs/slurm-%j.out"
    directives = [("--job-name", job_name or "praisonai-accel"), ("--nodes", str(nodes)), ("--ntasks-per-node", "1"),
                  ("--output", log_file), ("--signal", f"TERM@{signal_seconds}")]
    if not cpu:
        directives.append(("--gpus-per-node", str(gpus_per_node)))
    directives += [(flag, value) for flag, value in (("--partition", partition), ("--time", time), ("--account", account))
                   if value]
    sbatch_lines = [f"#SBATCH {flag}={sbatch_quote(_checked(flag, value))}" for flag, value in directives]
    sbatch_lines.append("#SBATCH --requeue")
    devices = f"--cpu --num-processes {gpus_per_node}" if cpu else f"--gpus {gpus_per_node}"
    node_command = (
        'echo "node $SLURM_NODEID of $SLURM_NNODES on $(hostname): $PRAISONAI_ACCEL_GPUS"; '
        'exec "$PRAISONAI_ACCEL_PYTHON" -m praisonai_accel train "$PRAISONAI_ACCEL_CONFIG" $PRAISONAI_ACCEL_GPUS '
        '--nnodes "$SLURM_NNODES" --rdzv-endpoint "$MAIN_ADDR:$MAIN_PORT"'
    )
    lines = ["#!/bin/bash"] + sbatch_lines + [
        "set -uo pipefail",
        "",
        f"export PRAISONAI_ACCEL_CONFIG={shlex.quote(str(config_path))}",
        f"export PRAISONAI_ACCEL_PYTHON={shlex.quote(python)}",
        f"export PRAISONAI_ACCEL_GPUS={shlex.quote(devices)}",
        f"OUTPUT_DIR={shlex.quote(str(output_dir))}",
        "mkdir -p \"$OUTPUT_DIR/logs\"",
        "latest_checkpoint() {  # the step of the newest complete checkpoint, or -1",
        '  ls -d "$OUTPUT_DIR"/checkpoint-*/COMPLETE 2>/dev/null | sed -n \'s|.*/checkpoint-\\([0-9]*\\)/COMPLETE$|\\1|p\' \\',
        "    | sort -n | tail -n 1 | grep . || echo -1",
        "}",
        "START_STEP=$(latest_checkpoint)",
        "# A checkpoint completed by this attempt is newer than this file: comparing steps would miss one saved after",
        "# resuming from an older checkpoint because the newest was damaged (and set aside).",
        'START_STAMP="$OUTPUT_DIR/logs/.slurm-$SLURM_JOB_ID.started"',
        'touch "$START_STAMP"',
        "saved_a_checkpoint() {",
        '  find "$OUTPUT_DIR" -mindepth 2 -maxdepth 2 -regextype posix-extended -regex \'.*/checkpoint-[0-9]+/COMPLETE\' \\',
        '    -newer "$START_STAMP" | grep -q .',
        "}",
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
        "# Stopped by SIGTERM ahead of the time limit: a checkpoint was saved; requeue to resume from it. Only when this",
        "# attempt saved one: a requeued job that fails during setup leaves progress.json saying preempted, and would",
        "# otherwise requeue forever.",
        'if grep -q \'"status": "preempted"\' "$OUTPUT_DIR/progress.json" 2>/dev/null; then',
        '  if saved_a_checkpoint; then',
        '    echo "preempted: requeueing job $SLURM_JOB_ID to resume from checkpoint-$(latest_checkpoint)"',
        '    scontrol requeue "$SLURM_JOB_ID"',
        "  else",
        '    echo "preempted, but no checkpoint newer than checkpoint-$START_STEP was saved: not requeueing" >&2',
        "  fi",
        "fi",
        "exit $status",
    ]
    return "\n".join(lines) + "\n"
