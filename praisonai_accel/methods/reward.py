"""Reward models (`method: reward`): a one-label sequence-classification head trained on preference pairs, as TRL's
RewardTrainer trains it (Bradley-Terry).

The rows are the preference data DPO reads (preference_data.py: TRL's chosen / rejected with or without prompt, text
or conversational, LLaMA-Factory's pairs), encoded the same way (prompt + completion, eos after plain text), plus an
optional per-row `margin`. Chosen and rejected rows go through the model in one forward; the reward of a row is the
score head at its last non-pad token (the model's own rule, so `score` and plain transformers give the same number).

Per pair: `-logsigmoid(r_chosen - r_rejected - margin) + center_rewards_coefficient * (r_chosen + r_rejected) ** 2`;
its mean over pairs is TRL's RewardTrainer.compute_loss. Metrics as TRL logs them: `accuracy` (r_chosen > r_rejected),
`margin`, `mean_reward`, and the means of the chosen and rejected rewards.

This module declares the method (its keys, metrics, checks; no torch at import: the config reads it before launch)
and says whether a directory is a reward model (`reward_model_problem`); reward_module.py holds the loss module (and
the shared-prefix rows that compute each pair's prompt once), reward_scoring.py what loading and using a trained reward
model needs (`load_scorer`, `score_texts`, `ModelReward`), which the `score` command and GRPO's `model:PATH` rewards
read.
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

from ..errors import ConfigError
from ..models.loading import SEQUENCE_CLASSIFIER
from . import preference_data as pdata
from .method_keys import REWARD_METRICS as METRICS
from .method_keys import RewardKeys
from .preference import FILLER, PreferenceData, PreferenceMethod

_TORCH_PARTS = {"reward_module": ("RewardLoss", "reward_losses", "reward_metric_sums"),
                "reward_scoring": ("sequence_rewards", "load_scorer", "score_ids", "score_texts", "encode_for_reward",
                                   "ModelReward")}


def __getattr__(name: str):
    for module, names in _TORCH_PARTS.items():
        if name in names:  # torch: imported when asked for, not when the config reads the keys
            import importlib

            return getattr(importlib.import_module(f".{module}", __package__), name)
    raise AttributeError(name)


def margin_bits(value: float) -> list[int]:
    """The preprocessing cache stores int32 columns: a float32 margin is kept as its bits, exactly."""
    import numpy as np

    return [int(np.asarray(value, dtype=np.float32).view(np.int32))]


def margin_value(bits) -> float:
    import numpy as np

    return float(np.asarray(bits, dtype=np.int32)[:1].view(np.float32)[0])


class RewardData(PreferenceData):
    def __init__(self, method, tokenizer):
        super().__init__(method, tokenizer)
        self.columns += ("margin",)


class RewardMethod(PreferenceMethod):
    """Reward models (TRL's RewardTrainer): a one-label sequence classifier trained on preference pairs."""

    name = "reward"
    keys = RewardKeys
    metrics = METRICS
    headline_metrics = ("accuracy", "margin")
    # model.py loads a one-label sequence classifier (LoRA task SEQ_CLS, the head trained in full) instead of a causal
    # LM; inference, the model card and unsloth's refusal read the same attribute
    model_head = SEQUENCE_CLASSIFIER

    @classmethod
    def check_config(cls, config) -> None:
        """A classifier whose head has several labels cannot become a reward model (it has one); GGUF and Ollama
        hold models that write text, which a reward model does not (llama.cpp would be handed its base LM)."""
        problem = base_head_problem(config.model_name)
        if problem:
            raise ConfigError(problem)
        for key in ("save_gguf", "ollama_model"):
            if getattr(config, key, None):
                raise ConfigError(f"{key}: a reward model (method: reward) scores text and writes none, so there is "
                                  f"no GGUF or Ollama model of it; remove {key}")

    @classmethod
    def report_rows(cls, records: list[dict]) -> list[tuple[str, str]]:
        """The last held-out accuracy: how often the model ranks an unseen chosen completion above its rejected."""
        evaluated = [r for r in records if r.get("eval_accuracy") is not None]
        if not evaluated:
            return []
        return [("eval accuracy (last)", f"{evaluated[-1]['eval_accuracy']:.4f} at step {evaluated[-1]['step']}")]

    def __init__(self, config):
        super().__init__(config)
        self.metric_names = METRICS

    def data(self, tokenizer):
        return RewardData(self, tokenizer)

    def check_row(self, row: dict, fmt: str) -> str | None:
        margin = row.get("margin")
        if margin is not None and (isinstance(margin, bool) or not isinstance(margin, (int, float))
                                   or not math.isfinite(margin)):
            return f"'margin' is {margin!r}; it must be a finite number"
        return pdata.check_row(row, fmt)

    def encode(self, row: dict, fmt: str, tokenizer, config, system_prompt: str | None = None):
        out = super().encode(row, fmt, tokenizer, config, system_prompt)
        if isinstance(out, dict):
            out["margin"] = margin_bits(row.get("margin") or 0.0)
        return out

    def collate(self, examples: list[dict], pad_token_id: int) -> dict:
        batch = pdata.collate_pairs(examples, pad_token_id)
        margins = [margin_value(e["margin"]) if "margin" in e else 0.0 for e in examples]
        if any(margins):
            import torch

            batch["margin"] = torch.tensor(margins, dtype=torch.float32)
        if any(FILLER in e for e in examples):
            batch[FILLER] = True
        return batch

    def collator(self, pad_token_id: int):
        self.pad_token_id = pad_token_id
        return functools.partial(self.collate, pad_token_id=pad_token_id)

    def loss_module(self, causal_lm, *, accelerator, tokenizer, use_cuda: bool):
        from .reward_module import RewardLoss, settle_prefix_sharing

        module = RewardLoss(causal_lm, self.config.center_rewards_coefficient, self.config.prefix_sharing)
        return settle_prefix_sharing(module, accelerator, tokenizer)

    def before_training(self, accelerator, module, dataset, collate, output_dir):
        return dataset


# ---------------------------------------------------------------- trained reward models: checks

def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def reward_model_problem(path) -> str | None:
    """Why the directory `path` is not a reward model (a one-label sequence classifier, or a SEQ_CLS adapter on
    one), in words, or None."""
    path = Path(path).expanduser()
    if not path.is_dir():
        return f"{path} is not a directory"
    adapter = _read_json(path / "adapter_config.json")
    if adapter is not None:
        if adapter.get("task_type") != "SEQ_CLS":
            return (f"{path} is an adapter for task {adapter.get('task_type')!r}, not a sequence classifier "
                    "(SEQ_CLS); train one with method: reward")
        return None
    config = _read_json(path / "config.json")
    if config is None:
        return f"{path} has no readable config.json or adapter_config.json"
    return head_problem(config, str(path))


def head_problem(config: dict, where: str) -> str | None:
    """Why a model config (config.json as a dict) is not a one-label sequence classifier, or None."""
    architectures = config.get("architectures") or []
    if not any(a.endswith("ForSequenceClassification") for a in architectures):
        return (f"{where} is not a sequence classifier (architectures: {', '.join(architectures) or 'none'}); "
                "train one with method: reward")
    labels = config.get("num_labels", len(config.get("id2label") or {}) or 2)
    if labels != 1:
        return f"{where} has a classification head with {labels} labels; a reward model has one"
    return None


def base_head_problem(model_name: str) -> str | None:
    """method: reward on model_name: why its head cannot become a reward head (a classifier of several labels), or
    None. A causal LM gets a new one-label head; a checkpoint that cannot be read here is left to the loader."""
    config = _read_json(Path(model_name).expanduser() / "config.json")
    if config is None:
        return None
    architectures = config.get("architectures") or []
    if any(a.endswith("ForSequenceClassification") for a in architectures):
        return head_problem(config, f"model_name: {model_name}")
    return None
