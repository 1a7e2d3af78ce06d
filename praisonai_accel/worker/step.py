"""One optimizer step over a group of micro-batches, normalised over the whole step.

The loss of a step is the sum of the method's unit losses over every micro-batch on every rank, divided by the
number of units (target tokens for SFT, pairs for DPO) in all of them: only then do 2 processes x batch B give the
same update as 1 process x batch 2B, and accumulation 2 the same as a batch twice as large. DDP averages gradients
over ranks, so each rank scales its summed loss by world / units; micro-batch gradients add up under no_sync.

Under sequence parallelism (`sp`) the ranks of a group hold the same rows and each trains its slice of them: the
counts, taken on whole rows, are summed over the world once per rank of a group and divided back; the loss sums
are the slices', which add up to the rows'."""

from __future__ import annotations

import itertools
from contextlib import nullcontext
from typing import Callable, Iterator

from ..data import target_count
from .flops import attended_keys, examples_in
from .metrics import StepResult


def micro_batch_groups(batches: Iterator, size: int) -> Iterator[list]:
    while group := list(itertools.islice(batches, size)):
        yield group


def repeated_groups(groups: Iterator[list], repeats: int, done: int = 0) -> Iterator[list]:
    """Each group `repeats` times in a row; `done`: the times the first was already trained on (a resume mid-way)."""
    for group in groups:
        for _ in range(repeats - done):
            yield group
        done = 0


def rng_snapshot() -> dict:
    """The generators dropout draws from, cheap to take at every step (host-side states, no device sync)."""
    import torch

    return {"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def restore_rng(snapshot: dict) -> None:
    import torch

    torch.set_rng_state(snapshot["cpu"])
    if snapshot["cuda"] is not None:
        torch.cuda.set_rng_state_all(snapshot["cuda"])


def optimizer_step(accelerator, model, optimizer, scheduler, method, group: list, max_grad_norm: float,
                   flop_counts, stop_agreed: Callable[[], bool], stop_requested: bool, sp=None) -> StepResult | None:
    """Forward/backward every micro-batch, then one optimizer step; totals are over all ranks.

    None when SIGTERM arrived between two micro-batches: a long step on a big model would otherwise end under
    the launcher's SIGKILL before its checkpoint. The step is abandoned: gradients dropped and the RNG put back
    as it was at the step's start, so the checkpoint of the last finished step resumes exactly."""
    import torch

    rng = rng_snapshot() if len(group) > 1 else None
    copies = sp.size if sp is not None else 1  # ranks holding each row
    device = accelerator.device
    wide = torch.float64 if device.type != "mps" else torch.float32
    # Counted on the device and read once, with the reduce: no wait per micro-batch (SFT's units are its targets).
    local = torch.stack([sum(torch.as_tensor(method.units(b), device=device).to(wide) for b in group),
                         sum(target_count(b) for b in group).to(wide)])
    step_units, step_targets = (int(x) // copies for x in accelerator.reduce(local, reduction="sum").tolist())
    scale = accelerator.num_processes / max(step_units, 1)  # DDP averages over ranks; micro-batch grads add up
    loss_sum = torch.zeros((), device=device)
    metric_sums: dict = {}
    counts = torch.zeros(3, dtype=torch.long, device=device)  # real tokens, attended keys, examples
    positions = 0
    for index, batch in enumerate(group):
        if index and stop_agreed():
            optimizer.zero_grad(set_to_none=True)
            restore_rng(rng)
            return None
        last = index == len(group) - 1
        with nullcontext() if last else accelerator.no_sync(model):
            summed, metrics = method.forward(model, batch if sp is None else sp.shard_batch(batch))
            accelerator.backward(summed * scale)
        if sp is not None:
            sp.end_batch()
        loss_sum += summed.detach()
        for name, value in metrics.items():
            metric_sums[name] = metric_sums.get(name, 0) + value.detach().float()
        mask = batch["attention_mask"]
        counts += torch.stack([mask.sum(), attended_keys(mask, batch.get("position_ids")), examples_in(batch)])
        positions += mask.numel()
    tokens, attended, examples = counts.tolist()  # one wait for the device per step, not three per micro-batch
    # Clipping at infinity clips nothing and still returns the norm, so grad_norm is always logged.
    grad_norm = float(accelerator.clip_grad_norm_(model.parameters(), max_norm=max_grad_norm if max_grad_norm > 0 else float("inf")))
    optimizer.step()
    if not accelerator.optimizer_step_was_skipped:
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    # One collective for the loss, the counts, the method's metrics and the stop decision, so every rank agrees.
    names = sorted(metric_sums)
    totals = accelerator.reduce(torch.tensor(
        [float(loss_sum), float(tokens), float(positions), float(stop_requested), float(examples), float(attended)]
        + [float(metric_sums[name]) for name in names],
        dtype=wide, device=device), "sum").tolist()
    tokens, attended = int(totals[1]) // copies, int(totals[5]) // copies
    return StepResult(loss_sum=totals[0], targets=step_targets, tokens=tokens, positions=int(totals[2]) // copies,
                      grad_norm=grad_norm, stop=totals[3] > 0, examples=int(totals[4]) // copies,
                      flops=flop_counts.step(tokens, attended, step_targets), units=step_units,
                      metric_sums=dict(zip(names, totals[6:])))
