"""praisonai-accel command line. Heavy libraries are imported inside commands, so --help stays fast."""

from __future__ import annotations

import sys

import typer

from .commands._common import one_line_errors
from .commands.chat import chat_command, generate_command
from .commands.config import config_app
from .commands.demo import demo_command
from .commands.env import env_command
from .commands.eval import eval_command
from .commands.export import export_app
from .commands.k8s import k8s_command
from .commands.merge import merge_command
from .commands.preprocess import preprocess_command
from .commands.preview import preview_command
from .commands.publish import publish_app
from .commands.report import report_command
from .commands.serve import serve_command
from .commands.score import score_command
from .commands.slurm import slurm_command
from .commands.train import train_command

app = typer.Typer(
    name="praisonai-accel",
    help="Fine-tune LLMs (LoRA, QLoRA, full) from one YAML file, on one GPU, every GPU of a machine, or several machines.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.command("train")(one_line_errors(train_command))
app.command("preview")(one_line_errors(preview_command))
app.command("preprocess")(one_line_errors(preprocess_command))
app.command("report")(one_line_errors(report_command))
app.command("slurm")(one_line_errors(slurm_command))
app.command("k8s")(one_line_errors(k8s_command))
app.command("env")(one_line_errors(env_command))
app.command("demo")(one_line_errors(demo_command))
app.command("merge")(one_line_errors(merge_command))
app.command("chat")(one_line_errors(chat_command))
app.command("generate")(one_line_errors(generate_command))
app.command("eval")(one_line_errors(eval_command))
app.command("serve")(one_line_errors(serve_command))
app.add_typer(config_app, name="config")
app.command("score")(one_line_errors(score_command))  # reward models (methods/reward.py)
app.add_typer(publish_app, name="publish")
app.add_typer(export_app, name="export")


# Commands that import torch (and transformers, lm-eval, peft) and close their files before they return: once their
# exit handlers have run (train's run lock, Ray's shutdown) and no thread is left, they leave without the
# interpreter's teardown (runtime/exit.py), about a second sooner.
LEAVE_WITHOUT_TEARDOWN = ("eval", "score", "generate", "merge", "train")


def main() -> None:
    command = next((arg for arg in sys.argv[1:] if not arg.startswith("-")), None)
    try:
        app()
    except SystemExit as done:
        if command not in LEAVE_WITHOUT_TEARDOWN:
            raise
        from .runtime.exit import exit_without_teardown

        exit_without_teardown(done.code)
