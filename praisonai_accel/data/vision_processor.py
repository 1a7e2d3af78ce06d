"""The processor of a vision-language checkpoint: whether a checkpoint takes images, its AutoProcessor (with
image_max_pixels / image_min_pixels), and the tokenizer that carries it through every stage that tokenizes (the
launcher's preprocessing, `preview`, the workers), so a text model's path is unchanged.

A checkpoint takes images when its config names a vision tower and maps to AutoModelForImageTextToText (LLaVA,
Qwen2-VL / Qwen2.5-VL, Gemma 3, Idefics3 / SmolVLM, ...).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import ConfigError

PROCESSOR_ATTRIBUTE = "praisonai_processor"  # the tokenizer of a vision-language model carries its processor here


def _image_text_to_text(model_type) -> bool:
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES


def is_vision_config(model_config) -> bool:
    """Does this transformers config describe a model that takes images (and text)? (checkpoint_inputs adds: and
    its image processor is saved with it)"""
    return (getattr(model_config, "vision_config", None) is not None
            and _image_text_to_text(getattr(model_config, "model_type", None)))


PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")


def checkpoint_file(name: str, filename: str, revision: str | None = None):
    """A file of a checkpoint as a path here: its folder's, the Hub cache's, or fetched from the Hub (config files
    are small; not when HF_HUB_OFFLINE). False when the checkpoint has no such file; None when it cannot be known
    (not here, and the Hub not reachable or not a repo id)."""
    from pathlib import Path

    folder = Path(name).expanduser()
    if folder.is_dir():
        return folder / filename if (folder / filename).is_file() else False
    try:
        from huggingface_hub import constants, hf_hub_download, try_to_load_from_cache
        from huggingface_hub.errors import EntryNotFoundError
        from huggingface_hub.file_download import _CACHED_NO_EXIST

        cached = try_to_load_from_cache(name, filename, revision=revision)
        if isinstance(cached, str):
            return Path(cached)
        if cached is _CACHED_NO_EXIST:
            return False
        if constants.HF_HUB_OFFLINE:
            return None
        try:
            return Path(hf_hub_download(name, filename, revision=revision))
        except EntryNotFoundError:
            return False
    except Exception:  # not a repo id, no such repo, the Hub unreachable: loading the model says why
        return None


@dataclass(frozen=True)
class ModelInputs:
    """What a checkpoint takes besides text, decided once (checkpoint_inputs) and handed on: by the launcher to its
    checks and --dry-run; by the worker to the backend's choice, the model's loading, the tokenizer, its checks and
    the model card; by inference to the processor's loading, GGUF / Ollama and serving."""

    images: bool | None  # None: its files cannot be had here (decided again once the model is downloaded)
    model_type: str | None = None

    @property
    def vision(self) -> bool:
        """Takes images; not knowing counts as text (loading the model then says why it cannot)."""
        return bool(self.images)


def checkpoint_inputs(model: str, revision: str | None = None, processor_sources=None) -> ModelInputs:
    """THE rule for whether a checkpoint takes images, everywhere: its config.json names a vision tower of an
    image-text-to-text model (AutoModelForImageTextToText: LLaVA, Qwen2-VL, Gemma 3, Idefics3, ...) and an image
    processor is saved where its processor is loaded from (`processor_sources`: (name, revision) pairs, any one;
    default the model). A multimodal checkpoint saved without one trains as text.

    Read from files; transformers is imported only for a config with a vision tower and an image processor (a text
    model's path, unsloth first, is unchanged)."""
    import json

    path = checkpoint_file(model, "config.json", revision)
    if not path:
        return ModelInputs(None)
    try:
        model_config = json.loads(path.read_text())
        model_type = model_config.get("model_type")
        if not isinstance(model_config.get("vision_config"), dict):
            return ModelInputs(False, model_type)
    except (OSError, ValueError, AttributeError):
        return ModelInputs(None)
    found = [checkpoint_file(name, filename, rev) for name, rev in (processor_sources or [(model, revision)])
             for filename in PROCESSOR_FILES]
    if not any(found):
        return ModelInputs(None if None in found else False, model_type)
    return ModelInputs(_image_text_to_text(model_type), model_type)


def model_inputs(config) -> ModelInputs:
    """checkpoint_inputs of a run's model, its processor from tokenizer_name where set (as load_processor reads it)."""
    source = (config.tokenizer_name, None) if config.tokenizer_name else (config.model_name, config.revision)
    return checkpoint_inputs(config.model_name, config.revision, [source])


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
