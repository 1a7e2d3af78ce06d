"""The tiny VLMs of demo_vision.py: each real architecture builds locally, loads back through the Auto classes with
its real processor, and computes a finite loss that depends on the image; and the drawn shape task's data."""

from __future__ import annotations

import json
import math

import pytest

from praisonai_accel.demo.vision import (KINDS, chat_template, exact_match, llamafactory_rows, make_tiny_vlm,
                                         prompt_messages, shape_records, shape_splits, trl_rows, unbuildable_reason)

PROCESSORS = {"llava": "LlavaProcessor", "qwen2_vl": "Qwen2VLProcessor", "gemma3": "Gemma3Processor",
              "idefics3": "Idefics3Processor"}
MODELS = {"llava": "LlavaForConditionalGeneration", "qwen2_vl": "Qwen2VLForConditionalGeneration",
          "gemma3": "Gemma3ForConditionalGeneration", "idefics3": "Idefics3ForConditionalGeneration"}


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    root = tmp_path_factory.mktemp("shapes")
    return root, shape_records(4, 0, root / "images")


@pytest.mark.parametrize("kind", KINDS)
def test_tiny_vlm_builds_reloads_and_computes_a_loss_from_the_image(kind, tmp_path, shapes):
    if unbuildable_reason(kind):
        pytest.skip(unbuildable_reason(kind))
    import torch
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    directory = make_tiny_vlm(kind, tmp_path / kind)
    assert (directory / "preprocessor_config.json").is_file() or (directory / "processor_config.json").is_file()
    assert sum(f.stat().st_size for f in directory.iterdir()) < 8_000_000
    model = AutoModelForImageTextToText.from_pretrained(directory)
    processor = AutoProcessor.from_pretrained(directory)
    assert type(model).__name__ == MODELS[kind] and type(processor).__name__ == PROCESSORS[kind]
    assert processor.chat_template == chat_template(kind)

    root, records = shapes
    conversations = [prompt_messages(r) + [{"role": "assistant", "content": [{"type": "text", "text": r["answer"]}]}]
                     for r in records[:2]]
    texts = [processor.apply_chat_template(c, tokenize=False) for c in conversations]
    assert all(r["answer"] in t for r, t in zip(records, texts))
    images = [[Image.open(root / r["image"]).convert("RGB")] for r in records[:2]]
    batch = processor(text=texts, images=images, return_tensors="pt", padding=True)
    image_token = processor.tokenizer.convert_tokens_to_ids(processor.image_token)
    assert (batch["input_ids"] == image_token).sum() > 0  # the placeholder became the image's tokens

    with torch.no_grad():
        loss = model(**batch, labels=batch["input_ids"]).loss
        other = model(**{**batch, "pixel_values": batch["pixel_values"].flip(0)}, labels=batch["input_ids"]).loss
    assert math.isfinite(float(loss)) and float(loss) > 0
    assert float(loss) != float(other)  # the pixels reach the language model


def test_a_kind_this_installation_cannot_build_says_why(tmp_path):
    blocked = [k for k in KINDS if unbuildable_reason(k)]
    if not blocked:
        pytest.skip("every kind builds with this installation")
    with pytest.raises(RuntimeError, match="cannot build a tiny .*torchvision"):
        make_tiny_vlm(blocked[0], tmp_path / "m")
    with pytest.raises(ValueError, match="unknown tiny VLM kind"):
        make_tiny_vlm("pixtral9", tmp_path / "m")


def test_shape_records_draw_the_colour_they_name(tmp_path):
    from PIL import Image

    train, held_out = shape_splits(tmp_path / "images", train=16, held_out=8)
    assert {r["answer"] for r in train} == {"red", "green", "blue", "yellow"}
    assert not {r["image"] for r in train} & {r["image"] for r in held_out}
    assert {r["image"].rsplit(".", 1)[1] for r in train} == {"png", "jpg"}
    for record in train:
        image = Image.open(tmp_path / record["image"]).convert("RGB")
        pixels = list(image.get_flattened_data())
        target = {"red": (220, 30, 30), "green": (30, 170, 50), "blue": (40, 60, 220), "yellow": (235, 215, 30)}
        wanted = target[record["answer"]]
        near = sum(all(abs(a - b) < 40 for a, b in zip(p, wanted)) for p in pixels)
        assert near > len(pixels) // 20, record  # a real share of the picture is the named colour
    assert shape_records(4, 3, tmp_path / "again") == shape_records(4, 3, tmp_path / "again")


def test_rows_in_trl_and_llamafactory_formats(tmp_path):
    records = shape_records(3, 1, tmp_path / "images")
    trl = trl_rows(records)
    assert trl[0]["images"] == [records[0]["image"]] and not records[0]["image"].startswith("/")
    assert trl[0]["messages"][0]["content"][0] == {"type": "image"}
    assert trl[0]["messages"][1]["content"] == [{"type": "text", "text": records[0]["answer"]}]
    factory = llamafactory_rows(records)
    assert factory[0]["messages"][0]["content"].count("<image>") == len(factory[0]["images"]) == 1
    assert factory[0]["messages"][1]["content"] == records[0]["answer"]
    json.dumps(trl + factory)


def test_exact_match():
    records = [{"answer": "red"}, {"answer": "blue"}, {"answer": "green"}, {"answer": "yellow"}]
    assert exact_match(["red", " blue\n", "green shape", "Yellow"], records) == 0.5
    assert exact_match([], []) == 0.0
