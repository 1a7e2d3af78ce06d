"""Evaluation (an exact, token-normalised eval loss over all ranks) and the best-metric / early-stopping bookkeeping."""

from __future__ import annotations

from ..config import TrainConfig


def evaluate(accelerator, loss_module, method, eval_data, collate, batch_size: int,
             sp=None) -> tuple[float, dict[str, float]]:
    """The method's loss and metrics over the whole eval set, means over its units (target tokens, pairs) as in
    training; each sample is scored by exactly one rank, no padding duplicates.

    Every rank runs the same number of forwards, whatever its share: under FSDP every forward is a collective, and
    under DDP a rank with no rows at all would meet another rank's all-reduce with a buffer broadcast. A rank short of
    rows scores the method's filler (an example that adds nothing to the loss or the units).

    Under sequence parallelism (`sp`) the rows are shared out by data-parallel rank and each rank of a group scores
    its slice of them; the units, counted on whole rows by every rank of a group, are divided back."""
    import math

    import torch

    rank, world = accelerator.process_index, accelerator.num_processes
    if sp is not None:
        rank, world = sp.layout.dp_rank, sp.layout.dp_size
    copies = sp.size if sp is not None else 1
    shard = list(range(rank, len(eval_data), world))
    forwards = math.ceil(math.ceil(len(eval_data) / world) / batch_size)
    filler = method.filler(eval_data[0])
    sums = torch.zeros(2 + len(method.metric_names), dtype=torch.float64, device=accelerator.device)
    loss_module.eval()
    with torch.no_grad(), accelerator.autocast():
        for start in range(0, forwards * batch_size, batch_size):
            rows = [eval_data[i] for i in shard[start:start + batch_size]] or [filler]
            batch = {k: v.to(accelerator.device) if hasattr(v, "to") else v for k, v in collate(rows).items()}
            summed, metrics = method.forward(loss_module, batch if sp is None else sp.shard_batch(batch))
            if sp is not None:
                sp.end_batch()
            values = [summed, method.units(batch)] + [metrics.get(name, 0.0) for name in method.metric_names]
            sums += torch.stack([torch.as_tensor(v, device=accelerator.device).double() for v in values])
    loss_module.train()
    totals = accelerator.reduce(sums, "sum")
    totals[1] /= copies
    units = totals[1].clamp(min=1)
    sums = {name: float(totals[2 + i]) for i, name in enumerate(method.metric_names)}
    return float(totals[0] / units), method.reduce_metrics(sums, float(totals[1])) if sums else {}


def saves_at(config: TrainConfig, step: int, end_of_epoch: bool) -> bool:
    if config.save_strategy == "steps":
        return step % config.save_steps == 0
    return config.save_strategy == "epoch" and end_of_epoch


def evals_at(config: TrainConfig, step: int, end_of_epoch: bool) -> bool:
    if config.eval_strategy == "steps":
        return step % config.eval_steps == 0
    return config.eval_strategy == "epoch" and end_of_epoch


def improved(metric: float, best: float | None, greater_is_better: bool, threshold: float) -> bool:
    if best is None:
        return True
    return metric > best + threshold if greater_is_better else metric < best - threshold


def record_evaluation(config: TrainConfig, state, evaluation: tuple[float, dict[str, float]], saves_now: bool) -> bool:
    """Track the best metric_for_best_model of an evaluation's (loss, metrics) (and the checkpoint about to hold it);
    True when early stopping says stop.

    As in transformers: any improvement makes a new best, but only one beyond early_stopping_threshold
    resets the patience counter.
    """
    loss, metrics = evaluation
    name = config.metric_for_best_model  # checked against the method's metrics by config.py
    name = name[len("eval_"):] if name.startswith("eval_") else name
    # A metric missing from this evaluation (KTO's rewards/chosen when no held-out example is desirable) is no news.
    metric = loss if name == "loss" else metrics.get(name)
    if metric is None:
        state.evals_without_improvement += 1
        patience = config.early_stopping_patience
        return bool(patience and state.evals_without_improvement >= patience)
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
