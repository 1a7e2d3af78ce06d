"""Tiny vision-language models of real architectures, built locally, and a visual task they can learn on a CPU.

`make_tiny_vlm(kind, directory)` saves a random-weight LLaVA, Qwen2-VL, Gemma 3 or Idefics3 (SmolVLM's
architecture) with its real processor class: the image processor built from its class with small sizes, a
byte-level BPE tokenizer trained here with the processor's image tokens, and the model's own chat template as its
checkpoints ship it (TRL keeps verbatim copies in trl/chat_templates; LLaVA 1.5's is llava-hf's). No download.

`shape_records` draws the demo task: a coloured square or circle on a plain background, saved as image files, with
the question "what colour is the shape?" and a one-word answer, in TRL's and LLaMA-Factory's formats;
`vision_demo_config` is how `praisonai-accel demo --vision` (and bench/vision.py) trains on it, `held_out_answers`
and `exact_match` how they score it.
"""

from __future__ import annotations

import contextlib
import io
import random
from pathlib import Path

KINDS = ("llava", "qwen2_vl", "gemma3", "idefics3")

# llava-hf/llava-1.5-*-hf's chat_template.json, verbatim.
LLAVA_15_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}{{ message['role'].upper() + ': '}}{% endif %}"
    "{# Render all images first #}{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>\n' }}{% endfor %}{# Render all text next #}{% if message['role'] != 'assistant' %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ content['text'] + ' '}}"
    "{% endfor %}{% else %}{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{% generation %}{{ content['text'] + ' '}}{% endgeneration %}{% endfor %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)
# The file in trl/chat_templates holding each model's template as its checkpoints ship it.
_TRL_TEMPLATE = {"qwen2_vl": "qwen2_5_vl", "gemma3": "gemma3", "idefics3": "idefics3"}

COLOURS = ("red", "green", "blue", "yellow")
SHAPES = ("square", "circle")
_RGB = {"red": (220, 30, 30), "green": (30, 170, 50), "blue": (40, 60, 220), "yellow": (235, 215, 30)}
_BACKGROUNDS = ((245, 245, 245), (200, 200, 200), (120, 120, 120), (25, 25, 25))
QUESTIONS = ("what colour is the shape?", "what is the colour of the shape?", "which colour is drawn?")


def chat_template(kind: str) -> str:
    if kind == "llava":
        return LLAVA_15_TEMPLATE
    import importlib.util

    trl = Path(importlib.util.find_spec("trl").origin).parent  # the file only: importing trl takes seconds
    return (trl / "chat_templates" / f"{_TRL_TEMPLATE[kind]}.jinja").read_text()


def _tokenizer_texts() -> list[str]:
    texts = list(QUESTIONS) + list(COLOURS) + list(SHAPES)
    texts += ["USER", "ASSISTANT", "User", "Assistant", "user", "assistant", "system", "model", "\n", ": ",
              "You are a helpful assistant.", "Picture 1", "Video 1", "the shape is"]
    return texts * 4


def _tokenizer(special: list[str], **named):
    """A byte-level BPE tokenizer trained on the demo's words, with `special` as unsplittable tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(_tokenizer_texts(), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, model_max_length=4096, **named)


def _text_config(tokenizer, **extra) -> dict:
    return {"vocab_size": len(tokenizer), "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 1024,
            "pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id,
            "bos_token_id": tokenizer.bos_token_id, "tie_word_embeddings": False, **extra}


def _vision(hidden: int = 32, image_size: int = 32, patch_size: int = 8) -> dict:
    return {"hidden_size": hidden, "intermediate_size": hidden * 2, "num_hidden_layers": 2, "num_attention_heads": 2,
            "image_size": image_size, "patch_size": patch_size}


def _llava():
    from transformers import (CLIPImageProcessorPil, CLIPVisionConfig, LlamaConfig, LlavaConfig,
                              LlavaForConditionalGeneration, LlavaProcessor)

    tokenizer = _tokenizer(["<unk>", "<s>", "</s>", "<pad>", "<image>"],
                           unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    images = CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    processor = LlavaProcessor(image_processor=images, tokenizer=tokenizer, patch_size=8,
                               vision_feature_select_strategy="default", num_additional_image_tokens=1,
                               chat_template=chat_template("llava"))
    config = LlavaConfig(vision_config=CLIPVisionConfig(**_vision(), projection_dim=32),
                         text_config=LlamaConfig(**_text_config(tokenizer)),
                         image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
                         vision_feature_select_strategy="default", vision_feature_layer=-2,
                         pad_token_id=tokenizer.pad_token_id)
    return LlavaForConditionalGeneration(config), processor


def _qwen2_vl():
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLImageProcessorPil, Qwen2VLProcessor

    tokenizer = _tokenizer(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                            "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"],
                           eos_token="<|im_end|>", pad_token="<|endoftext|>")
    images = Qwen2VLImageProcessorPil(patch_size=8, merge_size=2, temporal_patch_size=2,
                                      min_pixels=32 * 32, max_pixels=32 * 32)
    processor = Qwen2VLProcessor(image_processor=images, tokenizer=tokenizer, chat_template=chat_template("qwen2_vl"))
    ids = tokenizer.convert_tokens_to_ids
    config = Qwen2VLConfig(
        text_config=_text_config(tokenizer, rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3],
                                                             "rope_theta": 10000.0}),
        vision_config={"depth": 2, "embed_dim": 32, "hidden_size": 64, "num_heads": 2, "mlp_ratio": 2,
                       "patch_size": 8, "spatial_merge_size": 2, "temporal_patch_size": 2, "in_channels": 3},
        image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"))
    return Qwen2VLForConditionalGeneration(config), processor


def _gemma3():
    from transformers import (Gemma3Config, Gemma3ForConditionalGeneration, Gemma3ImageProcessorPil, Gemma3Processor,
                              Gemma3TextConfig, SiglipVisionConfig)

    tokenizer = _tokenizer(["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>",
                            "<start_of_image>", "<end_of_image>", "<image_soft_token>"],
                           pad_token="<pad>", eos_token="<eos>", bos_token="<bos>", unk_token="<unk>",
                           extra_special_tokens={"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                                                 "image_token": "<image_soft_token>"})
    images = Gemma3ImageProcessorPil(size={"height": 32, "width": 32})
    processor = Gemma3Processor(image_processor=images, tokenizer=tokenizer, image_seq_length=4,
                                chat_template=chat_template("gemma3"))
    ids = tokenizer.convert_tokens_to_ids
    config = Gemma3Config(
        text_config=Gemma3TextConfig(**_text_config(tokenizer, head_dim=16, sliding_window=64)),
        vision_config=SiglipVisionConfig(**_vision()), mm_tokens_per_image=4,
        boi_token_index=ids("<start_of_image>"), eoi_token_index=ids("<end_of_image>"),
        image_token_index=ids("<image_soft_token>"))
    model = Gemma3ForConditionalGeneration(config)
    # Gemma 3 starts its projector at zero (the pretrained checkpoints do not): random, so images reach the text
    model.model.multi_modal_projector.mm_input_projection_weight.data.normal_(0.0, 0.03)
    # Gemma 3's instruction-tuned checkpoints stop on <eos> and on <end_of_turn> (their generation_config)
    model.generation_config.eos_token_id = [ids("<eos>"), ids("<end_of_turn>")]
    return model, processor


def _idefics3():
    from transformers import (Idefics3Config, Idefics3ForConditionalGeneration, Idefics3ImageProcessorPil,
                              Idefics3Processor, Idefics3VisionConfig, LlamaConfig)

    grid = [f"<row_{i + 1}_col_{j + 1}>" for i in range(6) for j in range(6)]
    tokenizer = _tokenizer(["<|endoftext|>", "<|begin_of_text|>", "<end_of_utterance>", "<fake_token_around_image>",
                            "<image>", "<global-img>", *grid],
                           bos_token="<|begin_of_text|>", eos_token="<end_of_utterance>", pad_token="<|endoftext|>")
    images = Idefics3ImageProcessorPil(size={"longest_edge": 32}, max_image_size={"longest_edge": 32},
                                       do_image_splitting=False)
    processor = Idefics3Processor(image_processor=images, tokenizer=tokenizer, image_seq_len=4,
                                  chat_template=chat_template("idefics3"))
    config = Idefics3Config(vision_config=Idefics3VisionConfig(**_vision()),
                            text_config=LlamaConfig(**_text_config(tokenizer)), scale_factor=2,
                            image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
                            pad_token_id=tokenizer.pad_token_id)
    return Idefics3ForConditionalGeneration(config), processor


_BUILDERS = {"llava": _llava, "qwen2_vl": _qwen2_vl, "gemma3": _gemma3, "idefics3": _idefics3}


def unbuildable_reason(kind: str) -> str | None:
    """Why this installation cannot build `kind` locally, or None when it can."""
    from transformers.utils import is_torchvision_available

    if kind == "qwen2_vl" and not is_torchvision_available():
        # ProcessorMixin checks every attribute's class, the video processor's too, and transformers defines the
        # video processors only with torchvision; so neither this nor a real Qwen2-VL checkpoint's processor loads.
        return ("Qwen2VLProcessor needs a video processor, which transformers provides only with torchvision "
                "(not installed)")
    return None


def make_tiny_vlm(kind: str, directory: Path, seed: int = 0) -> Path:
    """Save a random-weight VLM of architecture `kind` (one of KINDS) and its processor, printing nothing.

    Both load back with AutoModelForImageTextToText / AutoProcessor.from_pretrained(directory)."""
    import torch
    from transformers.utils import logging as hf_logging

    if kind not in _BUILDERS:
        raise ValueError(f"unknown tiny VLM kind {kind!r}: one of {', '.join(KINDS)}")
    reason = unbuildable_reason(kind)
    if reason:
        raise RuntimeError(f"cannot build a tiny {kind} here: {reason}")
    directory = Path(directory)
    progress_bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            torch.manual_seed(seed)
            model, processor = _BUILDERS[kind]()
            model.save_pretrained(directory)
            processor.save_pretrained(directory)
    finally:
        if progress_bars:
            hf_logging.enable_progress_bar()
    return directory


def draw_shape(colour: str, shape: str, rng: random.Random, size: int = 64):
    """A PIL image: one filled `shape` of `colour` at a random place and size on a plain grey-scale background."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (size, size), rng.choice(_BACKGROUNDS))
    extent = rng.randint(size // 3, size * 2 // 3)
    left, top = rng.randint(0, size - extent), rng.randint(0, size - extent)
    box = (left, top, left + extent, top + extent)
    draw = ImageDraw.Draw(image)
    (draw.rectangle if shape == "square" else draw.ellipse)(box, fill=_RGB[colour])
    return image


def shape_records(count: int, seed: int, image_dir: Path, root: Path | None = None,
                  prefix: str = "shape") -> list[dict]:
    """`count` drawn images saved under image_dir (PNG and JPEG alternately) and one record each:
    {"image": path relative to `root` (default image_dir's parent), "question", "answer" (the colour), "shape",
    "colour"}. Turn them into a dataset's rows with `trl_rows` or `llamafactory_rows`."""
    image_dir = Path(image_dir)
    root = Path(root) if root is not None else image_dir.parent
    image_dir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    records = []
    for index in range(count):
        colour, shape = COLOURS[index % len(COLOURS)], rng.choice(SHAPES)
        path = image_dir / f"{prefix}-{seed}-{index:05d}.{'png' if index % 2 == 0 else 'jpg'}"
        draw_shape(colour, shape, rng).save(path)
        records.append({"image": path.relative_to(root).as_posix(), "question": rng.choice(QUESTIONS),
                        "answer": colour, "colour": colour, "shape": shape})
    rng.shuffle(records)
    return records


def shape_splits(image_dir: Path, train: int = 256, held_out: int = 64, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """A training set and a held-out set of different images (drawn from different seeds)."""
    return (shape_records(train, seed, image_dir, prefix="train"),
            shape_records(held_out, seed + 10_000, image_dir, prefix="test"))


def prompt_messages(record: dict) -> list[dict]:
    """The user turn of a record in TRL's vision format: an image part, then the question (as inference places
    the images of a prompt)."""
    from ..models.inference import vision_messages

    return vision_messages([{"role": "user", "content": record["question"]}], 1)


def trl_rows(records: list[dict]) -> list[dict]:
    """TRL's vision format: `messages` with typed content parts and an `images` column."""
    return [{"messages": prompt_messages(r) + [{"role": "assistant",
                                                "content": [{"type": "text", "text": r["answer"]}]}],
             "images": [r["image"]]} for r in records]


def llamafactory_rows(records: list[dict]) -> list[dict]:
    """LLaMA-Factory's sharegpt-style multimodal format: an `<image>` placeholder in the text plus `images`."""
    return [{"messages": [{"role": "user", "content": f"<image>{r['question']}"},
                          {"role": "assistant", "content": r["answer"]}],
             "images": [r["image"]]} for r in records]


def held_out_answers(model, processor, records: list[dict], image_root: Path, max_new_tokens: int = 8,
                     batch_size: int = 32) -> list[str]:
    """Greedy answers to every record's question about its image, in left-padded batches
    (inference.generate_batch: what `generate --image` runs, a batch at a time)."""
    from ..models.inference import generate_batch, read_image

    answers: list[str] = []
    for start in range(0, len(records), batch_size):
        chunk = records[start:start + batch_size]
        answers += generate_batch(model, processor, [[{"role": "user", "content": r["question"]}] for r in chunk],
                                  max_new_tokens, images=[[read_image(Path(image_root) / r["image"])] for r in chunk])
    return answers


def vision_demo_config(model_dir: Path, data_path: Path, output_dir: Path, **overrides) -> dict:
    """The demo's training config: the whole language model and the projector train, the random vision tower stays
    frozen (freeze_vision_tower's default, written out to show it); 120 steps of 2 x 8 images learn the colours."""
    config = {
        "model_name": str(model_dir),
        "dataset": [{"name": str(data_path)}],
        "max_seq_length": 128,
        "finetune_type": "full",
        "freeze_vision_tower": True,
        "freeze_multi_modal_projector": False,
        "per_device_train_batch_size": 8,
        "gradient_accumulation_steps": 1,
        "learning_rate": 3e-3,
        "max_steps": 120,
        "warmup_steps": 5,
        "lr_scheduler_type": "linear",
        "logging_steps": 20,
        "seed": 42,
        "output_dir": str(output_dir),
        "final_model_dir": "model",
    }
    config.update(overrides)
    return config


def exact_match(answers: list[str], records: list[dict]) -> float:
    """The fraction of answers equal to the record's answer (after stripping white space)."""
    return sum(a.strip() == r["answer"] for a, r in zip(answers, records)) / max(len(records), 1)
