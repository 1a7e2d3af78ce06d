"""SFT's data half for a vision-language model: rows with images -> token ids with each image's tokens in place,
labels that train only the model's replies, and references to the image files (never pixels) in the cache.

A row is rendered with the processor's chat template, its trained tokens found as for text (chat_masking), and its
image placeholders expanded exactly as the processor expands them: the processor is run on the rendered text with
blank images of the real images' sizes (the number of image tokens depends on the size alone), and its ids are
aligned with the text-only ids, so every token the processor added (the image's tokens, the newlines and markers
around them) is untrained. The ids are the processor's own: `processor(text, images)` of the same row gives them.
A row too long for max_seq_length is left out (an image's tokens are never cut).
"""

from __future__ import annotations

import difflib
from pathlib import Path

from ..config import DatasetSpec, TrainConfig
from ..errors import first_line
from ..data.batching import PadCollator
from ..data.cache import cache_dir
from ..data.chat_masking import IGNORE_INDEX, encode_conversation
from ..data.encoding import count_targets
from ..data.formats import TOO_LONG, DataError, RowProblem, check_row, to_conversation
from ..data.images import (
    IMAGE_COLUMNS, IMAGES_COLUMN, base_folder, check_images, encode_references, image_path, image_references,
    image_size, image_values, open_images, with_image_parts,
)
from .sft_rows import SFTData
from ..data.templates import template_label
from ..data.vision_processor import processor_of


class VisionSFTData(SFTData):
    name = "sft"
    columns = ("input_ids", "labels", "images")  # images: the files' paths (images.encode_references)

    def __init__(self, tokenizer, config: TrainConfig, plan=None):
        super().__init__(tokenizer, config, plan)
        self.processor = processor_of(tokenizer)
        self.store = Path(cache_dir(config)) / "images"  # images a dataset embeds (images.stored_image)

    def detect_format(self, columns: list[str], spec: DatasetSpec) -> str:
        fmt = super().detect_format(columns, spec)
        column = next((name for name in IMAGE_COLUMNS if name in columns), None)
        if fmt == "text" and column:
            raise DataError(f"dataset {spec.name}: format text cannot place its '{column}'; write the rows as "
                            "messages with {\"type\": \"image\"} parts or <image> placeholders")
        return fmt

    def check_row(self, row: dict, fmt: str, spec: DatasetSpec) -> RowProblem | None:
        problem = check_row(row, fmt, spec)
        if problem or fmt == "text":
            return problem
        return check_images(row, to_conversation(row, fmt, spec).messages, base_folder(spec), self.store)

    def encode(self, row: dict, fmt: str, tokenizer=None, config: TrainConfig | None = None,
               spec: DatasetSpec | None = None) -> dict | RowProblem:
        tokenizer, config, plan = tokenizer or self.tokenizer, config or self.config, self.plan
        if fmt == "text":
            encoded = super().encode(row, fmt, tokenizer, config, spec)
            return encoded if isinstance(encoded, RowProblem) else {**encoded, IMAGES_COLUMN: []}
        base = base_folder(spec)
        paths = [image_path(value, number, base, self.store) for number, value in enumerate(image_values(row), 1)]
        sizes = [image_size(path, number) for number, path in enumerate(paths, 1)]
        problem = next((p for p in paths + sizes if isinstance(p, RowProblem)), None)
        if problem is not None:  # the file changed since check_row read it
            return problem
        conversation = to_conversation(row, fmt, spec)
        messages = plan.prepare(with_image_parts(conversation.messages))
        try:
            ids, labels = encode_conversation(tokenizer, plan, messages, conversation.tools, config.train_on_inputs)
            text = tokenizer.apply_chat_template(messages, tools=conversation.tools or None, tokenize=False)
        except Exception as exc:  # the template rejects this conversation
            return RowProblem("chat template cannot render it",
                              f"the chat template {template_label(plan)} cannot render it: {type(exc).__name__}: "
                              f"{first_line(exc, '')}")
        expanded = processor_ids(self.processor, text, sizes)
        labels = aligned_labels(ids, labels, expanded, image_token_ids(self.processor))
        if labels is None:
            return RowProblem("images change the reply's tokens",
                              "the processor's image tokens change how a reply is tokenized")
        if len(expanded) > config.max_seq_length:
            return RowProblem(TOO_LONG, f"{TOO_LONG} ({len(expanded)} tokens with its images' "
                                        f"{len(expanded) - len(ids) + len(sizes)}; a row's images are never cut, so "
                                        f"it is left out)")
        if count_targets(labels) == 0:
            return RowProblem("nothing to train", "no token of it is trained once rendered")
        return {"input_ids": expanded, "labels": labels, "images": encode_references(paths, sizes), "truncated": False,
                "response_cut": False}

    def sample_problems(self, rows: list[dict], fmt: str, spec: DatasetSpec) -> str:
        return ""  # the reply spans are checked by aligned_labels on every row


def processor_ids(processor, text: str, sizes: list[tuple[int, int]]) -> list[int]:
    """The ids processor(text, images) gives for images of these sizes: run on blank images of the same sizes.
    Without special tokens, as TRL's collator calls it: the chat template writes bos where the model has one."""
    from PIL import Image

    images = [Image.new("RGB", size) for size in sizes]
    out = processor(text=[text], images=[images] if images else None, add_special_tokens=False)
    return [int(i) for i in out["input_ids"][0]]


def image_feature_ids(processor) -> set[int]:
    """The ids of the tokens an image's features replace (one per feature)."""
    return {i for i in (getattr(processor, "image_token_ids", None) or [getattr(processor, "image_token_id", None)])
            if isinstance(i, int)}


def image_token_ids(processor) -> set[int]:
    """Every token of an image: its feature tokens and the markers around them (begin / end of image); never
    trained."""
    tokenizer = processor.tokenizer
    tokens = {getattr(processor, name, None) for name in ("image_token", "boi_token", "eoi_token")}
    tokens |= {getattr(tokenizer, name, None) for name in ("image_token", "boi_token", "eoi_token")}
    ids = {tokenizer.convert_tokens_to_ids(t) for t in tokens if isinstance(t, str)} | image_feature_ids(processor)
    return {i for i in ids if isinstance(i, int) and i != tokenizer.unk_token_id}


def aligned_labels(ids: list[int], labels: list[int], expanded: list[int], image_ids: set[int]) -> list[int] | None:
    """Labels for the processor's ids: each token the text-only ids also hold keeps its label, every token the
    processor added is untrained. None when a trained token is not found again (the expansion changed a reply)."""
    out = [IGNORE_INDEX] * len(expanded)
    matcher = difflib.SequenceMatcher(None, ids, expanded, autojunk=False)
    for a, b, size in matcher.get_matching_blocks():
        out[b:b + size] = labels[a:a + size]
    out = [IGNORE_INDEX if token in image_ids else label for token, label in zip(expanded, out)]
    trained = sum(label != IGNORE_INDEX and token not in image_ids for token, label in zip(ids, labels))
    return out if sum(label != IGNORE_INDEX for label in out) == trained else None


class VisionCollator:
    """Right-pads a batch (PadCollator) and decodes its images, now: the image processor's tensors (pixel_values,
    image_grid_thw, pixel_attention_mask, ...) join the batch, and the token type ids where the processor makes
    them (Gemma 3: 1 on each image token)."""

    def __init__(self, pad_token_id: int, processor):
        self.pad, self.processor = PadCollator(pad_token_id), processor
        self.names = set(getattr(processor, "model_input_names", ())) - {"input_ids", "attention_mask"}

    def __call__(self, features: list[dict]) -> dict:
        import torch

        batch = self.pad([{k: v for k, v in f.items() if k != IMAGES_COLUMN} for f in features])
        # only the rows with images: the image processor takes no empty list, and the model places each image by
        # its tokens, so rows without any (text rows in the same dataset) are text to it
        images = [open_images(refs) for refs in (image_references(f[IMAGES_COLUMN]) for f in features) if refs]
        if images:
            pixels = self.processor.image_processor(images=images, return_tensors="pt")
            batch.update({k: v for k, v in pixels.items() if k in self.names})
        for name in ("token_type_ids", "mm_token_type_ids"):  # the processor's own: 1 on an image's tokens
            if name in self.names:
                batch[name] = torch.tensor(self.processor.create_mm_token_type_ids(batch["input_ids"].tolist()))
        return batch


def image_spans(processor, input_ids: list[int], paths: list[str]) -> list[tuple[int, int, str]]:
    """Where each image of an encoded example is: (start, end, `<image 1: 448x448 -> 256 tokens>`), from its first
    to its last image token (the tokens between, such as Idefics3's tile markers, with it). For `preview`."""
    feature_ids = image_feature_ids(processor)
    spans, cursor = [], 0
    for number, path in enumerate(paths, 1):
        size = image_size(Path(path), number)
        if isinstance(size, str):  # gone since preprocessing
            return spans
        count = sum(token in feature_ids for token in processor_ids(processor, processor.image_token, [size]))
        start = next((i for i in range(cursor, len(input_ids)) if input_ids[i] in feature_ids), None)
        if start is None or not count:
            return spans
        seen, end = 0, start
        while end < len(input_ids) and seen < count:
            seen += input_ids[end] in feature_ids
            end += 1
        spans.append((start, end, f"<image {number}: {size[0]}x{size[1]} -> {count} tokens>"))
        cursor = end
    return spans
