"""What a training method is to the recipe: how its batches are collated, what its loss is a mean over, and the
module whose forward computes that loss.

The recipe (worker/recipe.py) owns everything else — accumulation, the normalisation over micro-batches and ranks,
clipping, checkpoints, resume, evaluation scheduling, trackers — and knows no method by name. A batch always
carries `input_ids`, `attention_mask` and `labels` (-100 where nothing is trained), and `position_ids` for packed
rows; a method may add keys of its own.

The loss module is what `accelerator.prepare` wraps (DDP / FSDP2), so everything a step needs (a reference model's
log-probs too) happens inside its one forward: DDP and FSDP then see exactly one forward per backward. It keeps
the model being trained as its attribute `causal_lm` (checkpoints and the final save read it there) and exposes
`_no_split_modules`, `get_input_embeddings` and `get_output_embeddings` as lm_loss.CausalLMLoss does (FSDP2's
wrapping reads them).
"""

from __future__ import annotations

import logging
from typing import Any

from ..data.chat_masking import IGNORE_INDEX
from .method_keys import NoKeys

log = logging.getLogger("praisonai_accel")


class TrainingMethod:
    """Registered by name in methods/registry.py. Its class attributes and class methods are what the config, the
    checks, `preview`, `report`, the cache and the worker's exit codes ask of it, before anything imports torch."""

    name: str = ""
    # its config keys: a pydantic model (TRL's names and defaults, Field(description=...) on each) that config.yaml's
    # flat keys are validated against when this method is chosen; a key of another method is refused in one line
    keys: type = NoKeys
    loss_types: tuple[str, ...] = ()  # the values of its loss_type key, if it has one
    metrics: tuple[str, ...] = ()  # what it logs beside loss (TRL's names); metric_for_best_model may name eval_<m>
    takes_images: bool = False  # trains rows with images (a vision-language model's)
    # its own exceptions and the worker's exit code for each; the rank that hit one prints its line
    errors: tuple[tuple[type[BaseException], int], ...] = ()
    # what model.py loads: "causal-lm" (AutoModelForCausalLM, or the vision-language model's class), or
    # "sequence-classification" (a one-label AutoModelForSequenceClassification, LoRA task SEQ_CLS: a reward model)
    model_head: str = "causal-lm"
    unit: str = ""  # what the loss is a mean over, in words: "target tokens", "pairs", "examples"
    # logged metrics shown beside the loss on the console line, in `report` (first -> last) and as panels of
    # loss.png; shell-style patterns such as rewards/*/mean
    headline_metrics: tuple[str, ...] = ()
    metric_names: tuple[str, ...] = ()  # the metric sums forward returns; reduce_metrics makes the logged values
    # sequence_parallel_size > 1: `forward` then gets each rank's slice of the rows (sequence_parallel.shard_batch:
    # labels already shifted on the whole row, position ids the row's) and `loss_module` must sum that slice's loss.
    # A method that cannot is refused before launch (checks.sequence_parallel_rule).
    supports_sequence_parallel: bool = False
    # Optimizer steps each group of micro-batches the loader yields is trained for (GRPO's num_iterations): the
    # recipe hands `rollout` the same group that many times, and counts it consumed after its last step.
    steps_per_batch: int = 1

    def __init__(self, config):
        self.config = config

    # ---- what the house asks before anything is launched (no torch)
    @classmethod
    def check_config(cls, config) -> None:
        """Rules of this method that the CLI checks before launch and the worker again at setup (checks.py):
        ConfigError with one line. The keys' own rules are validators on `keys`."""

    @classmethod
    def unread_keys(cls, config) -> set[str]:
        """Keys of this method that these settings leave unread (a loss_type's own keys under another): --dry-run
        leaves them out while they are at their default."""
        return set()

    @classmethod
    def check_launch(cls, config) -> None:
        """Checks only the launching machine makes (launcher/prelaunch.py), such as importing the user's code the
        workers will import: ConfigError with one line."""

    @classmethod
    def cache_identity(cls, config) -> dict:
        """What of this method changes the encoded examples, keyed into the preprocessing cache (data/cache.py)."""
        return {"method": config.method}

    @classmethod
    def preview_parts(cls, row: dict) -> list[tuple[str, list[int], list[int]]]:
        """The parts of one encoded example `preview` shows, as (title, input_ids, labels); trained tokens are those
        whose label is not IGNORE_INDEX. Default: the row's input_ids and labels, untitled."""
        if "labels" in row:
            return [("", list(row["input_ids"]), list(row["labels"]))]
        ids = list(row["input_ids"])
        return [("", ids, [IGNORE_INDEX] * len(ids))]

    @classmethod
    def logged_parts(cls, config, count: int) -> list[list[tuple[str, list[int], list[int]]]]:
        """What `preview` shows of the run's own logged examples (the last `count`; GRPO: rollouts as sampled, tool
        results and glue untrained), each as preview_parts. Default none."""
        return []

    @classmethod
    def report_rows(cls, records: list[dict]) -> list[tuple[str, str]]:
        """Rows `report` shows for this method from the run's metrics.jsonl records, beyond the headline metrics
        (which `report` shows first -> last for every method). Default none."""
        return []

    run = None  # the run's context (methods/context.RunContext), once set_up has been called

    def set_up(self, run) -> None:
        """Called once by the recipe before `loss_module`, with the run's context (methods/context.RunContext): the
        accelerator, the tokenizer or processor, the output directory, and the recipe's way to log a table."""
        self.run = run

    # ---- data
    def data(self, tokenizer):
        """The data half the preprocessing driver (data/preprocess.py) runs: a data/method_data.MethodData (its
        `columns`, `detect_format`, `check_row`, `encode`, `length`, ...); see methods/sft_rows.SFTData."""
        raise NotImplementedError

    # ---- batches
    def collator(self, pad_token_id: int):
        """A callable turning a list of encoded examples into a batch of tensors (right padding)."""
        raise NotImplementedError

    def filler(self, example: dict) -> dict:
        """An example like `example` that adds nothing to the loss, the metrics or the units: evaluation gives it to
        a rank short of rows, so every rank runs the same number of forwards."""
        raise NotImplementedError

    def examples_in(self, batch: dict) -> int:
        """Examples of the training set in this batch (rows of the loader's dataset: a packed row counts once);
        resuming mid-epoch skips by it."""
        return len(batch["input_ids"])

    def units(self, batch: dict):
        """How many units this micro-batch holds: the loss of a step is its summed loss over the units of all its
        micro-batches on all ranks. A 0-dim tensor or an int."""
        raise NotImplementedError

    # ---- loss
    def loss_module(self, causal_lm, *, accelerator, tokenizer, use_cuda: bool):
        """The module accelerate.prepare wraps; its forward is driven by `forward`."""
        raise NotImplementedError

    def forward(self, module, batch: dict) -> tuple[Any, dict]:
        """(summed loss over the batch's units, {metric name: sum over units}) through the prepared module."""
        raise NotImplementedError

    def reduce_metrics(self, sums: dict[str, float], units: float) -> dict[str, float]:
        """The logged values of metric sums gathered over micro-batches and ranks: means over units by default."""
        return {name: value / max(units, 1) for name, value in sorted(sums.items())}

    def loader_batch_size(self, per_device_train_batch_size: int) -> int:
        """Examples per micro-batch of each rank's loader (GRPO's per_device_train_batch_size counts completions, its
        loader yields prompts)."""
        return per_device_train_batch_size

    def rollout(self, accelerator, module, group: list[dict], global_step: int, total_steps: int = 0,
                epoch: float = 0.0) -> list[dict]:
        """Called before each optimizer step with its micro-batches (`global_step`: the steps already taken, of
        `total_steps`; `epoch`: fractional, as logged); returns the micro-batches to train on. An online method
        generates and scores its examples here (GRPO)."""
        return group

    def save_state(self, directory, accelerator, global_step: int) -> None:
        """Called on every rank while a checkpoint at `global_step` is written into `directory` (before its manifest):
        what the method needs to resume exactly there, as safetensors or JSON (never a pickle). Default nothing."""

    def load_state(self, directory, accelerator, global_step: int) -> None:
        """Called on every rank when resuming from the checkpoint `directory` taken at `global_step`."""

    def before_training(self, accelerator, module, dataset, collate, output_dir):
        """Called once the module is prepared and before the first step (or the first step after a resume); returns
        the dataset to train on (a method may attach what it computed once, such as reference log-probs)."""
        return dataset
