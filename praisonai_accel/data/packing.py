"""Packing: rows of max_seq_length filled with whole examples, none of which can see another.

Examples are placed best-fit decreasing (longest first, each into the fullest row it still fits), so
rows come out nearly full. Each row carries position ids that restart at every example; given
position ids and no 2-D attention mask, transformers builds a block-diagonal causal mask on
sdpa/eager (and uses variable-length kernels with flash-attention), so attention never crosses from
one example into another. The first token of each example is never a target: in the row it would be
predicted from the previous example's last token.
"""

from __future__ import annotations

import bisect

import numpy as np

from .chat_masking import IGNORE_INDEX


def best_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Rows of example indices whose lengths add up to at most `capacity`; deterministic for given lengths."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (space left, row index), sorted
    for index in order:
        size = min(lengths[index], capacity)
        slot = bisect.bisect_left(free, (size, -1))
        if slot < len(free):
            space, row = free.pop(slot)
        else:
            space, row = capacity, len(rows)
            rows.append([])
        rows[row].append(index)
        if space - size > 0:
            bisect.insort(free, (space - size, row))
    return rows


class PackedDataset:
    """Rows of packed examples over a TokenizedDataset."""

    def __init__(self, examples, lengths: list[int], capacity: int):
        self.examples = examples
        self.rows = best_fit_decreasing(list(lengths), capacity)
        self.row_lengths = [sum(lengths[i] for i in row) for row in self.rows]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict:
        examples = [self.examples[i] for i in self.rows[index]]
        labels = [example["labels"].copy() for example in examples]
        for example_labels in labels:
            example_labels[0] = IGNORE_INDEX
        return {"input_ids": np.concatenate([example["input_ids"] for example in examples]),
                "labels": np.concatenate(labels),
                "position_ids": np.concatenate([np.arange(len(example["input_ids"])) for example in examples])}
