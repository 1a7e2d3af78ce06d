"""precompute_ref_log_probs: the reference log-probs of a dataset, computed once and kept with the run.

`compute_reference_logps` walks the encoded examples in order, in batches, under no_grad, through the loss module's
reference (the model with its adapter disabled, or the frozen copy): pairs give `ref_chosen_logps` /
`ref_rejected_logps`, KTO examples `ref_logps`, one float per example. `load_or_compute` keeps them in one
safetensors file (REFERENCE_DIR/<split>.safetensors inside output_dir) whose metadata holds a fingerprint of what
they depend on (the tokenized data's cache key and the model); a resumed run finds the file and does not recompute.
`WithReference` puts them on each example by its index, so collation hands them to the loss module, which then
skips the reference pass. KTO's KL rows pair examples within a batch, so their reference is still computed in the step.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from ..atomic import atomic_path
from ..data.chat_masking import IGNORE_INDEX
from .preference_data import _pad

REFERENCE_DIR = "reference_logps"
log = logging.getLogger("praisonai_accel")


def _columns(paired: bool) -> tuple[str, ...]:
    return ("ref_chosen_logps", "ref_rejected_logps") if paired else ("ref_logps",)


def compute_reference_logps(method, loss_module, examples, batch_size: int, pad_token_id: int,
                            device="cpu") -> dict[str, torch.Tensor]:
    """One float per example and column, in the examples' order."""
    out: dict[str, list[torch.Tensor]] = {name: [] for name in _columns(method.paired)}
    for start in range(0, len(examples), batch_size):
        chunk = [examples[i] for i in range(start, min(start + batch_size, len(examples)))]
        if method.paired:
            batch = method.collate(chunk, pad_token_id)
        else:
            rows = [list(e["completion_input_ids"]) for e in chunk]
            ids, mask = _pad(rows, pad_token_id)
            batch = {"input_ids": ids, "attention_mask": mask,
                     "labels": _pad([list(e["completion_labels"]) for e in chunk], IGNORE_INDEX)[0]}
        logps = loss_module.reference_logps(batch["input_ids"].to(device), batch["labels"].to(device),
                                            batch["attention_mask"].to(device)).float().cpu()
        if method.paired:
            out["ref_chosen_logps"].append(logps[:len(chunk)])
            out["ref_rejected_logps"].append(logps[len(chunk):])
        else:
            out["ref_logps"].append(logps)
    return {name: torch.cat(parts) if parts else torch.zeros(0) for name, parts in out.items()}


def reference_path(output_dir, split: str = "train") -> Path:
    return Path(output_dir) / REFERENCE_DIR / f"{split}.safetensors"


def load_or_compute(path: Path, fingerprint: str, compute) -> tuple[dict[str, torch.Tensor], bool]:
    """The tensors in `path` when its fingerprint matches, else compute() written there atomically.
    Returns (tensors, whether they were computed now)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    path = Path(path)
    if path.is_file():
        with safe_open(str(path), framework="pt") as f:
            if (f.metadata() or {}).get("fingerprint") == fingerprint:
                return {k: f.get_tensor(k) for k in f.keys()}, False
    tensors = {k: v.contiguous() for k, v in compute().items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    save_file(tensors, str(tmp), metadata={"fingerprint": fingerprint})
    os.replace(tmp, path)
    return tensors, True


class WithReference:
    """A dataset whose examples carry their precomputed reference log-probs (by position)."""

    def __init__(self, dataset, tensors: dict[str, torch.Tensor]):
        lengths = {len(v) for v in tensors.values()}
        if lengths != {len(dataset)}:
            raise ValueError(f"reference log-probs hold {sorted(lengths)} examples, the dataset {len(dataset)}")
        self.dataset, self.tensors = dataset, tensors

    def __len__(self) -> int:
        return len(self.dataset)

    @property
    def lengths(self) -> list[int]:  # the loader's length-grouped sampling reads them
        return self.dataset.lengths

    def __getitem__(self, index: int) -> dict:
        return {**self.dataset[index], **{k: float(v[index]) for k, v in self.tensors.items()}}


def precompute_on_ranks(method, accelerator, module, dataset, output_dir) -> WithReference:
    """The reference log-probs of `dataset`, each rank computing every world-th example through the prepared module
    (under FSDP2 every forward is a collective: all ranks run the same number), gathered, and written once by rank 0.
    A run that finds the file with the same fingerprint (the run's identity and its data) reads it instead."""
    import hashlib

    import numpy as np
    from accelerate.utils import gather_object

    config = method.config
    lengths = np.asarray(dataset.lengths, dtype=np.int64)
    fingerprint = hashlib.sha256(f"{config.run_fingerprint()}:{len(dataset)}:".encode() + lengths.tobytes()).hexdigest()
    path = reference_path(output_dir)
    found = _read_if_current(path, fingerprint)
    if found is not None and {len(v) for v in found.values()} == {len(dataset)}:
        if accelerator.is_main_process:
            log.info("reference log-probs: read from %s (%d examples), not recomputed", path, len(dataset))
        return WithReference(dataset, found)
    rank, world = accelerator.process_index, accelerator.num_processes
    mine = list(range(rank, len(dataset), world))
    batch_size = config.per_device_eval_batch_size or config.per_device_train_batch_size
    forwards = -(-(-(-len(dataset) // world)) // batch_size)
    pad_token_id = method.pad_token_id

    class _Through:  # the reference pass through the prepared module (DDP / FSDP2 hooks included)
        @staticmethod
        def reference_logps(input_ids, labels, attention_mask):
            return module(input_ids=input_ids, labels=labels, attention_mask=attention_mask, reference_only=True)

    was_training = module.training
    module.eval()
    values: dict[str, list[float]] = {}
    for start in range(0, forwards * batch_size, batch_size):
        chunk = mine[start:start + batch_size]
        rows = [dataset[i] for i in chunk] or [dataset[0]]  # a rank short of examples still runs the forward
        computed = compute_reference_logps(method, _Through, rows, len(rows), pad_token_id, accelerator.device)
        if chunk:
            for name, tensor in computed.items():
                values.setdefault(name, []).extend(tensor.tolist())
    module.train(was_training)
    gathered = gather_object([(mine, values)])
    tensors = {name: torch.zeros(len(dataset)) for name in _columns(method.paired)}
    for indices, rank_values in gathered:
        for name, column in rank_values.items():
            tensors[name][torch.as_tensor(indices[:len(column)], dtype=torch.long)] = torch.as_tensor(column)
    if accelerator.is_main_process:
        _write(path, tensors, fingerprint)
        log.info("reference log-probs: computed for %d examples, kept in %s", len(dataset), path)
    accelerator.wait_for_everyone()
    return WithReference(dataset, tensors)


def _read_if_current(path: Path, fingerprint: str) -> dict[str, torch.Tensor] | None:
    from safetensors import SafetensorError, safe_open

    if not Path(path).is_file():
        return None
    try:
        with safe_open(str(path), framework="pt") as f:
            if (f.metadata() or {}).get("fingerprint") != fingerprint:
                return None
            return {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError):  # damaged: computed again
        return None


def _write(path: Path, tensors: dict[str, torch.Tensor], fingerprint: str) -> None:
    from safetensors.torch import save_file

    with atomic_path(path, suffix=".safetensors") as tmp:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata={"fingerprint": fingerprint})
