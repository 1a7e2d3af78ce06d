"""eval_tasks during training: lm-eval's tasks, built once at setup, scored on the model being trained at each
evaluation and at the end, every rank scoring its share of the requests (evaluate/lm.py); rank 0 computes the
metrics and every rank gets them, so the best checkpoint and early stopping agree across ranks."""

from __future__ import annotations

import logging
from pathlib import Path

from ..config import ConfigError, TrainConfig
from ..evaluate.lm import run_lm
from ..evaluate.targets import template_default
from ..evaluate.tasks import build_tasks, scores

log = logging.getLogger("praisonai_accel")


class TaskEvaluation:
    def __init__(self, config: TrainConfig, manager, tokenizer, batch_size: int, apply_chat_template: bool):
        self.config = config
        self.manager = manager
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.apply_chat_template = apply_chat_template

    @classmethod
    def build(cls, config: TrainConfig, tokenizer, batch_size: int, fsdp: bool, formats: dict | None,
              vision: bool) -> "TaskEvaluation | None":
        """None without eval_tasks; the tasks (lm-eval's data loaded) or one line naming what cannot be built.
        `formats` ({dataset: format}) and `vision` decide the chat template as `eval` of the run does."""
        if not config.eval_tasks:
            return None
        if fsdp or config.sequence_parallel_size > 1:
            # lm-eval's ranks run different numbers of forwards, which sharded parameters cannot follow
            raise ConfigError("eval_tasks: not supported under FSDP or sequence_parallel_size > 1; score the "
                              "checkpoints with `praisonai-accel eval` instead")

        include = Path(config.eval_include_path) if config.eval_include_path else None
        manager, _ = build_tasks(config.eval_tasks, include, ("eval_tasks", "eval_include_path"))
        if config.eval_apply_chat_template is None:
            apply, why = template_default(formats, vision)
            why = f"{why}; eval_apply_chat_template: {str(not apply).lower()} to choose otherwise"
        else:
            apply, why = config.eval_apply_chat_template, "eval_apply_chat_template"
        if apply and not getattr(tokenizer, "chat_template", None):
            raise ConfigError("eval_apply_chat_template: the tokenizer has no chat template; set "
                              "eval_apply_chat_template: false")
        log.info("eval_tasks: chat template %s (%s)", "applied" if apply else "not applied", why)
        return cls(config, manager, tokenizer, batch_size, apply)

    def score(self, accelerator, loss_module) -> dict[str, float]:
        """{<task>/<metric>: value} on every rank, of the trained model as it is now (the adapter on its base)."""
        import torch
        from accelerate.utils import broadcast_object_list
        from lm_eval import simple_evaluate

        logging.getLogger("lm_eval").setLevel(logging.ERROR)  # its warnings about a model passed in already loaded
        model = accelerator.unwrap_model(loss_module).causal_lm
        training = model.training
        model.eval()
        lm = run_lm(model, self.tokenizer, self.batch_size, accelerator)
        # no_grad, not inference_mode: a buffer made here (a rotary cache) is used by later training steps
        with torch.no_grad(), accelerator.autocast():
            result = simple_evaluate(model=lm, tasks=list(self.config.eval_tasks), task_manager=self.manager,
                                     limit=self.config.eval_limit, random_seed=None, numpy_random_seed=None,
                                     torch_random_seed=None, fewshot_random_seed=self.config.seed,
                                     bootstrap_iters=0, log_samples=False,
                                     apply_chat_template=self.apply_chat_template)  # no seeding: training's RNG goes on
        model.train(training)
        found = [scores(result) if accelerator.is_main_process else None]
        if accelerator.num_processes > 1:
            broadcast_object_list(found, from_process=0)
        return found[0]


def task_summary(config: TrainConfig, metrics) -> dict:
    """What train_summary.json (and the model card) keep of eval_tasks: the tasks and their last evaluation's scores
    (rank 0's logger holds them)."""
    if not config.eval_tasks:
        return {}
    prefixes = tuple(f"eval_{task}/" for task in config.eval_tasks)
    last = (metrics.last_eval if metrics is not None else None) or {}
    return {"eval_tasks": list(config.eval_tasks),
            "eval_scores": {k: v for k, v in last.items() if k.startswith(prefixes)},
            "eval_scores_step": last.get("step")}
