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

log = logging.getLogger("praisonai_accel")


class TrainingMethod:
    name: str = ""
    unit: str = ""  # what the loss is a mean over, in words: "target tokens", "pairs", "examples"
    headline_metrics: tuple[str, ...] = ()  # logged metrics shown beside the loss (console, report, loss.png); patterns
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

    # ---- data
    def data(self, tokenizer):
        """The data half the preprocessing driver (data/preprocess.py) runs: `columns` (the ragged int columns of an
        encoded example), `detect_format`, `check_row`, `encode`, `length`; see data/sft_rows.SFTData."""
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
