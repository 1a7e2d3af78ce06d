"""What of a vision-language model trains (data/vision_processor.py says which checkpoints take images).

Such a checkpoint loads with AutoModelForImageTextToText and its AutoProcessor (model.py). Its parts are found by
parameter name, the way transformers names them: the vision tower (vision_tower, visual, vision_model), the projector between it and
the language model (multi_modal_projector, connector, Qwen2-VL's visual.merger), and the language model (the rest:
language_model / text_model, the embeddings and the LM head). The freeze_* keys (config_vision.py) say which train;
LoRA adapts only the unfrozen tower / language model, and an unfrozen projector is trained whole (peft's
modules_to_save), so it is saved with the adapter.
"""

from __future__ import annotations

import logging

log = logging.getLogger("praisonai_accel")

# Gemma 3n's audio tower goes with the vision tower (frozen alike: its adapters never fire on images and text), its
# embed_vision / embed_audio with the projectors, as does LLaVA-NeXT's image_newline (a parameter of the model)
VISION_PARTS = ("vision_tower", "visual", "vision_model", "vision_encoder", "image_encoder", "audio_tower")
PROJECTOR_PARTS = ("multi_modal_projector", "connector", "merger", "mm_projector", "embed_vision", "embed_audio",
                   "image_newline")


def part_of(name: str) -> str:
    """'vision', 'projector' or 'language': which part of a vision-language model a parameter or module is in."""
    pieces = name.split(".")
    if any(p in PROJECTOR_PARTS for p in pieces):
        return "projector"
    if any(p in VISION_PARTS for p in pieces):
        return "vision"
    return "language"


def frozen_parts(config) -> set[str]:
    return {part for part, frozen in (("vision", config.freeze_vision_tower),
                                      ("projector", config.freeze_multi_modal_projector),
                                      ("language", config.freeze_language_model)) if frozen}


def freeze(model, config) -> None:
    """requires_grad off on the frozen parts (full fine-tuning; LoRA freezes everything itself)."""
    frozen = frozen_parts(config)
    for name, parameter in model.named_parameters():
        if part_of(name) in frozen:
            parameter.requires_grad_(False)


def lora_scope(model, config) -> dict:
    """peft LoraConfig arguments that keep LoRA to the unfrozen tower / language model (exclude_modules: every
    linear layer of a frozen part and of the projector) and train an unfrozen projector whole (modules_to_save)."""
    from torch import nn

    frozen = frozen_parts(config)
    exclude = [name for name, module in model.named_modules()
               if isinstance(module, nn.Linear) and (part_of(name) in frozen or part_of(name) == "projector")]
    projectors = sorted({_projector_root(name) for name, _ in model.named_modules() if part_of(name) == "projector"})
    scope: dict = {"exclude_modules": exclude} if exclude else {}
    if "projector" not in frozen and projectors:
        scope["modules_to_save"] = [root.split(".")[-1] for root in projectors]
    return scope


def _projector_root(name: str) -> str:
    pieces = name.split(".")
    index = next(i for i, p in enumerate(pieces) if p in PROJECTOR_PARTS)
    return ".".join(pieces[:index + 1])


def unquantized_modules(model) -> list[str]:
    """The outermost modules of the vision tower and projector, and the LM head, by name: what QLoRA keeps in full
    precision (transformers' llm_int8_skip_modules match a name from its start)."""
    names = [name for name, _ in model.named_modules() if name]
    roots = [name for name in names if part_of(name) != "language" and part_of(name.rpartition(".")[0]) == "language"]
    head = model.get_output_embeddings()
    heads = [name for name, module in model.named_modules() if module is head and head is not None]
    return sorted(set(roots + heads[:1]))


def part_sizes(model) -> dict[str, tuple[int, int]]:
    """(trainable, total) parameters of each part, for the log."""
    sizes: dict[str, list[int]] = {}
    for name, parameter in model.named_parameters():
        part = sizes.setdefault(part_of(name.replace("modules_to_save.default.", "")), [0, 0])
        part[0] += parameter.numel() if parameter.requires_grad else 0
        part[1] += parameter.numel()
    return {part: (trained, total) for part, (trained, total) in sizes.items()}
