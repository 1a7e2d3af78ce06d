"""`eval --endpoint URL`: a served model (`praisonai-accel serve`, or any OpenAI-compatible server) scored through
lm-eval's own API models: local-chat-completions (the server applies the model's chat template), or
local-completions with --completions (endpoint_model.py builds their model_args)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

from ..errors import ConfigError, first_line

LOGPROB_TYPES = ("loglikelihood", "loglikelihood_rolling", "multiple_choice")


def served_model_name(base_url: str, timeout: float = 10.0) -> str:
    """The first model the endpoint lists at /v1/models, or one line saying why it cannot be asked."""
    url = base_url.rstrip("/") + "/models"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:  # noqa: S310 (the user's own endpoint)
            listed = json.loads(response.read().decode("utf-8")).get("data") or []
    except (urllib.error.URLError, OSError, ValueError, AttributeError) as exc:
        raise ConfigError(f"--endpoint {base_url}: cannot list its models at {url} ({first_line(exc)}); is it "
                          "serving? name the model with --model-name") from None
    if not listed or not isinstance(listed[0], dict) or "id" not in listed[0]:
        raise ConfigError(f"--endpoint {base_url}: {url} lists no model; name it with --model-name")
    return str(listed[0]["id"])


def endpoint(base_url: str, name: str, completions: bool, tokenizer: str | None):
    import importlib.util

    from .endpoint_model import endpoint_model

    missing = [m for m in ("tenacity", "aiohttp", "requests") if importlib.util.find_spec(m) is None]
    if missing:
        raise ConfigError(f"--endpoint: lm-eval's API models need {', '.join(missing)}: pip install "
                          "'praisonai-accel[eval]' (lm-eval[api])")
    return endpoint_model(base_url, name, chat=not completions, tokenizer=tokenizer)


def check_task_types(task_dict, completions: bool) -> None:
    """A chat endpoint returns text, never log-probabilities: a loglikelihood or multiple-choice task is one line."""
    from .tasks import leaf_tasks

    if completions:
        return
    for task in leaf_tasks(task_dict):
        if task.config.output_type in LOGPROB_TYPES:
            raise ConfigError(f"--tasks {task.config.task}: a {task.config.output_type} task needs log-probabilities, "
                              "which a chat endpoint does not return; use a generation task, or --completions "
                              "(local-completions) against a server that returns prompt log-probabilities")


def score_endpoint(model, request, manager) -> dict:
    """{"processes": 1, "tuned": lm-eval's results} of the endpoint on the request's tasks."""
    import logging

    from lm_eval import simple_evaluate

    from .score import _portable

    logging.getLogger("lm_eval").setLevel(logging.ERROR)
    result = simple_evaluate(model=model.model, model_args=model.model_args, tasks=request.tasks,
                             task_manager=manager, num_fewshot=request.num_fewshot, batch_size=request.batch_size,
                             limit=request.limit, log_samples=True, apply_chat_template=model.apply_chat_template,
                             random_seed=request.seed, bootstrap_iters=100000)
    return {"processes": 1, "tuned": _portable(result, request.log_samples)}
