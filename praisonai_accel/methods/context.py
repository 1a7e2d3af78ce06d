"""What a training method is handed by the recipe once, before its loss module is built (TrainingMethod.set_up):
the run's accelerator, tokenizer (a vision-language model's carries its processor), output directory, and the
recipe's way to log a table to the trackers. A method keeps no other handle on the run and imports no tracker."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable


@dataclass(frozen=True)
class RunContext:
    accelerator: Any
    tokenizer: Any
    output_dir: Path
    # (name, columns, rows, step): a table to the trackers that show one (TensorBoard as markdown text, wandb as a
    # Table); worker/accelerator.log_table
    log_table: Callable[[str, list[str], list[list], int], None] = lambda name, columns, rows, step: None
