"""config.yaml: the keys of vision-language fine-tuning (images + text), composed into TrainConfig.

LLaMA-Factory's names (freeze_vision_tower, freeze_multi_modal_projector, freeze_language_model, image_max_pixels,
image_min_pixels), and praisonai-train's finetune_vision_layers / finetune_language_layers as the same switches.
Whether the model takes images at all is known only from its config: checks.vision_rule (before launch where the
model's config.json is on this machine, else in the worker once it loads).
"""

from __future__ import annotations

from pydantic import BaseModel, Field, model_validator

# The keys that only mean something for a model that takes images (a text-only model refuses them).
VISION_KEYS = ("freeze_vision_tower", "freeze_multi_modal_projector", "freeze_language_model",
               "finetune_vision_layers", "finetune_language_layers", "image_max_pixels", "image_min_pixels")


class VisionKeys(BaseModel):
    freeze_vision_tower: bool = True
    freeze_multi_modal_projector: bool = False
    freeze_language_model: bool = False
    # praisonai-train's names: finetune_vision_layers = not freeze_vision_tower, finetune_language_layers = not
    # freeze_language_model. Kept as written (None: not written) so a contradiction can be named.
    finetune_vision_layers: bool | None = None
    finetune_language_layers: bool | None = None
    image_max_pixels: int | None = Field(default=None, gt=0)  # processors that resize by pixels (Qwen2-VL ...)
    image_min_pixels: int | None = Field(default=None, gt=0)

    @model_validator(mode="before")
    @classmethod
    def _praisonai_train_names(cls, data):
        """finetune_*_layers set the freeze_* switches; writing both names with opposite meanings is refused."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        for alias, key in (("finetune_vision_layers", "freeze_vision_tower"),
                           ("finetune_language_layers", "freeze_language_model")):
            value = data.get(alias)
            if not isinstance(value, bool):
                continue
            if isinstance(data.get(key), bool) and data[key] == value:
                raise ValueError(f"{alias}: {str(value).lower()} contradicts {key}: {str(data[key]).lower()} "
                                 f"(the same switch, inverted); keep one of them")
            data[key] = not value
        return data

    @model_validator(mode="after")
    def _check_vision_keys(self):
        if self.freeze_vision_tower and self.freeze_multi_modal_projector and self.freeze_language_model:
            raise ValueError("freeze_language_model: with freeze_vision_tower and freeze_multi_modal_projector, "
                             "nothing is left to train; unfreeze one of them")
        if (getattr(self, "finetune_type", "lora") in ("lora", "qlora") and self.freeze_vision_tower
                and self.freeze_language_model):
            raise ValueError("freeze_language_model: LoRA then adapts nothing (the vision tower is frozen too); "
                             "unfreeze one, or train the projector alone with finetune_type: full")
        if self.image_max_pixels and self.image_min_pixels and self.image_min_pixels > self.image_max_pixels:
            raise ValueError(f"image_min_pixels: {self.image_min_pixels} is more than image_max_pixels: "
                             f"{self.image_max_pixels}")
        return self

    def vision_keys_written(self) -> list[str]:
        """The vision keys this config sets away from their defaults (a text-only model refuses them)."""
        return [key for key in VISION_KEYS if key in self.model_fields_set]
