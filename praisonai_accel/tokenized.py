"""Tokenized examples as flat arrays on disk, read memory-mapped: the preprocessing cache.

Training processes only read this, so they never import `datasets` (nor pyarrow): that keeps ~80 MiB
out of every worker and a second off its start. Selections (shards, splits) are index arrays over
the same memory-mapped data.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

_ARRAYS = ("input_ids", "labels", "offsets", "truncated", "source")


class TokenizedDataset:
    def __init__(self, input_ids, labels, offsets, truncated, source, index=None):
        self.input_ids, self.labels, self.offsets = input_ids, labels, offsets
        self.truncated, self.source = truncated, source
        self.index = np.arange(len(offsets) - 1) if index is None else np.asarray(index, dtype=np.int64)

    @classmethod
    def from_columns(cls, input_ids: list, labels: list, truncated: list, source: list) -> "TokenizedDataset":
        offsets = np.zeros(len(input_ids) + 1, dtype=np.int64)
        np.cumsum([len(ids) for ids in input_ids], out=offsets[1:])
        flat = lambda rows: np.concatenate([np.asarray(r, dtype=np.int32) for r in rows]) if rows else np.zeros(0, np.int32)
        return cls(flat(input_ids), flat(labels), offsets, np.asarray(truncated, dtype=np.bool_),
                   np.asarray(source, dtype=np.int32))

    def save(self, directory: Path) -> None:
        """Write the whole dataset (not a selection of it)."""
        assert len(self.index) == len(self.offsets) - 1, "save() writes a whole dataset, not a selection"
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        for name in _ARRAYS:
            np.save(directory / f"{name}.npy", getattr(self, name))

    @classmethod
    def load(cls, directory: Path) -> "TokenizedDataset":
        return cls(*(np.load(Path(directory) / f"{name}.npy", mmap_mode="r") for name in _ARRAYS))

    @staticmethod
    def exists(directory: Path) -> bool:
        return all((Path(directory) / f"{name}.npy").is_file() for name in _ARRAYS)

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, position: int) -> dict:
        row = int(self.index[position])
        start, end = int(self.offsets[row]), int(self.offsets[row + 1])
        return {"input_ids": np.asarray(self.input_ids[start:end], dtype=np.int64),
                "labels": np.asarray(self.labels[start:end], dtype=np.int64)}

    @property
    def lengths(self) -> list[int]:
        return (self.offsets[self.index + 1] - self.offsets[self.index]).tolist()

    def select(self, positions) -> "TokenizedDataset":
        return TokenizedDataset(self.input_ids, self.labels, self.offsets, self.truncated, self.source,
                                self.index[np.asarray(list(positions), dtype=np.int64)])

    def split(self, test_fraction: float, seed: int) -> tuple["TokenizedDataset", "TokenizedDataset"]:
        """A seeded shuffle cut into (train, test); the test part holds ceil(test_fraction x n) examples."""
        order = np.random.default_rng(seed).permutation(len(self))
        test_size = max(1, int(np.ceil(test_fraction * len(self))))
        return self.select(np.sort(order[test_size:])), self.select(np.sort(order[:test_size]))
