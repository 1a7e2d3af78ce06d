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

import os
from pathlib import Path

import torch

REFERENCE_DIR = "reference_logps"


def _columns(paired: bool) -> tuple[str, ...]:
    return ("ref_chosen_logps", "ref_rejected_logps") if paired else ("ref_logps",)


def compute_reference_logps(method, loss_module, examples, batch_size: int, pad_token_id: int,
                            device="cpu") -> dict[str, torch.Tensor]:
    """One float per example and column, in the examples' order."""
    from .preference_data import _pad
    from ..chat_masking import IGNORE_INDEX

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

    def __getitem__(self, index: int) -> dict:
        return {**self.dataset[index], **{k: float(v[index]) for k, v in self.tensors.items()}}
