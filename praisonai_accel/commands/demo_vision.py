"""praisonai-accel demo --vision: a tiny vision-language model learns to name the colour of a drawn shape.

A random-weight Idefics3 (SmolVLM's architecture) with its real processor is built locally (demo_vision.py); 512
drawn images, each a red, green, blue or yellow square or circle on a plain background, train it on N CPU
processes; 64 other images are held out, and the exact-match accuracy of its greedy answers to "what colour is the
shape?" is shown before and after (chance: 25%).
"""

from __future__ import annotations

from pathlib import Path

import typer

KIND, TRAIN_IMAGES, HELD_OUT_IMAGES, SHOWN = "idefics3", 512, 64, 3


def vision_demo(directory: Path, processes: int, steps: int | None) -> None:
    from ..demo.text import write_jsonl
    from ..demo.vision import make_tiny_vlm, shape_splits, trl_rows, vision_demo_config
    from ._demo import launch_demo

    model_dir = directory / f"tiny-{KIND}"
    if not (model_dir / "config.json").exists():
        typer.echo(f"building a tiny vision-language model ({KIND}) in {model_dir}", err=True)
        make_tiny_vlm(KIND, model_dir)
    data_dir = directory / "vision_data"
    train, held_out = shape_splits(data_dir / "images", TRAIN_IMAGES, HELD_OUT_IMAGES)
    data = write_jsonl(trl_rows(train), data_dir / "train.jsonl")
    output = (directory / "vision_outputs").resolve()
    raw = vision_demo_config(model_dir.resolve(), data.resolve(), output, overwrite_output_dir=True,
                             **({"max_steps": steps} if steps else {}))
    before = _answers(model_dir, held_out, data_dir)
    summary = launch_demo(directory / "vision_config.yaml", raw, processes, output)
    after = _answers(Path(summary["final_model_dir"]), held_out, data_dir)
    _report(held_out, before, after, summary, data_dir)


def _answers(model_dir: Path, records: list[dict], image_root: Path) -> list[str]:
    from transformers.utils import logging as hf_logging

    from ..demo.vision import held_out_answers
    from ..models.inference import load_for_inference

    hf_logging.disable_progress_bar()
    model, processor = load_for_inference(model_dir, device="cpu")
    return held_out_answers(model, processor, records, image_root)


def _report(held_out: list[dict], before: list[str], after: list[str], summary: dict, image_root: Path) -> None:
    from ..demo.text import examples_to_show
    from ..demo.vision import exact_match

    answers = [a.strip() for a in after]
    for i in examples_to_show(answers, [r["answer"] for r in held_out], SHOWN):  # right and wrong, as the score has them
        record, verdict = held_out[i], "right" if answers[i] == held_out[i]["answer"] else "wrong"
        typer.echo(f"{image_root / record['image']} (a {record['colour']} {record['shape']}): {record['question']!r}\n"
                   f"  before: {before[i] or '(nothing)'}\n  after:  {after[i]}   ({verdict}; expected: "
                   f"{record['answer']})")
    typer.echo(f"exact-match accuracy on {len(held_out)} held-out images: {exact_match(before, held_out):.0%} before, "
               f"{exact_match(after, held_out):.0%} after {summary['global_step']} steps on "
               f"{summary['num_processes']} process{'es' * (summary['num_processes'] != 1)} (chance: 25%); "
               f"model in {summary['final_model_dir']}")
