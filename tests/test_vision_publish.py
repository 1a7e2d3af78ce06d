"""Saving and publishing a vision-language model: the processor travels with the final model, its checkpoints, the
Hub push and a merge; GGUF and Ollama publishing of one is refused in one line (that path is text-only)."""

from __future__ import annotations

import pytest
import torch
import yaml

from conftest import cli, cpu_env
from fake_servers import FakeHub
from praisonai_accel.demo.text import write_jsonl
from praisonai_accel.demo.vision import make_tiny_vlm, shape_records, trl_rows

TOKEN = "hf_TESTsecretTOKEN0123456789"
PROCESSOR_FILES = {"processor_config.json", "chat_template.jinja", "tokenizer.json", "tokenizer_config.json"}


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    return make_tiny_vlm("idefics3", tmp_path_factory.mktemp("vlm") / "idefics3")


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    root = tmp_path_factory.mktemp("shapes")
    records = shape_records(16, 0, root / "images")
    return write_jsonl(trl_rows(records), root / "train.jsonl"), [root / r["image"] for r in records]


def vision_config(directory, model, data, **overrides):
    raw = {"model_name": str(model), "dataset": [{"name": str(data)}], "max_seq_length": 128, "finetune_type": "lora",
           "lora_r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "per_device_train_batch_size": 4,
           "learning_rate": 1e-2, "max_steps": 4, "logging_steps": 2, "seed": 0, "plot_loss": False,
           "output_dir": str(directory / "out"), **overrides}
    path = directory / "config.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def trained(tmp_path_factory, vlm, shapes):
    """A real LoRA run over the tiny VLM, pushing every save to a local Hub."""
    directory = tmp_path_factory.mktemp("trained")
    with FakeHub(token=TOKEN) as hub:
        config = vision_config(directory, vlm, shapes[0], save_steps=2, push_to_hub=True, hub_model_id="me/tiny-vlm",
                               hub_strategy="every_save")
        env = cpu_env(HF_ENDPOINT=hub.url, HF_HUB_OFFLINE="0", HF_HUB_DISABLE_XET="1", HF_TOKEN=TOKEN)
        result = cli("train", str(config), "--cpu", env=env)
        assert result.returncode == 0, result.stderr[-3000:]
        commits = hub.of_kind("commit")
    return directory / "out", commits


def test_save_processing_writes_the_processor_the_tokenizer_carries(vlm, tmp_path):
    from transformers import AutoProcessor, AutoTokenizer

    from praisonai_accel.data.processor_files import save_processing
    from praisonai_accel.data.vision_processor import tokenizer_of

    tokenizer = tokenizer_of(AutoProcessor.from_pretrained(vlm))
    tokenizer.chat_template = tokenizer.chat_template.replace("Assistant:", "Assistant: ")  # as training left it
    save_processing(tokenizer, tmp_path / "vlm")
    assert PROCESSOR_FILES <= {p.name for p in (tmp_path / "vlm").iterdir()}
    again = AutoProcessor.from_pretrained(tmp_path / "vlm")
    assert type(again).__name__ == "Idefics3Processor" and again.chat_template == tokenizer.chat_template
    assert again.image_processor.to_dict() == AutoProcessor.from_pretrained(vlm).image_processor.to_dict()

    text = AutoTokenizer.from_pretrained(vlm)  # a text model's tokenizer carries none: the tokenizer alone, as before
    save_processing(text, tmp_path / "text")
    assert not (tmp_path / "text" / "processor_config.json").exists()
    assert (tmp_path / "text" / "tokenizer.json").exists()


def test_the_final_model_checkpoints_and_hub_push_carry_the_processor(trained):
    out, commits = trained
    assert PROCESSOR_FILES <= {p.name for p in (out / "lora_model").iterdir()}
    assert PROCESSOR_FILES <= {p.name for p in (out / "checkpoint-4" / "adapter").iterdir()}
    assert len(commits) == 3  # two saves and the end
    pushed = commits[-1]["files"]
    assert PROCESSOR_FILES | {"adapter_model.safetensors", "adapter_config.json"} <= set(pushed)
    assert pushed["processor_config.json"] == (out / "lora_model" / "processor_config.json").read_bytes()
    card = pushed["README.md"].decode()  # a card that says how to load a VLM and its processor
    assert "pipeline_tag: image-text-to-text" in card and "AutoPeftModelForCausalLM" not in card
    assert 'PeftModel.from_pretrained(base, "me/tiny-vlm")' in card
    assert 'AutoProcessor.from_pretrained("me/tiny-vlm")' in card


def test_a_merged_vlm_holds_its_processor_and_answers_like_base_plus_adapter(trained, shapes, tmp_path):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from praisonai_accel.models.inference import load_for_inference, read_image

    from praisonai_accel.models.inference import resolve_model_dir
    from praisonai_accel.publish.merge import merge_adapter

    out, _ = trained
    merge_adapter(resolve_model_dir(out), tmp_path / "merged")  # what `praisonai-accel merge` runs
    assert PROCESSOR_FILES <= {p.name for p in (tmp_path / "merged").iterdir()}
    assert not (tmp_path / "merged" / "adapter_config.json").exists()

    merged = AutoModelForImageTextToText.from_pretrained(tmp_path / "merged").eval()
    processor = AutoProcessor.from_pretrained(tmp_path / "merged")
    adapted, _ = load_for_inference(out, device="cpu")
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what colour is the shape?"}]}]
    prompt = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    batch = processor(text=[prompt], images=[[read_image(shapes[1][0])]], return_tensors="pt")
    with torch.no_grad():
        torch.testing.assert_close(merged(**batch).logits, adapted(**batch).logits, rtol=1e-4, atol=1e-4)

    model, loaded = load_for_inference(tmp_path / "merged", device="cpu")
    assert type(model).__name__ == "Idefics3ForConditionalGeneration" and hasattr(loaded, "image_processor")


def _one_line(args):
    from typer.testing import CliRunner

    from praisonai_accel.cli import app

    result = CliRunner().invoke(app, args)
    errors = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2 and len(errors) == 1 and errors[0].startswith("error: "), result.output[-2000:]
    return errors[0]


def test_ollama_and_gguf_refuse_a_vision_model_in_one_line(trained, vlm, shapes, tmp_path):
    out, _ = trained
    ollama = _one_line(["publish", "ollama", str(out), "--name", "tiny-vlm:test"])
    assert "ollama: this is a vision-language model (idefics3)" in ollama and "text-only" in ollama
    gguf = _one_line(["export", "gguf", str(out), "--out", str(tmp_path / "gguf")])
    assert "gguf export: this is a vision-language model (idefics3)" in gguf
    assert not (tmp_path / "gguf").exists()
    for key, extra in (("ollama_model", {"ollama_model": "tiny-vlm:test"}), ("save_gguf", {"save_gguf": True})):
        (tmp_path / key).mkdir()
        config = vision_config(tmp_path / key, vlm, shapes[0], **extra)
        refused = _one_line(["train", str(config), "--cpu", "--dry-run"])
        assert f"error: {key}: this is a vision-language model (idefics3), and our GGUF / Ollama path is text-only" \
            in refused
        assert not (tmp_path / key / "out").exists()  # before launch: nothing trained


def test_what_takes_images_is_a_vision_config_saved_with_its_image_processor(tiny_model, vlm, tmp_path, monkeypatch):
    """A text model, or a multimodal one trained on text and saved with its tokenizer alone, is published as before;
    a VLM's adapter saved without the processor takes images through its base's."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForImageTextToText

    from conftest import make_architecture
    from praisonai_accel.data.vision_processor import ModelInputs
    from praisonai_accel.models.inference import inputs_of
    from praisonai_accel.publish.gguf import GGUFError, plan_export

    assert inputs_of(tiny_model) == ModelInputs(False, "llama")
    text_trained = make_architecture(tmp_path / "gemma3", "gemma3")
    assert inputs_of(text_trained) == ModelInputs(False, "gemma3")
    monkeypatch.setenv("LLAMA_CPP_CONVERTER", str(tmp_path / "no-converter"))  # nothing fetched, whatever is cached
    with pytest.raises(GGUFError, match="LLAMA_CPP_CONVERTER=.*holds no convert_hf_to_gguf.py"):
        plan_export(text_trained, ["f16"], tmp_path / "gguf")  # past the vision rule, on to the converter
    assert inputs_of(vlm) == ModelInputs(True, "idefics3")
    adapter = get_peft_model(AutoModelForImageTextToText.from_pretrained(vlm),
                             LoraConfig(r=2, target_modules=["q_proj"]))
    adapter.save_pretrained(tmp_path / "adapter")
    assert inputs_of(tmp_path / "adapter") == ModelInputs(True, "idefics3")
