"""chat / generate with --image: a vision-language model (or a LoRA adapter over one) loads with its processor and
the image reaches the model; a missing or unreadable image, or images for a text-only model, is one line, exit 2."""

from __future__ import annotations

import subprocess
import sys

import pytest
from typer.testing import CliRunner

from conftest import cli, cpu_env, make_architecture
from praisonai_accel.cli import app
from praisonai_accel.demo.vision import KINDS, make_tiny_vlm, shape_records, unbuildable_reason


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    return make_tiny_vlm("idefics3", tmp_path_factory.mktemp("vlm") / "idefics3")


@pytest.fixture(scope="module")
def image(tmp_path_factory):
    root = tmp_path_factory.mktemp("images")
    return root / shape_records(1, 0, root / "images")[0]["image"]


def _capture_generate(model):
    seen = {}
    original = model.generate

    def generate(**kwargs):
        seen.update(kwargs)
        return original(**kwargs)

    model.generate = generate
    return seen


def test_generate_puts_the_image_through_the_processor(vlm, image):
    from transformers import Idefics3Processor

    from praisonai_accel.models.inference import generate, load_for_inference, read_image, stop_token_ids

    model, processor = load_for_inference(vlm, device="cpu")
    assert isinstance(processor, Idefics3Processor) and type(model).__name__ == "Idefics3ForConditionalGeneration"
    seen = _capture_generate(model)
    reply = generate(model, processor, [{"role": "user", "content": "what colour is the shape?"}], max_new_tokens=3,
                     images=[read_image(image)])
    assert isinstance(reply, str)
    image_token = processor.tokenizer.convert_tokens_to_ids("<image>")
    assert int((seen["input_ids"] == image_token).sum()) == processor.image_seq_len  # one image, its 4 tokens
    assert seen["pixel_values"].shape[-2:] == (32, 32)
    assert processor.tokenizer.convert_tokens_to_ids("<end_of_utterance>") in stop_token_ids(model, processor)

    seen.clear()
    generate(model, processor, [{"role": "user", "content": "hello"}], max_new_tokens=2)  # text alone still works
    assert "pixel_values" not in seen and image_token not in seen["input_ids"]


TURN_END = {"llava": None, "gemma3": "<end_of_turn>", "idefics3": "<end_of_utterance>", "qwen2_vl": "<|im_end|>"}


@pytest.mark.parametrize("kind", KINDS)
def test_every_tiny_architecture_answers_about_an_image(kind, image, tmp_path):
    """Each architecture's processor expands its own image tokens, and generation stops at its template's end of
    turn (LLaVA 1.5's template writes none: its eos)."""
    if unbuildable_reason(kind):
        pytest.skip(unbuildable_reason(kind))
    from praisonai_accel.models.inference import generate, load_for_inference, read_image, stop_token_ids

    model, processor = load_for_inference(make_tiny_vlm(kind, tmp_path / kind), device="cpu")
    seen = _capture_generate(model)
    reply = generate(model, processor, [{"role": "system", "content": "answer in one word"},
                                        {"role": "user", "content": "what colour is the shape?"}],
                     max_new_tokens=2, images=[read_image(image)])
    assert isinstance(reply, str) and "pixel_values" in seen
    assert int((seen["input_ids"] == processor.image_token_id).sum()) > 0
    stops = stop_token_ids(model, processor)
    assert processor.tokenizer.eos_token_id in stops
    if TURN_END[kind]:
        assert processor.tokenizer.convert_tokens_to_ids(TURN_END[kind]) in stops


def test_a_lora_adapter_over_a_vlm_loads_with_its_base_processor(vlm, image, tmp_path):
    import torch
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForImageTextToText

    from praisonai_accel.models.inference import generate, load_for_inference, read_image

    base = AutoModelForImageTextToText.from_pretrained(vlm)
    peft_model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    peft_model.save_pretrained(tmp_path / "adapter")
    assert not (tmp_path / "adapter" / "preprocessor_config.json").exists()

    model, processor = load_for_inference(tmp_path / "adapter", device="cpu")
    assert isinstance(model, PeftModel) and hasattr(processor, "image_processor")
    lora = {n: p for n, p in model.named_parameters() if "lora_B" in n}
    assert lora and all(torch.equal(p, dict(peft_model.named_parameters())[n]) for n, p in lora.items())
    seen = _capture_generate(model)
    generate(model, processor, [{"role": "user", "content": "what colour?"}], max_new_tokens=2,
             images=[read_image(image)])
    assert "pixel_values" in seen


def test_a_multimodal_model_saved_without_a_processor_still_loads_for_text(tmp_path):
    from praisonai_accel.models.inference import generate, is_processor, load_for_inference

    model, tokenizer = load_for_inference(make_architecture(tmp_path / "gemma3", "gemma3"), device="cpu")
    assert not is_processor(tokenizer)
    assert isinstance(generate(model, tokenizer, [{"role": "user", "content": "add 2 and 3"}], max_new_tokens=2), str)


def test_generate_and_chat_with_image_on_the_command_line(vlm, image):
    result = cli("generate", str(vlm), "-p", "what colour is the shape?", "-p", "which colour is drawn?",
                 "--image", str(image), "--max-new-tokens", "3")
    assert result.returncode == 0, result.stderr[-2000:]
    assert len(result.stdout.splitlines()) == 2
    chat = subprocess.run([sys.executable, "-m", "praisonai_accel", "chat", str(vlm), "--image", str(image),
                           "--max-new-tokens", "3"], input="what colour is the shape?\nand now?\n",
                          capture_output=True, text=True, timeout=300, env=cpu_env())
    assert chat.returncode == 0, chat.stderr[-2000:]
    assert len(chat.stdout.splitlines()) == 2


def _one_line_error(args):
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in result.output, result.output
    return lines[0]


def test_bad_images_and_images_for_a_text_model_are_one_line(vlm, image, tiny_model, tmp_path):
    missing = _one_line_error(["generate", str(vlm), "-p", "x", "--image", str(tmp_path / "nope.png")])
    assert f"--image {tmp_path / 'nope.png'}: does not exist" in missing
    (tmp_path / "bad.jpg").write_text("not a picture")
    assert "is not an image file" in _one_line_error(["chat", str(vlm), "--image", str(tmp_path / "bad.jpg")])
    truncated = tmp_path / "cut.png"
    truncated.write_bytes(image.read_bytes()[:60])
    assert "cut.png" in _one_line_error(["generate", str(vlm), "-p", "x", "--image", str(truncated)])
    text_only = _one_line_error(["generate", str(tiny_model), "-p", "x", "--image", str(image)])
    assert "holds a text-only model (llama); images need a vision-language model" in text_only


def test_whether_a_checkpoint_takes_images_is_one_rule_fetched_from_the_hub_when_not_here(vlm, tmp_path, monkeypatch):
    """A Hub id not in the cache: its config.json and processor files are fetched (here: a fake Hub serving the
    tiny Idefics3's folder), so use_unsloth: auto on a GPU never picks unsloth's text-only loader for a VLM; offline
    and not cached, it cannot be told, and unsloth is not chosen either. The worker, the model card, GGUF / Ollama
    (inference.inputs_of) decide by the same function."""
    import huggingface_hub
    from huggingface_hub import constants
    from huggingface_hub.errors import EntryNotFoundError

    from praisonai_accel.models import loading as model_module
    from praisonai_accel.config import parse_config
    from praisonai_accel.data.vision_processor import ModelInputs, model_inputs
    from praisonai_accel.runtime.distributed import DistEnv
    from praisonai_accel.models.inference import inputs_of

    def fake_hub(folder):
        def download(repo_id, filename, revision=None, **_):
            if not (folder / filename).is_file():
                raise EntryNotFoundError(f"{filename} not in {repo_id}")
            return str(folder / filename)
        return download

    def unsloth_imported():
        raise AssertionError("unsloth was imported for a model that may take images")

    monkeypatch.setattr(model_module, "import_unsloth", unsloth_imported)
    config = parse_config({"model_name": "someone/tiny-idefics3", "dataset": "d.jsonl"})
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert model_inputs(config).images is None and model_inputs(config).vision is False
    backend = model_module.choose_backend(config, DistEnv(), use_cuda=True, inputs=model_inputs(config))
    assert backend.name == "transformers" and "someone/tiny-idefics3 takes images cannot be told" in backend.reason
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_hub(vlm))
    assert model_inputs(config).images is True
    backend = model_module.choose_backend(config, DistEnv(), use_cuda=True, inputs=model_inputs(config))
    assert (backend.name, backend.reason) == ("transformers", "a vision-language model")
    assert inputs_of(vlm) == ModelInputs(True, "idefics3")
    no_processor = tmp_path / "no-processor"
    no_processor.mkdir()
    (no_processor / "config.json").write_text((vlm / "config.json").read_text())
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_hub(no_processor))
    assert model_inputs(config).images is False  # a multimodal checkpoint saved without its processor: text
    assert model_inputs(parse_config({"model_name": str(vlm), "dataset": "d.jsonl",
                                      "tokenizer_name": str(no_processor)})).images is False  # the processor's source
