"""Images + text, in process: the vision keys, rows with images (bad ones named by number), the ids and labels of
every architecture we can build against its own processor's output, what the cache keeps, and what trains.

Tiny random-weight LLaVA, Gemma 3 and Idefics3 (demo_vision.make_tiny_vlm; Qwen2-VL where torchvision is installed)
with their real processors; LLaMA-Factory's mllm_demo.json with its real JPEGs (../shared/fixtures/llamafactory).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import REPO
from praisonai_accel.checks import vision_rule
from praisonai_accel.config import ConfigError, parse_config
from praisonai_accel.data import IGNORE_INDEX, DataError, load_tokenizer, tokenize_dataset
from praisonai_accel.data.images import decode_references
from praisonai_accel.data.vision_processor import is_vision_config
from praisonai_accel.demo.vision import KINDS, make_tiny_vlm, shape_records, trl_rows, unbuildable_reason
from praisonai_accel.methods.sft import SFT

FIXTURES = REPO.parent / "shared" / "fixtures" / "llamafactory"
MLLM_DEMO = FIXTURES / "mllm_demo.json"


@pytest.fixture(scope="session")
def tiny_vlms(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("vlms")
    return {kind: make_tiny_vlm(kind, root / kind) for kind in KINDS if unbuildable_reason(kind) is None}


def _vlm(tiny_vlms, kind: str) -> Path:
    if kind not in tiny_vlms:
        pytest.skip(f"tiny {kind}: {unbuildable_reason(kind)}")
    return tiny_vlms[kind]


def _config(model: Path, data: Path, tmp_path: Path, **overrides):
    return parse_config({"model_name": str(model), "dataset": [{"name": str(data)}],
                         "output_dir": str(tmp_path / "out"), **overrides})


def _encoded(config):
    tokenizer = load_tokenizer(config)
    method = SFT(config)
    data, stats, skipped = tokenize_dataset(config.dataset, tokenizer, config, method.data(tokenizer))
    return tokenizer, method, data, stats, skipped


def test_vision_keys_take_praisonai_trains_names_and_refuse_contradictions(tiny_model):
    base = {"model_name": "m", "dataset": "d.jsonl"}
    config = parse_config({**base, "finetune_vision_layers": True, "finetune_language_layers": True})
    assert (config.freeze_vision_tower, config.freeze_language_model, config.freeze_multi_modal_projector) == \
        (False, False, False)
    with pytest.raises(ConfigError, match=r"^config: finetune_vision_layers: true contradicts freeze_vision_tower: "
                                          r"true \(the same switch, inverted\); keep one of them$"):
        parse_config({**base, "finetune_vision_layers": True, "freeze_vision_tower": True})
    with pytest.raises(ConfigError, match="^config: freeze_language_model: true: LoRA then adapts nothing "
                                          r"\(freeze_vision_tower: true freezes the vision tower too\)"):
        parse_config({**base, "freeze_language_model": True})
    # the key the config wrote is the one named; praisonai-train's switches as pydantic reads booleans
    with pytest.raises(ConfigError, match="^config: finetune_language_layers: false: LoRA then adapts nothing "
                                          r"\(finetune_vision_layers: false freezes"):
        parse_config({**base, "finetune_language_layers": False, "finetune_vision_layers": "false"})
    for written in ("true", 1, "yes"):
        assert parse_config({**base, "finetune_vision_layers": written}).freeze_vision_tower is False
    assert parse_config({**base, "finetune_language_layers": "true"}).freeze_language_model is False
    with pytest.raises(ConfigError, match="finetune_vision_layers: true contradicts freeze_vision_tower: true"):
        parse_config({**base, "finetune_vision_layers": "1", "freeze_vision_tower": "true"})
    # a text-only model refuses vision keys; a vision model refuses packing and other methods
    text_only = parse_config({**base, "model_name": str(tiny_model), "image_max_pixels": 1024})
    with pytest.raises(ConfigError, match=r"^image_max_pixels: .* takes no images .*; remove image_max_pixels$"):
        vision_rule(text_only, False)
    vision_rule(parse_config(base), False)  # defaults are not "written"
    for at_default in ({"freeze_vision_tower": True}, {"finetune_vision_layers": False},
                       {"finetune_language_layers": True, "freeze_multi_modal_projector": False}):
        vision_rule(parse_config({**base, **at_default}), False)  # praisonai-train's configs write them
    with pytest.raises(ConfigError, match="^finetune_vision_layers: m takes no images"):
        vision_rule(parse_config({**base, "finetune_vision_layers": True}), False)
    with pytest.raises(ConfigError, match="^packing: rows with images are not packed"):
        vision_rule(parse_config({**base, "packing": True}), True)
    with pytest.raises(ConfigError, match="^method: dpo: m takes images, which only method: sft trains"):
        vision_rule(parse_config({**base, "method": "dpo"}), True)


@pytest.mark.parametrize("kind", KINDS)
def test_ids_and_labels_are_the_processors_own_with_images_and_prompts_untrained(tiny_vlms, kind, tmp_path):
    """LLaMA-Factory's mllm_demo (two images in one row, several turns, Chinese): the ids the collator feeds the
    model are processor.apply_chat_template + processor(text, images); pixel values and token type ids too; the
    trained tokens are the replies, never an image token or a prompt."""
    if not MLLM_DEMO.is_file():
        pytest.skip("../shared/fixtures/llamafactory is absent")
    from PIL import Image
    from transformers import AutoProcessor

    model = _vlm(tiny_vlms, kind)
    config = _config(model, MLLM_DEMO, tmp_path, max_seq_length=4096)
    tokenizer, method, data, stats, _ = _encoded(config)
    assert stats.datasets[0].examples == 6
    processor = AutoProcessor.from_pretrained(model)
    collate = method.collator(tokenizer.pad_token_id)
    rows = json.loads(MLLM_DEMO.read_text())
    for index, row in enumerate(rows):
        messages = [{"role": m["role"], "content": [
            part for i, piece in enumerate(m["content"].split("<image>"))
            for part in ([{"type": "image"}] if i else []) + ([{"type": "text", "text": piece}] if piece else [])]}
            for m in row["messages"]]
        text = processor.apply_chat_template(messages, tokenize=False)
        images = [Image.open(FIXTURES / path).convert("RGB") for path in row["images"]]
        # as TRL's vision collator calls it (the template writes bos; the tokenizer must not add a second)
        expected = processor(text=[text], images=[images], return_tensors="pt", add_special_tokens=False)
        example = data[index]
        assert decode_references(example["images"]) == [str((FIXTURES / p).resolve()) for p in row["images"]]
        batch = collate([example])
        assert batch["input_ids"][0].tolist() == expected["input_ids"][0].tolist(), index
        for key in expected:
            if key not in ("input_ids", "attention_mask"):
                assert torch.equal(batch[key], expected[key]), (index, key)
        labels = batch["labels"][0]
        image_ids = torch.tensor(sorted({processor.image_token_id, *processor.image_token_ids}))
        assert (labels[torch.isin(batch["input_ids"][0], image_ids)] == IGNORE_INDEX).all()
        trained = tokenizer.decode(labels[labels != IGNORE_INDEX])
        for message in row["messages"]:
            content = message["content"].replace("<image>", "")
            assert (content in trained) == (message["role"] == "assistant"), (index, trained)


def test_bad_rows_are_named_by_number_and_can_be_skipped(tiny_vlms, tmp_path):
    model = _vlm(tiny_vlms, "llava")
    records = shape_records(2, 0, tmp_path / "img")
    rows = trl_rows(records)
    (tmp_path / "img" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\x00" * 20)
    lf_row = {"messages": [{"role": "user", "content": "<image><image>two?"}, {"role": "assistant", "content": "no"}],
              "images": [records[0]["image"]]}
    bad = [
        {**rows[0], "images": ["img/nowhere.png"]},
        {**rows[0], "images": ["https://example.com/a.png"]},
        lf_row,
        {**rows[0], "images": ["img/broken.png"]},
    ]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows + bad))
    with pytest.raises(DataError) as error:
        _encoded(_config(model, data, tmp_path))
    line = str(error.value)
    assert "\n" not in line
    assert line.startswith(f"dataset {data} (format messages): line 3: image 1 ({tmp_path}/img/nowhere.png) does not "
                           "exist; line 4: image 1 is a URL (https://example.com/a.png); training reads images offline")
    assert "line 5: 2 image placeholders" in line and "4 invalid rows in all" in line
    _, _, encoded, stats, skipped = _encoded(_config(model, data, tmp_path, skip_invalid_rows=True))
    assert len(encoded) == 2
    assert [(r.where, r.reason.kind) for r in skipped] == [
        ("line 3", "missing image"), ("line 4", "image is a URL"), ("line 5", "image count mismatch"),
        ("line 6", "unreadable image")]


def test_the_cache_keeps_ids_and_image_paths_and_too_long_rows_are_left_out_whole(tiny_vlms, tmp_path):
    model = _vlm(tiny_vlms, "llava")
    rows = trl_rows(shape_records(3, 0, tmp_path / "img"))
    rows[0]["messages"][0]["content"][1]["text"] += " answer in one word, please"
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tokenizer, _, encoded, _, _ = _encoded(_config(model, data, tmp_path))
    assert set(encoded.columns) == {"input_ids", "labels", "images"}  # no pixels
    lengths = encoded.lengths
    assert all(length > 16 for length in lengths)  # an image is 16 tokens here: lengths count them
    short = max(lengths) - 1
    _, _, kept, stats, skipped = _encoded(_config(model, data, tmp_path, max_seq_length=short, skip_invalid_rows=True,
                                                  excess_length_strategy="truncate"))
    assert len(kept) == sum(length <= short for length in lengths)
    assert stats.datasets[0].dropped == len(lengths) - len(kept)
    assert "a row's images are never cut" in str(skipped[0].reason)


def _loaded(model: Path, tmp_path: Path, rows: list[dict] | None = None, **overrides):
    from praisonai_accel.runtime.distributed import DistEnv
    from praisonai_accel.data.vision_processor import model_inputs
    from praisonai_accel.models.loading import Backend, load_model_and_tokenizer

    rows = rows if rows is not None else trl_rows(shape_records(2, 0, tmp_path / "img"))
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = _config(model, data, tmp_path, **overrides)
    causal_lm, tokenizer = load_model_and_tokenizer(config, DistEnv.from_environ(), Backend("transformers"), False,
                                                    False, model_inputs(config))
    return config, causal_lm, tokenizer


@pytest.mark.parametrize("kind", ["llava", "gemma3", "idefics3"])
def test_frozen_parts_get_no_gradient_and_do_not_change(tiny_vlms, kind, tmp_path):
    """Defaults (LoRA): the vision tower frozen and without LoRA, the projector trained whole, LoRA on the language
    model; one optimizer step changes only those."""
    from praisonai_accel.models.vision import part_of

    config, causal_lm, tokenizer = _loaded(_vlm(tiny_vlms, kind), tmp_path)
    assert is_vision_config(causal_lm.config)
    trainable = {name for name, p in causal_lm.named_parameters() if p.requires_grad}
    assert {part_of(name) for name in trainable} == {"projector", "language"}
    assert all("lora_" in n for n in trainable if part_of(n) == "language")
    assert not any("lora_" in name for name, _ in causal_lm.named_parameters() if part_of(name) == "vision")
    method = SFT(config)
    data, _, _ = tokenize_dataset(config.dataset, tokenizer, config, method.data(tokenizer))
    batch = method.collator(tokenizer.pad_token_id)([data[0], data[1]])
    module = method.loss_module(causal_lm, accelerator=_NoAccelerator(), tokenizer=tokenizer, use_cuda=False)
    assert module.chunked  # the LM head at target positions, over the language model's hidden states
    with torch.no_grad():
        chunked = method.forward(module, batch)[0]
        module.chunked = False
        full = method.forward(module, batch)[0]  # the model's own logits, the images through its forward
        module.chunked = True
        blank = method.forward(module, {**batch, "pixel_values": torch.full_like(batch["pixel_values"], 0.5)})[0]
    assert torch.allclose(chunked, full, rtol=1e-5, atol=1e-5), (chunked, full)
    assert not torch.allclose(chunked, blank)  # the images reach the model
    before = {name: p.detach().clone() for name, p in causal_lm.named_parameters()}
    optimizer = torch.optim.SGD([p for p in causal_lm.parameters() if p.requires_grad], lr=1.0)
    loss, _ = method.forward(module, batch)
    loss.backward()
    for name, p in causal_lm.named_parameters():
        assert (p.grad is not None) == (name in trainable), name
    optimizer.step()
    changed = {name for name, p in causal_lm.named_parameters() if not torch.equal(p, before[name])}
    assert changed and changed <= trainable
    assert any(part_of(n) == "projector" for n in changed) and any("lora_B" in n for n in changed)


def test_unfreezing_the_vision_tower_puts_lora_there_and_full_fine_tuning_honours_freezing(tiny_vlms, tmp_path):
    from praisonai_accel.models.vision import part_of

    model = _vlm(tiny_vlms, "llava")
    _, lora, _ = _loaded(model, tmp_path, finetune_vision_layers=True, freeze_multi_modal_projector=True)
    parts = {part_of(n) for n, p in lora.named_parameters() if p.requires_grad}
    assert parts == {"vision", "language"}
    _, full, _ = _loaded(model, tmp_path, finetune_type="full", freeze_language_model=True)
    assert {part_of(n) for n, p in full.named_parameters() if p.requires_grad} == {"projector"}


class _NoAccelerator:
    """What settle_chunking reads of an Accelerator, for one process."""

    device = torch.device("cpu")

    class distributed_type:  # noqa: N801
        name = "NO"


def test_a_datasets_image_feature_is_kept_as_a_file_not_as_pixels(tiny_vlms, tmp_path):
    """A parquet file (as a Hub dataset is) whose images are an Image feature with the JPEG/PNG bytes embedded,
    and Arrow-typed messages (every part has every field, "text": None on image parts)."""
    import datasets

    model = _vlm(tiny_vlms, "idefics3")
    rows = trl_rows(shape_records(3, 0, tmp_path / "img"))
    sources = [(tmp_path / r["images"][0]).read_bytes() for r in rows]
    table = datasets.Dataset.from_dict(
        {"messages": [r["messages"] for r in rows], "images": [[{"bytes": b, "path": None}] for b in sources]})
    table = table.cast_column("images", datasets.List(datasets.Image()))
    table.to_parquet(str(tmp_path / "train.parquet"))
    for image in (tmp_path / "img").iterdir():
        image.unlink()  # only the parquet file holds them now
    tokenizer, method, data, stats, _ = _encoded(_config(model, tmp_path / "train.parquet", tmp_path))
    assert stats.datasets[0].examples == 3
    for index, expected in enumerate(sources):
        paths = decode_references(data[index]["images"])
        assert len(paths) == 1 and Path(paths[0]).read_bytes() == expected
        assert Path(paths[0]).parent == tmp_path / "out" / ".cache" / "preprocessed" / "images"
    batch = method.collator(tokenizer.pad_token_id)([data[0], data[1], data[2]])
    assert batch["pixel_values"].shape[0] == 3


def test_image_pixel_budget_reaches_processors_that_take_one_and_is_refused_by_others():
    """Qwen2-VL's image processor (its PIL backend needs no torchvision) resizes to image_max_pixels; CLIP's
    (LLaVA's) has no pixel budget: one line."""
    from PIL import Image
    from transformers import CLIPImageProcessorPil
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from praisonai_accel.data.vision_processor import set_pixel_budget

    config = parse_config({"model_name": "m", "dataset": "d.jsonl", "image_max_pixels": 64 * 64,
                           "image_min_pixels": 32 * 32})
    image = Image.new("RGB", (400, 300))
    processor = Qwen2VLImageProcessorPil()
    before = processor(images=[image], return_tensors="pt")["image_grid_thw"][0].prod().item()
    set_pixel_budget(processor, config, "m")
    grid = processor(images=[image], return_tensors="pt")["image_grid_thw"][0]
    assert grid.prod().item() * 14 * 14 <= 64 * 64 < before * 14 * 14
    assert processor.to_dict()["size"] == {"longest_edge": 4096, "shortest_edge": 1024}  # in the cache key
    with pytest.raises(ConfigError, match=r"^image_max_pixels: the image processor of m \(CLIPImageProcessorPil\) "
                                          r"does not resize by a pixel budget; remove it$"):
        set_pixel_budget(CLIPImageProcessorPil(), config, "m")


def test_rows_with_images_for_a_text_model_are_bad_rows(tiny_model, tmp_path):
    from praisonai_accel.demo.vision import llamafactory_rows

    row = llamafactory_rows(shape_records(1, 0, tmp_path / "img"))[0]
    text = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "red"}], "images": []}
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in [text, row]))
    with pytest.raises(DataError, match=rf"^dataset {data} \(format messages\): line 2: it has images, and "
                                        rf"{tiny_model} takes none \(no vision tower, or no image processor saved "
                                        r"with it\) \(1 invalid row in all;"):
        _encoded(_config(tiny_model, data, tmp_path))


def test_trls_parts_and_llamafactorys_placeholders_in_every_format_encode_alike(tiny_vlms, tmp_path):
    model = _vlm(tiny_vlms, "gemma3")
    image = shape_records(1, 0, tmp_path / "img")[0]["image"]
    rows = [
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "what is "}, {"type": "image"},
                                                   {"type": "text", "text": "?"}]},
                      {"role": "assistant", "content": [{"type": "text", "text": "red"}]}], "images": [image]},
        {"messages": [{"role": "user", "content": "what is <image>?"}, {"role": "assistant", "content": "red"}],
         "images": [image]},
        {"conversations": [{"from": "human", "value": "what is <image>?"}, {"from": "gpt", "value": "red"}],
         "images": [image]},
        {"instruction": "what is <image>?", "output": "red", "images": image},
    ]
    encoded = []
    for number, row in enumerate(rows):
        data = tmp_path / f"rows{number}.jsonl"
        data.write_text(json.dumps(row) + "\n")
        example = _encoded(_config(model, data, tmp_path))[2][0]
        encoded.append((example["input_ids"].tolist(), example["labels"].tolist()))
    assert all(e == encoded[0] for e in encoded[1:])


@pytest.mark.parametrize("kind", ["llava", "gemma3", "idefics3"])
def test_rows_without_images_train_beside_rows_with_images(tiny_vlms, kind, tmp_path):
    """Text-only rows in a dataset of image rows (no `images`, or an empty list): a batch of text rows alone and a
    mixed batch both reach the model, with a finite loss (the image processor sees only the rows with images)."""
    text = [{"messages": [{"role": "user", "content": f"say {word}"}, {"role": "assistant", "content": word}],
             **extra} for word, extra in (("red", {}), ("blue", {"images": []}))]
    rows = text + trl_rows(shape_records(2, 0, tmp_path / "img"))
    config, causal_lm, tokenizer = _loaded(_vlm(tiny_vlms, kind), tmp_path, rows)
    method = SFT(config)
    data, stats, _ = tokenize_dataset(config.dataset, tokenizer, config, method.data(tokenizer))
    assert stats.datasets[0].examples == 4
    assert [len(data[i]["images"]) for i in range(4)][:2] == [0, 0]
    collate = method.collator(tokenizer.pad_token_id)
    module = method.loss_module(causal_lm, accelerator=_NoAccelerator(), tokenizer=tokenizer, use_cuda=False)
    text_batch, mixed_batch = collate([data[0], data[1]]), collate([data[0], data[2], data[3]])
    assert "pixel_values" not in text_batch and mixed_batch["pixel_values"].shape[0] == 2
    for batch in (text_batch, mixed_batch):
        loss = method.forward(module, batch)[0]
        assert torch.isfinite(loss)
        loss.backward()


def test_format_text_on_a_vlm_trains_as_text(tiny_vlms, tmp_path):
    model = _vlm(tiny_vlms, "llava")
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"text": f"a {w} square"}) + "\n" for w in ("red", "blue")))
    tokenizer, method, encoded, stats, _ = _encoded(_config(model, data, tmp_path))
    assert stats.datasets[0].examples == 2 and len(encoded[0]["images"]) == 0
    batch = method.collator(tokenizer.pad_token_id)([encoded[0], encoded[1]])
    assert "pixel_values" not in batch and batch["input_ids"].shape[0] == 2


def test_the_cache_key_holds_the_processors_image_token_count_and_a_changed_image_is_one_line(tiny_vlms, tmp_path):
    """Idefics3's image_seq_len is the processor's, not its image processor's: it changes the key. An image file
    replaced by one of another size after preprocessing: the collator names it and the stale cache."""
    from PIL import Image

    from praisonai_accel.data.cache import cache_key
    from praisonai_accel.data.images import image_references

    model = _vlm(tiny_vlms, "idefics3")
    rows = trl_rows(shape_records(2, 0, tmp_path / "img"))
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = _config(model, data, tmp_path)
    tokenizer, method, encoded, _, _ = _encoded(config)
    key = cache_key(config.dataset, tokenizer, config)
    tokenizer.praisonai_processor.image_seq_len += 1
    assert cache_key(config.dataset, tokenizer, config) != key
    tokenizer.praisonai_processor.image_seq_len -= 1
    path, width, height = image_references(encoded[0]["images"])[0]
    assert (width, height) == Image.open(path).size
    Image.new("RGB", (width + 8, height)).save(path)
    with pytest.raises(DataError, match=rf"^image {path} is {width + 8}x{height} but was {width}x{height} when the "
                                        r"dataset was preprocessed \(the image changed\): the preprocessing cache is "
                                        r"stale; delete it to preprocess again$"):
        method.collator(tokenizer.pad_token_id)([encoded[0], encoded[1]])


def test_a_decompression_bomb_is_a_bad_row_and_one_line_for_chat(tmp_path, monkeypatch):
    from PIL import Image

    from praisonai_accel.data.images import check_images
    from praisonai_accel.models.inference import read_image

    path = tmp_path / "big.png"
    Image.new("RGB", (64, 64)).save(path)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 16 * 16)  # PIL refuses twice this many as a bomb
    row = {"messages": [{"role": "user", "content": "<image>"}], "images": [str(path)]}
    problem = check_images(row, row["messages"], tmp_path)
    assert problem.kind == "unreadable image" and str(problem).startswith(f"image 1 ({path}) is refused: Image size")
    with pytest.raises(ValueError, match=rf"^{path}: is refused: Image size \(4096 pixels\) exceeds limit"):
        read_image(path)


def test_gemma3n_audio_and_embedders_and_llava_next_newline_are_vision_and_projector_parts():
    """Names as transformers 5's Gemma3nModel and LlavaNextModel give them."""
    from praisonai_accel.models.vision import part_of

    assert part_of("model.audio_tower.conformer.0.ffw_layer_start.ffw_layer_1.weight") == "vision"
    assert part_of("model.embed_audio.embedding_projection.weight") == "projector"
    assert part_of("model.embed_vision.embedding_projection.weight") == "projector"
    assert part_of("model.image_newline") == "projector"
    assert part_of("model.language_model.layers.0.self_attn.q_proj.weight") == "language"


@pytest.mark.parametrize("kind,kept", [("llava", ["lm_head", "model.multi_modal_projector", "model.vision_tower"]),
                                       ("idefics3", ["lm_head", "model.connector", "model.vision_model"])])
def test_qlora_leaves_the_vision_tower_projector_and_head_unquantized(tiny_vlms, kind, kept, tmp_path):
    """bitsandbytes cannot run here: the BitsAndBytesConfig arguments built for a tiny VLM, and transformers' own
    matching of them against the model's linear layers."""
    from transformers import AutoConfig, AutoModelForImageTextToText
    from transformers.quantizers.quantizers_utils import should_convert_module

    from praisonai_accel.models.loading import quantization_settings, vision_quantization_skips
    from praisonai_accel.models.vision import part_of

    model = _vlm(tiny_vlms, kind)
    settings = quantization_settings(torch.bfloat16, vision_quantization_skips(_config(model, model, tmp_path)))
    assert settings["llm_int8_skip_modules"] == kept and settings["load_in_4bit"]
    with torch.device("meta"):
        built = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(model))
    linears = [name for name, module in built.named_modules() if isinstance(module, torch.nn.Linear)]
    for name in linears:
        quantized = should_convert_module(name, settings["llm_int8_skip_modules"])
        assert quantized == (part_of(name) == "language" and name != "lm_head"), name
    assert "llm_int8_skip_modules" not in quantization_settings(torch.bfloat16)  # a text model: transformers' own


def test_fsdp2_wraps_each_vision_encoder_layer_as_a_unit_of_its_own(tiny_vlms, tiny_model, tmp_path):
    """Idefics3's _no_split_modules names its vision attention, not its vision encoder layer: the layer class is
    added, so accelerate's transformer wrapping (what --fsdp runs) makes each layer, MLP and norms with it, a unit."""
    from accelerate.utils.dataclasses import get_module_class_from_name

    config, causal_lm, tokenizer = _loaded(_vlm(tiny_vlms, "idefics3"), tmp_path)
    module = SFT(config).loss_module(causal_lm, accelerator=_NoAccelerator(), tokenizer=tokenizer, use_cuda=False)
    names = set(module._no_split_modules)
    assert {"Idefics3EncoderLayer", "LlamaDecoderLayer"} <= names
    layers = causal_lm.get_base_model().model.vision_model.encoder.layers
    assert all(type(layer) is get_module_class_from_name(module, "Idefics3EncoderLayer") for layer in layers)
    from transformers import AutoModelForCausalLM

    from praisonai_accel.methods.lm_loss import vision_layer_classes

    assert vision_layer_classes(AutoModelForCausalLM.from_pretrained(tiny_model)) == set()  # a text model's own list


def test_placeholders_are_counted_in_the_conversation_that_trains(tiny_vlms, tmp_path):
    """check_row counts the images of the conversation formats.to_conversation builds (alpaca's instruction and
    input joined by a blank line), not of a rebuilt one: "<image" + ">" across the two is no placeholder."""
    model = _vlm(tiny_vlms, "llava")
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"instruction": "what is <image", "input": "> about", "output": "red"}) + "\n")
    assert _encoded(_config(model, data, tmp_path))[3].datasets[0].examples == 1


def test_a_single_image_column_is_images_for_every_check(tiny_model, tiny_vlms, tmp_path):
    """One `image` per row (as some Hub datasets have) is read as the row's images everywhere: a text model refuses
    the row, and format text on a VLM cannot place it."""
    image = shape_records(1, 0, tmp_path / "img")[0]["image"]
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "<image>"},
                                             {"role": "assistant", "content": "red"}], "image": image}) + "\n")
    with pytest.raises(DataError, match=r"line 1: it has images, and .* takes none"):
        _encoded(_config(tiny_model, data, tmp_path))
    text = tmp_path / "text.jsonl"
    text.write_text(json.dumps({"text": "a red square", "image": image}) + "\n")
    with pytest.raises(DataError, match=r"format text cannot place its 'image'"):
        _encoded(_config(_vlm(tiny_vlms, "llava"), text, tmp_path))
