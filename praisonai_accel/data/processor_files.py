"""Saving what turns a conversation into a model's input next to the model: the tokenizer, or for a vision-language
model its whole processor (the image processor's settings in processor_config.json or preprocessor_config.json, the
chat template, the tokenizer), so the directory loads back with AutoProcessor and `chat --image` works from it."""

from __future__ import annotations

import copy
from pathlib import Path

from .vision_processor import processor_of


def save_processing(tokenizer, directory: Path, processor=None) -> None:
    """tokenizer.save_pretrained(directory), or the processor's save_pretrained for a vision-language model: the
    `processor` given, else the one the tokenizer carries (data/vision_processor.tokenizer_of). The tokenizer as
    training used it (its chat template, its pad token) is the one saved with the processor."""
    if getattr(tokenizer, "image_processor", None) is not None:  # already a processor (merge loads one)
        tokenizer.save_pretrained(directory)
        return
    processor = processor if processor is not None else processor_of(tokenizer)
    if processor is None:
        tokenizer.save_pretrained(directory)
        return
    template = getattr(tokenizer, "chat_template", None)
    if processor.tokenizer is not tokenizer or (isinstance(template, str) and template != processor.chat_template):
        processor = copy.copy(processor)
        processor.tokenizer = tokenizer
        if isinstance(template, str):
            processor.chat_template = template
    processor.save_pretrained(directory)
