"""The transformers model inside whatever wraps it (a peft model), for the code that reaches its parts."""

from __future__ import annotations


def transformers_model(model):
    return model.get_base_model() if hasattr(model, "get_base_model") else model
