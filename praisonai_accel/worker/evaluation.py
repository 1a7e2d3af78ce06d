"""Evaluation (an exact, token-normalised eval loss over all ranks) and the best-metric / early-stopping bookkeeping."""

from __future__ import annotations

from ..config import TrainConfig


def evaluate(accelerator, loss_module, eval_data, collate, batch_size: int) -> float:
    """Token-normalised loss over the whole eval set; each sample is scored by exactly one rank, no padding duplicates.

    Every rank runs the same number of forwards, whatever its share: under FSDP every forward is a collective, and
    under DDP a rank with no rows at all would meet another rank's all-reduce with a buffer broadcast. A rank short of
    rows scores a row whose labels are all masked, which adds nothing to the loss or the target count."""
    import math

    import numpy as np
    import torch

    from ..chat_masking import IGNORE_INDEX
    from ..data import batch_targets

    rank, world = accelerator.process_index, accelerator.num_processes
    shard = list(range(rank, len(eval_data), world))
    forwards = math.ceil(math.ceil(len(eval_data) / world) / batch_size)
    filler = {**eval_data[0], "labels": np.full(len(eval_data[0]["labels"]), IGNORE_INDEX, dtype=np.int64)}
    loss_sum = torch.zeros((), dtype=torch.float64, device=accelerator.device)
    targets = torch.zeros((), dtype=torch.float64, device=accelerator.device)
    loss_module.eval()
    with torch.no_grad(), accelerator.autocast():
        for start in range(0, forwards * batch_size, batch_size):
            rows = [eval_data[i] for i in shard[start:start + batch_size]] or [filler]
            batch = {k: v.to(accelerator.device) for k, v in collate(rows).items()}
            loss_sum += loss_module(batch["input_ids"], batch["labels"], batch["attention_mask"]).double()
            targets += batch_targets(batch)
    loss_module.train()
    totals = accelerator.reduce(torch.stack([loss_sum, targets]), "sum")
    return float(totals[0] / totals[1].clamp(min=1))


def improved(metric: float, best: float | None, greater_is_better: bool, threshold: float) -> bool:
    if best is None:
        return True
    return metric > best + threshold if greater_is_better else metric < best - threshold


def record_evaluation(config: TrainConfig, state, metric: float, saves_now: bool) -> bool:
    """Track the best metric (and the checkpoint about to hold it); True when early stopping says stop.

    As in transformers: any improvement makes a new best, but only one beyond early_stopping_threshold
    resets the patience counter.
    """
    previous_best = state.best_metric
    if improved(metric, previous_best, config.greater_is_better, 0.0):
        state.best_metric = metric
        if saves_now:
            state.best_checkpoint = f"checkpoint-{state.global_step}"
    if improved(metric, previous_best, config.greater_is_better, config.early_stopping_threshold):
        state.evals_without_improvement = 0
    else:
        state.evals_without_improvement += 1
    patience = config.early_stopping_patience
    return bool(patience and state.evals_without_improvement >= patience)
