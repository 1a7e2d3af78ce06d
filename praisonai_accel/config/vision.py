"""config.yaml: the keys of vision-language fine-tuning (images + text), composed into TrainConfig.

LLaMA-Factory's names (freeze_vision_tower, freeze_multi_modal_projector, freeze_language_model, image_max_pixels,
image_min_pixels), and praisonai-train's finetune_vision_layers / finetune_language_layers as the same switches.
Whether the model takes images at all is known only from its config: checks.vision_rule (before launch where the
model's config.json is on this machine, else in the worker once it loads).
"""

from __future__ import annotations

from pydantic import BaseModel, Field, TypeAdapter, ValidationError, model_validator

# The keys that only mean something for a model that takes images (a text-only model refuses them).
VISION_KEYS = ("freeze_vision_tower", "freeze_multi_modal_projector", "freeze_language_model",
               "finetune_vision_layers", "finetune_language_layers", "image_max_pixels", "image_min_pixels")


class VisionKeys(BaseModel):
    """Vision: which parts of a vision-language model train, and its images' size (a text-only model refuses them)."""

    freeze_vision_tower: bool = Field(default=True, description="The vision encoder gets no gradient (LoRA is not put "
                                                                "on it).")
    freeze_multi_modal_projector: bool = Field(
        default=False, description="Freeze the projector between the encoder and the language model; when it trains "
                                   "under LoRA it trains whole and is saved with the adapter.")
    freeze_language_model: bool = Field(default=False, description="Freeze the language model (with the embeddings "
                                                                   "and the LM head).")
    # Kept as written (None: not written) so a contradiction with the freeze_* switch can be named.
    finetune_vision_layers: bool | None = Field(
        default=None, description="praisonai-train's name: finetune_vision_layers: true is freeze_vision_tower: false.")
    finetune_language_layers: bool | None = Field(
        default=None, description="praisonai-train's name: the inverse of freeze_language_model.")
    image_max_pixels: int | None = Field(
        default=None, gt=0, description="The most pixels an image is resized to, for processors that take a pixel "
                                        "budget (Qwen2-VL, Qwen2.5-VL); default: the processor's.")
    image_min_pixels: int | None = Field(default=None, gt=0,
                                         description="The fewest pixels an image is resized to (as image_max_pixels).")

    @model_validator(mode="before")
    @classmethod
    def _praisonai_train_names(cls, data):
        """finetune_*_layers set the freeze_* switches; writing both names with opposite meanings is refused."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        for alias, key in (("finetune_vision_layers", "freeze_vision_tower"),
                           ("finetune_language_layers", "freeze_language_model")):
            value, other = _as_bool(data.get(alias)), _as_bool(data.get(key))
            if value is None:  # not written, or not a boolean (pydantic names it)
                continue
            if other is not None and other == value:
                raise ValueError(f"{alias}: {str(value).lower()} contradicts {key}: {str(other).lower()} "
                                 f"(the same switch, inverted); keep one of them")
            data[key] = not value
        return data

    def _written(self, key: str, alias: str) -> str:
        """The name the config gave this switch: `key: true`, or praisonai-train's `alias: false`."""
        return f"{alias}: false" if alias in self.model_fields_set else f"{key}: true"

    @model_validator(mode="after")
    def _check_vision_keys(self):
        language = self._written("freeze_language_model", "finetune_language_layers")
        vision = self._written("freeze_vision_tower", "finetune_vision_layers")
        if self.freeze_vision_tower and self.freeze_multi_modal_projector and self.freeze_language_model:
            raise ValueError(f"{language}: with {vision} and freeze_multi_modal_projector: true, nothing is left to "
                             "train; unfreeze one of them")
        if (getattr(self, "finetune_type", "lora") in ("lora", "qlora") and self.freeze_vision_tower
                and self.freeze_language_model):
            raise ValueError(f"{language}: LoRA then adapts nothing ({vision} freezes the vision tower too); "
                             "unfreeze one, or train the projector alone with finetune_type: full")
        if self.image_max_pixels and self.image_min_pixels and self.image_min_pixels > self.image_max_pixels:
            raise ValueError(f"image_min_pixels: {self.image_min_pixels} is more than image_max_pixels: "
                             f"{self.image_max_pixels}")
        return self

    def vision_keys_written(self) -> list[str]:
        """The vision keys this config sets away from their defaults (a text-only model refuses them; one written at
        its default, as praisonai-train's configs write finetune_vision_layers: false, is accepted)."""
        aliases = {"finetune_vision_layers": "freeze_vision_tower", "finetune_language_layers": "freeze_language_model"}
        fields, written = type(self).model_fields, self.model_fields_set
        named = [key for key in VISION_KEYS if key in written  # a switch set through its alias is named as written
                 and not any(alias in written and target == key for alias, target in aliases.items())]
        return [key for key in named if getattr(self, aliases.get(key, key)) != fields[aliases.get(key, key)].default]

def _as_bool(value) -> bool | None:
    """A value as pydantic reads a bool ("true", 1, ...); None when absent or not a boolean."""
    if value is None:
        return None
    try:
        return TypeAdapter(bool).validate_python(value)
    except ValidationError:
        return None
