"""The processor of a vision-language checkpoint: whether a checkpoint takes images, its AutoProcessor (with
image_max_pixels / image_min_pixels), and the tokenizer that carries it through every stage that tokenizes (the
launcher's preprocessing, `preview`, the workers), so a text model's path is unchanged.

A checkpoint takes images when its config names a vision tower and maps to AutoModelForImageTextToText (LLaVA,
Qwen2-VL / Qwen2.5-VL, Gemma 3, Idefics3 / SmolVLM, ...).
"""

from __future__ import annotations

import functools

from ..config import ConfigError

PROCESSOR_ATTRIBUTE = "praisonai_processor"  # the tokenizer of a vision-language model carries its processor here


def is_vision_config(model_config) -> bool:
    """Does this transformers config describe a model that takes images (and text)?"""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return (getattr(model_config, "vision_config", None) is not None
            and getattr(model_config, "model_type", None) in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)


PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")


def _checkpoint_file(config, filename: str):
    """The path of a file of the checkpoint on this machine (its folder, or the Hub cache); False when the
    checkpoint is here without it; None when the checkpoint is not here (a Hub id not cached)."""
    from pathlib import Path

    folder = Path(config.model_name).expanduser()
    if folder.is_dir():
        return folder / filename if (folder / filename).is_file() else False
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(config.model_name, filename, revision=config.revision)
    except Exception:  # not a repo id
        return None
    return Path(cached) if isinstance(cached, str) else None


def declares_images(config) -> bool | None:
    """Does the checkpoint take images: its config.json names a vision tower and it ships an image processor? Read
    from the files (a local folder, or the Hub cache) without importing transformers (unsloth must be imported
    first); None when they are not here. A multimodal checkpoint saved without its processor trains on text."""
    import json

    path = _checkpoint_file(config, "config.json")
    if not path:
        return None
    try:
        if not isinstance(json.loads(path.read_text()).get("vision_config"), dict):
            return False
    except (OSError, ValueError, AttributeError):
        return None
    return any(_checkpoint_file(config, name) for name in PROCESSOR_FILES)


@functools.lru_cache(maxsize=8)
def _vision_checkpoint(name: str, revision: str | None, trust_remote_code: bool) -> bool:
    from transformers import AutoConfig, AutoProcessor

    try:
        if not is_vision_config(AutoConfig.from_pretrained(name, revision=revision, trust_remote_code=trust_remote_code)):
            return False
        processor = AutoProcessor.from_pretrained(name, revision=revision, trust_remote_code=trust_remote_code)
    except Exception:  # not loadable: loading the model says why, in one line
        return False
    return getattr(processor, "image_processor", None) is not None


def is_vision_checkpoint(config) -> bool:
    """Whether config.model_name takes images here (declares_images; a checkpoint not on this machine is asked)."""
    declared = declares_images(config)
    if declared is not None:
        return declared
    return _vision_checkpoint(config.model_name, config.revision, config.trust_remote_code)


def load_processor(config):
    """The checkpoint's AutoProcessor, with image_max_pixels / image_min_pixels set where its image processor takes
    a pixel budget (one line where it takes none)."""
    from transformers import AutoProcessor

    name = config.tokenizer_name or config.model_name
    revision = config.revision if name == config.model_name else None
    processor = AutoProcessor.from_pretrained(name, revision=revision, trust_remote_code=config.trust_remote_code)
    image_processor = getattr(processor, "image_processor", None)
    if image_processor is None:
        raise ConfigError(f"model_name: {name} has no image processor (its AutoProcessor is "
                          f"{type(processor).__name__}); a vision-language model needs one")
    set_pixel_budget(image_processor, config, name)
    return processor


def set_pixel_budget(image_processor, config, name: str) -> None:
    """image_max_pixels / image_min_pixels on an image processor that resizes to a pixel budget (Qwen2-VL's and its
    kin: min_pixels / max_pixels among its keyword arguments, kept in transformers 5 as size's shortest_edge /
    longest_edge); one line for one that does not."""
    takes = set(getattr(getattr(type(image_processor), "valid_kwargs", None), "__annotations__", {}))
    for key, attribute, edge in (("image_max_pixels", "max_pixels", "longest_edge"),
                                 ("image_min_pixels", "min_pixels", "shortest_edge")):
        value = getattr(config, key)
        if value is None:
            continue
        if attribute not in takes and not hasattr(image_processor, attribute):
            raise ConfigError(f"{key}: the image processor of {name} ({type(image_processor).__name__}) does not "
                              "resize by a pixel budget; remove it")
        if hasattr(image_processor, attribute):
            setattr(image_processor, attribute, value)
        size = getattr(image_processor, "size", None)
        if isinstance(size, dict) or (size is not None and hasattr(size, "__setitem__")):
            size[edge] = value


def tokenizer_of(processor):
    """The processor's tokenizer with the processor's chat template, carrying the processor (PROCESSOR_ATTRIBUTE)."""
    tokenizer = processor.tokenizer
    if getattr(processor, "chat_template", None):
        tokenizer.chat_template = processor.chat_template
    setattr(tokenizer, PROCESSOR_ATTRIBUTE, processor)
    return tokenizer


def processor_of(tokenizer):
    """The processor a vision-language model's tokenizer carries; None for a text model."""
    return getattr(tokenizer, PROCESSOR_ATTRIBUTE, None)
