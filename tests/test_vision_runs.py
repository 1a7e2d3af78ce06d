"""Images + text through the CLI, with real processes (the in-process proofs are test_vision_data.py), on a tiny
random-weight LLaVA and the drawn-shapes task:
- 2 processes x B give the losses and adapter (LoRA + the projector) of 1 process x 2B, to 1e-5;
- a run SIGKILLed mid-way resumes exactly (the losses and final adapter of the uninterrupted run);
- a text-only model given a vision key is refused before launch, in one line.
"""

from __future__ import annotations

import json
import signal

import pytest

from conftest import REPO, cli, load_adapter, read_metrics, write_config
from test_checkpoint import TWO, assert_same_run, start, wait_for_step
from test_training import workers_left
from praisonai_accel.demo.vision import make_tiny_vlm, shape_records, trl_rows

EXACT = dict(max_steps=8, per_device_train_batch_size=2, learning_rate=1e-2, lora_dropout=0.0, lora_r=4,
             logging_steps=1, warmup_steps=0, max_seq_length=256)


@pytest.fixture(scope="module")
def llava_and_shapes(tmp_path_factory):
    root = tmp_path_factory.mktemp("vision")
    data = root / "data" / "shapes.jsonl"
    data.parent.mkdir()
    data.write_text("".join(json.dumps(r) + "\n" for r in trl_rows(shape_records(48, 0, root / "data" / "img"))))
    return make_tiny_vlm("llava", root / "llava"), data


def _config(directory, model_and_data, **overrides):
    model, data = model_and_data
    return write_config(directory, model, data, **{**EXACT, "dataset": [{"name": str(data)}], **overrides})


@pytest.fixture(scope="module")
def reference(tmp_path_factory, llava_and_shapes):
    """The uninterrupted 2-process run."""
    directory = tmp_path_factory.mktemp("reference")
    result = cli("train", str(_config(directory, llava_and_shapes)), *TWO)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "backend: transformers (a vision-language model)" in result.stderr
    return directory / "out"


def _losses(out):
    return [m["loss"] for m in read_metrics(out) if "loss" in m]


def test_2_processes_x_B_give_the_adapter_of_1_process_x_2B(tmp_path, llava_and_shapes, reference):
    result = cli("train", str(_config(tmp_path, llava_and_shapes, per_device_train_batch_size=4)), "--cpu")
    assert result.returncode == 0, result.stderr[-3000:]
    single, double = _losses(tmp_path / "out"), _losses(reference)
    assert len(single) == len(double) == 8
    assert max(abs(a - b) for a, b in zip(single, double)) <= 1e-5, (single, double)
    assert double[-1] < double[0]
    a, b = load_adapter(tmp_path / "out" / "lora_model"), load_adapter(reference / "lora_model")
    assert any("multi_modal_projector" in k for k in a) and any("lora_B" in k for k in a)
    assert not any("vision_tower" in k for k in a)
    assert max((a[k].double() - b[k].double()).abs().max().item() for k in a) <= 1e-5


def test_sigkill_then_resume_gives_the_uninterrupted_run(tmp_path, llava_and_shapes, reference):
    config = _config(tmp_path, llava_and_shapes, save_steps=1)
    out = tmp_path / "out"
    proc = start(config, *TWO)
    wait_for_step(out, 4, proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    assert not (out / "train_summary.json").exists(), "the run finished before it could be killed"
    assert not workers_left(config)
    result = cli("train", str(config), *TWO)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed from" in result.stderr
    assert_same_run(out, reference, tol=1e-5)


def test_a_vision_key_on_a_text_model_is_refused_before_launch(tmp_path, tiny_model, alpaca_file):
    config = write_config(tmp_path, tiny_model, alpaca_file, freeze_vision_tower=False)
    result = cli("train", str(config), "--cpu")
    assert result.returncode == 2
    assert result.stderr.strip() == (
        f"error: freeze_vision_tower: {tiny_model} takes no images (its config names no vision tower, or no image "
        "processor is saved with it); remove freeze_vision_tower")


def test_fsdp2_full_fine_tuning_shards_every_part_and_leaves_the_frozen_tower_as_it_was(tmp_path, llava_and_shapes):
    """--fsdp on 2 processes: the vision blocks are units of their own (LLaVA's _no_split_modules names
    CLIPEncoderLayer), the head is gathered with the language model's final norm for the chunked loss; the saved
    model's vision tower is the base model's, bit for bit, and the projector and language model moved."""
    from safetensors.torch import load_file

    model, _ = llava_and_shapes
    config = _config(tmp_path, llava_and_shapes, finetune_type="full", final_model_dir="model", max_steps=3,
                     learning_rate=1e-3)
    result = cli("train", str(config), *TWO, "--fsdp")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "LM head at target positions only, chunked" in result.stderr
    summary = json.loads((tmp_path / "out" / "train_summary.json").read_text())
    assert summary["distributed_type"] == "FSDP" and summary["weights_in_sync"]
    base = load_file(str(model / "model.safetensors"))
    total = sum(t.numel() * 4 for t in base.values())
    assert all(0.4 * total <= b <= 0.6 * total for b in summary["parameter_bytes_per_rank"])
    trained = load_file(str(tmp_path / "out" / "model" / "model.safetensors"))
    assert trained.keys() == base.keys()
    moved = {k.split(".")[0] for k in base if not base[k].equal(trained[k])}  # llava's saved names
    assert moved == {"multi_modal_projector", "language_model"}, moved
    assert (tmp_path / "out" / "model" / "processor_config.json").is_file()


def test_preview_shows_where_each_image_goes_and_marks_only_the_replies(tmp_path, llava_and_shapes):
    demo = REPO.parent / "shared" / "fixtures" / "llamafactory" / "mllm_demo.json"
    if not demo.is_file():
        pytest.skip("../shared/fixtures/llamafactory is absent")
    config = _config(tmp_path, llava_and_shapes, dataset=[{"name": str(demo)}], max_seq_length=4096)
    result = cli("preview", str(config), "-n", "1")
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert lines[:4] == [
        "--- example 1 of 6: 153 tokens, 73 trained (trained tokens between [[ and ]])",
        "USER: <image 1: 300x168 -> 16 tokens>",
        "Who are they? ASSISTANT: [[They're Kane and Gretzka from Bayern Munich. ]]USER: "
        "<image 2: 300x168 -> 16 tokens>",
        "What are they doing? ASSISTANT: [[They are celebrating on the soccer field. ]]"]
