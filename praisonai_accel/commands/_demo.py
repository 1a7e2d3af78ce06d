"""What the demos share: the SFT demo's model (trained first where a later demo starts from it), a demo's config
launched on CPU processes exactly as `train` launches one, and a text model's greedy answers to held-out prompts."""

from __future__ import annotations

import json
from pathlib import Path

import typer


# written in a folder the demo takes: later demos (and re-runs) write there again; a folder without it that holds
# anything is the user's, and the demo's data.jsonl and config.yaml would replace files of theirs
DEMO_MARKER = ".praisonai-accel-demo"


def claim_demo_dir(directory: Path) -> None:
    """--dir: a new or empty folder (marked as the demo's), or one a demo marked; anything else is refused before a
    file is written."""
    from ..config import ConfigError

    if directory.exists() and not directory.is_dir():
        raise ConfigError(f"--dir {directory}: is a file; name a new or empty folder for the demo")
    if (directory / DEMO_MARKER).is_file():
        return
    held = sorted(p.name for p in directory.iterdir()) if directory.is_dir() else []
    if held and not _written_by_an_earlier_demo(directory):
        shown = ", ".join(held[:3]) + (", ..." if len(held) > 3 else "")
        raise ConfigError(f"--dir {directory}: holds files no demo wrote ({shown}); the demo writes its model, data "
                          "and config there, so name a new or empty folder")
    directory.mkdir(parents=True, exist_ok=True)
    (directory / DEMO_MARKER).write_text("a folder of praisonai-accel demos: `praisonai-accel demo --dir` writes here\n")


# each demo's config file, and the models they start from, inside the demo's folder
_DEMO_CONFIGS = ("config.yaml", "dpo_config.yaml", "grpo_config.yaml", "reward_config.yaml", "agent_config.yaml",
                 "vision_config.yaml")
_DEMO_MODELS = ("tiny-llama", "tiny-idefics3", "agent_base", "outputs/model")


def _written_by_an_earlier_demo(directory: Path) -> bool:
    """A demo folder from before the marker: one of the demos' configs there trains one of their models in it."""
    import yaml

    models = {(directory / name).resolve() for name in _DEMO_MODELS}
    for name in _DEMO_CONFIGS:
        try:
            model = (yaml.safe_load((directory / name).read_text()) or {}).get("model_name")
        except (OSError, ValueError, AttributeError, yaml.YAMLError):
            continue
        if isinstance(model, str) and Path(model).resolve() in models:
            return True
    return False


def sft_demo_model(directory: Path, train_sft) -> Path:
    """The SFT demo's final model under `directory`, trained first (`train_sft()`) when it is absent."""
    model = directory / "outputs" / "model"
    if not (model / "config.json").exists():
        typer.echo(f"no SFT demo model in {model}: training it first", err=True)
        train_sft()
    return model.resolve()


def launch_demo(config_path: Path, raw: dict, processes: int, output: Path) -> dict:
    """Write `raw` to `config_path`, launch it on `processes` CPU processes and return the run's train_summary.json;
    exit with the run's code when it fails."""
    import yaml

    from ..config import parse_config
    from ..launcher.local import launch
    from ..launcher.plan import plan_launch

    config_path.write_text(yaml.safe_dump(raw, sort_keys=False))
    plan = plan_launch(config_path, parse_config(raw), num_processes=processes, cpu=True)
    typer.echo(f"$ {plan.printable()}", err=True)
    code = launch(plan)
    summary_path = output / "train_summary.json"
    if code != 0 or not summary_path.exists():
        raise typer.Exit(code or 1)
    return json.loads(summary_path.read_text())


def text_answers(model_dir: Path, records: list[dict]) -> list[str]:
    """The model's greedy answers to the demo's held-out prompts (praisonai_accel.demo.text.held_out_answers)."""
    from transformers.utils import logging as hf_logging

    from ..demo.text import held_out_answers
    from ..models.inference import load_for_inference

    hf_logging.disable_progress_bar()
    model, tokenizer = load_for_inference(model_dir, device="cpu")
    return held_out_answers(model, tokenizer, records)
