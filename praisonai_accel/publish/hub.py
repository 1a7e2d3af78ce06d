"""Pushing to the Hugging Face Hub from rank 0, in the background, without ever touching local files.

Uploads run on one worker thread, in order, from hard-linked snapshots of the folders, so a
checkpoint rotated away mid-upload is still pushed whole and the local copy is never changed.
Other ranks never wait: the final wait happens after the process group is gone.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from .. import __version__
from ..config import ConfigError, TrainConfig
from ..data.vision_processor import ModelInputs
from ..errors import first_line
from ..models.loading import SEQUENCE_CLASSIFIER
from ..run_dir.output_dirs import MARKER as OUTPUT_MARKER

log = logging.getLogger("praisonai_accel")

TOKEN_ENV = "HF_TOKEN"
CHECKPOINT_IGNORE = ["*.tmp", "*.tmp/*", OUTPUT_MARKER]


def hub_token() -> str | None:
    """The token as huggingface_hub finds it: HF_TOKEN, else the one saved by `hf auth login`."""
    from huggingface_hub import get_token

    return get_token() or None


def is_hub_id(name: str) -> bool:
    """org/name or name, and not a path on this machine."""
    return not Path(name).expanduser().exists() and not name.startswith(("/", ".", "~")) and name.count("/") <= 1


def check_hub_access(config: TrainConfig, api=None) -> str | None:
    """Before training: a token exists, and hub_private is not silently ignored by an existing public repo.
    Returns the token; raises ConfigError with one line otherwise."""
    if not config.push_to_hub:
        return None
    token = hub_token()
    if not token:
        raise ConfigError(f"push_to_hub: no Hugging Face token; set {TOKEN_ENV} or run `hf auth login` (nothing was trained)")
    if config.hub_private:
        from huggingface_hub import HfApi
        from huggingface_hub.errors import RepositoryNotFoundError

        try:
            info = (api or HfApi(token=token)).model_info(config.hub_model_id)
        except RepositoryNotFoundError:
            return token  # created private by the first push
        except Exception as exc:  # unreachable now: the push reports it after training
            log.warning("warning: push_to_hub: could not check %s (%s); pushing at the end anyway", config.hub_model_id,
                        redact(type(exc).__name__, token))
            return token
        if info.private is False:
            raise ConfigError(f"hub_private: true, but {config.hub_model_id} already exists and is public, so checkpoints "
                              "would be public; make it private on the Hub, or set hub_private: false")
    return token


def redact(text: str, secret: str | None) -> str:
    return text.replace(secret, "***") if secret else text


def _snapshot(folder: Path, staging_root: Path) -> Path:
    """Hard-linked copy in output_dir: costs no space, and outlives the original's deletion (rotation)."""
    staging_root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".push-", dir=staging_root))
    target = staging / folder.name
    try:
        shutil.copytree(folder, target, copy_function=os.link)
    except OSError:  # another filesystem: fall back to a real copy
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(folder, target)
    return target


class HubPublisher:
    """Rank 0's uploads for one run, following hub_strategy like transformers' Trainer."""

    def __init__(self, config: TrainConfig, api=None):
        self.config = config
        self.repo_id = config.hub_model_id
        self._api = api
        self.token = check_hub_access(config, api)
        self._executor: ThreadPoolExecutor | None = None
        self._futures: list[tuple[str, Future]] = []
        self._repo_ready = False
        self.errors: list[str] = []

    @property
    def api(self):
        if self._api is None:
            from huggingface_hub import HfApi

            rank = os.environ.get("RANK", "0")
            self._api = HfApi(token=self.token, library_name="praisonai-accel", library_version=__version__,
                              user_agent={"rank": rank})
        return self._api

    # ---------------------------------------------------------------- what gets pushed when

    def on_checkpoint(self, checkpoint: Path) -> None:
        strategy = self.config.hub_strategy
        if strategy == "every_save" and (checkpoint / "adapter").is_dir():
            self._submit(checkpoint / "adapter", "", f"Training in progress, step {checkpoint.name.split('-')[-1]}")
        elif strategy == "checkpoint":
            self._submit(checkpoint, "last-checkpoint", f"Checkpoint {checkpoint.name}", delete_patterns=["*"])
        elif strategy == "all_checkpoints":
            self._submit(checkpoint, checkpoint.name, f"Checkpoint {checkpoint.name}")

    def on_final(self, final_dir: Path) -> None:
        self._submit(final_dir, "", "End of training")

    # ---------------------------------------------------------------- mechanics

    def _submit(self, folder: Path, path_in_repo: str, message: str, delete_patterns: list[str] | None = None) -> None:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hub-push")
        snapshot = _snapshot(Path(folder), self.config.output_path())
        future = self._executor.submit(self._upload, snapshot, path_in_repo, message, delete_patterns)
        self._futures.append((message, future))

    def _upload(self, snapshot: Path, path_in_repo: str, message: str, delete_patterns) -> str:
        try:
            if not self._repo_ready:
                self.api.create_repo(self.repo_id, private=self.config.hub_private, exist_ok=True)
                self._repo_ready = True
            info = self.api.upload_folder(
                repo_id=self.repo_id, folder_path=str(snapshot), path_in_repo=path_in_repo or None,
                commit_message=message, ignore_patterns=CHECKPOINT_IGNORE,
                delete_patterns=delete_patterns,  # matched relative to path_in_repo by huggingface_hub
            )
            return str(getattr(info, "commit_url", info))
        finally:
            shutil.rmtree(snapshot.parent, ignore_errors=True)

    def wait(self) -> list[str]:
        """Block until every push is done; returns one line per failure (the token redacted)."""
        for message, future in self._futures:
            try:
                url = future.result()
                log.info("pushed to https://huggingface.co/%s (%s): %s", self.repo_id, message, url)
            except Exception as exc:  # network, 401/403, 404...: report, never raise past training
                self.errors.append(redact(f"push to {self.repo_id} failed ({message}): {type(exc).__name__}: {first_line(exc)}",
                                          self.token))
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        return self.errors


def model_card(config: TrainConfig, summary: dict, inputs: ModelInputs, latest_eval: dict | None = None) -> str:
    """README.md for the pushed folder: what it is, what it was trained on, how, and how well: the last scores of
    eval_tasks (summary["eval_scores"]) and the latest `praisonai-accel eval` results file of the run, if any."""
    # Local paths name someone's disk (/home/alice/private/...): only a file's name is published.
    datasets = [d.name if is_hub_id(d.name) else Path(d.name).name for d in config.dataset]
    hub_datasets = [d.name for d in config.dataset if is_hub_id(d.name)]
    base = config.model_name if is_hub_id(config.model_name) else Path(config.model_name).name
    vision = inputs.vision
    reward = getattr(config, "model_head", "causal-lm") == SEQUENCE_CLASSIFIER  # a reward model (methods/reward.py)
    pipeline = "image-text-to-text" if vision else "text-classification" if reward else "text-generation"
    front = ["---"] + [f"base_model: {config.model_name}"] * is_hub_id(config.model_name) + [
        "library_name: peft" if config.uses_lora else "library_name: transformers",
        f"pipeline_tag: {pipeline}", "tags:", "- praisonai-accel", f"- {config.finetune_type}"] + [
        "- reward-model"] * reward
    if hub_datasets:
        front += ["datasets:"] + [f"- {d}" for d in hub_datasets]
    front.append("---")
    world = summary.get("num_processes", 1)
    rows = [
        ("base model", base),
        ("method", config.finetune_type),
        ("datasets", ", ".join(datasets)),
        ("max_seq_length", config.max_seq_length),
        ("learning_rate", config.learning_rate),
        ("lr_scheduler_type", config.lr_scheduler_type),
        ("per_device_train_batch_size", config.per_device_train_batch_size),
        ("gradient_accumulation_steps", config.gradient_accumulation_steps),
        ("processes", world),
        ("effective batch", config.per_device_train_batch_size * config.gradient_accumulation_steps * world),
        ("optimizer steps", summary.get("global_step")),
        ("seed", config.seed),
    ]
    if config.uses_lora:
        rows += [("lora_r", config.lora_r), ("lora_alpha", config.lora_alpha), ("lora_dropout", config.lora_dropout),
                 ("lora_target_modules", config.lora_target_modules)]
    final_loss = summary.get("final_loss")
    rows.append(("final training loss", f"{final_loss:.4f}" if final_loss is not None else "n/a"))
    if summary.get("best_metric") is not None:
        rows.append((config.metric_for_best_model, f"{summary['best_metric']:.4f}"))
    table = ["| | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows]
    title = config.hub_model_id or Path(config.final_model_dir).name
    usage = _vision_usage(base, title, config.uses_lora) if vision else _reward_usage(base, title, config.uses_lora) \
        if reward else (
        "```python\nfrom peft import AutoPeftModelForCausalLM\n"
        f"model = AutoPeftModelForCausalLM.from_pretrained(\"{title}\")\n```"
        if config.uses_lora else
        f"```python\nfrom transformers import AutoModelForCausalLM\nmodel = AutoModelForCausalLM.from_pretrained(\"{title}\")\n```"
    )
    what = (f" A reward model (method: {config.method}): one score per prompt + completion, higher for the "
            "preferred one."
            if reward else "")
    body = [f"# {title}", "", f"Fine-tuned from `{base}` with praisonai-accel {__version__}.{what}", "",
            "## Training", ""] + table + _evaluation(summary, latest_eval) + ["", "## Use", "", usage, ""]
    return "\n".join(front + [""] + body)


def _evaluation(summary: dict, latest: dict | None) -> list[str]:
    """## Evaluation: eval_tasks' scores at the run's last evaluation; the latest eval's table, base against tuned."""
    def cell(value):
        return "-" if value is None else f"{value:.4f}"

    sections = []
    if summary.get("eval_scores"):
        sections.append([f"lm-evaluation-harness tasks scored during training (eval_tasks), at step "
                         f"{summary.get('eval_scores_step')}:", "", "| metric | score |", "|---|---|"]
                        + [f"| {name} | {cell(value)} |" for name, value in summary["eval_scores"].items()])
    if latest and latest.get("comparison"):
        sections.append([f"`praisonai-accel eval` of step {latest.get('checkpoint_step')} ({latest.get('created')}):",
                         "", "| task | metric | base | tuned | change |", "|---|---|---|---|---|"]
                        + [f"| {r['task']} | {r['metric'].replace(',none', '')} | {cell(r.get('base'))} | "
                           f"{cell(r.get('tuned'))} | {'-' if r.get('change') is None else format(r['change'], '+.4f')} |"
                           for r in latest["comparison"]])
    out = ["", "## Evaluation"] if sections else []
    for lines in sections:
        out += [""] + lines
    return out


def _reward_usage(base: str, title: str, lora: bool) -> str:
    """How to score with a reward model: `praisonai-accel score`, or transformers (peft for an adapter)."""
    lines = ["```bash", f"praisonai-accel score {title} --prompt \"...\" --completion \"...\"", "```", "",
             "```python", "from transformers import AutoModelForSequenceClassification"]
    if lora:
        lines += ["from peft import PeftModel", "",
                  f"base = AutoModelForSequenceClassification.from_pretrained(\"{base}\", num_labels=1)",
                  f"model = PeftModel.from_pretrained(base, \"{title}\")"]
    else:
        lines += ["", f"model = AutoModelForSequenceClassification.from_pretrained(\"{title}\")"]
    return "\n".join(lines + ["```"])


def _vision_usage(base: str, title: str, lora: bool) -> str:
    """How to load a vision-language model and its processor (peft's AutoPeftModel would pick AutoModelForCausalLM)."""
    lines = ["```python", "from transformers import AutoModelForImageTextToText, AutoProcessor"]
    if lora:
        lines += ["from peft import PeftModel", "", f"base = AutoModelForImageTextToText.from_pretrained(\"{base}\")",
                  f"model = PeftModel.from_pretrained(base, \"{title}\")"]
    else:
        lines += ["", f"model = AutoModelForImageTextToText.from_pretrained(\"{title}\")"]
    return "\n".join(lines + [f"processor = AutoProcessor.from_pretrained(\"{title}\")", "```"])
