"""One rank's part of `praisonai-accel eval`: load the model once, score it with lm-eval (the adapter enabled, then
disabled for the base; a full fine-tune's base loaded after it), and on rank 0 write what was scored to a JSON file
the command reads."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from .targets import EvalTarget


@dataclass
class EvalRequest:
    target: EvalTarget
    tasks: list[str]
    include_path: str | None = None
    limit: float | None = None
    num_fewshot: int | None = None
    batch_size: int = 8
    apply_chat_template: bool = False
    log_samples: bool = False
    base: bool = False
    seed: int = 0

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "EvalRequest":
        raw = json.loads(text)
        raw["target"] = EvalTarget(**raw["target"])
        return cls(**raw)


def load_model(target: EvalTarget, device=None):
    from ..models.inference import load_for_inference

    model, tokenizer = load_for_inference(Path(target.model) if Path(target.model).exists() else target.model,
                                          device=str(device) if device is not None else None,
                                          trust_remote_code=target.trust_remote_code)
    text = getattr(tokenizer, "tokenizer", tokenizer)
    if text is not tokenizer and not text.chat_template and getattr(tokenizer, "chat_template", None):
        text.chat_template = tokenizer.chat_template  # a processor may hold the template its tokenizer lacks
    return model, text


def _simple_evaluate(lm, request: EvalRequest, manager):
    from lm_eval import simple_evaluate

    return simple_evaluate(model=lm, tasks=request.tasks, task_manager=manager, num_fewshot=request.num_fewshot,
                           batch_size=request.batch_size, limit=request.limit, log_samples=True,
                           apply_chat_template=request.apply_chat_template, random_seed=request.seed,
                           bootstrap_iters=100000)


def per_item(samples: dict) -> dict:
    """{task: {metric: {doc_id: value}}} from lm-eval's logged samples: what the paired test compares."""
    out: dict = {}
    for task, rows in (samples or {}).items():
        for row in rows:
            for key, value in row.items():
                if isinstance(value, (int, float)) and key not in ("doc_id", "target"):  # a bool is a score too
                    out.setdefault(task, {}).setdefault(key, {})[str(row["doc_id"])] = float(value)
    return out


def _portable(result: dict, log_samples: bool) -> dict:
    from lm_eval.utils import handle_non_serializable

    kept = {k: v for k, v in result.items() if k != "samples" or log_samples}
    kept["per_item"] = per_item(result.get("samples"))
    return json.loads(json.dumps(kept, default=handle_non_serializable))


def score(request: EvalRequest, accelerator=None, manager=None, device=None) -> dict | None:
    """{"tuned": lm-eval's results, "base": ... (with --base)} on rank 0; None on the other ranks."""
    import logging

    import torch

    logging.getLogger("lm_eval").setLevel(logging.ERROR)  # its warnings about a model passed in already loaded

    from .lm import run_lm
    from .tasks import build_tasks

    manager = manager or build_tasks(request.tasks, Path(request.include_path) if request.include_path else None)[0]
    device = accelerator.device if accelerator is not None else device
    model, tokenizer = load_model(request.target, device)
    lm = run_lm(model, tokenizer, request.batch_size, accelerator)
    out = {}
    with torch.inference_mode():
        out["tuned"] = _simple_evaluate(lm, request, manager)
        if request.base and request.target.adapter:
            with model.disable_adapter():
                out["base"] = _simple_evaluate(lm, request, manager)
        elif request.base:  # a full fine-tune: its base's weights, read with the run's tokenizer and template
            del lm, model
            lm = run_lm(load_model(request.target.base_target(), device)[0], tokenizer, request.batch_size,
                        accelerator)
            out["base"] = _simple_evaluate(lm, request, manager)
    if lm.rank != 0:
        return None
    return {"processes": lm.world_size, **{name: {**_portable(result, request.log_samples), **_template(lm, request)}
                                           for name, result in out.items()}}


def _template(lm, request: EvalRequest) -> dict:
    """The chat template lm-eval rendered prompts with (None without), as lm-eval's own results file records it."""
    from lm_eval.utils import hash_string

    template = lm.chat_template(True) if request.apply_chat_template else None
    return {"chat_template": template, "chat_template_sha": hash_string(template) if template else None}
