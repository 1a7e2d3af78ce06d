"""praisonai-accel demo --vision: on 2 CPU processes a tiny VLM goes from chance to >= 95% exact match on held-out
images; its config and evaluation."""

from __future__ import annotations

import re

from typer.testing import CliRunner

from conftest import cli
from praisonai_accel.cli import app
from praisonai_accel.config import parse_config
from praisonai_accel.demo.vision import (held_out_answers, make_tiny_vlm, shape_records,
                                         vision_demo_config)


def test_demo_vision_learns_the_colour_of_held_out_shapes_on_two_processes(tmp_path):
    result = cli("demo", "--vision", "--dir", str(tmp_path / "demo"), timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    line = result.stdout.splitlines()[-1]
    match = re.match(r"exact-match accuracy on 64 held-out images: (\d+)% before, (\d+)% after 120 steps on "
                     r"2 processes \(chance: 25%\)", line)
    assert match, result.stdout
    before, after = int(match[1]), int(match[2])
    assert before <= 40 and after >= 95, line
    assert result.stdout.count("  after:  ") == 3 and "; expected: " in result.stdout
    assert "backend: transformers (a vision-language model)" in result.stderr
    assert (tmp_path / "demo" / "vision_outputs" / "model" / "processor_config.json").is_file()


def test_the_demo_config_is_a_valid_vision_config(tmp_path):
    config = parse_config(vision_demo_config(tmp_path / "m", tmp_path / "d.jsonl", tmp_path / "o"))
    assert config.freeze_vision_tower and not config.freeze_multi_modal_projector and config.finetune_type == "full"


def test_held_out_answers_are_one_per_image_and_scored_exactly(tmp_path):
    from praisonai_accel.models.inference import generate, load_for_inference, read_image

    model, processor = load_for_inference(make_tiny_vlm("idefics3", tmp_path / "vlm"), device="cpu")
    records = shape_records(5, 0, tmp_path / "images")
    answers = held_out_answers(model, processor, records, tmp_path, batch_size=2)  # left-padded batches of 2
    assert len(answers) == 5 and all(isinstance(a, str) for a in answers)
    one = generate(model, processor, [{"role": "user", "content": records[3]["question"]}], max_new_tokens=8,
                   images=[read_image(tmp_path / records[3]["image"])])
    assert answers[3] == one  # the batch answers as inference.generate does, one at a time


def test_demo_vision_with_another_method_is_one_line(tmp_path):
    result = CliRunner().invoke(app, ["demo", "--vision", "--method", "dpo", "--dir", str(tmp_path / "demo")])
    assert result.exit_code == 2
    assert result.output.strip() == "error: --vision: the vision demo trains with sft; drop --method dpo"
    assert not (tmp_path / "demo").exists()
